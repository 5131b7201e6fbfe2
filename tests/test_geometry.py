"""Shard geometry as specification: what every coordinate holds, checked against torch's own sharding.

Three sources of truth, from the strongest: real DTensor / FSDP2-over-TP shards in 4 (and 6) gloo processes,
torch's own split functions called without a process group, and properties (tiling, inverse search) over random
placements. An ``arange`` tensor makes every element identifiable, so comparisons are element by element.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_emig.layout import HybridLayout
from lightning_emig.migration.geometry import (
    GeometryError,
    Holding,
    LocalPiece,
    PlacementSpec,
    ShardBox,
    TensorSharding,
    coordinate_to_rank,
    normalize_placement,
    rank_to_coordinate,
    shard_boxes,
    shard_holdings,
)
from lightning_emig.migration.stages import StageOwner, StageSplit, split_stages
from lightning_emig.testing.distributed import run_distributed


def SS(dim: int, sf: int) -> _StridedShard:  # noqa: N802 - reads like a placement
    return _StridedShard(dim, split_factor=sf)


def arange(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)


def assemble(full: torch.Tensor, holding: Holding) -> torch.Tensor:
    """The local tensor a holding describes, built from the full tensor; pieces must tile it exactly once."""
    local = torch.full(holding.local_shape, -1, dtype=full.dtype)
    hits = torch.zeros(holding.local_shape, dtype=torch.int64)
    for piece in holding.pieces:
        assert piece.local_box.shape == piece.global_box.shape
        local[piece.local_box.slices_within(ShardBox.full(holding.local_shape))] = full[
            piece.global_box.slices_within(ShardBox.full(full.shape))
        ]
        hits[piece.local_box.slices_within(ShardBox.full(holding.local_shape))] += 1
    assert bool((hits == 1).all()), f"pieces do not tile the local tensor once: {holding}"
    return local


# ------------------------------------------------------------------------------------------------- boxes
def test_box_basics() -> None:
    box = ShardBox(((2, 5), (0, 4)))
    assert box.shape == (3, 4) and box.numel == 12 and box.start == (2, 0) and not box.is_empty
    assert box.intersect(ShardBox(((4, 9), (3, 8)))) == ShardBox(((4, 5), (3, 4)))
    assert box.intersect(ShardBox(((5, 9), (0, 4)))) is None
    assert ShardBox(((4, 5), (1, 3))).slices_within(box) == (slice(2, 3), slice(1, 3))
    assert box.contains(ShardBox(((2, 3), (1, 2)))) and not box.contains(ShardBox(((1, 3), (1, 2))))
    assert ShardBox(((3, 3), (0, 4))).is_empty
    scalar = ShardBox(())
    assert scalar.numel == 1 and scalar.intersect(scalar) == scalar
    with pytest.raises(GeometryError, match="need 0 <= start <= stop"):
        ShardBox(((3, 2),))
    with pytest.raises(GeometryError, match="is not inside"):
        ShardBox(((0, 6), (0, 1))).slices_within(box)


def test_box_split_follows_torch_chunk() -> None:
    box = ShardBox(((0, 7), (2, 4)))
    assert box.split(3) == (
        ShardBox(((0, 3), (2, 4))),
        ShardBox(((3, 6), (2, 4))),
        ShardBox(((6, 7), (2, 4))),
    )
    # a dim too short for the parts: the longest dim is cut, empty chunks are dropped
    assert ShardBox(((0, 1), (0, 3))).split(4) == tuple(ShardBox(((0, 1), (i, i + 1))) for i in range(3))
    assert ShardBox(()).split(3) == (ShardBox(()),)


def test_local_piece_addresses_sub_boxes() -> None:
    piece = LocalPiece(ShardBox(((4, 6), (0, 3))), (2, 0))
    sub = ShardBox(((5, 6), (1, 3)))
    assert piece.local_slices(sub) == (slice(3, 4), slice(1, 3))
    assert piece.local_offset(sub) == (3, 1)


@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=4).flatmap(
        lambda s: st.tuples(st.just(s), st.integers(0, 10**6))
    )
)
@settings(max_examples=50, deadline=None)
def test_rank_and_coordinate_round_trip(case: tuple[list[int], int]) -> None:
    mesh_shape, seed = case
    rank = seed % math.prod(mesh_shape)
    coord = rank_to_coordinate(rank, mesh_shape)
    assert coordinate_to_rank(coord, mesh_shape) == rank
    # row-major, as mesh = arange(world).reshape(mesh_shape)
    assert torch.arange(math.prod(mesh_shape)).reshape(mesh_shape)[coord].item() == rank


def test_bad_inputs_fail_loudly() -> None:
    from torch.distributed.tensor import Partial

    with pytest.raises(GeometryError, match="Partial state must be reduced"):
        normalize_placement(Partial(), 2)
    with pytest.raises(GeometryError, match="shards dim 2 of a 2-d tensor"):
        normalize_placement(Shard(2), 2)
    assert normalize_placement(Shard(-1), 2) == PlacementSpec("shard", 1)
    with pytest.raises(GeometryError, match="outside a world of 4"):
        rank_to_coordinate(4, (2, 2))
    with pytest.raises(GeometryError, match="2 placements for 1 mesh dims"):
        TensorSharding.create((4,), (4,), [Shard(0), Shard(0)], axis_groups=[(0,)])
    with pytest.raises(GeometryError, match="not one box"):
        shard_boxes((16,), (4,), [SS(0, 2)])


# ----------------------------------------------------------------------- torch's own splits, no processes
def _dtensor_local(
    full: torch.Tensor, mesh_shape: tuple[int, ...], placements: list[Any], coord: tuple[int, ...]
):
    """DTensor's left-to-right construction (as ``distribute_tensor`` and the private offset helper model it)."""
    local = full
    for axis, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        local = placement._split_tensor(local, mesh_shape[axis], with_padding=False)[0][coord[axis]]
    return local


