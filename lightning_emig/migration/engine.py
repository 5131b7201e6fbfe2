"""Migrate live training state between two layouts (and two worlds) over one process group.

``migrate`` is the single entry point, for a layout change on the same processes and for a world change
(processes that only send, processes that only receive). Every process of ``group`` calls it:

1. agree on what moves: where a process has no old state (a joiner) the old specs come from the lowest live old
   rank, unless the caller already gave them to every process (a join's announcement carries them), where one has
   no new state (a leaver) the new specs from new rank 0 (one broadcast each); a side every process holds (both,
   in a layout change on the same processes) is each process's own, and the next all-gather checks they agree;
2. plan locally (no communication: every process derives the same plan); plans are cached per (specs, layouts,
   identity, process, options), so a change seen before (a layout switched back and forth, a benchmark's repeats)
   pays no planning;
3. agree on the plan: one tiny all-gather of each process's peer count (the pair bucket size needs both ends'),
   where a process whose planning failed (e.g. state that no live process holds) sends -1, so every process
   stops before any transfer instead of waiting for a peer that will never post its operations; the same
   all-gather checks that every process uses the same transfer options and the same specs (else every process
   refuses);
4. transfer: local copies, then bucketed point-to-point rounds; old storage is released as it leaves. A local error
   on one process (a copy, a release) does not make it abandon the rounds its peers post: it runs them all and
   raises afterwards, so nobody waits for the group's timeout;
5. agree on success: one all-gather of every process's failure flag and byte counts (and, where one failed, a
   second of the errors' texts), so a checksum mismatch or any other error on one process fails every process
   promptly, naming the original error, and no process continues on state that another rejected.

Ranks passed to torch are ranks *in* ``group`` (``IdentityMap.union_rank``), so ``group`` may be the default group
or any group whose ranks are the union's processes ordered by pid.
"""

from __future__ import annotations

import functools
import time
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_emig.layout import HybridLayout
from lightning_emig.migration.identity import IdentityMap
from lightning_emig.migration.planner import PlanOptions, RankPlan, TensorMigration, plan_for_rank
from lightning_emig.migration.state import ShardingSpec, StateTensor, free_storage, storage_key, storages_of
from lightning_emig.migration.transfer import TransferOptions, TransferStats, run_transfer


class MigrationFailedError(RuntimeError):
    """The migration did not complete on every process; the new state must not be used."""


@dataclass(slots=True)
class MigrationReport:
    plan: RankPlan
    stats: TransferStats
    seconds: dict[str, float] = field(default_factory=dict)
    total_bytes_received: int = 0
    """Bytes every process of the group received, summed (learnt in the closing agreement)."""
    total_bytes_copied: int = 0
    """Bytes every process copied locally, summed."""

    @property
    def bytes_moved(self) -> int:
        return self.stats.bytes_received


def _broadcast_specs(
    specs: dict[str, ShardingSpec] | None, src: int, group: dist.ProcessGroup | None
) -> dict[str, ShardingSpec]:
    box = [specs]
    dist.broadcast_object_list(box, group=group, group_src=src)
    return box[0]


