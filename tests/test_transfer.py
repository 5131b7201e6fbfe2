"""Transfer bucketing as specification (pure: no process group).

Both ends of a pair cut their common transfer list into buckets without talking to each other, so the cut must be
a function of the list and the size alone; the pieces must carry exactly the original elements, in the original
byte order; and no bucket may exceed its size except a single element, which is what bounds the extra memory of a
round by ``bucket_bytes``. The executor's pack/unpack must survive buckets that mix dtypes.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_emig.layout import HybridLayout
from lightning_emig.migration.geometry import ShardBox, TensorSharding
from lightning_emig.migration.identity import IdentityMap
from lightning_emig.migration.planner import TensorMigration, Transfer, plan_all
from lightning_emig.migration.transfer import (
    TransferOptions,
    _pack,
    _schedule,
    _split_rows,
    _unpack,
    buckets_for_pair,
    max_single_row_bytes,
    pair_bucket_bytes,
)


# ------------------------------------------------------------------------------------------------ helpers
def make_transfer(name: str, shape: tuple[int, ...], start: tuple[int, ...], itemsize: int = 4) -> Transfer:
    """A transfer of the box ``start + shape`` that sits at ``start`` in the sender and at 0 in the receiver."""
    box = ShardBox.from_offset(start, shape)
    return Transfer(name, box, 0, 1, tuple(start), (0,) * len(shape), box.numel * itemsize)


def elements(transfers: list[Transfer]) -> list[tuple[str, tuple[int, ...]]]:
    """Every global element the transfers carry, in byte order (transfer by transfer, row-major in each box)."""
    out = []
    for t in transfers:
        for index in torch.cartesian_prod(*(torch.arange(a, b) for a, b in t.box.bounds)).reshape(
            -1, t.box.ndim
        ).tolist() if t.box.ndim else [[]]:
            out.append((t.tensor, tuple(index)))
    return out


shapes = st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple)


@st.composite
def transfer_lists(draw: st.DrawFn) -> list[Transfer]:
    count = draw(st.integers(1, 5))
    out = []
    for i in range(count):
        shape = draw(shapes)
        start = tuple(draw(st.integers(0, 3)) for _ in shape)
        out.append(make_transfer(f"t{i}", shape, start, draw(st.sampled_from([1, 2, 4, 8]))))
    return out


# ---------------------------------------------------------------------------------------------- splitting
@settings(max_examples=150, deadline=None)
@given(shape=shapes, max_bytes=st.integers(1, 600), itemsize=st.sampled_from([2, 4, 8]))
def test_split_rows_tiles_the_box_in_byte_order(shape: tuple[int, ...], max_bytes: int, itemsize: int) -> None:
    transfer = make_transfer("w", shape, tuple(range(1, len(shape) + 1)), itemsize)
    pieces = _split_rows(transfer, max_bytes)
    # the same elements, each once, in the row-major order of the original box: packing the pieces one after the
    # other gives the bytes of the original box
    assert elements(pieces) == elements([transfer])
    assert sum(p.nbytes for p in pieces) == transfer.nbytes
    for piece in pieces:
        assert piece.nbytes == piece.box.numel * itemsize
        assert transfer.box.contains(piece.box)
        # both local offsets move with the box: the piece reads and writes where the original would
        delta = tuple(p - o for p, o in zip(piece.box.start, transfer.box.start, strict=True))
        assert piece.src_start == tuple(s + d for s, d in zip(transfer.src_start, delta, strict=True))
        assert piece.dst_start == tuple(s + d for s, d in zip(transfer.dst_start, delta, strict=True))
        assert (piece.tensor, piece.src, piece.dst) == (transfer.tensor, transfer.src, transfer.dst)
        # only a single element may exceed the limit
        assert piece.nbytes <= max_bytes or piece.box.numel == 1


def test_split_rows_prefers_whole_rows() -> None:
    transfer = make_transfer("w", (10, 4), (0, 0))  # rows of 16 bytes
    assert [p.box.shape for p in _split_rows(transfer, 160)] == [(10, 4)]
    assert [p.box.shape for p in _split_rows(transfer, 50)] == [(3, 4)] * 3 + [(1, 4)]
    # a row wider than the limit is cut along the next dim, row by row
    wide = make_transfer("w", (2, 10), (4, 0))  # rows of 40 bytes
    assert [p.box.bounds for p in _split_rows(wide, 16)] == [
        ((4, 5), (0, 4)), ((4, 5), (4, 8)), ((4, 5), (8, 10)),
        ((5, 6), (0, 4)), ((5, 6), (4, 8)), ((5, 6), (8, 10)),
    ]
    scalar = make_transfer("step", (), ())
    assert _split_rows(scalar, 1) == [scalar]


# ---------------------------------------------------------------------------------------------- buckets
@settings(max_examples=150, deadline=None)
@given(transfers=transfer_lists(), size=st.integers(1, 400))
def test_buckets_are_deterministic_bounded_and_lossless(transfers: list[Transfer], size: int) -> None:
    buckets = buckets_for_pair(tuple(transfers), size)
    # the other end of the pair computes the same cut from an equal list
    assert buckets == buckets_for_pair(tuple(list(transfers)), size)
    assert all(buckets), "no empty bucket"
    for bucket in buckets:
        nbytes = sum(t.nbytes for t in bucket)
        assert nbytes <= size or (len(bucket) == 1 and bucket[0].box.numel == 1), (size, bucket)
    flat = [t for bucket in buckets for t in bucket]
    assert elements(flat) == elements(transfers)
    assert sum(t.nbytes for t in flat) == sum(t.nbytes for t in transfers)


def test_buckets_pack_greedily_in_plan_order() -> None:
    a, b, c = (make_transfer(n, (2, 4), (0, 0)) for n in "abc")  # 32 bytes each
    assert buckets_for_pair((a, b, c), 64) == [[a, b], [c]]
    assert buckets_for_pair((a, b, c), 1000) == [[a, b, c]]
    assert buckets_for_pair((), 64) == []


def test_pair_bucket_bytes_is_symmetric_and_within_budget() -> None:
    for budget in (1, 7, 4096, 256 << 20):
        for mine in range(0, 9):
            for theirs in range(0, 9):
                size = pair_bucket_bytes(budget, mine, theirs)
                assert size == pair_bucket_bytes(budget, theirs, mine)
                assert size >= 1
                assert size * 2 * max(mine, theirs, 1) <= max(budget, 2 * max(mine, theirs, 1))
    assert pair_bucket_bytes(4096, 2, 4) == 4096 // 8


def test_bucket_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        TransferOptions(bucket_bytes=0)


# -------------------------------------------------------------------------------------------- the rounds
def _sharding(shape: tuple[int, ...], layout: HybridLayout, tp_dim: int | None) -> TensorSharding:
    """FSDP2 on dim 0 over dp_shard, over TP on ``tp_dim`` (None: replicated over tp)."""
    names, placements = [], []
    if layout.dp_shard > 1:
        names.append("dp_shard")
        strided = layout.tp > 1 and tp_dim == 0
        placements.append(_StridedShard(0, split_factor=layout.tp) if strided else Shard(0))
    if layout.tp > 1:
        names.append("tp")
        placements.append(Replicate() if tp_dim is None else Shard(tp_dim))
    return TensorSharding.for_layout(shape, layout, names, placements)


def _migrations(old: HybridLayout, new: HybridLayout) -> list[TensorMigration]:
    # rows far wider than a pair's bucket (w2-like), uneven vocab-like rows, a norm and a scalar
    specs = {"wide": ((6, 1000), 1), "embed": ((259, 24), 0), "norm": ((24,), None)}
    out = [TensorMigration(k, 4, _sharding(s, old, d), _sharding(s, new, d)) for k, (s, d) in specs.items()]
    scalar = TensorSharding.for_layout((), old, [], [])
    out.append(TensorMigration("step", 4, scalar, TensorSharding.for_layout((), new, [], [])))
    return out


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (HybridLayout(dp_shard=4), HybridLayout(dp_shard=1, tp=4)),
        (HybridLayout(dp_shard=2, tp=2), HybridLayout(dp_shard=4)),
        (HybridLayout(dp_shard=3, tp=2), HybridLayout(dp_shard=6)),
    ],
    ids=str,
)
@pytest.mark.parametrize("bucket_bytes", [64, 1000, 4096])
def test_round_buffers_stay_within_the_bucket_budget(
    old: HybridLayout, new: HybridLayout, bucket_bytes: int
) -> None:
    """Every process's send + receive buffers of any round fit in ``bucket_bytes``, rows wider than a bucket
    included, and every planned byte travels in some round."""
    world = old.world_size
    plans = plan_all(_migrations(old, new), IdentityMap.same_processes(world))
    peer_counts = {pid: len(plan.peers) for pid, plan in plans.items()}
    schedules = {pid: _schedule(plan, peer_counts[pid], peer_counts, bucket_bytes) for pid, plan in plans.items()}
    for pid, schedule in schedules.items():
        plan = plans[pid]
        largest_item = 4
        for sends, recvs in schedule:
            used = sum(t.nbytes for b in (*sends.values(), *recvs.values()) for t in b)
            assert used <= max(bucket_bytes, 2 * len(plan.peers) * largest_item)
            assert used <= bucket_bytes + max_single_row_bytes(plan)
        sent = sum(t.nbytes for sends, _ in schedule for b in sends.values() for t in b)
        received = sum(t.nbytes for _, recvs in schedule for b in recvs.values() for t in b)
        assert (sent, received) == (plan.bytes_sent, plan.bytes_received)
        # round k of the pair (A, B) on A's side is round k of (B, A) on B's side
        for k, (sends, _) in enumerate(schedule):
            for peer, bucket in sends.items():
                assert schedules[peer][k][1][pid] == bucket


def test_max_single_row_bytes() -> None:
    transfers = (make_transfer("a", (3, 10), (0, 0)), make_transfer("b", (2, 5, 3), (0, 0, 0)))
    plan = plan_all([], IdentityMap.same_processes(1))[0]
    plan = type(plan)(0, 0, 0, (), transfers, ())
    assert max_single_row_bytes(plan) == 60


# --------------------------------------------------------------------------------------- pack and unpack
def test_pack_unpack_round_trip_with_mixed_dtypes() -> None:
    """A float32 box right after an odd number of bfloat16 elements sits at an offset float32 cannot view."""
    old = {
        "half": torch.arange(15, dtype=torch.bfloat16).reshape(3, 5),
        "single": torch.arange(12, dtype=torch.float32).reshape(3, 4) + 0.5,
        "double": torch.arange(6, dtype=torch.float64) - 7.25,
        "step": torch.tensor(3.0),
    }
    bucket = [
        Transfer("half", ShardBox(((0, 1), (0, 3))), 0, 1, (0, 0), (1, 1), 3 * 2),  # 6 bytes: misaligns the rest
        Transfer("single", ShardBox(((1, 3), (1, 4))), 0, 1, (1, 1), (0, 0), 6 * 4),
        Transfer("step", ShardBox(()), 0, 1, (), (), 4),
        Transfer("double", ShardBox(((2, 5),)), 0, 1, (2,), (0,), 3 * 8),
    ]
    buffer = _pack(bucket, old, torch.empty(sum(t.nbytes for t in bucket), dtype=torch.uint8))
    assert buffer.dtype == torch.uint8 and buffer.numel() == sum(t.nbytes for t in bucket)
    new = {
        "half": torch.zeros(2, 4, dtype=torch.bfloat16),
        "single": torch.zeros(2, 3),
        "step": torch.tensor(0.0),
        "double": torch.zeros(3, dtype=torch.float64),
    }
    _unpack(bucket, buffer, new)
    assert torch.equal(new["half"][1, 1:4], old["half"][0, 0:3])
    assert torch.equal(new["single"], old["single"][1:3, 1:4])
    assert torch.equal(new["step"], old["step"])
    assert torch.equal(new["double"], old["double"][2:5])
    assert math.isclose(float(new["half"][0].abs().sum()), 0.0)
