"""The layout picker as specification: tables of world sizes, memory limits and constraints, the choice each must
give and how it must explain it. Pure: no process group; the expected values follow from the memory and throughput
models (asserted through their own numbers), not from hard-coded answers, except where the issue fixes them
(the 1B model at 80 GB picks pure FSDP on 8 devices).
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from typing import Any

import pytest
import torch

from lightning_emig.layout import HybridLayout
from lightning_emig.migration.identity import IdentityMap
from lightning_emig.migration.planner import TensorMigration, plan_all
from lightning_emig.migration.rank_order import choose_rank_order
from lightning_emig.models.llama import MODEL_SIZES, Llama
from lightning_emig.pick import main as pick_main
from lightning_emig.picker import (
    HardwareProfile,
    NoFeasibleLayoutError,
    PickerConstraints,
    PickerError,
    PickResult,
    estimate_memory,
    estimate_migration_bytes,
    estimate_step_time,
    load_profile,
    pick_layout,
    save_profile,
)
from lightning_emig.picker.migration_cost import MIGRATED_BYTES_PER_ELEMENT, sharding_of, stage_ranges
from lightning_emig.picker.shapes import param_counts, param_tensors
from lightning_emig.picker.throughput import flops_per_token

LLAMA_1B = MODEL_SIZES["llama_1b"]
#: The 1B recipe (recipes/llama_1b.yaml): 512 sequences of 2048 tokens per optimizer step.
GLOBAL_BATCH, SEQ_LEN = 512, 2048
GB = 1e9


def layout(r: int, s: int, t: int, p: int = 1) -> HybridLayout:
    return HybridLayout(dp_replicate=r, dp_shard=s, tp=t, pp=p)


def pick(world: int, memory_gb: float | None = 80, *, model: Any = LLAMA_1B, global_batch: int = GLOBAL_BATCH,
         **constraints: Any) -> PickResult:
    c = PickerConstraints(devices_per_node=8, device_memory_gb=memory_gb, **constraints)
    return pick_layout(world, model, global_batch_size=global_batch, seq_len=SEQ_LEN, constraints=c)


def degrees(lay: HybridLayout) -> tuple[int, int, int, int]:
    return (lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp)


# ------------------------------------------------------------------------------------------------ shapes
@pytest.mark.parametrize("name", ["tiny", "llama_125m", "llama_1b"])
def test_param_shapes_are_the_models(name: str) -> None:
    config = MODEL_SIZES[name]
    with torch.device("meta"):
        model = Llama(config)
    actual = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert actual == [(t.name, t.shape) for t in param_tensors(config)]
    assert param_counts(config).total == config.num_params() == model.num_params()


# ------------------------------------------------------------------------------------------------ memory
def test_memory_state_is_16_bytes_per_sharded_parameter() -> None:
    for lay in (layout(1, 8, 1), layout(2, 4, 1), layout(1, 1, 1)):
        m = estimate_memory(LLAMA_1B, lay, seq_len=SEQ_LEN, micro_batch_size=1)
        state = m.parameters + m.gradients + m.optimizer
        assert state == 16 * math.ceil(LLAMA_1B.num_params() / lay.dp_shard)
        assert m.pipeline_buffers == 0


def test_memory_responds_to_each_knob() -> None:
    def total(lay: HybridLayout, **kw: Any) -> int:
        args = {"seq_len": SEQ_LEN, "micro_batch_size": 2, **kw}
        return estimate_memory(LLAMA_1B, lay, **args).total

    base = layout(1, 8, 1)
    assert total(base, micro_batch_size=4) > total(base)
    assert total(base, activation_checkpointing=True) < total(base)
    assert total(layout(1, 4, 2)) < total(base)  # TP splits activations (and no less state per device)
    assert total(layout(1, 16, 1)) < total(base)
    assert total(layout(2, 4, 1)) > total(base)  # HSDP replicates the state
    fp32 = estimate_memory(LLAMA_1B, base, seq_len=SEQ_LEN, micro_batch_size=2, mixed_precision="fp32")
    bf16 = estimate_memory(LLAMA_1B, base, seq_len=SEQ_LEN, micro_batch_size=2)
    assert fp32.parameters == bf16.parameters and fp32.activations > 1.5 * bf16.activations


# -------------------------------------------------------------------------------------------- throughput
def test_compute_time_is_flops_over_devices() -> None:
    profile = HardwareProfile()
    for lay in (layout(1, 8, 1), layout(1, 4, 2), layout(2, 2, 2)):
        accum = GLOBAL_BATCH // (2 * lay.dp)
        step = estimate_step_time(LLAMA_1B, lay, seq_len=SEQ_LEN, micro_batch_size=2, grad_accumulation=accum,
                                  devices_per_node=8, profile=profile)
        expected = flops_per_token(LLAMA_1B, SEQ_LEN, False) * GLOBAL_BATCH * SEQ_LEN / (8 * profile.flops("bf16"))
        assert step.compute == pytest.approx(expected)
        assert (step.tensor_parallel > 0) == (lay.tp > 1)
        assert step.data_parallel_exposed <= step.data_parallel


def test_communication_across_nodes_is_slower() -> None:
    def dp_seconds(devices_per_node: int) -> float:
        return estimate_step_time(LLAMA_1B, layout(1, 16, 1), seq_len=SEQ_LEN, micro_batch_size=1,
                                  grad_accumulation=32, devices_per_node=devices_per_node).data_parallel

    assert dp_seconds(8) > 5 * dp_seconds(16)


def test_hardware_profile_round_trips_and_rejects_unknown_keys(tmp_path: Any) -> None:
    measured = HardwareProfile(name="run-dir", compute_efficiency=0.3, inter_node_bandwidth=20e9)
    save_profile(measured, tmp_path / "profile.json")
    assert load_profile(tmp_path / "profile.json") == measured
    (tmp_path / "bad.json").write_text(json.dumps({"flops": 1.0}))
    with pytest.raises(ValueError, match=r"unknown hardware profile key\(s\) \['flops'\]; valid keys: name"):
        load_profile(tmp_path / "bad.json")


# ------------------------------------------------------------------------------------- migration cost
def test_migration_estimate_equals_the_planners_plan() -> None:
    """The grouped estimate equals the bytes the planner's full plan receives, tensor by tensor, on the tiny
    model (uneven shards included)."""
    tiny, deep = MODEL_SIZES["tiny"], MODEL_SIZES["tiny_deep"]
    staged = HybridLayout(dp_shard=1, pp=2, pp_virtual=2).resolve(2)  # blocks 0, 2 and 1, 3
    for config, old, new in [(tiny, layout(1, 2, 2), layout(1, 3, 1)), (tiny, layout(1, 4, 1), layout(2, 2, 2)),
                             (tiny, layout(1, 1, 2), layout(1, 5, 1)), (deep, layout(1, 1, 1, 2), staged),
                             (deep, staged, layout(1, 2, 2, 2))]:
        ranges = {lay: stage_ranges(config, lay.stages) for lay in (old, new)}
        tensors = [TensorMigration(t.name, MIGRATED_BYTES_PER_ELEMENT, sharding_of(t, old, ranges[old]),
                                   sharding_of(t, new, ranges[new])) for t in param_tensors(config)]
        identity = IdentityMap.first_ranks(old.world_size, new.world_size)  # a change of world keeps the order
        planned = sum(plan.bytes_received for plan in plan_all(tensors, identity).values())
        assert estimate_migration_bytes(config, old, new) == planned > 0


def test_on_the_same_processes_the_estimate_uses_the_rank_order_a_live_change_chooses() -> None:
    """FSDP over 4 -> two stages of FSDP over 2 on one node: the estimate is the plan under the rank order
    choose_rank_order picks (each process keeps its quarter of its stage), fewer bytes than the default order's."""
    config = MODEL_SIZES["tiny"]
    old, new = layout(1, 4, 1), layout(1, 2, 1, 2)
    ranges = {lay.pp: stage_ranges(config, lay.pp) for lay in (old, new)}

    def tensors_for(a: HybridLayout, b: HybridLayout) -> list[TensorMigration]:
        return [TensorMigration(t.name, MIGRATED_BYTES_PER_ELEMENT, sharding_of(t, a, ranges[a.pp]),
                                sharding_of(t, b, ranges[b.pp])) for t in param_tensors(config)]

    identity = IdentityMap.same_processes(4)
    chosen = choose_rank_order(old, new, tensors_for, identity).layout
    assert chosen.rank_order is not None
    planned, default = (sum(p.bytes_received for p in plan_all(tensors_for(old, lay), identity).values())
                        for lay in (chosen, new))
    assert estimate_migration_bytes(config, old, new) == planned < default


