"""The live join: every process of a new world meets in ``strategy.load_checkpoint("live")`` and the state moves.

Why the state moves inside ``strategy.load_checkpoint("live")``: processes that join run Lightning's whole
startup (default-group barriers and broadcasts), so the processes that kept running end their ``Trainer.fit``
at an optimizer-step boundary and start a new one in the same process, with their old state still in memory.
Both sides then run the identical startup and meet in ``load_checkpoint``, where, instead of reading a file:

1. every process says who it is (node, local rank, old rank or None): one ``all_gather_object``;
2. the lowest new rank that holds state broadcasts the old layout and world, the specs of its old state (the
   joiners allocate their optimizer state from its optimizer entries, and the migration plans from them: no
   broadcast of its own) and the resume metadata Lightning restores itself (loops with the data stream's
   committed offset, callbacks, LR schedulers);
3. every process allocates the new optimizer state and :func:`~lightning_emig.migration.change.execute_change`
   moves parameters, persistent buffers and optimizer state point to point (old storage is released as it leaves);
4. the loop counters are re-expressed for this world's gradient accumulation (from the layout they were captured
   under, recorded in the metadata: the one place a live change rescales them) and the metadata is returned as the
   "checkpoint", so Lightning restores loops, callbacks and schedulers.

Scope: a pure join (every old rank is alive and keeps running). A process's id in the migration is its new
rank, so the union of old and new processes is the new world and ``union_rank(pid) == new rank``.
An announced preemption reuses it: the leavers' state has already moved to the survivors over the old group
(:mod:`~lightning_emig.membership.preempt`), so the survivors' handoff describes the *new* world (old world = new
world, local copies only) and carries ``prior``, the change that really happened, for the event.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_emig.change.boundary import rescale_batch_progress
from lightning_emig.change.rng import restore_rng_for_rank
from lightning_emig.consistency import settle_handoff_proof
from lightning_emig.layout import HybridLayout
from lightning_emig.membership.handoff import LiveHandoff
from lightning_emig.migration.change import ChangeRecord, added_seconds, execute_change, whole_state_specs
from lightning_emig.migration.identity import IdentityMap, ProcessInfo
from lightning_emig.migration.state import (
    ShardingSpec,
    adopt_optimizer_state,
    allocate_optimizer_state,
    training_state,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_emig.change.host import JoinHost


@dataclass(frozen=True, slots=True)
class _Announcement:
    """Broadcast by the lowest new rank that holds state."""

    old_layout: dict[str, int]
    old_world: int
    state_specs: dict[str, ShardingSpec]
    """Every tensor's spec in the broadcasting process's old state (under pipeline stages: its stage's only)."""
    metadata: dict[str, Any]
    seconds: dict[str, float]
    last_step_wall: float
    prior: ChangeRecord | None = None


def join_live(
    strategy: JoinHost, trainer: pl.Trainer, handoff: LiveHandoff | None, node_id: str
) -> tuple[dict[str, Any], ChangeRecord, float]:
    """Move the live state into this (new) world; returns the resume metadata for Lightning, the change's record
    (the change that left state for this fit, if any, then this join) and when the last step on the old world
    finished (``time.time()``).

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
    proving = 0.0
    if rank == source:
        assert handoff is not None
        proving = settle_handoff_proof(handoff.metadata)  # an old world of one summed its digest until now
        box[0] = _Announcement(
            old_layout=handoff.old_layout.as_dict(), old_world=handoff.old_world,
            state_specs={k: t.spec for k, t in (handoff.state or {}).items()}, metadata=handoff.metadata,
            seconds=dict(handoff.seconds),
            last_step_wall=handoff.last_step_wall, prior=handoff.prior,
        )
    dist.broadcast_object_list(box, src=source)
    news: _Announcement = box[0]
    old_layout = HybridLayout(**news.old_layout)
    settings = strategy.elastic_settings
    _rescale_counters(news.metadata, strategy)
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
    seconds = {"prove_handed": proving, "handshake": time.perf_counter() - started - proving}

    module = strategy.lightning_module
    assert module is not None
    optimizer = strategy.optimizers[0]
    new_state = training_state(module, None)
    held = handoff.state if handoff is not None else None
    adopted: set[str] = set()
    if held is not None and _holds_the_new_layout(who, news.old_world, old_layout, strategy):
        # A drain or a rebuild from replicas left each process its new shards (plain buffers): the optimizer's
        # state (two thirds of an AdamW state) is taken as it is; only the parameters are copied into the model.
        adopted = adopt_optimizer_state(module, optimizer, held)
        held = {k: t for k, t in held.items() if k not in adopted}
    old_specs = {k: spec for k, spec in news.state_specs.items() if k not in adopted}
    template = {k: spec for k, spec in old_specs.items() if k.startswith("optim/")}
    if old_layout.pp > 1 or strategy.layout.pp > 1:  # each old stage holds its own parameters' state only
        template = whole_state_specs(handoff.optimizer_template if handoff is not None else None, old_layout,
                                     strategy.layout)
        template = {k: spec for k, spec in template.items() if k not in adopted}
    new_state.update(allocate_optimizer_state(module, optimizer, template))
    strategy.live_transfer_started = True  # from here a failure may leave the handoff's state partly released
    record = execute_change(
        kind="join", step=int(news.metadata["global_step"]), old_state=held,
        new_state=new_state, old_layout=old_layout, new_layout=strategy.layout, identity=identity, pid=rank,
        transfer=settings.transfer, old_specs=old_specs,
    )
    if handoff is not None:
        handoff.state = None  # released by the migration; drop the references
    for group, saved in zip(optimizer.param_groups, news.metadata["optimizer_hyper"], strict=True):
        group.update(saved)
    if handoff is None:
        # A new process has no RNG state of its own: derive one (the rule of lightning_emig.change.rng).
        restore_rng_for_rank(None, rank, seed=strategy.seed, step=int(news.metadata["global_step"]))
    record = dataclasses.replace(record, seconds=phases_of_join(news.seconds, seconds, record.seconds))
    if news.prior is not None:  # the state moved before this fit (preemption, failure): report that change
        record = news.prior.then(record)
    metadata = dict(news.metadata)
    if handoff is not None:  # a holder keeps its own callbacks' state; a joiner takes the source's, as from a file
        metadata["callbacks"] = handoff.metadata["callbacks"]
    return metadata, record, news.last_step_wall


def phases_of_join(handed: dict[str, float], joining: dict[str, float], moving: dict[str, float]) -> dict[str, float]:
    """The seconds of a join's phases, in the order they ran: those the handoff brought (``handed``: from the step
    boundary to this fit, a drain's included), the handshake's, the migration's. A phase in more than one of them
    ran more than once (a drain settled its handed proof, the join settles what is left of it): its seconds add up."""
    return added_seconds(added_seconds(handed, joining), moving)


def state_after_join(strategy: JoinHost, metadata: dict[str, Any], last_step_wall: float) -> LiveHandoff:
    """The joined state as the last step boundary's: a peer failing before this fit's first step boundary finds it
    (:attr:`~lightning_emig.membership.settings.ElasticWorker.last_boundary`)."""
    import copy

    return LiveHandoff(
        generation=-1, holders=(), old_layout=strategy.layout, old_world=strategy.world_size,
        old_rank=strategy.global_rank, state=training_state(strategy.lightning_module, strategy.optimizers[0]),
        metadata=copy.deepcopy(metadata), last_step_wall=last_step_wall,
    )


def _holds_the_new_layout(who: list[Any], old_world: int, old_layout: HybridLayout,
                          strategy: JoinHost) -> bool:
    """Every process of the new world holds its state under the new layout, world and rank already (the same answer
    on every process: it decides which tensors the migration moves)."""
    return (old_layout, old_world) == (strategy.layout, strategy.world_size) and all(
        old == rank for rank, (_, _, old) in enumerate(who))


def _rescale_counters(metadata: dict[str, Any], strategy: JoinHost) -> None:
    """The loop counters were captured under the accumulation of the layout recorded with them; Lightning steps on
    this world's. Re-express them, and record the layout they are now expressed in."""
    captured_under = HybridLayout(**metadata["lightning_emig"]["layout"])
    old_accumulation = strategy.elastic_settings.plan_for(captured_under).grad_accumulation
    rescale_batch_progress(metadata, old_accumulation, strategy.batch_plan.grad_accumulation)
    metadata["lightning_emig"] = {"layout": strategy.layout.as_dict(), "world_size": strategy.world_size}