def _gather_ints(values: list[int], group: dist.ProcessGroup | None) -> list[list[int]]:
    """Every process's ``values`` (the same count on each): one all-gather of a small int64 tensor, no pickling (an
    object all-gather is two collectives and a pickle on each side: most of a tiny model's migration)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [g.tolist() for g in gathered]


def _peer_counts(
    plan: RankPlan | None, identity: IdentityMap, group: dist.ProcessGroup | None, options: TransferOptions,
    specs_digest: int,
) -> dict[int, int] | None:
    """Every process's number of peers (one tiny all-gather): both ends of a pair need the same bucket size.

    ``plan`` is None where planning failed; then every process gets None and must not start the transfer. The same
    all-gather carries each process's transfer options and a digest of the specs it planned from: processes that
    disagree (another bucket size, checksums on one side, another model) would post mismatched messages, so every
    process refuses before the first byte moves.
    """
    mine = (options.bucket_bytes, int(options.checksum), options.in_place_min_bytes)
    gathered = _gather_ints([-1 if plan is None else len(plan.peers), *mine, specs_digest], group)
    agreed = {(g[1], bool(g[2]), g[3]) for g in gathered}
    if len(agreed) > 1:
        raise MigrationFailedError(
            f"processes disagree on the transfer options (bucket_bytes, checksum, in_place_min_bytes): "
            f"{sorted(agreed)}; every process must use the same (no state was transferred or released)"
        )
    if len({g[4] for g in gathered}) > 1:
        raise MigrationFailedError(
            "processes disagree on the state's tensors (names, shapes, dtypes or placements): every process must "
            "build the same model and optimizer (no state was transferred or released)"
        )
    counts = [g[0] for g in gathered]
    if any(c < 0 for c in counts):
        return None
    return dict(zip(identity.pids, counts, strict=True))


def _agree_on_success(
    error: BaseException | None, stats: TransferStats, group: dist.ProcessGroup | None, pid: int
) -> tuple[int, int]:
    """Every process learns whether the migration failed anywhere, and the bytes every process received and copied
    (one small all-gather); where it failed, why (a second one, of the errors' texts). Returns the byte totals."""
    gathered = _gather_ints([int(error is not None), stats.bytes_received, stats.bytes_copied], group)
    failed_anywhere = any(failed for failed, _, _ in gathered)
    if failed_anywhere:
        texts: list[str | None] = [None] * dist.get_world_size(group)
        mine = None if error is None else f"process {pid}: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
        dist.all_gather_object(texts, mine, group=group)
        if error is not None:
            raise error
        failed = [t for t in texts if t is not None]
        raise MigrationFailedError(
            f"migration failed on another process ({'; '.join(failed[:3])}); the new state was not accepted"
        )
    return sum(r for _, r, _ in gathered), sum(c for _, _, c in gathered)


def migrate(
    *,
    old_state: dict[str, StateTensor] | None,
    new_state: dict[str, StateTensor] | None,
    old_layout: HybridLayout,
    new_layout: HybridLayout,
    identity: IdentityMap,
    pid: int,
    group: dist.ProcessGroup | None = None,
    transfer: TransferOptions | None = None,
    planning: PlanOptions | None = None,
    release_old: bool = False,
    old_specs: Mapping[str, ShardingSpec] | None = None,
) -> MigrationReport:
    """Move ``old_state`` (held under ``old_layout``) into ``new_state``'s tensors (under ``new_layout``).

    ``old_state`` is None on a joiner, ``new_state`` None on a leaver; every process of ``group`` calls this (a
    process with neither takes part in the agreement only). With ``release_old`` the storage of each old tensor is
    freed as soon as nothing more is read from it (the old model must not be used afterwards) — also when the
    migration then fails, so a failed migration with ``release_old`` leaves no usable state in memory and the
    caller must fall back to a checkpoint; without it the old state stays intact and usable. ``old_specs``: the old
    side's specs where the caller already gave them to every process (a process without old state plans from them
    and none are broadcast); given on every process of ``group`` or on none (it decides whether a collective runs).

    Raises:
        ChecksumMismatchError: on a process that received corrupt bytes.
        MigrationFailedError: on every other process when the migration failed anywhere.
        StateLostError: on a process that needs state no live process holds (the others raise
            MigrationFailedError).
    """
    me = identity.process(pid)
    if (old_state is None) != (me.old_rank is None) or (new_state is None) != (me.new_rank is None):
        raise ValueError(f"process {pid}: state given does not match its roles {me}")
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    old_specs, new_specs = _agreed_specs(old_state, new_state, identity, group, old_layout, new_layout, old_specs)
    digest = _digest(old_specs, new_specs)
    seconds["agree"] = time.perf_counter() - start

    start = time.perf_counter()
    options = transfer or TransferOptions()
    try:
        plan = _cached_plan(old_specs, new_specs, old_layout, new_layout, identity, pid, planning or PlanOptions())
    except Exception:  # the others must learn about it before anyone posts a transfer
        _peer_counts(None, identity, group, options, digest)
        raise
    seconds["plan"] = time.perf_counter() - start

    start = time.perf_counter()
    peer_counts = _peer_counts(plan, identity, group, options, digest)
    if peer_counts is None:
        raise MigrationFailedError(
            "planning failed on another process (see its error); no state was transferred or released"
        )
    old_locals = {k: t.local for k, t in (old_state or {}).items()}
    new_locals = {k: t.local for k, t in (new_state or {}).items()}
    error: BaseException | None = None
    stats = TransferStats()
    try:
        stats = run_transfer(
            plan, old_locals, new_locals, union_rank=identity.union_rank, peer_counts=peer_counts, group=group,
            options=options, on_release=_releaser(old_locals, new_locals) if release_old else None,
        )
    except Exception as exc:  # every process must learn about it before anyone continues
        error = exc
    received, copied = _agree_on_success(error, stats, group, pid)
    seconds["transfer"] = time.perf_counter() - start
    return MigrationReport(plan=plan, stats=stats, seconds=seconds, total_bytes_received=received,
                           total_bytes_copied=copied)


def union_specs(specs: dict[str, ShardingSpec] | None, group: dist.ProcessGroup | None) -> dict[str, ShardingSpec]:
    """Every process's specs, merged (a key two processes hold must have the same spec on both); a collective of
    ``group``."""
    return _union_of_sides([specs], group)[0]


def _union_of_sides(
    sides: list[dict[str, ShardingSpec] | None], group: dist.ProcessGroup | None
) -> list[dict[str, ShardingSpec]]:
    """:func:`union_specs` of several sides (old, new) in one all-gather."""
    gathered: list[list[dict[str, ShardingSpec] | None]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(gathered, sides, group=group)  # every process sends a list as long as ``sides``
    unions: list[dict[str, ShardingSpec]] = []
    for index in range(len(sides)):
        union: dict[str, ShardingSpec] = {}
        for parts in gathered:
            for key, spec in (parts[index] or {}).items():
                if union.setdefault(key, spec) != spec:
                    raise ValueError(f"{key}: processes disagree on its sharding ({union[key]} vs {spec})")
        unions.append(dict(sorted(union.items())))
    return unions


def _agreed_specs(
    old_state: dict[str, StateTensor] | None, new_state: dict[str, StateTensor] | None, identity: IdentityMap,
    group: dist.ProcessGroup | None, old_layout: HybridLayout, new_layout: HybridLayout,
    known_old: Mapping[str, ShardingSpec] | None,
) -> tuple[dict[str, ShardingSpec], dict[str, ShardingSpec]]:
    """The old and new specs every process plans from: the union over every process's where a layout has pipeline
    stages (each stage holds its own tensors only; both sides in one all-gather); else a side every process holds
    is its own (checked by digest in the next all-gather), and a side some process lacks (a joiner's old, a
    leaver's new) is broadcast from a process that holds it, or for the old side taken from ``known_old``."""
    old_specs = {k: t.spec for k, t in old_state.items()} if old_state else None
    new_specs = {k: t.spec for k, t in new_state.items()} if new_state else None
    if old_layout.pp > 1 or new_layout.pp > 1:
        old_union, new_union = _union_of_sides([old_specs, new_specs], group)
        return old_union, new_union
    if any(p.old_rank is None for p in identity.processes):
        if known_old is None:
            old_src = identity.union_rank(min(p.pid for p in identity.processes if p.old_rank is not None))
            old_specs = _broadcast_specs(old_specs, old_src, group)
        elif old_specs is None:
            old_specs = dict(known_old)
    if any(p.new_rank is None for p in identity.processes):
        new_specs = _broadcast_specs(new_specs, identity.union_rank(identity.by_new_rank(0).pid), group)
    assert old_specs is not None and new_specs is not None
    return old_specs, new_specs


def _digest(old_specs: dict[str, ShardingSpec], new_specs: dict[str, ShardingSpec]) -> int:
    """The same number on every process that holds the same specs (``hash`` of a string differs per process)."""
    text = "\n".join(f"{side}:{key}={_spec_text(spec)}" for side, specs in (("old", old_specs), ("new", new_specs))
                     for key, spec in sorted(specs.items()))
    return zlib.crc32(text.encode())


@functools.lru_cache(maxsize=4096)
def _spec_text(spec: ShardingSpec) -> str:
    """``repr(spec)``, once per distinct spec: a model has a few dozen among hundreds of state tensors; with ``repr``
    of them all the digest took 7 ms of every 125M change on an idle core (2 ms with this), 14-26 ms on 4 processes
    sharing 2 cores."""
    return repr(spec)


#: Recent plans by their inputs (a few; a plan holds one process's transfer list).
_PLANS: OrderedDict[tuple, RankPlan] = OrderedDict()
_PLAN_CACHE_SIZE = 8


def _cached_plan(
    old_specs: dict[str, ShardingSpec], new_specs: dict[str, ShardingSpec], old_layout: HybridLayout,
    new_layout: HybridLayout, identity: IdentityMap, pid: int, planning: PlanOptions,
) -> RankPlan:
    key = (tuple(sorted(old_specs.items())), tuple(sorted(new_specs.items())), old_layout, new_layout, identity,
           pid, planning)
    plan = _PLANS.get(key)
    if plan is None:
        plan = plan_for_rank(tensor_migrations(old_specs, new_specs, old_layout, new_layout), identity, pid, planning)
        _PLANS[key] = plan
        while len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    _PLANS.move_to_end(key)
    return plan


def plan_ahead(
    old_specs: dict[str, ShardingSpec], new_specs: dict[str, ShardingSpec], old_layout: HybridLayout,
    new_layout: HybridLayout, identity: IdentityMap, pid: int, planning: PlanOptions | None = None,
) -> RankPlan:
    """The plan :func:`migrate` will use for these specs (computed now and cached): for a change prepared before its
    step boundary. Communicates nothing; the specs must be those ``migrate`` will agree on (no pipeline stages: there
    they are the union over every process's, a collective)."""
    return _cached_plan(old_specs, new_specs, old_layout, new_layout, identity, pid, planning or PlanOptions())


def tensor_migrations(
    old_specs: dict[str, ShardingSpec], new_specs: dict[str, ShardingSpec], old: HybridLayout, new: HybridLayout
) -> list[TensorMigration]:
    """Every tensor of the specs, placed on ``old`` and on ``new`` (the planner's input)."""
    if set(old_specs) != set(new_specs):
        missing, extra = sorted(set(old_specs) - set(new_specs)), sorted(set(new_specs) - set(old_specs))
        raise ValueError(
            f"old and new state differ in tensors: only old {missing[:5]}, only new {extra[:5]}; the new model "
            "and optimizer must have the same parameters and state as the old"
        )
    out = []
    for key in sorted(old_specs):
        a, b = old_specs[key], new_specs[key]
        if a.dtype != b.dtype:
            raise ValueError(f"{key}: dtype changes from {a.dtype} to {b.dtype}; migration does not cast")
        out.append(TensorMigration(key, a.itemsize, a.on(old), b.on(new)))
    return out


def _releaser(old_locals: dict[str, torch.Tensor], new_locals: dict[str, torch.Tensor]):  # noqa: ANN202
    keep = storages_of(new_locals.values())  # old tensors that are new state too (a module's root buffers) stay

    def release(key: str) -> None:
        tensor = old_locals.pop(key, None)
        if tensor is not None and storage_key(tensor) not in keep:
            free_storage(tensor)

    return release