def test_migration_estimate_on_the_1b_model() -> None:
    state = MIGRATED_BYTES_PER_ELEMENT * LLAMA_1B.num_params()
    assert estimate_migration_bytes(LLAMA_1B, layout(1, 8, 1), layout(1, 8, 1)) == 0
    # Doubling FSDP, the joiners ranked after the survivors (the launcher's order, which a change of world keeps):
    # new rank r < 8 holds the r-th sixteenth, old rank r held the r-th eighth: only rank 0's sixteenth stays.
    assert estimate_migration_bytes(LLAMA_1B, layout(1, 8, 1), layout(1, 16, 1)) == pytest.approx(state * 15 / 16,
                                                                                                  rel=1e-3)


# -------------------------------------------------------------------------------- the picker's tables
MEMORY_LIMITS = [80, 40, 16]


@pytest.mark.parametrize("memory_gb", MEMORY_LIMITS)
def test_every_world_from_1_to_64(memory_gb: float) -> None:
    """Worlds 1-64, 8 devices per node: every choice is feasible, exact in its batch, within the tie tolerance of
    the fastest, and leaves devices idle only when no layout on more devices is (nearly) as fast."""
    for world in range(1, 65):
        try:
            result = pick(world, memory_gb)
        except NoFeasibleLayoutError as error:
            # Only where the 16-byte-per-parameter state alone cannot fit in the world's devices, and said so.
            assert 16 * LLAMA_1B.num_params() / world > 0.9 * memory_gb * GB, world
            assert all(c.rejected.startswith("memory ") for c in error.candidates if c.layout.world_size == world)
            continue
        chosen, lay = result.chosen, result.layout
        assert lay.world_size + result.idle_devices == world
        assert chosen.plan is not None and chosen.plan.dp_degree == lay.dp
        assert chosen.plan.micro_batch_size * chosen.plan.grad_accumulation * lay.dp == GLOBAL_BATCH
        assert chosen.est_memory_bytes <= 0.9 * memory_gb * GB
        assert 8 % lay.tp == 0 and LLAMA_1B.n_kv_heads % lay.tp == 0 and lay.pp == 1
        feasible = [c for c in result.candidates if c.feasible]
        fastest = min(c.est_step_seconds for c in feasible)
        assert chosen.est_step_seconds <= fastest * 1.02
        more = [c for c in feasible if c.idle_devices < result.idle_devices]
        assert all(c.est_step_seconds > fastest * 1.02 for c in more), world
        if result.idle_devices:
            expected = "faster than the best layout on more devices" if more else "no feasible layout uses more"
            assert expected in result.explanation
        else:
            assert "idle" not in result.explanation
        assert all(c.rejected for c in result.candidates if not c.feasible)
        assert sum(1 for c in result.candidates if c.idle_devices == 0) >= 1  # full-world layouts are listed


