"""Rank assignment: which rank order a new layout numbers its processes in, so state stays where it already is.

A layout's degrees say what every mesh coordinate holds; its rank order (:attr:`HybridLayout.rank_order`) says
which process sits at which coordinate. Migration cannot give processes arbitrary coordinates: torch sorts a
sub-group's ranks, FSDP2 shards by that group rank and DTensor places by coordinate, so along every axis ranks must
ascend with the coordinate. What it can choose is the order of the axes along the ranks — e.g. for a change from
four FSDP shards to two pipeline stages of two shards each, numbering ``dp_shard`` slowest puts stage 0 on
processes 0 and 2 and stage 1 on 1 and 3, and every process keeps the quarter of its stage it already holds (a third
fewer bytes on the wire than the default order, where process 1 keeps nothing of stage 0).

Invariants:

* the chosen order keeps at least as many bytes in place as the default one (the default is a candidate and wins
  ties), and never puts more tensor-parallel or FSDP (``dp_shard``) groups across nodes than the default order does:
  a transfer saved once is not worth inter-node all-gathers in every step;
* pure and deterministic: every process evaluates the same candidates on the same inputs and gets the same order;
* the order only relabels processes: which state exists and what each coordinate holds stay the same.

The same function serves a live change (:mod:`lightning_emig.change.reconfigure`, from the real state's specs) and
the picker's migration estimate (from shapes).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from lightning_emig.layout import DEFAULT_RANK_ORDER, HybridLayout, MeshAxis
from lightning_emig.migration.geometry import Holding
from lightning_emig.migration.identity import IdentityMap
from lightning_emig.migration.planner import TensorMigration

#: Axes whose groups talk in every step (all-gathers, reduce-scatters): kept within nodes.
LOCAL_AXES: tuple[MeshAxis, ...] = (MeshAxis.TP, MeshAxis.DP_SHARD)


@dataclass(frozen=True, slots=True)
class RankOrderChoice:
    layout: HybridLayout
    """The new layout with the chosen rank order."""
    bytes_in_place: int
    """Bytes of the new state every process already holds (copied locally, never sent), summed."""
    default_bytes_in_place: int
    """The same under the default rank order."""

    @property
    def bytes_saved(self) -> int:
        return self.bytes_in_place - self.default_bytes_in_place


def candidate_orders(layout: HybridLayout) -> list[HybridLayout]:
    """``layout`` under every distinct rank order torch can use, the default first. Axes of degree 1 do not change
    the numbering, so orders that differ only in where those sit are one candidate."""
    seen: set[tuple[str, ...]] = set()
    out = []
    for order in (DEFAULT_RANK_ORDER, *itertools.permutations(DEFAULT_RANK_ORDER)):
        if order.index("dp_replicate") > order.index("dp_shard"):
            continue
        effective = tuple(a for a in order if layout.degree(MeshAxis(a)) > 1)
        if effective in seen:
            continue
        seen.add(effective)
        out.append(layout.with_rank_order(order))
    return out


def choose_rank_order(
    old_layout: HybridLayout,
    new_layout: HybridLayout,
    tensors_for: Callable[[HybridLayout, HybridLayout], Sequence[TensorMigration]],
    identity: IdentityMap,
) -> RankOrderChoice:
    """The rank order for ``new_layout`` that keeps the most bytes in place under ``identity`` (whose processes'
    ``node`` says where each sits), among those that keep tensor-parallel and FSDP groups as node-local as the default.

    ``tensors_for(old, new)`` gives the state's tensors between two layouts (the old one is ``old_layout``).
    """
    nodes = [identity.by_new_rank(r).node for r in range(identity.new_world)]
    candidates = candidate_orders(new_layout.degrees)
    default = candidates[0]
    default_spread = groups_across_nodes(default, nodes)
    default_bytes = bytes_in_place(tensors_for(old_layout, default), identity)
    best = RankOrderChoice(default, default_bytes, default_bytes)
    for layout in candidates[1:]:
        spread = groups_across_nodes(layout, nodes)
        if any(spread[axis] > default_spread[axis] for axis in LOCAL_AXES):
            continue
        kept = bytes_in_place(tensors_for(old_layout, layout), identity)
        if kept > best.bytes_in_place:
            best = RankOrderChoice(layout, kept, default_bytes)
    return best


def bytes_in_place(tensors: Sequence[TensorMigration], identity: IdentityMap) -> int:
    """Bytes of their new shards that processes already hold under the old layout, summed over processes (tensors
    with the same geometry on both sides are counted once, weighted)."""
    weights: Counter[tuple[object, object]] = Counter()
    for t in tensors:
        weights[(t.old, t.new)] += t.itemsize
    total = 0
    for (old, new), itemsize in weights.items():
        for p in identity.processes:
            if p.old_rank is None or p.new_rank is None:
                continue
            total += itemsize * _common_elements(old.holding_of_rank(p.old_rank), new.holding_of_rank(p.new_rank))
    return total


def groups_across_nodes(layout: HybridLayout, nodes: Sequence[Hashable]) -> dict[MeshAxis, int]:
    """For each of :data:`LOCAL_AXES`, how many of its groups hold processes of more than one node (``nodes[r]``:
    the node of global rank ``r``)."""
    grid = layout.rank_grid()
    shape = layout.mesh_shape
    axis_index = {name: i for i, name in enumerate(DEFAULT_RANK_ORDER)}
    out = {}
    for axis in LOCAL_AXES:
        a = axis_index[axis.value]
        stride = 1
        for n in shape[a + 1:]:
            stride *= n
        spread = 0
        for flat in range(len(grid)):
            if (flat // stride) % shape[a]:  # count each group once, from its coordinate 0 along the axis
                continue
            members = {nodes[grid[flat + k * stride]] for k in range(shape[a])}
            spread += len(members) > 1
        out[axis] = spread
    return out


def _common_elements(a: Holding | None, b: Holding | None) -> int:
    if a is None or b is None:
        return 0
    total = 0
    for x in a.pieces:
        for y in b.pieces:
            common = x.global_box.intersect(y.global_box)
            if common is not None:
                total += common.numel
    return total
