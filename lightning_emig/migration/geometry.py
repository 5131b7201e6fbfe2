"""Shard geometry: which part of a global tensor every mesh coordinate holds.

Pure: no process group, no tensor data. Given a tensor's global shape, the mesh shape and its placements, this module
answers for *any* coordinate (not only our own) which global elements it holds and where they sit in its local
tensor, and, the other way round, which coordinates hold a given global box.

Model and invariants:

* Holdings and boxes are those of :mod:`~lightning_emig.migration.boxes`; splits follow ``torch.chunk`` (as
  DTensor's ``Shard`` and FSDP2 make them). Pipeline ownership by name is :mod:`~lightning_emig.migration.stages`.
* ``_StridedShard(d, sf)`` on an axis whose right-hand axes that shard dim ``d`` multiply to ``sf`` is FSDP2 over
  TP: FSDP2 chunks the TP-local tensor, so those right-hand axes chunk first and this axis chunks the result. The
  holding is one contiguous box. This is what FSDP2 stores, also where torch's private, left-to-right
  ``_compute_local_shape_and_global_offset`` disagrees (uneven dims with ``dp_shard >= 3``; see the tests).
* Any other ``_StridedShard`` follows DTensor's split-and-interleave (``_StridedShard._split_tensor``) and may hold
  several pieces.
* Over all coordinates, every element is held exactly ``replicas`` times: the product of the sizes of the axes that
  do not shard the tensor (with a pipeline ``stage``, only coordinates of that stage hold anything).
* Ranks run row-major over the mesh coordinates (``mesh = arange(world).reshape(mesh_shape)``), or over the axes in
  ``rank_axes`` order (slowest first) where a layout numbers its ranks another way.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from lightning_emig.layout import rank_strides
from lightning_emig.migration.boxes import (
    Coordinate,
    GeometryError,
    Holding,
    Interval,
    LocalPiece,
    ShardBox,
    chunk_span,
    chunk_spans,
)

if TYPE_CHECKING:
    from lightning_emig.layout import HybridLayout

# --------------------------------------------------------------------------------------------- placements
@dataclass(frozen=True, slots=True)
class PlacementSpec:
    """A placement reduced to plain data: ``kind`` is ``"replicate"``, ``"shard"`` or ``"strided"``."""

    kind: str
    dim: int = -1
    split_factor: int = 1

    def __repr__(self) -> str:
        if self.kind == "replicate":
            return "R"
        if self.kind == "shard":
            return f"S({self.dim})"
        return f"SS({self.dim},sf={self.split_factor})"

    @property
    def is_shard(self) -> bool:
        return self.kind != "replicate"


REPLICATE = PlacementSpec("replicate")


def normalize_placement(placement: Any, ndim: int) -> PlacementSpec:
    """Turn a torch ``Placement`` (or a :class:`PlacementSpec`) into a :class:`PlacementSpec` for an ``ndim`` tensor."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if isinstance(placement, PlacementSpec):
        spec = placement
    elif isinstance(placement, _StridedShard):  # before Shard: in some torch versions it subclasses Shard
        spec = PlacementSpec("strided", placement.dim, int(placement.split_factor))
    elif isinstance(placement, Shard):
        spec = PlacementSpec("shard", placement.dim)
    elif isinstance(placement, Replicate):
        spec = REPLICATE
    else:
        raise GeometryError(
            f"placement {placement!r} holds no definite part of the tensor (Partial state must be reduced before "
            "migration); only Replicate, Shard and _StridedShard are supported"
        )
    if spec.kind == "replicate":
        return spec
    dim = spec.dim + ndim if spec.dim < 0 else spec.dim
    if not 0 <= dim < ndim:
        raise GeometryError(f"placement {spec!r} shards dim {spec.dim} of a {ndim}-d tensor")
    if spec.split_factor < 1:
        raise GeometryError(f"placement {spec!r} has a split factor below 1")
    return PlacementSpec(spec.kind, dim, spec.split_factor)


@dataclass(frozen=True, slots=True)
class _Step:
    """One split applied to a running local tensor: chunk (or interleave) ``dim`` over a group of mesh axes."""

    axes: tuple[int, ...]
    sizes: tuple[int, ...]
    dim: int
    interleave_factor: int  # 0: plain chunk; >0: DTensor's split-and-interleave with this split factor

    @property
    def parts(self) -> int:
        return math.prod(self.sizes)


