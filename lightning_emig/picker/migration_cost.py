"""Bytes a change of layout moves, from shapes alone: the picker's default tie-breaker.

It drives the migration planner's own geometry and rank assignment (:mod:`lightning_emig.migration`) with the
placements training gives each parameter (pinned by ``tests/test_parallel_parity.py``), without any tensor.

Invariants:

* the result is the bytes every process must receive that it does not already hold, summed over processes, under
  the rank order a live change uses: on the same processes the one
  :func:`~lightning_emig.migration.rank_order.choose_rank_order` picks (most bytes kept in place, TP and FSDP groups
  no less node-local), across a change of world the default one (what a join does; a drain may keep more);
* every old rank is assumed alive to send (a change with notice) and keeps its rank; processes beyond the old world
  are joiners; ranks fill nodes of ``devices_per_node`` in order;
* the migrated state is what training migrates: the fp32 parameter and AdamW's two fp32 moments (12 bytes an
  element; AdamW's scalar ``step`` is ignored); gradients are not migrated;
* tensors of equal shape and placement are planned once, weighted by their count (bytes are linear in it).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from lightning_emig.migration.geometry import REPLICATE, PlacementSpec, TensorSharding
from lightning_emig.migration.identity import IdentityMap, ProcessInfo
from lightning_emig.migration.planner import TensorMigration
from lightning_emig.migration.rank_order import bytes_in_place, choose_rank_order
from lightning_emig.migration.stages import stage_holding
from lightning_emig.picker.shapes import ParamTensor, param_counts, param_tensors

if TYPE_CHECKING:
    from lightning_emig.layout import HybridLayout
    from lightning_emig.models.llama import LlamaConfig

#: fp32 parameter + AdamW exp_avg + exp_avg_sq.
MIGRATED_BYTES_PER_ELEMENT = 12


def stage_ranges(model: LlamaConfig, stages: int) -> tuple[range, ...]:
    """Every stage's blocks: the project's one split rule over this model's parameter counts."""
    return param_counts(model).stages(stages)


def pipeline_process_of(tensor: ParamTensor, layout: HybridLayout, ranges: tuple[range, ...]) -> int | None:
    """The pipeline coordinate holding ``tensor`` under ``layout`` (``ranges``: its ``layout.stages`` stages'
    blocks; stage ``s`` is on process ``s % pp``), None without stages."""
    return stage_holding(tensor.block, tensor.first_stage, ranges, layout.pp) if layout.pp > 1 else None


def sharding_of(tensor: ParamTensor, layout: HybridLayout, ranges: tuple[range, ...]) -> TensorSharding:
    """The geometry training gives ``tensor`` under ``layout`` (``ranges``: every stage's blocks): TP first, then
    FSDP2 on dim 0 over the dp axes."""
    names: list[str] = []
    placements: list[PlacementSpec] = []
    if layout.dp > 1:
        if layout.dp_replicate > 1:
            names.append("dp_replicate")
            placements.append(REPLICATE)
        names.append("dp_shard")
        strided = layout.tp > 1 and tensor.tp_dim == 0  # FSDP2 chunks the TP-local dim 0 again
        placements.append(PlacementSpec("strided", 0, layout.tp) if strided else PlacementSpec("shard", 0))
    if layout.tp > 1:
        names.append("tp")
        placements.append(REPLICATE if tensor.tp_dim is None else PlacementSpec("shard", tensor.tp_dim))
    stage = pipeline_process_of(tensor, layout, ranges)
    return TensorSharding.for_layout(tensor.shape, layout, names, placements, stage=stage)


def estimate_migration_bytes(model: LlamaConfig, old: HybridLayout, new: HybridLayout, *,
                             bytes_per_element: int = MIGRATED_BYTES_PER_ELEMENT, devices_per_node: int = 8) -> int:
    """Bytes received over the network when the state moves from ``old`` to ``new`` (both resolved)."""
    if old == new:
        return 0

    def tensors_for(a: HybridLayout, b: HybridLayout) -> list[TensorMigration]:
        return grouped_migrations(model, a, b, bytes_per_element)

    identity = IdentityMap(tuple(
        ProcessInfo(p, p // devices_per_node, p if p < old.world_size else None, p if p < new.world_size else None)
        for p in range(max(old.world_size, new.world_size))), old.world_size, new.world_size)
    if old.world_size == new.world_size and new.rank_order is None:
        new = choose_rank_order(old, new, tensors_for, identity).layout
    tensors = tensors_for(old, new)
    needed = sum(t.new.replicas * _numel(t.new.global_shape) * t.itemsize for t in tensors)
    return needed - bytes_in_place(tensors, identity)


def grouped_migrations(model: LlamaConfig, old: HybridLayout, new: HybridLayout,
                        bytes_per_element: int) -> list[TensorMigration]:
    """The migrated state between two layouts as planner input, tensors of equal shape, TP dim and stages once each
    (``itemsize`` weighted by their count: bytes are linear in it)."""
    old_ranges, new_ranges = stage_ranges(model, old.stages), stage_ranges(model, new.stages)

    def key(t: ParamTensor) -> tuple[object, ...]:
        stages = tuple(pipeline_process_of(t, lay, ranges)
                       for lay, ranges in ((old, old_ranges), (new, new_ranges)))
        return (t.shape, t.tp_dim, stages)

    tensors = param_tensors(model)
    counts = Counter(key(t) for t in tensors)
    first: dict[tuple[object, ...], ParamTensor] = {}
    for t in tensors:
        first.setdefault(key(t), t)
    return [
        TensorMigration(name=f"{index:03d}:{t.name}", itemsize=bytes_per_element * counts[k],
                        old=sharding_of(t, old, old_ranges), new=sharding_of(t, new, new_ranges))
        for index, (k, t) in enumerate(first.items())
    ]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