def test_1b_at_80gb_picks_data_parallelism_alone_on_one_node() -> None:
    """Eight replicas, their all-reduce once per step (``defer_grad_sync="replicas"``, the default), against pure FSDP's
    gathers every micro-batch: both hide behind compute, the replicas by a hair, for more memory. With the
    all-reduce after every micro-batch (``"none"``) pure FSDP is the faster."""
    result = pick(8)
    assert degrees(result.layout) == (8, 1, 1, 1)
    assert result.idle_devices == 0 and "uses all 8 devices" in result.explanation
    assert result.chosen.activation_checkpointing is False
    fsdp = next(c for c in result.candidates if degrees(c.layout) == (1, 8, 1, 1))
    assert fsdp.est_step_seconds <= 1.02 * result.chosen.est_step_seconds
    assert fsdp.est_memory_bytes < result.chosen.est_memory_bytes
    assert degrees(pick(8, defer_grad_sync="none").layout) == (1, 8, 1, 1)


def test_1b_keeps_tensor_parallelism_within_a_node_at_64() -> None:
    for memory_gb, ckpt in [(80, "auto"), (4, False)]:
        result = pick(64, memory_gb, activation_checkpointing=ckpt)
        assert result.layout.world_size == 64 and 8 % result.layout.tp == 0
        crossing = [c for c in result.candidates if c.layout.tp > 8]
        assert crossing and all(c.rejected == f"tp={c.layout.tp} crosses nodes (8 devices per node)"
                                for c in crossing)
    # The 4 GB limit (no recomputation) forbids pure FSDP even over 64 devices, so TP is needed, and stays inside.
    assert result.layout.tp > 1