# ------------------------------------------------------------------------------------------ tensor sharding
@dataclass(frozen=True, slots=True)
class Source:
    """A distinct piece of a tensor and every rank that holds it (all of them hold it at the same local offset)."""

    piece: LocalPiece
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TensorSharding:
    """How one tensor is laid out over a mesh; answers for any coordinate or rank.

    Attributes:
        global_shape: Shape of the full tensor.
        mesh_shape: Shape of the whole mesh whose ranks we plan over (for a layout: ``pp, dp_replicate, dp_shard,
            tp``).
        placements: One per mesh dim *of the tensor's own DTensor mesh*.
        axis_groups: For each of those mesh dims, the axes of ``mesh_shape`` it spans, outermost first (a flattened
            ``dp`` mesh dim spans ``dp_replicate`` and ``dp_shard``). Axes in no group hold replicas.
        stage: When set, only coordinates with ``coordinate[stage_axis] == stage`` hold the tensor (pipeline stage
            ownership); other coordinates hold nothing at all.
        rank_axes: The axes of ``mesh_shape`` from slowest to fastest along the ranks; ``None``: row-major.
    """

    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[PlacementSpec, ...]
    axis_groups: tuple[tuple[int, ...], ...]
    stage: int | None = None
    stage_axis: int = 0
    rank_axes: tuple[int, ...] | None = None
    steps: tuple[_Step, ...] = field(init=False, repr=False, compare=False)
    _replica_axes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if any(n < 0 for n in self.global_shape) or any(n < 1 for n in self.mesh_shape):
            raise GeometryError(f"bad shapes: tensor {self.global_shape}, mesh {self.mesh_shape}")
        if len(self.placements) != len(self.axis_groups):
            raise GeometryError(f"{len(self.placements)} placements for {len(self.axis_groups)} mesh dims")
        used = [a for group in self.axis_groups for a in group]
        if len(set(used)) != len(used) or any(not 0 <= a < len(self.mesh_shape) for a in used):
            raise GeometryError(
                f"axis groups {self.axis_groups} must be disjoint axes of mesh {self.mesh_shape}"
            )
        if self.stage is not None:
            if not 0 <= self.stage < self.mesh_shape[self.stage_axis]:
                raise GeometryError(
                    f"stage {self.stage} outside the {self.mesh_shape[self.stage_axis]} stages"
                )
            for p, group in zip(self.placements, self.axis_groups, strict=True):
                if p.is_shard and self.stage_axis in group:
                    raise GeometryError(
                        "a tensor owned by one pipeline stage cannot also be sharded over stages"
                    )
        sharded = {a for p, g in zip(self.placements, self.axis_groups, strict=True) if p.is_shard for a in g}
        replica = tuple(
            a
            for a in range(len(self.mesh_shape))
            if a not in sharded and (self.stage is None or a != self.stage_axis)
        )
        object.__setattr__(self, "steps", _build_steps(self))
        object.__setattr__(self, "_replica_axes", replica)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def create(
        cls,
        global_shape: Sequence[int],
        mesh_shape: Sequence[int],
        placements: Sequence[Any],
        *,
        axis_groups: Sequence[Sequence[int]] | None = None,
        stage: int | None = None,
        stage_axis: int = 0,
        rank_axes: Sequence[int] | None = None,
    ) -> TensorSharding:
        """Build from torch placements; without ``axis_groups`` the tensor's mesh is the whole mesh."""
        shape = tuple(int(n) for n in global_shape)
        groups = (
            tuple((i,) for i in range(len(mesh_shape)))
            if axis_groups is None
            else tuple(tuple(g) for g in axis_groups)
        )
        specs = tuple(normalize_placement(p, len(shape)) for p in placements)
        order = None if rank_axes is None else tuple(int(a) for a in rank_axes)
        if order is not None and sorted(order) != list(range(len(mesh_shape))):
            raise GeometryError(f"rank axes {order} must order every axis of mesh {tuple(mesh_shape)} once")
        if order == tuple(range(len(mesh_shape))):
            order = None
        return cls(shape, tuple(int(n) for n in mesh_shape), specs, groups, stage, stage_axis, order)

    @classmethod
    def for_layout(
        cls,
        global_shape: Sequence[int],
        layout: HybridLayout,
        mesh_dim_names: Sequence[str],
        placements: Sequence[Any],
        *,
        stage: int | None = None,
    ) -> TensorSharding:
        """Place a DTensor (its mesh dim names and placements) on the full mesh of a resolved layout.

        ``mesh_dim_names`` are names of :class:`~lightning_emig.layout.MeshAxis`; ``"dp"`` spans ``dp_replicate`` and
        ``dp_shard``. Axes the DTensor's mesh does not name hold replicas (or, with ``stage``, the pp axis selects
        the owner stage).
        """
        from lightning_emig.layout import MESH_AXIS_ORDER, MeshAxis

        index = {axis.value: i for i, axis in enumerate(MESH_AXIS_ORDER)}
        index_groups = {name: (i,) for name, i in index.items()}
        index_groups[MeshAxis.DP.value] = (index["dp_replicate"], index["dp_shard"])
        unknown = [n for n in mesh_dim_names if n not in index_groups]
        if unknown:
            raise GeometryError(f"mesh dim names {unknown} are not layout axes {sorted(index_groups)}")
        groups = [index_groups[n] for n in mesh_dim_names]
        return cls.create(global_shape, layout.mesh_shape, placements, axis_groups=groups, stage=stage,
                          rank_axes=layout.rank_axes)

    # ---------------------------------------------------------------------- queries
    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def replicas(self) -> int:
        """How many coordinates hold each element."""
        return math.prod(self.mesh_shape[a] for a in self._replica_axes)

    def holding(self, coordinate: Sequence[int]) -> Holding | None:
        """What ``coordinate`` holds, or ``None`` when it is on another pipeline stage."""
        coord = tuple(coordinate)
        if len(coord) != len(self.mesh_shape) or any(
            not 0 <= c < n for c, n in zip(coord, self.mesh_shape, strict=True)
        ):
            raise GeometryError(f"coordinate {coord} is not on mesh {self.mesh_shape}")
        if self.stage is not None and coord[self.stage_axis] != self.stage:
            return None
        return _holding(self, tuple(coord[a] for s in self.steps for a in s.axes))

    def holding_of_rank(self, rank: int) -> Holding | None:
        return self.holding(rank_to_coordinate(rank, self.mesh_shape, self.rank_axes))

    def replica_ranks(self, rank: int) -> tuple[int, ...]:
        """Every rank holding exactly what ``rank`` holds (itself included), ascending; empty off-stage."""
        coord = rank_to_coordinate(rank, self.mesh_shape, self.rank_axes)
        if self.stage is not None and coord[self.stage_axis] != self.stage:
            return ()
        return self.ranks_varying_replicas(coord)

    def sources(self, box: ShardBox) -> tuple[Source, ...]:
        """Every distinct piece overlapping ``box``, with the ranks holding it.

        Cost grows with the number of overlapping pieces (and their replicas), not with the world: plain chunk
        splits are inverted arithmetically, only DTensor-interleaved splits try each chunk.
        """
        if box.ndim != len(self.global_shape):
            raise GeometryError(f"{box} does not match tensor shape {self.global_shape}")
        if box.is_empty:
            return ()
        return _sources(self, box)

    def all_holdings(self) -> dict[Coordinate, Holding | None]:
        """The holding of every coordinate (world-sized: for tests and small tools)."""
        return {c: self.holding(c) for c in itertools.product(*(range(n) for n in self.mesh_shape))}

    def ranks_varying_replicas(self, coord: Coordinate) -> tuple[int, ...]:
        base = list(coord)
        if self.stage is not None:
            base[self.stage_axis] = self.stage
        for a in self._replica_axes:
            base[a] = 0
        # A rank is linear in the coordinate, so the replicas are the base rank plus every sum of replica-axis
        # strides: additions only, as a source of HSDP state has a replica per dp_replicate coordinate.
        ranks = [coordinate_to_rank(base, self.mesh_shape, self.rank_axes)]
        strides = rank_strides(self.mesh_shape, self.rank_axes)
        for a in self._replica_axes:
            step = strides[a]
            ranks = list(itertools.chain.from_iterable(range(r, r + self.mesh_shape[a] * step, step) for r in ranks))
        return tuple(sorted(ranks))