def _fsdp_over_tp_local(
    full: torch.Tensor, tp_placement: Any, dp: int, tp: int, d: int, t: int
) -> torch.Tensor:
    """What FSDP2 stores: torch's TP split of the full tensor, then FSDP2's own dim-0 chunking of the TP shard."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    tp_local = _dtensor_local(full, (tp,), [tp_placement], (t,))
    return _chunk_with_empty(tp_local, dp, dim=0)[d]


FSDP_OVER_TP = [
    # (global shape, dp_shard, tp, TP placement): Colwise weights/biases are Shard(0), Rowwise weights Shard(1)
    ((8, 4), 2, 2, Shard(0)),
    ((7, 4), 2, 2, Shard(0)),
    ((7, 4), 3, 2, Shard(0)),  # uneven with dp_shard 3: torch's private offset helper gets this wrong
    ((11, 3), 3, 3, Shard(0)),
    ((5,), 2, 4, Shard(0)),
    ((9, 2), 4, 2, Shard(0)),
    ((3, 6), 2, 3, Shard(1)),
    ((5, 7), 3, 2, Shard(1)),
    ((6, 5), 4, 1, Shard(0)),
    ((2, 2), 4, 2, Shard(0)),
]


@pytest.mark.parametrize(("shape", "dp", "tp", "tp_placement"), FSDP_OVER_TP)
def test_fsdp_over_tp_geometry_matches_fsdp_chunking(shape, dp, tp, tp_placement) -> None:
    tp_dim = tp_placement.dim
    sf = tp if tp_dim == 0 else 1
    placements = [SS(0, sf) if sf > 1 else Shard(0), tp_placement]
    full = arange(shape)
    for (d, t), holding in shard_holdings(shape, (dp, tp), placements).items():
        expected = _fsdp_over_tp_local(full, tp_placement, dp, tp, d, t)
        got = assemble(full, holding)
        assert len(holding.pieces) <= 1, "FSDP-over-TP shards are single boxes"
        if expected.numel() == 0:
            assert got.numel() == 0
        else:
            assert torch.equal(got, expected), f"coordinate {(d, t)}"


DTENSOR_TABLE = [
    # (global shape, mesh shape, placements): left-to-right DTensor semantics, including uneven and empty shards
    ((5, 3), (4,), [Shard(0)]),
    ((3,), (4,), [Shard(0)]),
    ((6, 5), (2, 2), [Shard(1), Shard(0)]),
    ((7, 6), (2, 2), [Shard(0), Shard(0)]),
    ((7, 6), (3, 2), [Shard(0), Shard(1)]),
    ((4, 6), (2, 2), [Replicate(), Shard(1)]),
    ((16,), (4,), [SS(0, 2)]),  # interleaved: two pieces per rank
    ((10, 3), (2, 2), [SS(0, 3), Replicate()]),
    ((12,), (2, 3), [SS(0, 2), Shard(0)]),  # sf=2 != tp=3: not FSDP-shaped, interleaved semantics
    ((4, 4, 5), (2, 1, 3), [Shard(2), Replicate(), Shard(0)]),
    ((), (2, 2), [Replicate(), Replicate()]),
]


@pytest.mark.parametrize(("shape", "mesh_shape", "placements"), DTENSOR_TABLE)
def test_dtensor_geometry_matches_torch_split(shape, mesh_shape, placements) -> None:
    full = arange(shape)
    for coord, holding in shard_holdings(shape, mesh_shape, placements).items():
        expected = _dtensor_local(full, mesh_shape, placements, coord)
        got = assemble(full, holding)
        assert got.shape == expected.shape and torch.equal(got, expected), f"coordinate {coord}"


PRIVATE_HELPER_TABLE = [case for case in DTENSOR_TABLE if len(case[0]) > 0] + [
    ((8, 4), (2, 2), [SS(0, 2), Shard(0)]),
    ((7, 4), (2, 2), [SS(0, 2), Shard(0)]),
    ((9, 3), (2, 1, 2), [Replicate(), SS(0, 2), Shard(0)]),
    ((6, 6), (2, 2), [Shard(0), Shard(1)]),
]


@pytest.mark.parametrize(("shape", "mesh_shape", "placements"), PRIVATE_HELPER_TABLE)
def test_private_offset_helper_agrees_where_it_applies(shape, mesh_shape, placements) -> None:
    """Pins ``_compute_local_shape_and_global_offset`` (private torch API) against our geometry."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    for coord, holding in shard_holdings(shape, mesh_shape, placements).items():
        local_shape, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), placements
        )
        assert tuple(local_shape) == holding.local_shape, f"coordinate {coord}"
        if holding.numel:
            assert tuple(offset) == holding.global_offset, f"coordinate {coord}"