def test_node_boundary_is_checked_before_the_models_heads() -> None:
    """An MHA variant of the 1B model whose heads tp=16 divides: allowed to cross nodes it is costed, not refused."""
    mha = dataclasses.replace(LLAMA_1B, n_kv_heads=32)
    within = pick(64, 80, model=mha)
    across = pick(64, 80, model=mha, tp_within_node=False)
    assert {c.rejected for c in within.candidates if c.layout.tp == 16} == {"tp=16 crosses nodes (8 devices per node)"}
    assert any(c.feasible for c in across.candidates if c.layout.tp == 16)
    assert across.chosen.est_step_seconds <= within.chosen.est_step_seconds


@pytest.mark.parametrize("world", [8, 16, 64])
def test_a_memory_limit_that_forbids_pure_fsdp_makes_tp_greater_than_1(world: int) -> None:
    # The limit: 3% below what pure FSDP needs at its cheapest (micro 1, no recomputation allowed).
    least = estimate_memory(LLAMA_1B, layout(1, world, 1), seq_len=SEQ_LEN, micro_batch_size=1).total
    memory_gb = 0.97 * least / 0.9 / GB
    result = pick(world, memory_gb, activation_checkpointing=False)
    pure = next(c for c in result.candidates if degrees(c.layout) == (1, world, 1, 1))
    assert pure.rejected is not None and pure.rejected.startswith("memory ") and "GB usable" in pure.rejected
    assert result.layout.tp > 1 and result.idle_devices == 0
    assert result.chosen.est_memory_bytes <= 0.9 * memory_gb * GB


PRIME_WORLDS = [
    # (world, global batch, micro batch sizes, allowed dp_replicate, idle devices expected): the batch admits
    # dp = world in each case.
    (11, 704, (1,), (1,), 3),  # pure FSDP, micro 1: its traffic every micro-batch dominates, the 9th-11th devices
    # are on a second node -> idle
    (11, 704, (1,), None, 0),  # replicas: their all-reduce waits for the step's last of 64 micro-batches -> all 11
    (11, 704, (8,), None, 0),  # micro 8: compute hides it, using all 11 is faster
    (7, 448, (1, 2, 4, 8), None, 0),  # one node: all 7
    (13, 512, (1, 2, 4, 8), None, 5),  # no layout uses 13 devices (dp must divide 512; tp=13 crosses nodes)
]


@pytest.mark.parametrize(("world", "global_batch", "micros", "replicas", "idle"), PRIME_WORLDS)
def test_a_prime_world_leaves_devices_idle_only_when_faster(world: int, global_batch: int, micros: tuple[int, ...],
                                                           replicas: tuple[int, ...] | None, idle: int) -> None:
    result = pick(world, 80, global_batch=global_batch, micro_batch_sizes=micros, dp_replicate=replicas)
    assert result.idle_devices == idle
    full = [c for c in result.candidates if c.idle_devices == 0 and c.feasible]
    if idle and full:
        assert min(c.est_step_seconds for c in full) > 1.02 * result.chosen.est_step_seconds
        assert "faster than the best layout on more devices" in result.explanation
    elif idle:
        assert "no feasible layout uses more than 8 of 13 devices" in result.explanation
    else:
        assert full and result.layout.world_size == world