def _build_steps(sharding: TensorSharding) -> tuple[_Step, ...]:
    """Order the splits: mesh dims left to right, except FSDP-over-TP strided splits, which go after the splits
    they were made after (see the module docstring)."""
    steps: list[tuple[int, _Step]] = []
    for mesh_dim, (spec, group) in enumerate(zip(sharding.placements, sharding.axis_groups, strict=True)):
        if spec.is_shard:
            sizes = tuple(sharding.mesh_shape[a] for a in group)
            steps.append((mesh_dim, _Step(group, sizes, spec.dim, 0)))
    order = [mesh_dim for mesh_dim, _ in steps]
    by_dim = dict(steps)
    for mesh_dim in reversed(order[:]):
        spec = sharding.placements[mesh_dim]
        if spec.kind != "strided":
            continue
        later = [m for m in order if m > mesh_dim and sharding.placements[m].dim == spec.dim]
        if later and math.prod(by_dim[m].parts for m in later) == spec.split_factor:
            order.remove(mesh_dim)
            order.insert(max(order.index(m) for m in later) + 1, mesh_dim)
        elif spec.split_factor > 1:
            step = by_dim[mesh_dim]
            by_dim[mesh_dim] = _Step(step.axes, step.sizes, step.dim, spec.split_factor)
    return tuple(by_dim[m] for m in order)


