"""Batch arithmetic and the global-offset sampler: no sample lost or repeated when dp changes at a step boundary."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_emig.data import (
    BatchPlan,
    BatchPlanError,
    GlobalOffsetSampler,
    SamplerStateError,
    feasible_dp_degrees,
)
from lightning_emig.data.sampler import mix_seed

# ---------------------------------------------------------------------------------------------- BatchPlan

VALID_PLANS = [
    # (global, micro, dp) -> (accumulation, samples per dp rank)
    ((32, 4, 4), (2, 8)),
    ((32, 32, 1), (1, 32)),
    ((32, 1, 32), (1, 1)),
    ((24, 2, 3), (4, 8)),
    ((7, 7, 1), (1, 7)),
]


@pytest.mark.parametrize(("args", "expected"), VALID_PLANS)
def test_batch_plan_arithmetic(args: tuple[int, int, int], expected: tuple[int, int]) -> None:
    plan = BatchPlan(*args)
    assert (plan.grad_accumulation, plan.samples_per_dp_rank) == expected
    assert plan.micro_batch_size * plan.grad_accumulation * plan.dp_degree == plan.global_batch_size


INVALID_PLANS = [
    # (global, micro, dp), text the error must contain (it names the numbers to change)
    ((0, 4, 1), "global_batch_size must be positive, got 0"),
    ((32, -1, 1), "micro_batch_size must be positive, got -1"),
    ((32, 4, 0), "dp_degree must be positive, got 0"),
    ((32.0, 4, 1), "global_batch_size must be an int"),
    ((32, True, 1), "micro_batch_size must be an int"),
    ((30, 4, 4), "global batch 30 is not divisible by micro batch 4 x dp 4 = 16"),
    ((30, 4, 4), "change global_batch_size to a multiple of 16 (e.g. 32)"),
    ((32, 3, 1), "choose a micro_batch_size that divides 32"),
    ((32, 4, 3), "with micro batch 4 choose dp_degree in [1, 2, 4, 8]"),
]


@pytest.mark.parametrize(("args", "message"), INVALID_PLANS)
def test_batch_plan_rejects(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(BatchPlanError) as excinfo:
        BatchPlan(*args)
    assert message in str(excinfo.value)


def test_batch_plan_describe_and_tokens() -> None:
    plan = BatchPlan(32, 4, 4)
    assert plan.describe(256) == "global batch 32 = micro 4 x accum 2 x dp 4; 8192 tokens/step"
    assert plan.describe() == "global batch 32 = micro 4 x accum 2 x dp 4"
    assert plan.tokens_per_step(256) == 8192
    with pytest.raises(BatchPlanError, match="seq_len"):
        plan.tokens_per_step(0)


def test_batch_plan_keeps_global_batch_across_dp_degrees() -> None:
    plan = BatchPlan(32, 4, 4)
    assert plan.with_dp_degree(2) == BatchPlan(32, 4, 2)
    assert plan.with_dp_degree(2).grad_accumulation == 4
    with pytest.raises(BatchPlanError):
        plan.with_dp_degree(3)
    assert BatchPlan(global_batch_size=8, micro_batch_size=2, dp_degree=2) == BatchPlan(8, 2, 2)


def test_feasible_dp_degrees() -> None:
    assert feasible_dp_degrees(32, 4) == [1, 2, 4, 8]
    assert feasible_dp_degrees(24, 2) == [1, 2, 3, 4, 6, 12]
    assert feasible_dp_degrees(32, 3) == []
    for dp in feasible_dp_degrees(24, 2):
        BatchPlan(24, 2, dp)


# ---------------------------------------------------------------------------------------------- sampler


def test_mix_seed_is_pinned() -> None:
    # The data order of every run depends on these values: a change here silently changes every run.
    assert mix_seed(0, 0) == 0x235B9F3CF861BE00
    assert mix_seed(0, 1) == 0x2EB05CB0704A35D0
    assert len({mix_seed(s, e) for s in range(10) for e in range(10)}) == 100
    assert all(0 <= mix_seed(s, -s) < 2**63 for s in range(5))


def test_epochs_are_seeded_permutations() -> None:
    sampler = GlobalOffsetSampler(num_samples=50, global_batch_size=8, seed=3)
    first = sampler.permutation(0).clone()
    assert sorted(first.tolist()) == list(range(50))
    assert torch.equal(GlobalOffsetSampler(50, 8, seed=3).permutation(0), first)
    assert not torch.equal(sampler.permutation(1), first)
    assert not torch.equal(GlobalOffsetSampler(50, 8, seed=4).permutation(0), first)
    assert torch.equal(sampler.permutation(0), first)  # back after the cache moved on


def test_epoch_geometry_drops_the_tail() -> None:
    sampler = GlobalOffsetSampler(num_samples=50, global_batch_size=8)
    assert (sampler.steps_per_epoch, sampler.samples_per_epoch, sampler.dropped_per_epoch) == (6, 48, 2)
    assert [sampler.epoch_of(k * 8) for k in (0, 5, 6, 11, 12)] == [0, 0, 1, 1, 2]
    assert sampler.global_batch(40) == sampler.permutation(0)[40:48].tolist()
    assert sampler.global_batch(48) == sampler.permutation(1)[:8].tolist()


def test_position_is_one_offset() -> None:
    sampler = GlobalOffsetSampler(num_samples=50, global_batch_size=8)
    assert sampler.offset == 0
    assert sampler.advance() == 8
    assert sampler.advance(3) == 32
    assert (sampler.step, sampler.epoch_of()) == (4, 0)
    sampler.seek(56)
    assert (sampler.offset, sampler.epoch_of()) == (56, 1)
    with pytest.raises(SamplerStateError, match="not a step boundary"):
        sampler.seek(12)
    with pytest.raises(SamplerStateError, match="non-negative"):
        sampler.advance(-1)


def test_ranks_read_contiguous_slices_of_the_global_batch() -> None:
    sampler = GlobalOffsetSampler(num_samples=100, global_batch_size=12, seed=1)
    batch = sampler.global_batch(24)
    assert sampler.indices_for_step(24, dp_degree=3, dp_rank=1, micro_batch_size=2) == [
        batch[4:6],
        batch[6:8],
    ]
    for dp in feasible_dp_degrees(12, 2):
        flat = [i for r in range(dp) for micro in sampler.indices_for_step(24, dp, r, 2) for i in micro]
        assert flat == batch


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_under_torch_order_every_micro_batch_is_the_one_distributed_sampler_gives(dp: int) -> None:
    """Lightning's injected ``DistributedSampler`` deals its order out round-robin; a micro-batch's composition
    matters to whatever is not a plain mean over samples (batch norm, per-position loss weights)."""
    from torch.utils.data import DistributedSampler

    micro, accumulation, size = 2, 3, 96
    sampler = GlobalOffsetSampler(size, global_batch_size=micro * accumulation * dp, seed=5, torch_order=True)
    for rank in range(dp):
        lightning = DistributedSampler(range(size), num_replicas=dp, rank=rank, shuffle=True, seed=5)
        lightning.set_epoch(1)
        order = list(lightning)
        theirs = [order[k: k + micro] for k in range(0, len(order), micro)]
        ours = [batch for step in range(sampler.steps_per_epoch)
                for batch in sampler.indices_for_step(sampler.samples_per_epoch + step * sampler.global_batch_size,
                                                      dp, rank, micro)]
        assert ours == theirs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp_degree": 2, "dp_rank": 2, "micro_batch_size": 2}, r"dp_rank must be an int in \[0, 2\)"),
        ({"dp_degree": 2, "dp_rank": -1, "micro_batch_size": 2}, r"dp_rank must be an int in \[0, 2\)"),
        ({"dp_degree": 5, "dp_rank": 0, "micro_batch_size": 2}, "not divisible by micro batch 2 x dp 5"),
    ],
)
def test_indices_for_step_rejects(kwargs: dict[str, int], message: str) -> None:
    sampler = GlobalOffsetSampler(num_samples=100, global_batch_size=12)
    with pytest.raises(ValueError, match=message):
        sampler.indices_for_step(0, **kwargs)


def test_constructor_rejects() -> None:
    with pytest.raises(SamplerStateError, match="smaller than one global batch"):
        GlobalOffsetSampler(num_samples=7, global_batch_size=8)
    with pytest.raises(SamplerStateError, match="global_batch_size must be a positive int"):
        GlobalOffsetSampler(num_samples=7, global_batch_size=0)


def test_state_dict_round_trip() -> None:
    sampler = GlobalOffsetSampler(num_samples=50, global_batch_size=8, seed=2)
    sampler.advance(9)
    state = sampler.state_dict()
    assert state == {"offset": 72, "seed": 2, "num_samples": 50, "global_batch_size": 8}
    restored = GlobalOffsetSampler(num_samples=50, global_batch_size=8, seed=2)
    restored.load_state_dict(state)
    assert restored.offset == 72
    assert restored.indices_for_step(72, 2, 1, 2) == sampler.indices_for_step(72, 2, 1, 2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_samples": 60}, "saved with num_samples=60 but this sampler has num_samples=50"),
        (
            {"global_batch_size": 16},
            "saved with global_batch_size=16 but this sampler has global_batch_size=8",
        ),
        ({"seed": 1}, "saved with seed=1 but this sampler has seed=2"),
        ({"offset": 12}, "offset 12 is not a step boundary"),
        ({"offset": -8}, "offset must be a non-negative int"),
        ({"extra": 1}, r"unknown keys \['extra'\]"),
    ],
)
def test_load_state_dict_rejects_another_data_order(change: dict[str, int], message: str) -> None:
    sampler = GlobalOffsetSampler(num_samples=50, global_batch_size=8, seed=2)
    state = {**sampler.state_dict(), **change}
    with pytest.raises(SamplerStateError, match=message):
        sampler.load_state_dict(state)
    assert sampler.offset == 0  # a refused state changes nothing


def test_load_state_dict_rejects_missing_keys() -> None:
    sampler = GlobalOffsetSampler(num_samples=50, global_batch_size=8)
    with pytest.raises(SamplerStateError, match=r"missing keys \['offset'\]"):
        sampler.load_state_dict({"seed": 0, "num_samples": 50, "global_batch_size": 8})


# ---------------------------------------------------------------------------------------------- the property


@st.composite
def elastic_runs(draw: st.DrawFn) -> tuple[int, int, int, int, list[int]]:
    """(num_samples, global batch, micro batch, seed, dp degree of every step over two epochs)."""
    micro = draw(st.integers(1, 4))
    global_batch = micro * draw(st.integers(1, 12))
    num_samples = draw(st.integers(global_batch, 6 * global_batch + global_batch - 1))
    seed = draw(st.integers(0, 2**31))
    steps = 2 * (num_samples // global_batch)
    degrees = feasible_dp_degrees(global_batch, micro)
    # The dp degree changes at random step boundaries; between changes it stays put.
    dp = draw(st.sampled_from(degrees))
    per_step = []
    for _ in range(steps):
        if draw(st.integers(0, 3)) == 0:
            dp = draw(st.sampled_from(degrees))
        per_step.append(dp)
    return num_samples, global_batch, micro, seed, per_step


@settings(max_examples=150, deadline=None)
@given(elastic_runs())
def test_dp_changes_lose_and_repeat_nothing(run: tuple[int, int, int, int, list[int]]) -> None:
    num_samples, global_batch, micro, seed, dp_per_step = run
    reference = GlobalOffsetSampler(num_samples, global_batch, seed)
    # Every process has its own sampler; after a dp change the new ranks restore from a state dict, as after a
    # migration, so the only thing carried over is the offset.
    ranks = [GlobalOffsetSampler(num_samples, global_batch, seed)]
    seen_per_epoch: dict[int, list[int]] = {}
    for dp in dp_per_step:
        if len(ranks) != dp:
            state = ranks[0].state_dict()
            ranks = [GlobalOffsetSampler(num_samples, global_batch, seed) for _ in range(dp)]
            for sampler in ranks:
                sampler.load_state_dict(state)
        offset = ranks[0].offset
        step = []
        for rank, sampler in enumerate(ranks):
            assert sampler.offset == offset
            micro_batches = sampler.indices_for_step(offset, dp, rank, micro)
            assert len(micro_batches) == BatchPlan(global_batch, micro, dp).grad_accumulation
            assert all(len(m) == micro for m in micro_batches)
            step.extend(i for m in micro_batches for i in m)
            sampler.advance()
        assert step == reference.global_batch(offset)  # each step is exactly its global batch, in order
        seen_per_epoch.setdefault(reference.epoch_of(offset), []).extend(step)

    assert sorted(seen_per_epoch) == [0, 1]
    for epoch, seen in seen_per_epoch.items():
        consumed = reference.permutation(epoch)[: reference.samples_per_epoch].tolist()
        assert len(seen) == len(set(seen)), "a sample was seen twice in one epoch"
        assert sorted(seen) == sorted(consumed), "a sample of the epoch was lost"
        assert len(seen) == num_samples - num_samples % global_batch