def test_idle_devices_forbidden_means_no_layout_for_an_awkward_world() -> None:
    with pytest.raises(NoFeasibleLayoutError, match="no feasible layout for 24 devices") as info:
        pick(24, idle_devices_allowed=False)
    assert all(c.idle_devices == 0 for c in info.value.candidates)
    assert "global batch 512 not divisible by any micro in [1, 2, 4, 8] x dp 24" in str(info.value)


def test_an_explicit_table_entry_overrides_the_search() -> None:
    result = pick(8, table={8: {"dp_shard": -1, "tp": 2}})
    assert degrees(result.layout) == (1, 4, 2, 1) and result.candidates == (result.chosen,)
    assert result.explanation == "pinned by table[8]"
    assert degrees(pick(16, table={8: {"tp": 2}}).layout) != (1, 4, 2, 1)  # other worlds still search
    with pytest.raises(PickerError, match=r"table\[8\] pins .* cannot run: memory"):
        pick(8, 2, table={8: {"dp_replicate": 8, "dp_shard": 1}})


def test_near_ties_are_broken_by_migration_bytes() -> None:
    c = PickerConstraints(devices_per_node=8, device_memory_gb=80, tie_tolerance=0.05)
    common = {"global_batch_size": GLOBAL_BATCH, "seq_len": SEQ_LEN, "constraints": c}
    fresh = pick_layout(64, LLAMA_1B, **common)
    pure = layout(1, 64, 1)
    assert fresh.layout != pure
    assert fresh.chosen.est_step_seconds < pure_time(fresh) <= 1.05 * fresh.chosen.est_step_seconds
    # Training in pure FSDP already: staying costs no bytes, the faster HSDP layout would move tens of GB.
    stay = pick_layout(64, LLAMA_1B, current=pure, **common)
    assert stay.layout == pure and stay.chosen.migration_bytes == 0
    assert "preferred for fewer migration bytes (0.00 GB vs" in stay.explanation


def pure_time(result: PickResult) -> float:
    return next(c.est_step_seconds for c in result.candidates if degrees(c.layout) == (1, result.world, 1, 1))


def test_a_caller_supplied_migration_cost_is_used() -> None:
    c = PickerConstraints(devices_per_node=8, device_memory_gb=80)
    prefer = layout(4, 2, 1)
    calls: list[tuple[HybridLayout, HybridLayout]] = []

    def cost(old: HybridLayout, new: HybridLayout) -> int:
        calls.append((old, new))
        return 0 if new == prefer else 1

    result = pick_layout(8, LLAMA_1B, global_batch_size=GLOBAL_BATCH, seq_len=SEQ_LEN, constraints=c,
                         current=layout(1, 8, 1), migration_bytes=cost)
    assert result.layout == prefer and all(old == layout(1, 8, 1) for old, _ in calls)
    assert result.chosen.est_step_seconds <= 1.02 * min(x.est_step_seconds for x in result.candidates if x.feasible)


def test_identical_inputs_give_identical_choices() -> None:
    for world in (8, 24, 64):
        first, second = pick(world, 16), pick(world, 16)
        assert first.to_record() == second.to_record()
        assert first.table() == second.table()
        json.dumps(first.to_record())  # JSON-able


@pytest.mark.parametrize("name", ["tiny", "llama_125m", "llama_1b"])
def test_the_largest_stage_is_the_one_the_builder_makes(name: str) -> None:
    from lightning_emig.parallelize.pipeline import keep_stage

    config = MODEL_SIZES[name]
    for pp in range(2, min(config.n_layers, 5) + 1):
        sizes = []
        for stage in range(pp):
            with torch.device("meta"):
                model = keep_stage(Llama(config), pp, stage)
            sizes.append((sum(p.numel() for p in model.parameters()), len(model.layers)))
        counts = param_counts(config)
        assert counts.stage_local(1, pp) == max(size for size, _ in sizes), (name, pp)
        assert counts.stage_blocks(pp) == max(blocks for _, blocks in sizes), (name, pp)