# ------------------------------------------------------------------------------------------- interval math
def _positions(step: _Step, length: int, index: int) -> list[Interval]:
    """Positions (in the running local dim of ``length``) that chunk ``index`` of ``step`` keeps."""
    if not step.interleave_factor:
        return [chunk_span(length, step.parts, index)]
    out = []
    for lo, hi in chunk_spans(length, step.interleave_factor):
        a, b = chunk_span(hi - lo, step.parts, index)
        out.append((lo + a, lo + b))
    return out


def _take(intervals: list[Interval], positions: list[Interval]) -> list[Interval]:
    """The global intervals at ``positions`` of a dim made of ``intervals`` (both ascending); merged."""
    out: list[Interval] = []
    for ps, pe in positions:
        base = 0
        for a, b in intervals:
            lo, hi = max(ps, base), min(pe, base + b - a)
            if lo < hi:
                start, stop = a + lo - base, a + hi - base
                if out and out[-1][1] == start:
                    out[-1] = (out[-1][0], stop)
                else:
                    out.append((start, stop))
            base += b - a
    return out


def _length(intervals: list[Interval]) -> int:
    return sum(b - a for a, b in intervals)


def _position_span(intervals: list[Interval], lo: int, hi: int) -> Interval | None:
    """Positions covering the global indices ``[lo, hi)`` within ``intervals``, or ``None`` if none are there."""
    base, first, last = 0, None, None
    for a, b in intervals:
        s, e = max(a, lo), min(b, hi)
        if s < e:
            first = base + s - a if first is None else first
            last = base + e - a
        base += b - a
    return None if first is None else (first, last)  # type: ignore[return-value]


