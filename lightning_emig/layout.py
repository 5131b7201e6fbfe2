"""Hybrid-parallel layouts and the DeviceMesh built from them.

A :class:`HybridLayout` names four degrees: ``dp_replicate`` (HSDP replicas), ``dp_shard`` (FSDP2 sharding),
``tp`` (tensor parallel) and ``pp`` (pipeline stages), and ``pp_virtual``, the pipeline stages each process of the
``pp`` axis holds (the model is cut into ``pp x pp_virtual`` stages, stage ``s`` on the process whose ``pp``
coordinate is ``s % pp``: the interleaved schedule's layout). Invariants:

* a *resolved* layout has every degree >= 1 and their product equals the world size;
* at most one degree is ``-1`` before resolution, meaning "whatever is left of the world";
* the mesh axes are always laid out in the order ``pp, dp_replicate, dp_shard, tp``, and every axis exists even
  when its degree is 1, so geometry code can treat every layout alike;
* the *rank order* says how global ranks run over that mesh: by default row-major (``tp`` innermost, so
  tensor-parallel peers are neighbouring ranks, i.e. on the same node); a layout may number ranks with the axes in
  another order (``rank_order``, outermost first) so that, after a change, processes keep the shards they already
  hold (see :mod:`lightning_emig.migration.rank_order`). Along every axis ranks still ascend with the coordinate
  (torch sorts a sub-group's ranks: FSDP2 shards by that group rank, DTensor by coordinate), and ``dp_replicate``
  stays outside ``dp_shard`` so the flattened ``dp`` axis ascends too;
* the flattened data-parallel axis ``dp`` (``dp_replicate x dp_shard``) is what the sampler and the loss use.

Vocabulary: an *axis* is a mesh axis, a *dim* is a tensor dimension.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning_emig.collective_sockets import recording_group_sockets

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.distributed.device_mesh import DeviceMesh


class MeshAxis(str, enum.Enum):
    """Names of the mesh axes; ``DP`` is the flattened ``DP_REPLICATE x DP_SHARD`` axis."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    TP = "tp"
    DP = "dp"

    def __str__(self) -> str:
        return self.value


#: Order of the axes of every mesh we build (outermost first).
MESH_AXIS_ORDER: tuple[MeshAxis, ...] = (MeshAxis.PP, MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.TP)

#: The degrees of a layout (its fields other than the rank order).
DEGREES: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp", "pp")

#: Global ranks numbered row-major over :data:`MESH_AXIS_ORDER` (``rank_order=None``).
DEFAULT_RANK_ORDER: tuple[str, ...] = tuple(axis.value for axis in MESH_AXIS_ORDER)


PIPELINE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
"""The schedules stages train with (the strategy's ``pipeline_schedule``, the picker's cost model): torch's
``ScheduleGPipe`` and ``Schedule1F1B`` run one stage per process, ``ScheduleInterleaved1F1B`` the ``pp_virtual``
stages of each process (also one)."""

GRAD_SYNC_DEFERRALS: tuple[str, ...] = ("replicas", "all", "none")
"""Which gradient reductions wait for a step's last micro-batch (the strategy's ``defer_grad_sync``, the picker's cost
model): the all-reduce across HSDP replicas, also the reduce-scatter, or none (see
:mod:`lightning_emig.strategy.grad_sync`)."""


def deferred_grad_sync(layout: HybridLayout, defer: str) -> str:
    """What a step of ``layout`` trained with ``defer_grad_sync=defer`` leaves to its last micro-batch: under
    ``pp > 1`` torch's pipeline schedule defers every reduction of an FSDP2 stage itself (``"all"``)."""
    return "all" if layout.pp > 1 else defer


#: The schedules that run several stages per process (``pp_virtual > 1``).
MULTI_STAGE_SCHEDULES: tuple[str, ...] = ("interleaved_1f1b",)


