"""One change of (world, layout), whatever caused it: the single executor and its typed record.

A live layout change on the same processes, a join, the drain of nodes leaving with notice and the rebuild after an
abrupt failure differ only in who holds what before and after (the :class:`IdentityMap`) and in where the new shards
live (a freshly built model's tensors, or plain buffers laid out for a world whose model is not built yet). Each of
them calls :func:`execute_change` with those, on every process of the group that spans the old and the new world:

1. :func:`~lightning_emig.migration.engine.migrate` moves the state (minimal bytes; local copies free; every process
   learns of a failure anywhere before anyone continues);
2. the bytes every process received and copied locally are added up (migrate's closing agreement carries them);
3. the result is a :class:`ChangeRecord`: kind, step, old and new world and layout, bytes, seconds per phase, steps
   rolled back, the nodes that left or died. It is what the event reports and what a handoff carries into the next
   fit when the state moved before it (no dict between modules).

:func:`allocate_shards` gives the plain buffers for a rank's new shards from the geometry alone (no mesh, no model),
:func:`in_place_order` the rank order for them that keeps the most state where it is (free to choose there: no model
is built for it);
:func:`whole_state_specs` says what the whole state is where each process holds only its pipeline stage's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_emig.layout import HybridLayout
from lightning_emig.migration.boxes import Holding
from lightning_emig.migration.engine import migrate, tensor_migrations, union_specs
from lightning_emig.migration.identity import IdentityMap
from lightning_emig.migration.rank_order import choose_rank_order
from lightning_emig.migration.state import ShardingSpec, StateTensor, storages_of
from lightning_emig.migration.transfer import TransferOptions

ChangeKind = Literal["reconfigure", "join", "preempt", "failure", "restart"]


@dataclass(frozen=True, slots=True)
class ChangeRecord:
    """What one change did (the same on every process of the new world)."""

    kind: ChangeKind
    step: int
    """The optimizer step training resumes at."""
    old_layout: HybridLayout
    new_layout: HybridLayout
    old_world: int
    new_world: int
    bytes_moved: int = 0
    """Bytes received over the wire, summed over every process."""
    bytes_copied_locally: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    steps_rolled_back: int = 0
    nodes: tuple[str, ...] = ()
    """The nodes that left (``preempt``) or died (``failure``)."""

    def then(self, later: ChangeRecord) -> ChangeRecord:
        """This change followed by ``later`` (e.g. a drain, then the local re-layout in the next fit) as one change:
        from this one's old world to ``later``'s new one, bytes and seconds added up."""
        return dataclasses.replace(
            self, step=later.step, new_layout=later.new_layout, new_world=later.new_world,
            bytes_moved=self.bytes_moved + later.bytes_moved,
            bytes_copied_locally=self.bytes_copied_locally + later.bytes_copied_locally,
            seconds=added_seconds(later.seconds, self.seconds),
        )


def added_seconds(first: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """``first`` with ``more``'s seconds added phase by phase (``first``'s order: the order the phases ran)."""
    total = dict(first)
    for phase, seconds in more.items():
        total[phase] = total.get(phase, 0.0) + seconds
    return total


def execute_change(
    *,
    kind: ChangeKind,
    step: int,
    old_state: dict[str, StateTensor] | None,
    new_state: dict[str, StateTensor] | None,
    old_layout: HybridLayout,
    new_layout: HybridLayout,
    identity: IdentityMap,
    pid: int,
    transfer: TransferOptions,
    release_old: bool = True,
    group: dist.ProcessGroup | None = None,
    old_specs: Mapping[str, ShardingSpec] | None = None,
) -> ChangeRecord:
    """Move ``old_state`` into ``new_state`` (see :func:`~lightning_emig.migration.engine.migrate` for the roles: a
    joiner has no old state, a leaver no new state, and for ``old_specs``) and return the change's record, on every
    process of ``group``."""
    report = migrate(
        old_state=old_state, new_state=new_state, old_layout=old_layout, new_layout=new_layout, identity=identity,
        pid=pid, group=group, transfer=transfer, release_old=release_old, old_specs=old_specs,
    )
    return ChangeRecord(
        kind=kind, step=step, old_layout=old_layout, new_layout=new_layout, old_world=identity.old_world,
        new_world=identity.new_world, bytes_moved=report.total_bytes_received,
        bytes_copied_locally=report.total_bytes_copied,
        # "plan": agreeing on the specs and planning (cached for a change seen before); "transfer": the rounds and
        # the closing agreement.
        seconds={"plan": report.seconds["agree"] + report.seconds["plan"], "transfer": report.seconds["transfer"]},
    )


@dataclass(frozen=True, slots=True)
class HeldShards:
    """What a process holds before a change: its state under ``layout`` at ``rank``."""

    state: Mapping[str, StateTensor]
    layout: HybridLayout
    rank: int


def allocate_shards(specs: Mapping[str, ShardingSpec], layout: HybridLayout, rank: int,
                    device: torch.device | str = "cpu", *, held: HeldShards | None = None) -> dict[str, StateTensor]:
    """Plain local buffers for ``rank``'s shards of every tensor ``specs`` names under ``layout`` (no mesh needed).

    With ``held`` (this process's state before the change), a shard it already holds exactly as the new layout
    wants it (a replica that stays, a box that did not move) is adopted: the old tensor *is* the new shard, the
    migration's copy of it is skipped and no new memory is taken. The caller keeps those storages when it releases
    the old state (:func:`adopted_storages`)."""
    out = {}
    for key, spec in specs.items():
        holding = spec.on(layout).holding_of_rank(rank)
        kept = _kept_as_it_is(key, spec, holding, held) if held is not None else None
        if kept is not None:
            out[key] = StateTensor(key, spec, kept)
            continue
        shape = holding.local_shape if holding is not None else (0,)
        out[key] = StateTensor(key, spec, torch.empty(shape, dtype=spec.dtype, device=device))
    return out


def _kept_as_it_is(key: str, spec: ShardingSpec, holding: Holding | None, held: HeldShards) -> torch.Tensor | None:
    """The old local tensor of ``key`` if it holds exactly ``holding`` (same box, same pieces, a plain contiguous
    tensor of the spec's dtype); None where it must be written anew."""
    old = held.state.get(key)
    if holding is None or holding.is_empty or old is None:
        return None
    local = old.local
    if (isinstance(local, DTensor) or not local.is_contiguous() or local.dtype != spec.dtype
            or tuple(local.shape) != holding.local_shape):
        return None
    return local if spec.on(held.layout).holding_of_rank(held.rank) == holding else None


def adopted_storages(new_state: Mapping[str, StateTensor] | None) -> frozenset[int]:
    """The storages of ``new_state`` (a release of the old state must keep them: some may be adopted old shards)."""
    return storages_of(t.local for t in (new_state or {}).values())


def in_place_order(specs: Mapping[str, ShardingSpec], old_layout: HybridLayout, new_layout: HybridLayout,
                   identity: IdentityMap) -> HybridLayout:
    """``new_layout`` numbered in the rank order that keeps the most of the state ``specs`` names in place under
    ``identity`` (its processes' nodes keep TP and FSDP groups node-local), for buffers laid out with the same
    placements (a drain, a rebuild); the same answer on every process."""
    def tensors_for(old: HybridLayout, new: HybridLayout) -> list:
        return tensor_migrations(dict(specs), dict(specs), old, new)

    return choose_rank_order(old_layout, new_layout.degrees, tensors_for, identity).layout


def whole_state_specs(own: Mapping[str, ShardingSpec] | None, old_layout: HybridLayout,
                      new_layout: HybridLayout, group: dist.ProcessGroup | None = None) -> dict[str, ShardingSpec]:
    """The spec of every tensor of the state from this process's ``own``. A process holds them all, except where a
    layout has pipeline stages (a stage holds its own tensors only): there, the union over every process of
    ``group`` (default: the default group; a collective: every process calls it, ``own`` None where it holds
    nothing)."""
    if old_layout.pp > 1 or new_layout.pp > 1:
        return union_specs(dict(own or {}), group)
    return dict(own or {})


def device_of(state: Mapping[str, StateTensor]) -> torch.device:
    """Where a state's tensors live (the CPU for an empty one)."""
    return next((t.local.device for t in state.values()), torch.device("cpu"))
