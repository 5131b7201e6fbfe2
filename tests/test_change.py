"""The typed record of a change: a drain (or a rebuild) followed by the next fit's local re-layout is one change."""

from __future__ import annotations

from lightning_emig import HybridLayout
from lightning_emig.change.live_join import phases_of_join
from lightning_emig.migration.change import ChangeRecord


def test_a_change_followed_by_its_completion_is_one_change_from_the_first_world_to_the_last() -> None:
    drain = ChangeRecord(kind="preempt", step=40, old_layout=HybridLayout(dp_shard=3), new_layout=HybridLayout(dp_shard=2),
                         old_world=3, new_world=2, bytes_moved=1000, bytes_copied_locally=10,
                         seconds={"transfer": 0.5}, nodes=("b",))
    local = ChangeRecord(kind="join", step=40, old_layout=HybridLayout(dp_shard=2), new_layout=HybridLayout(dp_shard=2),
                         old_world=2, new_world=2, bytes_moved=0, bytes_copied_locally=500,
                         seconds={"handshake": 0.1, "transfer": 0.25})
    whole = drain.then(local)
    assert (whole.kind, whole.step, whole.old_world, whole.new_world, whole.nodes) == ("preempt", 40, 3, 2, ("b",))
    assert (whole.old_layout.dp_shard, whole.new_layout.dp_shard) == (3, 2)
    assert (whole.bytes_moved, whole.bytes_copied_locally) == (1000, 510)
    assert list(whole.seconds) == ["handshake", "transfer"] and whole.seconds["transfer"] == 0.75


def test_a_drains_handed_proof_counts_in_the_preemptions_phases() -> None:
    """The drain waited for its handed proof; the next fit's join waits for none (it was settled): the event keeps the
    drain's wait. (The join's own phases used to replace the handoff's, and a preemption's 0.2-0.4 s wait for its
    digests went missing from its phases.)"""
    handed = {"capture": 0.01, "agree_leave": 0.02, "prove_handed": 0.37, "build": 0.08}
    phases = phases_of_join(handed, {"prove_handed": 0.0, "handshake": 0.01}, {"plan": 0.03, "transfer": 0.1})
    assert phases == {"capture": 0.01, "agree_leave": 0.02, "prove_handed": 0.37, "build": 0.08, "handshake": 0.01,
                      "plan": 0.03, "transfer": 0.1}
    assert list(phases) == ["capture", "agree_leave", "prove_handed", "build", "handshake", "plan", "transfer"]
    assert phases_of_join({}, {"prove_handed": 0.2}, {})["prove_handed"] == 0.2  # a join from a world of one


def _fsdp_specs() -> dict[str, object]:
    """Four blocks' weights, FSDP-sharded on dim 0 (what a drain lays out: the old specs' placements)."""
    import torch
    from torch.distributed.tensor import Shard

    from lightning_emig.migration.stages import StageOwner, StageSplit
    from lightning_emig.migration.state import ShardingSpec

    split = StageSplit(block_costs=(64,) * 4, first_extra=0, last_extra=0, blocks=tuple(f"layers.{i}" for i in range(4)))
    return {f"model/layers.{i}.w": ShardingSpec((8, 8), torch.float32, ("dp_shard",), (Shard(0),),
                                                StageOwner.of(f"layers.{i}.w", split)) for i in range(4)}


def test_a_drain_lays_the_survivors_buffers_out_in_the_order_that_keeps_them() -> None:
    """pp 2 x dp_shard 4 on two nodes of four; the second node leaves; the survivors (one node) take pp 2 x dp_shard
    2. In the default order new ranks 0, 1 hold stage 0 and process 1 keeps nothing of its quarter; numbered
    dp_shard first, stage 0 sits on 0 and 2 and every survivor keeps its quarter. Were the survivors on two nodes,
    that order would put the FSDP groups across them: the default stays."""
    from lightning_emig.migration.change import in_place_order
    from lightning_emig.migration.engine import tensor_migrations
    from lightning_emig.migration.identity import IdentityMap, ProcessInfo
    from lightning_emig.migration.rank_order import bytes_in_place, choose_rank_order

    specs = _fsdp_specs()
    old, new = HybridLayout(pp=2, dp_shard=4).resolve(8), HybridLayout(pp=2, dp_shard=2).resolve(4)

    def identity(nodes: list[str]) -> IdentityMap:
        return IdentityMap(tuple(ProcessInfo(r, nodes[r], r, r if r < 4 else None) for r in range(8)), 8, 4)

    one_node = identity(["a"] * 4 + ["b"] * 4)
    chosen = in_place_order(specs, old, new, one_node)
    assert chosen.degrees == new and chosen.rank_order is not None
    assert chosen.rank_order.index("dp_shard") < chosen.rank_order.index("pp")
    kept = bytes_in_place(tensor_migrations(specs, specs, old, chosen), one_node)
    # the survivors held stage 0 (blocks 0, 1): its two new holders keep a quarter of each block (16 floats) each
    assert kept == 2 * 2 * 16 * 4 > bytes_in_place(tensor_migrations(specs, specs, old, new), one_node)
    two_nodes = identity(["a", "a", "b", "b", "c", "c", "c", "c"])
    assert in_place_order(specs, old, new, two_nodes) == new
    assert choose_rank_order(old, new, lambda a, b: tensor_migrations(specs, specs, a, b), one_node).layout == chosen


def test_the_next_fit_keeps_the_order_its_state_was_handed_over_in() -> None:
    """After a drain or a rebuild the next fit chooses its layout by the usual rule (default order); where that has
    the handed state's degrees on the same world it takes the handed order, so the state does not move again. A
    join (another world) keeps the fit's own."""
    from types import SimpleNamespace

    from lightning_emig.change.enter import keeping_handed_order
    from lightning_emig.data.batching import BatchPlan
    from lightning_emig.membership.settings import LayoutChoice

    ordered = HybridLayout(pp=2, dp_shard=2, rank_order="dp_replicate>dp_shard>pp>tp").resolve(4)
    choice = LayoutChoice(ordered.degrees, BatchPlan(global_batch_size=8, micro_batch_size=1, dp_degree=2))

    def kept(world: int, handed: HybridLayout | None) -> HybridLayout:
        handoff = None if handed is None else SimpleNamespace(old_layout=handed, old_world=handed.world_size)
        return keeping_handed_order(choice, handoff, world).layout  # type: ignore[arg-type]

    assert kept(4, ordered) == ordered
    assert kept(4, None) == ordered.degrees
    assert kept(4, HybridLayout(dp_shard=4).resolve(4)) == ordered.degrees
    assert kept(4, HybridLayout(pp=2, dp_shard=1, rank_order="dp_replicate>dp_shard>pp>tp").resolve(2)) == \
        ordered.degrees