def least_micro_batches(schedule: str, pp: int) -> int:
    """Micro-batches per step ``schedule`` needs over ``pp`` stages: 1F1B one per stage, GPipe and the interleaved
    schedule any number (the interleaved one also needs :func:`micro_batches_problem`'s divisibility)."""
    return pp if schedule == "1f1b" else 1


def micro_batches_problem(schedule: str, pp: int, micro_batches: int) -> str | None:
    """Why ``schedule`` cannot run ``micro_batches`` per step over ``pp`` processes, or None.

    torch's interleaved 1F1B runs the micro-batches in rounds of ``pp`` (``max(1, micro_batches // pp)`` rounds),
    and the rounds must be equal."""
    least = least_micro_batches(schedule, pp)
    if micro_batches < least:
        return f"the {schedule} schedule needs at least {least} micro-batches per step (one per stage), got {micro_batches}"
    rounds = max(1, micro_batches // pp)
    if schedule == "interleaved_1f1b" and micro_batches % rounds:
        return (f"the interleaved_1f1b schedule runs micro-batches in {rounds} equal rounds over pp={pp}: "
                f"{micro_batches} micro-batches per step do not divide into them (use a multiple of pp, or fewer than pp)")
    return None


class LayoutError(ValueError):
    """A layout that cannot be used for the given world or model."""


#: The short form's letters (the benchmarks' notation: ``p2v2s2`` is pp=2, pp_virtual=2, dp_shard=2).
SHORT_LETTERS: dict[str, str] = {"r": "dp_replicate", "s": "dp_shard", "t": "tp", "p": "pp", "v": "pp_virtual"}


def degrees_from_short(text: str) -> dict[str, int]:
    """The degrees a short form names (letters of :data:`SHORT_LETTERS`, each followed by its degree)."""
    import re

    parts = re.findall(r"([a-z])(\d+)", text)
    if not parts or "".join(a + n for a, n in parts) != text or any(a not in SHORT_LETTERS for a, _ in parts):
        raise LayoutError(f"bad layout {text!r}: use letters {'/'.join(SHORT_LETTERS)} each with a degree, e.g. "
                          "t2s2 (tp=2, dp_shard=2) or p2v2 (pp=2, two stages a process)")
    return {SHORT_LETTERS[a]: int(n) for a, n in parts}


@dataclass(frozen=True, kw_only=True, slots=True)
class HybridLayout:
    """Degrees of a hybrid-parallel layout.

    Example: ``HybridLayout(dp_shard=-1, tp=2).resolve(8)`` is ``dp_shard=4, tp=2``.
    """

    dp_replicate: int = 1
    """Number of replicas of the sharded model (HSDP outer axis)."""
    dp_shard: int = -1
    """Number of ranks each parameter is sharded over by FSDP2; ``-1`` fills the rest of the world."""
    tp: int = 1
    """Tensor-parallel degree; must divide attention heads, kv heads and the FFN width."""
    pp: int = 1
    """Pipeline-parallel processes (the ``pp`` mesh axis); ``pp x pp_virtual`` must not exceed the number of blocks."""
    pp_virtual: int = 1
    """Pipeline stages on each ``pp`` process (virtual stages, for the interleaved schedule); > 1 needs ``pp > 1``.
    Not a mesh axis: it changes which blocks a process holds, not which processes there are."""
    rank_order: tuple[str, ...] | None = None
    """Mesh axes from the one whose coordinate changes slowest along the global ranks to the fastest; ``None``:
    :data:`DEFAULT_RANK_ORDER`. Migration chooses it (it changes which process holds what, never what is held)."""

    def __post_init__(self) -> None:
        for name in DEGREES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise LayoutError(f"layout degree {name} must be an int, got {value!r}")
            if value == 0 or value < -1:
                raise LayoutError(f"layout degree {name}={value} must be a positive integer or -1 (the rest)")
        free = [name for name in DEGREES if getattr(self, name) == -1]
        if len(free) > 1:
            raise LayoutError(f"at most one layout degree may be -1 (the rest of the world), got {free}")
        if not isinstance(self.pp_virtual, int) or isinstance(self.pp_virtual, bool) or self.pp_virtual < 1:
            raise LayoutError(f"pp_virtual must be a positive integer, got {self.pp_virtual!r}")
        if self.pp_virtual > 1 and self.pp == 1:
            raise LayoutError(f"pp_virtual={self.pp_virtual} (stages per pipeline process) needs pp > 1")
        object.__setattr__(self, "rank_order", _checked_rank_order(self.rank_order))

    # ------------------------------------------------------------------ degrees
    @property
    def is_resolved(self) -> bool:
        return all(getattr(self, name) > 0 for name in DEGREES)

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicas x shards): how many different micro-batches run at once."""
        self.require_resolved()
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        self.require_resolved()
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes of the mesh axes in :data:`MESH_AXIS_ORDER`."""
        self.require_resolved()
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def stages(self) -> int:
        """Pipeline stages the model is cut into: ``pp x pp_virtual``."""
        return self.pp * self.pp_virtual

    def degree(self, axis: MeshAxis) -> int:
        if axis is MeshAxis.DP:
            return self.dp
        return getattr(self, axis.value)

    def require_resolved(self) -> None:
        if not self.is_resolved:
            raise LayoutError(f"{self} still has a -1 degree; call .resolve(world_size) first")

    # --------------------------------------------------------------- resolution
    def resolve(self, world_size: int) -> HybridLayout:
        """Fill the ``-1`` degree from ``world_size`` and check that the product matches it."""
        if world_size < 1:
            raise LayoutError(f"world size must be >= 1, got {world_size}")
        known = math.prod(v for v in (self.dp_replicate, self.dp_shard, self.tp, self.pp) if v > 0)
        free = [name for name in DEGREES if getattr(self, name) == -1]
        if free:
            if world_size % known:
                raise LayoutError(
                    f"cannot fill {free[0]}=-1: the other degrees multiply to {known}, "
                    f"which does not divide the world size {world_size}"
                )
            return replace(self, **{free[0]: world_size // known})
        if known != world_size:
            raise LayoutError(
                f"layout {self.describe()} multiplies to {known} but the world size is {world_size}; "
                "change a degree or set one of them to -1"
            )
        return self

    def validate_for_model(self, *, n_heads: int, n_kv_heads: int, ffn_hidden: int, n_layers: int) -> None:
        """Raise :class:`LayoutError` when the model cannot be split this way."""
        for name, size in (("attention heads", n_heads), ("kv heads", n_kv_heads), ("FFN width", ffn_hidden)):
            if self.tp > 0 and size % self.tp:
                raise LayoutError(f"tp={self.tp} does not divide the model's {name} ({size}); pick a tp that does")
        if self.pp * self.pp_virtual > n_layers:
            raise LayoutError(f"{self.describe_stages()} is more stages than the model's {n_layers} blocks")

    def describe_stages(self) -> str:
        return f"pp={self.pp}" if self.pp_virtual == 1 else f"pp={self.pp} x pp_virtual={self.pp_virtual}"

    def describe(self) -> str:
        degrees = f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp} {self.describe_stages()}"
        return degrees if self.rank_order is None else f"{degrees} ranks={'>'.join(self.rank_order)}"

    def as_dict(self) -> dict[str, Any]:
        """The degrees, and the rank order where it is not the default (JSON-ready; ``HybridLayout(**d)`` reads it)."""
        out: dict[str, Any] = {name: getattr(self, name) for name in DEGREES}
        if self.pp_virtual != 1:
            out["pp_virtual"] = self.pp_virtual
        if self.rank_order is not None:
            out["rank_order"] = list(self.rank_order)
        return out

    # ------------------------------------------------------------------ ranks
    @property
    def degrees(self) -> HybridLayout:
        """This layout with the default rank order (what the degrees alone decide)."""
        return replace(self, rank_order=None)

    def with_rank_order(self, order: Sequence[str] | None) -> HybridLayout:
        return replace(self, rank_order=None if order is None else tuple(order))

    @property
    def rank_axes(self) -> tuple[int, ...]:
        """The rank order as indices into :data:`MESH_AXIS_ORDER` (slowest first)."""
        index = {name: i for i, name in enumerate(DEFAULT_RANK_ORDER)}
        return tuple(index[name] for name in (self.rank_order or DEFAULT_RANK_ORDER))

    def rank_grid(self) -> list[int]:
        """The global rank at every mesh coordinate, row-major over :attr:`mesh_shape` (what ``DeviceMesh`` takes)."""
        import itertools

        shape = self.mesh_shape
        strides = rank_strides(shape, self.rank_axes)
        return [sum(c * s for c, s in zip(coord, strides, strict=True))
                for coord in itertools.product(*(range(n) for n in shape))]


def rank_strides(shape: Sequence[int], order: Sequence[int] | None = None) -> list[int]:
    """Rank stride of every axis of ``shape`` (how far the rank moves per step of that axis's coordinate) when ranks
    run over the axes in ``order`` (indices, slowest first; ``None``: row-major)."""
    strides = [0] * len(shape)
    step = 1
    for axis in reversed(range(len(shape)) if order is None else order):
        strides[axis] = step
        step *= shape[axis]
    return strides


def _checked_rank_order(order: Sequence[str] | None) -> tuple[str, ...] | None:
    if order is None:
        return None
    if isinstance(order, str):
        order = [part.strip() for part in order.replace(">", ",").split(",")]
    order = tuple(str(name) for name in order)
    if sorted(order) != sorted(DEFAULT_RANK_ORDER):
        raise LayoutError(f"rank_order {list(order)} must name each of {list(DEFAULT_RANK_ORDER)} once")
    if order.index("dp_replicate") > order.index("dp_shard"):
        raise LayoutError(f"rank_order {list(order)}: dp_replicate must come before dp_shard (the flattened data "
                          "axis must number its ranks in ascending order)")
    return None if order == DEFAULT_RANK_ORDER else order


@dataclass(frozen=True, slots=True)
class LayoutMesh:
    """The DeviceMesh of a layout plus its flattened data-parallel sub-mesh.

    torch wants callers to keep a flattened mesh themselves rather than slice it back out of the root, so the
    ``dp`` sub-mesh is kept here. ``layout_mesh[MeshAxis.TP]`` returns the 1-D sub-mesh of any axis.
    """

    layout: HybridLayout
    root: DeviceMesh
    dp: DeviceMesh | None
    """``None`` only on a process outside a mesh built over a subset of ranks (see :func:`build_mesh`)."""

    def __getitem__(self, axis: MeshAxis | str) -> DeviceMesh:
        axis = MeshAxis(axis)
        if axis is MeshAxis.DP:
            return self.dp
        return self.root[axis.value]

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (which micro-batches it reads)."""
        return self.dp.get_local_rank()


def build_mesh(layout: HybridLayout, device_type: str, ranks: Sequence[int] | None = None, *,
               timeout: timedelta | None = None) -> LayoutMesh:
    """Build the 4-axis DeviceMesh (and its flattened ``dp`` axis) for a resolved layout.

    Args:
        layout: A resolved layout.
        device_type: ``"cpu"`` or ``"cuda"``.
        ranks: The default group's ranks the mesh spans, ascending, in the layout's rank order (row-major over
            ``layout.mesh_shape`` by default); ``None`` means all of them (``0..world-1``). A subset lets two meshes of
            different worlds live in one default group (migration between worlds: the old mesh over the old
            processes, the new one over the new). Creating a mesh creates sub-groups, a collective over the whole
            default group: *every* process of the default group must call this, in the same order and with the
            same arguments, members or not. A non-member gets a :class:`LayoutMesh` whose
            ``root.get_coordinate()`` is ``None`` and whose ``dp`` is ``None``; it must not build a model on it.
        timeout: Timeout of every sub-group the mesh creates (FSDP2, HSDP and TP collectives run on them). Without
            it torch gives a sub-group its 30-minute default, not the default group's: a dead peer would block a
            survivor inside an all-gather for half an hour.
    """
    from torch.distributed.device_mesh import init_device_mesh

    layout.require_resolved()
    names = tuple(axis.value for axis in MESH_AXIS_ORDER)
    bounded = _bounded_groups(device_type, timeout)
    with recording_group_sockets(gloo=device_type == "cpu"):  # a way out of its collectives when a peer is gone
        if ranks is not None or layout.rank_order is not None:
            ranks = range(layout.world_size) if ranks is None else ranks
            return _build_mesh_over(layout, device_type, [int(r) for r in ranks], names, bounded)
        root = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=names,
                                backend_override=dict.fromkeys(range(len(names)), bounded) if bounded else None)
        # torch 2.13 has no public way to flatten mesh axes (torchtitan uses the same call).
        dp = root[(MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value)]._flatten(  # noqa: SLF001
            MeshAxis.DP.value, backend_override=bounded)
    return LayoutMesh(layout=layout, root=root, dp=dp)


def _bounded_groups(device_type: str, timeout: timedelta | None) -> tuple[str, Any] | None:
    """``(backend, options)`` that give a mesh's sub-groups ``timeout`` (torch's ``backend_override`` form).

    torch 2.13 reads a sub-group's timeout from its options' private ``_timeout`` (``DeviceMesh`` itself does);
    pinned by ``tests/test_layout.py``."""
    if timeout is None:
        return None
    import torch.distributed as dist

    if device_type == "cuda":
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
    else:
        backend, options = "gloo", dist.ProcessGroupGloo._Options()  # noqa: SLF001 - no public constructor
    options._timeout = timeout  # noqa: SLF001
    return backend, options


def _build_mesh_over(layout: HybridLayout, device_type: str, ranks: list[int], names: tuple[str, ...],
                     bounded: tuple[str, Any] | None) -> LayoutMesh:
    """The mesh over a subset of the default group.

    A non-member cannot slice a mesh (torch needs the local rank in the slice), so it cannot ``_flatten`` the
    data-parallel axes as members would, and the groups that flattening creates would be created by members only
    (a desynchronized collective). So the ``dp`` axis comes from a second mesh every process creates alike: the
    same ranks laid out as ``(pp x tp, dp_replicate x dp_shard)``, whose second axis members slice out.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if len(ranks) != layout.world_size or len(set(ranks)) != len(ranks):
        raise LayoutError(
            f"a mesh for {layout.describe()} needs {layout.world_size} distinct ranks, got {ranks}"
        )
    if ranks != sorted(ranks):
        # torch sorts a sub-group's ranks: FSDP2 shards by that group rank while DTensor places by mesh
        # coordinate, so along any axis whose ranks are not ascending the two would disagree on who holds what.
        raise LayoutError(
            f"mesh ranks must be ascending (mesh coordinate order = process-group rank order), got {ranks}"
        )
    world = dist.get_world_size()
    if any(not 0 <= r < world for r in ranks):
        raise LayoutError(f"mesh ranks {ranks} are not all ranks of the default group (size {world})")
    # position i of the layout's rank order is default-group rank ranks[i]
    grid = torch.tensor(ranks, dtype=torch.int64)[torch.tensor(layout.rank_grid())].reshape(layout.mesh_shape)
    root = DeviceMesh(device_type, grid, mesh_dim_names=names,
                      backend_override=(bounded,) * len(names) if bounded else None)
    pp, dp_replicate, dp_shard, tp = layout.mesh_shape
    dp_grid = grid.permute(0, 3, 1, 2).reshape(pp * tp, dp_replicate * dp_shard)
    dp_root = DeviceMesh(device_type, dp_grid, mesh_dim_names=("pp_tp", MeshAxis.DP.value),
                         backend_override=(bounded,) * 2 if bounded else None)
    member = dist.get_rank() in ranks
    return LayoutMesh(layout=layout, root=root, dp=dp_root[MeshAxis.DP.value] if member else None)