def test_gpipe_keeps_every_micro_batch_in_flight_and_1f1b_at_most_pp() -> None:
    lay = HybridLayout(dp_shard=2, pp=4).resolve(8)

    def activations(schedule: str, accumulation: int) -> int:
        return estimate_memory(LLAMA_1B, lay, seq_len=SEQ_LEN, micro_batch_size=1, grad_accumulation=accumulation,
                               pipeline_schedule=schedule).activations

    one = activations("gpipe", 1)
    assert activations("gpipe", 16) == 16 * one
    assert activations("1f1b", 16) == 4 * one == activations("1f1b", 4)


def test_two_stages_a_process_shorten_the_bubble_and_keep_more_in_flight() -> None:
    """Interleaved 1F1B over pp=4 x pp_virtual=2: half of 1F1B's fill and drain; activations 1 + 3/8 of 1F1B's."""
    plain, interleaved = (HybridLayout(dp_shard=2, pp=4, pp_virtual=v).resolve(8) for v in (1, 2))
    common = {"seq_len": SEQ_LEN, "micro_batch_size": 1, "grad_accumulation": 8}
    step = {lay.pp_virtual: estimate_step_time(LLAMA_1B, lay, devices_per_node=8, **common)
            for lay in (plain, interleaved)}
    assert step[2].pipeline_bubble == pytest.approx(step[1].pipeline_bubble / 2)
    memory = {schedule: estimate_memory(LLAMA_1B, lay, pipeline_schedule=schedule, **common).activations
              for schedule, lay in (("1f1b", plain), ("interleaved_1f1b", interleaved))}
    assert memory["interleaved_1f1b"] == round(memory["1f1b"] * (1 + 3 / 8))


def test_1f1b_needs_a_micro_batch_per_stage() -> None:
    staged = pick(16, None, global_batch=16, allow_pp=True, pp=(1, 4), micro_batch_sizes=(4,),
                  pipeline_schedule="1f1b")
    # dp 4 x micro 4 = 16: one micro-batch per step, fewer than 4 stages
    rejected = {degrees(c.layout): c.rejected for c in staged.candidates if not c.feasible}
    assert "1f1b needs >= pp=4 micro-batches per step" in rejected[(1, 4, 1, 4)]
    gpipe = pick(16, None, global_batch=16, allow_pp=True, pp=(1, 4), micro_batch_sizes=(4,))
    assert any(c.feasible and degrees(c.layout) == (1, 4, 1, 4) for c in gpipe.candidates)


def test_pipeline_parallelism_only_when_allowed() -> None:
    assert all(c.layout.pp == 1 for c in pick(16).candidates)
    allowed = pick(16, 80, allow_pp=True)
    staged = [c for c in allowed.candidates if c.layout.pp > 1 and c.feasible]
    assert staged and all(c.step.pipeline_bubble > 0 and c.memory.pipeline_buffers > 0 for c in staged)


# -------------------------------------------------------------------------------------- invalid settings
INVALID = [
    ({"tpp": [2]}, r"unknown picker key\(s\) \['tpp'\]; valid keys: dp_replicate, dp_shard, tp, pp"),
    ({"pp": [1, 2]}, r"pp=\[1, 2\] allows pipeline stages but allow_pp is false: pipeline stages are opt-in"),
    ({"pipeline_schedule": "interleaved"}, r"pipeline_schedule must be one of \['gpipe', '1f1b', 'interleaved_1f1b'\]"),
    ({"table": {8: {"pp": 2, "dp_shard": 4}}}, r"table\[8\]: pp=2 but allow_pp is false"),
    ({"table": {8: {"dp_shard": 16}}}, r"table\[8\]: .* needs 16 devices but the world has 8"),
    ({"table": {8: {"tensor": 2}}}, r"table\[8\]: unknown layout key\(s\) \['tensor'\]; valid keys"),
    ({"tp": [16]}, r"no allowed tp=\[16\] keeps tensor parallelism within a node of 8 devices"),
    ({"mixed_precision": "fp16"}, r"mixed_precision must be 'bf16' or 'fp32', got 'fp16'"),
    ({"activation_checkpointing": "sometimes"}, r"activation_checkpointing must be 'auto', true or false"),
    ({"micro_batch_sizes": 0}, r"micro_batch_sizes as a maximum must be >= 1"),
    ({"device_memory_gb": -1}, r"device_memory_gb must be a positive number or null"),
    ({"devices_per_node": 0}, r"devices_per_node must be a positive int"),
]


