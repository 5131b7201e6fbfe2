"""tools/simulate.py: its byte counts are the real planner's, and a 16384-rank change runs on sampled ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_emig.layout import HybridLayout
from lightning_emig.migration.identity import IdentityMap
from lightning_emig.migration.planner import RankPlan, plan_all
from lightning_emig.models.llama import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import simulate  # noqa: E402

TINY = LlamaConfig(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=128, vocab_size=256, max_seq_len=64)
PER_NODE = 4
ASSUMPTIONS = simulate.Assumptions(devices_per_node=PER_NODE)

SMALL_CHANGES = [
    (8, {"dp_shard": 4, "tp": 2}, 6, {"dp_shard": 3, "tp": 2}),
    (8, {"pp": 2, "dp_shard": 2, "tp": 2}, 6, {"pp": 2, "dp_shard": 3}),
    (4, {"dp_shard": 2, "tp": 2}, 8, {"dp_replicate": 2, "dp_shard": 2, "tp": 2}),
]


def _layouts(old_world: int, old: dict[str, int], new_world: int, new: dict[str, int]
             ) -> tuple[HybridLayout, HybridLayout]:
    return HybridLayout(**old).resolve(old_world), HybridLayout(**new).resolve(new_world)


def _node_split(plan: RankPlan, identity: IdentityMap) -> tuple[int, int]:
    """(intra, inter) bytes a plan receives, by the nodes of sender and receiver."""
    node = identity.process(plan.pid).node
    intra = sum(t.nbytes for t in plan.recvs if identity.process(t.src).node == node)
    return intra, plan.bytes_received - intra


@pytest.mark.parametrize("per_class", [None, 100], ids=["plan_all", "plan_for_rank"])
@pytest.mark.parametrize(("old_world", "old", "new_world", "new"), SMALL_CHANGES)
def test_the_record_sums_what_plan_all_moves(old_world: int, old: dict[str, int], new_world: int,
                                             new: dict[str, int], per_class: int | None) -> None:
    """Every process counted, whether planned all at once or one by one: the sums of the real plans."""
    old_layout, new_layout = _layouts(old_world, old, new_world, new)
    record = simulate.simulate("tiny", TINY, old_layout, new_layout, ASSUMPTIONS, samples=3, per_class=per_class)
    identity = simulate.identity_for(old_world, new_world, PER_NODE)
    plans = plan_all(simulate.migrations(TINY, old_layout, new_layout, 12), identity)
    received = [plans[identity.by_new_rank(r).pid].bytes_received for r in range(new_world)]
    splits = [_node_split(plan, identity) for plan in plans.values()]
    assert record["traffic_exact"]
    assert record["total_bytes"] == sum(received) > 0
    assert record["max_rank_bytes"] == max(received)
    assert record["mean_rank_bytes"] == pytest.approx(sum(received) / new_world)
    assert (record["intra_node_bytes"], record["inter_node_bytes"]) == tuple(map(sum, zip(*splits, strict=True)))
    assert record["plan_seconds_per_rank"] > 0
    naive = simulate.identity_for(old_world, new_world, PER_NODE, shuffle_seed=0)
    naive_plans = plan_all(simulate.migrations(TINY, old_layout, new_layout, 12), naive)
    assert record["naive_total_bytes"] == sum(p.bytes_received for p in naive_plans.values())


def test_a_sample_of_alike_processes_extrapolates_exactly() -> None:
    """FSDP 8 -> 16 over whole nodes: all joiners alike, so two of them (and two survivors) give the exact sums."""
    old_layout, new_layout = _layouts(8, {"dp_shard": 8}, 16, {"dp_shard": 8, "dp_replicate": 2})
    exact = simulate.simulate("tiny", TINY, old_layout, new_layout, ASSUMPTIONS, samples=2, naive=False)
    sampled = simulate.simulate("tiny", TINY, old_layout, new_layout, ASSUMPTIONS, samples=2, per_class=2,
                                naive=False)
    assert not sampled["traffic_exact"]
    assert exact["total_bytes"] == exact["inter_node_bytes"] > 0  # joiners sit on nodes of their own
    for key in ("total_bytes", "intra_node_bytes", "inter_node_bytes", "max_rank_bytes"):
        assert sampled[key] == exact[key], key


def test_a_16384_rank_change_runs_on_sampled_ranks() -> None:
    model = simulate.MODELS["8b"]
    old, new = simulate.rule_layout(model, 16384), simulate.rule_layout(model, 12288)
    record = simulate.simulate("8b", model, old, new, simulate.Assumptions(), samples=2, per_class=3)
    assert not record["traffic_exact"]
    assert record["plan_seconds_per_rank"] > 0
    assert 0 < record["max_rank_bytes"] <= record["total_bytes"] <= record["state_bytes"]
    assert record["intra_node_bytes"] + record["inter_node_bytes"] == pytest.approx(record["total_bytes"], abs=2)
    assert record["est_transfer_seconds"] > simulate.Assumptions().latency_s
    assert record["peak_extra_bytes_per_rank"] > simulate.Assumptions().bucket_bytes
    assert record["est_checkpoint_restart_seconds"] > simulate.Assumptions().restart_s
    assert record["tp_groups_across_nodes"] == 0 < record["naive_tp_groups_across_nodes"]


def test_layouts_from_the_rule_and_the_command_line() -> None:
    assert simulate.rule_layout(simulate.MODELS["405b"], 16384) == HybridLayout(dp_shard=256, tp=8, pp=8)
    assert simulate.rule_layout(simulate.MODELS["8b"], 1024) == HybridLayout(dp_shard=128, tp=8)
    world, layout = simulate.parse_layout("*:dp_replicate=-1,dp_shard=8,tp=8")
    assert (world, layout.resolve(1024)) == ("*", HybridLayout(dp_replicate=16, dp_shard=8, tp=8))
    assert simulate.parse_layout("768:tp=8")[1].resolve(768) == HybridLayout(dp_shard=96, tp=8)