def test_private_offset_helper_disagrees_with_fsdp_on_uneven_dp3() -> None:
    """FSDP2 chunks the TP shard (rows 4..6 over 3 dp ranks: 4 | 5 | 6), torch's left-to-right helper puts row 6
    on tp rank 0 instead. Geometry follows what FSDP2 stores; this test tells us if torch changes."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements = [SS(0, 2), Shard(0)]
    boxes = shard_boxes((7, 4), (3, 2), placements)
    assert boxes[(2, 0)].is_empty and boxes[(2, 1)] == ShardBox(((6, 7), (0, 4)))
    shape, _ = _compute_local_shape_and_global_offset((7, 4), (3, 2), [2, 0], placements)
    assert tuple(shape) == (1, 4)


def test_fsdp_over_tp_on_layout_axes_and_stages() -> None:
    layout = HybridLayout(pp=2, dp_replicate=2, dp_shard=2, tp=2).resolve(16)
    sharding = TensorSharding.for_layout(
        (8, 4), layout, ("dp_replicate", "dp_shard", "tp"), [Replicate(), SS(0, 2), Shard(0)], stage=1
    )
    assert sharding.replicas == 2
    # rank 9 = (pp 1, dp_replicate 0, dp_shard 0, tp 1): tp shard rows 4..7, its first dp half
    assert sharding.holding_of_rank(9).box == ShardBox(((4, 6), (0, 4)))
    assert sharding.holding_of_rank(1) is None  # stage 0 holds nothing of a stage-1 tensor
    assert sharding.replica_ranks(9) == (9, 13)
    flat = TensorSharding.for_layout((9,), layout, ("dp",), [Shard(0)])
    # the flattened dp axis chunks over dp_replicate x dp_shard = 4 parts; pp and tp hold replicas
    # (9 rows in chunks of 3: the last dp rank's shard is empty)
    assert flat.holding_of_rank(coordinate_to_rank((0, 1, 0, 0), layout.mesh_shape)).box == ShardBox(
        ((6, 9),)
    )
    assert flat.holding_of_rank(coordinate_to_rank((1, 1, 1, 1), layout.mesh_shape)).is_empty
    assert flat.replicas == 4


def test_stage_ownership_by_declared_module_paths() -> None:
    five = split_stages([1] * 5, 2)  # the project's one split rule; equal blocks: the later stage takes the extra one
    assert five == (range(0, 2), range(2, 5))
    assert split_stages([1] * 4, 4) == tuple(range(i, i + 1) for i in range(4))
    # Blocks where the model says they are (timm's ``blocks.<i>``, any name), the embedding as it declares it.
    sizes = [("wte.weight", 0), *((f"blocks.{i}.w", 1) for i in range(5)), ("head.weight", 0), ("blocks_norm.w", 0)]
    split = StageSplit.of_tensors(sizes, blocks=[f"blocks.{i}" for i in range(5)], first=["wte"])
    assert split.ranges(2) == five and split.block_costs == (1,) * 5

    def stage(name: str) -> int | None:
        return StageOwner.of(name, split).stage(2)

    assert stage("blocks.1.w") == 0 and stage("blocks.2.w") == 1 and stage("blocks.4.w") == 1
    assert stage("wte.weight") == 0 and stage("head.weight") == 1
    assert stage("blocks_norm.w") == 1  # a sibling whose name starts like a block's is not in it
    assert stage("layers.1.w") == 1  # a name that looks like a block but is not declared one: the last stage
    held = split.with_prefix("model.")
    assert StageOwner.of("model.blocks.1.w", held).stage(2) == 0 and StageOwner.of("model.wte.weight", held).stage(2) == 0
    with pytest.raises(GeometryError, match="cannot split 2 layers into 3"):
        split_stages([1, 1], 3)


# -------------------------------------------------------------------------------------------- properties
@st.composite
def shardings(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], list[Any]]:
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements: list[Any] = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(["R", "S", "SS", "FSDP"] if ndim else ["R"]))
        if kind == "R":
            placements.append(Replicate())
            continue
        dim = draw(st.integers(0, ndim - 1))
        if kind == "S":
            placements.append(Shard(dim))
        elif kind == "SS":
            placements.append(SS(dim, draw(st.integers(2, 4))))
        else:  # FSDP-shaped: split factor = product of later axes that shard the same dim (filled in below)
            placements.append(("fsdp", dim))
    for axis in reversed(range(len(mesh_shape))):  # right to left: later axes are final already
        p = placements[axis]
        if isinstance(p, tuple):
            later = [
                mesh_shape[j]
                for j in range(axis + 1, len(mesh_shape))
                if isinstance(placements[j], (Shard, _StridedShard)) and placements[j].dim == p[1]
            ]
            sf = math.prod(later)
            placements[axis] = SS(p[1], sf) if sf > 1 else Shard(p[1])
    return shape, mesh_shape, placements


@given(shardings())
@settings(max_examples=150, deadline=None)
def test_holdings_tile_the_tensor_replicas_times(case) -> None:
    shape, mesh_shape, placements = case
    sharding = TensorSharding.create(shape, mesh_shape, placements)
    counts = torch.zeros(shape, dtype=torch.int64)
    full = arange(shape)
    for holding in sharding.all_holdings().values():
        assert holding is not None
        assemble(full, holding)  # local pieces tile the local tensor exactly
        for piece in holding.pieces:
            assert not piece.global_box.is_empty
            counts[piece.global_box.slices_within(ShardBox.full(shape))] += 1
    assert bool((counts == sharding.replicas).all())
    expected_replicas = math.prod(
        n for n, p in zip(mesh_shape, placements, strict=True) if isinstance(p, Replicate)
    )
    assert sharding.replicas == expected_replicas


@given(shardings(), st.data())
@settings(max_examples=120, deadline=None)
def test_sources_find_exactly_the_overlapping_holders(case, data) -> None:
    shape, mesh_shape, placements = case
    sharding = TensorSharding.create(shape, mesh_shape, placements)
    bounds = []
    for n in shape:
        a = data.draw(st.integers(0, n))
        bounds.append((a, data.draw(st.integers(a, n))))
    box = ShardBox(tuple(bounds))
    brute: dict[tuple[Any, ...], set[int]] = {}
    for coord, holding in sharding.all_holdings().items():
        for piece in holding.pieces:
            if piece.global_box.intersect(box) is not None:
                brute.setdefault((piece.global_box, piece.local_start), set()).add(
                    coordinate_to_rank(coord, mesh_shape)
                )
    found = {(s.piece.global_box, s.piece.local_start): set(s.ranks) for s in sharding.sources(box)}
    assert found == brute
    for source in sharding.sources(box):
        assert list(source.ranks) == sorted(source.ranks)
        assert all(sharding.replica_ranks(r) == source.ranks for r in source.ranks)


@given(shardings())
@settings(max_examples=100, deadline=None)
def test_left_to_right_cases_match_torch_split(case) -> None:
    shape, mesh_shape, placements = case
    fsdp_shaped = any(
        isinstance(p, _StridedShard)
        and math.prod(
            mesh_shape[j]
            for j in range(i + 1, len(placements))
            if isinstance(placements[j], (Shard, _StridedShard)) and placements[j].dim == p.dim
        )
        == p.split_factor
        for i, p in enumerate(placements)
    )
    if fsdp_shaped or not shape:
        return
    full = arange(shape)
    for coord, holding in shard_holdings(shape, mesh_shape, placements).items():
        assert torch.equal(assemble(full, holding), _dtensor_local(full, mesh_shape, placements, coord))


# --------------------------------------------------------------------------------- real DTensor / FSDP2
DISTRIBUTE_CASES = [
    ((5, 3), (4,), [Shard(0)]),
    ((3,), (4,), [Shard(0)]),
    ((6, 5), (2, 2), [Shard(1), Shard(0)]),
    ((7, 6), (2, 2), [Shard(0), Shard(0)]),
    ((4, 6), (2, 2), [Replicate(), Shard(1)]),
    ((8, 4), (2, 2), [SS(0, 2), Shard(0)]),
    ((16,), (4,), [SS(0, 2)]),
    ((12,), (4,), [SS(0, 3)]),
    ((), (2, 2), [Replicate(), Replicate()]),
]

LAYOUTS_4 = [
    {"dp_shard": 2, "tp": 2},
    {"dp_replicate": 2, "dp_shard": 1, "tp": 2},
    {"dp_replicate": 2, "dp_shard": 2},
    {"dp_shard": 4},
    {"tp": 4},
]


class _Net(torch.nn.Module):
    """Colwise ``up`` (uneven out dim), Rowwise ``down`` (uneven in dim), a TP-replicated ``scale``, a plain ``head``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, 5)
        self.scale = torch.nn.Parameter(torch.zeros(5))
        self.head = torch.nn.Linear(5, 3, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(arange(tuple(p.shape)).to(p.dtype))


def _plain(tensor: torch.Tensor) -> tuple[tuple[int, ...], list[Any]]:
    # Plain data, not tensors: torch pickles tensors through shared memory, which dies with the worker.
    return tuple(tensor.shape), tensor.flatten().tolist()


def _tensor(plain: tuple[tuple[int, ...], list[Any]]) -> torch.Tensor:
    shape, values = plain
    return torch.tensor(values, dtype=torch.int64).reshape(shape)


def _layout_locals(rank: int, world: int, kwargs: dict[str, int], hidden: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_emig.layout import build_mesh

    layout = HybridLayout(**kwargs).resolve(world)
    mesh = build_mesh(layout, "cpu")
    net = _Net(6, hidden)
    if layout.tp > 1:
        parallelize_module(net, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        net.scale = torch.nn.Parameter(distribute_tensor(net.scale.data, mesh["tp"], [Replicate()]))
    if layout.dp > 1:
        dp_mesh = mesh.root[("dp_replicate", "dp_shard")] if layout.dp_replicate > 1 else mesh["dp_shard"]
        fully_shard(net.head, mesh=dp_mesh)
        fully_shard(net, mesh=dp_mesh)
    out = {}
    for name, p in net.named_parameters():
        if not isinstance(p, DTensor):  # no FSDP2 and no TP plan: a full copy on every rank
            out[name] = (tuple(p.shape), (), [], _plain(p.detach()))
            continue
        specs = [normalize_placement(x, p.ndim) for x in p.placements]
        out[name] = (
            tuple(p.shape),
            tuple(p.device_mesh.mesh_dim_names),
            specs,
            _plain(p.to_local().detach()),
        )
    return out


def _world4_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    result: dict[str, Any] = {"distribute": [], "layouts": []}
    for shape, mesh_shape, placements in DISTRIBUTE_CASES:
        mesh = init_device_mesh("cpu", mesh_shape)
        local = distribute_tensor(arange(shape), mesh, placements).to_local()
        result["distribute"].append((tuple(mesh.get_coordinate()), _plain(local)))
    for kwargs in LAYOUTS_4:
        result["layouts"].append(_layout_locals(rank, world, kwargs, hidden=7))
    return result


def _check_layout_locals(world: int, kwargs: dict[str, int], per_rank: list[dict[str, Any]]) -> set[str]:
    layout = HybridLayout(**kwargs).resolve(world)
    seen = set()
    for rank, params in enumerate(per_rank):
        for name, (shape, mesh_names, specs, plain) in params.items():
            local = _tensor(plain)
            sharding = TensorSharding.for_layout(shape, layout, mesh_names, specs)
            expected = assemble(arange(shape), sharding.holding_of_rank(rank))
            assert local.shape == expected.shape, f"{kwargs} rank {rank} {name}"
            assert torch.equal(local, expected), f"{kwargs} rank {rank} {name}"
            seen.add(f"{name}:{mesh_names}:{specs}")
    return seen


@pytest.mark.multiprocess
def test_geometry_matches_real_shards_on_four_processes() -> None:
    results = run_distributed(_world4_worker, 4, timeout_s=90)
    for case_index, (shape, mesh_shape, placements) in enumerate(DISTRIBUTE_CASES):
        holdings = shard_holdings(shape, mesh_shape, placements)
        for rank, result in enumerate(results):
            coord, plain = result["distribute"][case_index]
            local = _tensor(plain)
            assert coord == rank_to_coordinate(rank, mesh_shape)
            assert torch.equal(local, assemble(arange(shape), holdings[coord])), (shape, placements, coord)
    seen: set[str] = set()
    for index, kwargs in enumerate(LAYOUTS_4):
        seen |= _check_layout_locals(4, kwargs, [r["layouts"][index] for r in results])
    # the placements FSDP2-over-TP produced on torch 2.13 (what the geometry above was checked on)
    assert "up.weight:('dp_shard', 'tp'):[SS(0,sf=2), S(0)]" in seen
    assert "down.weight:('dp_shard', 'tp'):[S(0), S(1)]" in seen
    assert "up.weight:('dp_replicate', 'dp_shard', 'tp'):[R, SS(0,sf=2), S(0)]" in seen
    assert "scale:('dp_shard', 'tp'):[S(0), R]" in seen
    assert "head.weight:('dp_shard',):[S(0)]" in seen


def _world6_worker(rank: int, world: int) -> dict[str, Any]:
    return _layout_locals(rank, world, {"dp_shard": 3, "tp": 2}, hidden=7)


@pytest.mark.multiprocess
def test_geometry_follows_fsdp_where_the_private_helper_does_not() -> None:
    """dp_shard=3 x tp=2 with 7 output rows: FSDP2's real shards match geometry (not the left-to-right helper)."""
    results = run_distributed(_world6_worker, 6, timeout_s=90)
    _check_layout_locals(6, {"dp_shard": 3, "tp": 2}, results)
    assert results[4]["up.weight"][3][0] == (0, 6)  # (dp_shard 2, tp 0): FSDP2 leaves it empty


def test_all_coordinates_listed_once() -> None:
    holdings = shard_holdings((5,), (2, 3), [Shard(0), Replicate()])
    assert sorted(holdings) == list(itertools.product(range(2), range(3)))
