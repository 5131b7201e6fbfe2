"""Handing live training state to a bigger world: :class:`LiveHandoff` and :func:`join_live`.

Why the state moves inside ``strategy.load_checkpoint("live")``: processes that join run Lightning's whole
startup (default-group barriers and broadcasts), so the processes that kept running end their ``Trainer.fit``
at an optimizer-step boundary and start a new one in the same process, with their old state still in memory.
Both sides then run the identical startup and meet in ``load_checkpoint``, where, instead of reading a file:

1. every process says who it is (node, local rank, old rank or None): one ``all_gather_object``;
2. the lowest new rank that holds state broadcasts the old layout and world, the optimizer-state template
   (what joiners need to allocate their optimizer state) and the resume metadata Lightning restores itself
   (loops with the data stream's committed offset, callbacks, LR schedulers);
3. every process allocates the new optimizer state and :func:`~lightning_emig.migration.engine.migrate` moves
   parameters and optimizer state point to point (old storage is released as it leaves);
4. the metadata is returned as the "checkpoint", so Lightning restores loops, callbacks and schedulers.

Scope: a pure join (every old rank is alive and keeps running). A process's id in the migration is its new
rank, so the union of old and new processes is the new world and ``union_rank(pid) == new rank``.
An announced preemption reuses it: the leavers' state has already moved to the survivors over the old group
(:mod:`~lightning_emig.membership.preempt`), so the survivors' handoff describes the *new* world (old world = new
world, local copies only) and carries ``prior``, the change that really happened, for the event.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_emig.data.batching import BatchPlan
from lightning_emig.layout import HybridLayout
from lightning_emig.migration.engine import migrate
from lightning_emig.migration.planner import IdentityMap, ProcessInfo
from lightning_emig.migration.state import ShardingSpec, StateTensor, allocate_optimizer_state, training_state
from lightning_emig.migration.transfer import TransferOptions
from lightning_emig.strategy.boundary import rescale_batch_progress
from lightning_emig.strategy.rng import restore_rng_for_rank

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_emig.strategy.elastic import ElasticMigrationStrategy

LIVE_CHECKPOINT = "live"
"""``Trainer.fit(ckpt_path=LIVE_CHECKPOINT)``: take the state from the running processes, not from a file."""


@dataclass(slots=True, kw_only=True)
class LiveHandoff:
    """What a process that kept running carries from one ``Trainer.fit`` into the next (never pickled whole)."""

    generation: int
    """The generation to join."""
    old_generation: int
    old_layout: HybridLayout
    old_world: int
    old_rank: int
    state: dict[str, StateTensor] | None
    """References to the live local tensors of the old model and optimizer (freed by the migration)."""
    metadata: dict[str, Any]
    """Resume metadata, shaped like a Lightning checkpoint captured in ``on_train_batch_end``."""
    last_step_wall: float
    """``time.time()`` when the last step on the old world had finished (downtime starts here)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Phases measured so far (detect, agree, capture, teardown, group, ...)."""
    phase_started: float = field(default_factory=time.perf_counter)
    """``perf_counter`` when the current phase began (``lap`` closes it)."""
    prior: dict[str, Any] | None = None
    """Set when the state already moved into the new world before this handoff (announced preemption, see
    :mod:`~lightning_emig.membership.preempt`): the event's ``kind``, old layout and world, bytes moved."""
    leaving: bool = False
    """This process's node was preempted: its state was handed over, it leaves the job (no next fit)."""

    @property
    def optimizer_template(self) -> dict[str, ShardingSpec]:
        return {k: t.spec for k, t in (self.state or {}).items() if k.startswith("optim/")}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.phase_started
        self.phase_started = now


def layout_for_new_world(requested: HybridLayout, world_size: int) -> HybridLayout:
    """The largest valid layout by a simple rule (until the picker lands), resolved for ``world_size``.

    Keep the requested ``tp``, ``pp`` and ``dp_replicate`` when their product divides the new world and let
    ``dp_shard`` fill the rest; otherwise fall back to pure FSDP over the whole world.
    """
    fixed = requested.tp * requested.pp * requested.dp_replicate
    if all(d > 0 for d in (requested.tp, requested.pp, requested.dp_replicate)) and world_size % fixed == 0:
        return HybridLayout(
            dp_replicate=requested.dp_replicate, dp_shard=-1, tp=requested.tp, pp=requested.pp
        ).resolve(world_size)
    return HybridLayout(dp_shard=-1).resolve(world_size)


@dataclass(frozen=True, slots=True)
class _Announcement:
    """Broadcast by the lowest new rank that holds state."""

    old_layout: dict[str, int]
    old_world: int
    optimizer_template: dict[str, ShardingSpec]
    metadata: dict[str, Any]
    seconds: dict[str, float]
    last_step_wall: float
    prior: dict[str, Any] | None = None