@pytest.mark.parametrize(("mapping", "message"), INVALID)
def test_invalid_constraints_raise_naming_what_to_change(mapping: dict[str, Any], message: str) -> None:
    with pytest.raises(PickerError, match=message):
        PickerConstraints.from_mapping({"devices_per_node": 8, **mapping})


MODEL_INVALID = [
    ({"tp": [3]}, r"no allowed tp=\[3\] divides the model's heads \(32\), kv heads \(8\) and FFN width \(8192\); "
                  r"valid tp for this model: \[1, 2, 4, 8\]"),
    ({"table": {6: {"dp_shard": -1, "tp": 3}}}, r"table\[6\]: tp=3 does not divide the model's attention heads"),
]


@pytest.mark.parametrize(("mapping", "message"), MODEL_INVALID)
def test_constraints_the_model_cannot_meet_raise(mapping: dict[str, Any], message: str) -> None:
    constraints = PickerConstraints.from_mapping({"devices_per_node": 8, "tp_within_node": False, **mapping})
    with pytest.raises(PickerError, match=message):
        pick_layout(8, LLAMA_1B, global_batch_size=GLOBAL_BATCH, seq_len=SEQ_LEN, constraints=constraints)
    with pytest.raises(PickerError, match="exceeds the model's max_seq_len 2048"):
        pick_layout(8, LLAMA_1B, global_batch_size=GLOBAL_BATCH, seq_len=4096)


def test_a_disallowed_degree_is_a_rejected_row() -> None:
    result = pick(8, tp=[1, 2, 3])
    rows = {degrees(c.layout): c.rejected for c in result.candidates if c.idle_devices == 0}
    assert rows[(1, 2, 4, 1)] == "tp=4 not allowed (tp in [1, 2, 3])"
    assert rows[(1, 1, 8, 1)] == "tp=8 not allowed (tp in [1, 2, 3])"