def _unravel(index: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(sizes):
        index, r = divmod(index, n)
        out.append(r)
    return tuple(reversed(out))


def _ravel(values: Sequence[int], sizes: Sequence[int]) -> int:
    index = 0
    for v, n in zip(values, sizes, strict=True):
        index = index * n + v
    return index


def _apply(step: _Step, dims: list[list[Interval]], index: int) -> list[list[Interval]]:
    current = dims[step.dim]
    child = list(dims)
    child[step.dim] = _take(current, _positions(step, _length(current), index))
    return child


@lru_cache(maxsize=65536)
def _holding(sharding: TensorSharding, step_coords: tuple[int, ...]) -> Holding:
    dims: list[list[Interval]] = [[(0, n)] if n else [] for n in sharding.global_shape]
    it = iter(step_coords)
    for step in sharding.steps:
        index = _ravel([next(it) for _ in step.axes], step.sizes)
        dims = _apply(step, dims, index)
    return _make_holding(sharding.global_shape, dims)


def _make_holding(global_shape: tuple[int, ...], dims: list[list[Interval]]) -> Holding:
    local_shape = tuple(_length(d) for d in dims)
    offset = tuple(d[0][0] if d else n for d, n in zip(dims, global_shape, strict=True))
    pieces = []
    for combo in itertools.product(*(_with_local_starts(d) for d in dims)):
        box = ShardBox(tuple(interval for interval, _ in combo))
        pieces.append(LocalPiece(box, tuple(start for _, start in combo)))
    return Holding(local_shape, offset, tuple(pieces))


def _with_local_starts(intervals: list[Interval]) -> list[tuple[Interval, int]]:
    out, base = [], 0
    for a, b in intervals:
        out.append(((a, b), base))
        base += b - a
    return out


@lru_cache(maxsize=65536)
def _sources(sharding: TensorSharding, box: ShardBox) -> tuple[Source, ...]:
    dims: list[list[Interval]] = [[(0, n)] if n else [] for n in sharding.global_shape]
    found: list[Source] = []
    for coord_values, leaf_dims in _search(sharding.steps, 0, dims, (), box):
        holding = _make_holding(sharding.global_shape, leaf_dims)
        pieces = [p for p in holding.pieces if p.global_box.intersect(box) is not None]
        if not pieces:
            continue
        coord = [0] * len(sharding.mesh_shape)
        it = iter(coord_values)
        for step in sharding.steps:
            for a in step.axes:
                coord[a] = next(it)
        ranks = sharding.ranks_varying_replicas(tuple(coord))
        found.extend(Source(p, ranks) for p in pieces)
    return tuple(found)


def _search(
    steps: tuple[_Step, ...], i: int, dims: list[list[Interval]], coords: tuple[int, ...], box: ShardBox
) -> Iterator[tuple[tuple[int, ...], list[list[Interval]]]]:
    """Depth-first over split choices, keeping only branches whose running local tensor still meets ``box``."""
    if i == len(steps):
        yield coords, dims
        return
    step = steps[i]
    lo, hi = box.bounds[step.dim]
    current = dims[step.dim]
    span = _position_span(current, lo, hi)
    if span is None:
        return
    if step.interleave_factor:
        candidates: range = range(step.parts)
    else:
        size = -(-_length(current) // step.parts)
        candidates = range(span[0] // size, min((span[1] - 1) // size, step.parts - 1) + 1)
    for index in candidates:
        child = _apply(step, dims, index)
        if _position_span(child[step.dim], lo, hi) is not None:
            yield from _search(steps, i + 1, child, coords + _unravel(index, step.sizes), box)


# -------------------------------------------------------------------------------------- plain-API helpers
def shard_holdings(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any]
) -> dict[Coordinate, Holding]:
    """What every coordinate of ``mesh_shape`` holds of a tensor with these (torch) placements."""
    holdings = TensorSharding.create(global_shape, mesh_shape, placements).all_holdings()
    return {c: h for c, h in holdings.items() if h is not None}


def shard_boxes(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any]
) -> dict[Coordinate, ShardBox]:
    """The single box every coordinate holds; raises :class:`GeometryError` for interleaved (multi-piece) layouts."""
    return {c: h.box for c, h in shard_holdings(global_shape, mesh_shape, placements).items()}


def rank_to_coordinate(rank: int, mesh_shape: Sequence[int], rank_axes: Sequence[int] | None = None) -> Coordinate:
    """Mesh coordinate of ``rank`` when ranks run over the axes in ``rank_axes`` order (slowest first; ``None``:
    row-major, ``arange(world).reshape(mesh_shape)``)."""
    world = math.prod(mesh_shape)
    if not 0 <= rank < world:
        raise GeometryError(f"rank {rank} is outside a world of {world} (mesh {tuple(mesh_shape)})")
    if rank_axes is None:
        return _unravel(rank, tuple(mesh_shape))
    values = _unravel(rank, tuple(mesh_shape[a] for a in rank_axes))
    coord = [0] * len(mesh_shape)
    for a, v in zip(rank_axes, values, strict=True):
        coord[a] = v
    return tuple(coord)


def coordinate_to_rank(coordinate: Sequence[int], mesh_shape: Sequence[int],
                       rank_axes: Sequence[int] | None = None) -> int:
    if len(coordinate) != len(mesh_shape) or any(
        not 0 <= c < n for c, n in zip(coordinate, mesh_shape, strict=True)
    ):
        raise GeometryError(f"coordinate {tuple(coordinate)} is not on mesh {tuple(mesh_shape)}")
    if rank_axes is None:
        return _ravel(coordinate, mesh_shape)
    return _ravel([coordinate[a] for a in rank_axes], [mesh_shape[a] for a in rank_axes])