@dataclass(slots=True)
class JoinResult:
    """What :func:`join_live` learned, for the strategy's join event."""

    old_layout: HybridLayout
    old_world: int
    bytes_moved: int
    bytes_copied_locally: int
    seconds: dict[str, float]
    last_step_wall: float
    step: int
    kind: str = "join"
    steps_rolled_back: int | None = None


def join_live(
    strategy: ElasticMigrationStrategy, trainer: pl.Trainer, handoff: LiveHandoff | None, node_id: str
) -> tuple[dict[str, Any], JoinResult]:
    """Move the live state into this (new) world; returns the resume metadata for Lightning and a report.

    Every process of the new world calls it from ``load_checkpoint``, after Lightning built the new model and
    optimizer (``configure_model`` ran with ``strategy.migrating`` set, so nothing was initialised).
    """
    started = time.perf_counter()
    rank, world = strategy.global_rank, strategy.world_size
    local_rank = strategy.local_rank
    who: list[Any] = [None] * world
    dist.all_gather_object(who, (node_id, local_rank, handoff.old_rank if handoff is not None else None))
    holders = [r for r, (_, _, old) in enumerate(who) if old is not None]
    if not holders:
        raise RuntimeError(
            "fit(ckpt_path='live') but no process of the new world holds live state: nothing to join "
            "(start from a checkpoint instead)"
        )
    source = holders[0]
    box: list[Any] = [None]
    if rank == source:
        assert handoff is not None
        box[0] = _Announcement(
            old_layout=handoff.old_layout.as_dict(), old_world=handoff.old_world,
            optimizer_template=handoff.optimizer_template, metadata=handoff.metadata, seconds=dict(handoff.seconds),
            last_step_wall=handoff.last_step_wall, prior=handoff.prior,
        )
    dist.broadcast_object_list(box, src=source)
    news: _Announcement = box[0]
    old_layout = HybridLayout(**news.old_layout)
    # The counters were captured under the old world's gradient accumulation; Lightning steps on this world's.
    old_plan = BatchPlan(global_batch_size=strategy.global_batch_size, micro_batch_size=strategy.micro_batch_size,
                         dp_degree=old_layout.dp)
    rescale_batch_progress(news.metadata, old_plan.grad_accumulation, strategy.batch_plan.grad_accumulation)
    old_ranks = sorted(old for _, _, old in who if old is not None)
    if old_ranks != list(range(news.old_world)):
        raise NotImplementedError(
            f"live join needs every old rank alive; old ranks present {old_ranks}, old world {news.old_world} "
            "(departures and failures take another path)"
        )
    identity = IdentityMap(
        tuple(ProcessInfo(pid=r, node=node, old_rank=old, new_rank=r) for r, (node, _, old) in enumerate(who)),
        news.old_world, world,
    )
    seconds = {"handshake": time.perf_counter() - started}

    module = strategy.lightning_module
    assert module is not None
    optimizer = strategy.optimizers[0]
    new_state = training_state(module, None)
    new_state.update(allocate_optimizer_state(module, optimizer, news.optimizer_template))
    report = migrate(
        old_state=handoff.state if handoff is not None else None, new_state=new_state, old_layout=old_layout,
        new_layout=strategy.layout, identity=identity, pid=rank,
        transfer=TransferOptions(bucket_bytes=strategy.bucket_bytes, checksum=strategy.checksum),
        release_old=True,
    )
    if handoff is not None:
        handoff.state = None  # released by the migration; drop the references
    for group, saved in zip(optimizer.param_groups, news.metadata["optimizer_hyper"], strict=True):
        group.update(saved)
    if handoff is None:
        # A new process has no RNG state of its own: derive one (the rule of lightning_emig.strategy.rng).
        restore_rng_for_rank(None, rank, seed=strategy.seed, step=int(news.metadata["global_step"]))
    moved = [0, 0]
    totals: list[Any] = [None] * world
    dist.all_gather_object(totals, (report.stats.bytes_received, report.stats.bytes_copied))
    moved = [sum(t[0] for t in totals), sum(t[1] for t in totals)]
    seconds["transfer"] = news.seconds.get("transfer", 0.0) + sum(report.seconds.values())
    result = JoinResult(
        old_layout=old_layout, old_world=news.old_world, bytes_moved=moved[0], bytes_copied_locally=moved[1],
        seconds={**news.seconds, **seconds}, last_step_wall=news.last_step_wall,
        step=int(news.metadata["global_step"]),
    )
    if news.prior is not None:  # the state moved before this fit (preemption, failure): report that change
        result.kind = news.prior["kind"]
        result.steps_rolled_back = news.prior.get("steps_rolled_back")
        result.old_layout = HybridLayout(**news.prior["old_layout"])
        result.old_world = int(news.prior["old_world"])
        result.bytes_moved += int(news.prior["bytes_moved"])
        result.bytes_copied_locally += int(news.prior["bytes_copied_locally"])
    return dict(news.metadata), result