# ------------------------------------------------------------------------------------------------- CLI
def test_cli_prints_tables_and_writes_the_records(tmp_path: Any) -> None:
    out = tmp_path / "pick.json"
    cmd = [sys.executable, "-m", "lightning_emig.pick", "model=llama_1b", "world=[8,24]", "devices_per_node=8",
           "device_memory_gb=80", "global_batch_size=512", "seq_len=2048", "tp=[1,2,4,8]", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "world 8: dp_replicate=8 dp_shard=1 tp=1 pp=1" in done.stdout and "world 24:" in done.stdout
    records = json.loads(out.read_text())
    assert [r["world"] for r in records] == [8, 24]
    for record in records:
        assert {"world", "layout", "est_memory_bytes", "est_step_seconds", "migration_bytes", "idle_devices",
                "candidates"} <= record.keys()
    assert records[1]["idle_devices"] == 8 and records[0]["layout"]["dp_replicate"] == 8


def test_cli_unknown_key_names_the_valid_ones(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    assert pick_main(["world=8", "tensor_parallel=2"]) == 2
    err = capsys.readouterr().err
    assert "unknown key(s) ['tensor_parallel']" in err and "valid keys: model, world" in err
    out = tmp_path / "one.json"
    assert pick_main(["world=8", "micro_batch_size=4", "current.dp_shard=4", "current.tp=2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["world"] == 8 and record["micro_batch_size"] == 4 and record["migration_bytes"] is not None


# --- the picker as training asks it ------------------------------------------------------------------------------


def _training_picker(**section: Any) -> Any:
    from lightning_emig.picker.policy import LayoutPicker

    return LayoutPicker.from_section({"enabled": True, **section}, model=MODEL_SIZES["tiny"], seq_len=128,
                                     local_world_size=1)


def test_training_uses_every_process_and_the_configured_micro_batch() -> None:
    from lightning_emig.picker.policy import LayoutPicker

    assert LayoutPicker.from_section({"enabled": False}, model=MODEL_SIZES["tiny"], seq_len=128,
                                     local_world_size=1) is None
    picker = _training_picker()
    for world in (1, 2, 3, 6):
        result = picker.pick(world, global_batch_size=12, micro_batch_size=2)
        assert result.idle_devices == 0 and result.layout.world_size == world
        assert result.chosen.plan is not None and result.chosen.plan.micro_batch_size == 2
    with pytest.raises(NoFeasibleLayoutError, match="global batch 12 not divisible by micro 2 x dp 4"):
        picker.pick(4, global_batch_size=12, micro_batch_size=2)  # 4 processes: no layout uses all


def test_a_pinned_world_in_the_training_section_overrides_the_search() -> None:
    searched = _training_picker().pick(2, global_batch_size=12, micro_batch_size=2).layout
    pinned = _training_picker(table={"2": {"dp_shard": 2}}).pick(2, global_batch_size=12, micro_batch_size=2)
    assert searched == HybridLayout(dp_replicate=2, dp_shard=1) and pinned.layout == HybridLayout(dp_shard=2)
    assert "pinned by table[2]" in pinned.explanation


def test_the_training_section_is_checked_at_start() -> None:
    with pytest.raises(PickerError, match="unknown picker key"):
        _training_picker(tpp=[2])
    with pytest.raises(PickerError, match="elastic.picker.profile"):
        _training_picker(profile="/nonexistent/profile.json")


def test_elastic_settings_ask_the_picker_and_check_its_answer() -> None:
    from lightning_emig.membership.settings import ElasticSettings
    from lightning_emig.migration.transfer import TransferOptions

    def refuse_replicas(layout: HybridLayout) -> None:
        if layout.dp_replicate > 1:
            raise ValueError("this module refuses replicas")

    settings = ElasticSettings(requested_layout=HybridLayout(), global_batch_size=12, micro_batch_size=2,
                               transfer=TransferOptions(), validate_layout=lambda layout: None,
                               picker=_training_picker())
    choice = settings.choose(3, current=HybridLayout(dp_replicate=2, dp_shard=1))
    assert choice.layout == HybridLayout(dp_replicate=3, dp_shard=1) and choice.plan.grad_accumulation == 2
    record = choice.record()
    assert record is not None and record["migration_bytes"] > 0 and "fastest" in record["explanation"]
    strict = dataclasses.replace(settings, validate_layout=refuse_replicas)
    with pytest.raises(ValueError, match="refuses replicas"):
        strict.choose(3)


def test_a_profile_measured_and_saved_in_the_run_directory_calibrates_the_picker(tmp_path: Any) -> None:
    from lightning_emig.config import TrainConfig
    from lightning_emig.picker.calibrate import PROFILE_FILE
    from lightning_emig.picker.calibrate import main as calibrate
    from lightning_emig.training.builders import layout_picker

    assert calibrate(["--out", str(tmp_path / PROFILE_FILE), "--device", "cpu", "--quick"]) == 0
    measured = load_profile(tmp_path / PROFILE_FILE)
    default = HardwareProfile()
    assert measured.name == "measured on cpu"
    assert measured.flops_fp32 != default.flops_fp32 and measured.hbm_bandwidth != default.hbm_bandwidth
    assert measured.inter_node_bandwidth == default.inter_node_bandwidth  # one node cannot measure it
    cfg = TrainConfig()
    cfg.elastic.picker.enabled = True
    picker = layout_picker(cfg, tmp_path)
    assert picker is not None and picker.profile == measured
    assert layout_picker(cfg, tmp_path / "elsewhere").profile == default  # type: ignore[union-attr]
