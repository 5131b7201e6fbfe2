"""Migration planner as specification: minimal bytes, exact coverage, agreement between peers, sane choices.

The property test draws random layout pairs and worlds (1-16), random identity maps (stayers, leavers, joiners)
and nodes, plans every process, *executes* the plan on ``arange`` data in memory, and checks that every process
ends up with exactly its new shards, that bytes received equal the intersection minimum, and that what A plans to
send B is what B plans to receive from A, in the same order.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_emig.layout import HybridLayout
from lightning_emig.migration.geometry import ShardBox, TensorSharding
from lightning_emig.migration.identity import IdentityMap, PlanError, ProcessInfo
from lightning_emig.migration.planner import (
    PlanOptions,
    RankPlan,
    StateLostError,
    TensorMigration,
    Transfer,
    plan_all,
    plan_for_rank,
)
from lightning_emig.migration.rank_order import (
    LOCAL_AXES,
    candidate_orders,
    choose_rank_order,
    groups_across_nodes,
)
from lightning_emig.migration.stages import StageOwner, StageSplit

N_LAYERS = 4
#: The test model's stages: equal blocks, the embedding on the first stage.
SPLIT = StageSplit((1,) * N_LAYERS, 0, 0, blocks=tuple(f"layers.{i}" for i in range(N_LAYERS)), first=("tok_embeddings",))


# ------------------------------------------------------------------------------------- model-like state
def fsdp_tp_sharding(
    shape: tuple[int, ...], layout: HybridLayout, tp_placement: Any | None, stage: int | None
) -> TensorSharding:
    """The placements FSDP2 (dim 0 over dp) over TP (``tp_placement``) gives a parameter under ``layout``."""
    names: list[str] = []
    placements: list[Any] = []
    if layout.dp > 1 and shape:  # scalars (AdamW's step) stay whole on every rank
        if layout.dp_replicate > 1:
            names.append("dp_replicate")
            placements.append(Replicate())
        names.append("dp_shard")
        tp_on_dim0 = layout.tp > 1 and isinstance(tp_placement, Shard) and tp_placement.dim == 0
        placements.append(_StridedShard(0, split_factor=layout.tp) if tp_on_dim0 else Shard(0))
    if layout.tp > 1 and tp_placement is not None:
        names.append("tp")
        placements.append(tp_placement)
    return TensorSharding.for_layout(shape, layout, names, placements, stage=stage if layout.pp > 1 else None)


#: name -> (shape, TP placement); uneven on purpose (vocab 11, widths 6 and 10).
MODEL: dict[str, tuple[tuple[int, ...], Any | None]] = {
    "tok_embeddings.weight": ((11, 6), Shard(0)),
    "layers.0.attention.wq.weight": ((10, 6), Shard(0)),
    "layers.0.attention.wo.weight": ((6, 10), Shard(1)),
    "layers.1.attention_norm.weight": ((6,), Replicate()),
    "layers.3.feed_forward.w1.weight": ((10, 6), Shard(0)),
    "output.weight": ((11, 6), Shard(0)),
    "layers.2.attention.wq.weight.step": ((), None),  # a scalar optimizer state, replicated
}


def model_shardings(layout: HybridLayout) -> dict[str, TensorSharding]:
    return {
        name: fsdp_tp_sharding(shape, layout, tp, StageOwner.of(name, SPLIT).stage(layout.pp))
        for name, (shape, tp) in MODEL.items()
    }


def migrations(old: HybridLayout, new: HybridLayout, itemsize: int = 4) -> list[TensorMigration]:
    olds, news = model_shardings(old), model_shardings(new)
    return [TensorMigration(name, itemsize, olds[name], news[name]) for name in MODEL]


def layouts(world: int) -> st.SearchStrategy[HybridLayout]:
    divisors = [d for d in range(1, world + 1) if world % d == 0]

    @st.composite
    def build(draw: st.DrawFn) -> HybridLayout:
        pp = draw(st.sampled_from([d for d in divisors if d <= N_LAYERS]))
        rest = world // pp
        tp = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
        rest //= tp
        dp_replicate = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
        layout = HybridLayout(pp=pp, tp=tp, dp_replicate=dp_replicate, dp_shard=rest // dp_replicate)
        return draw(st.sampled_from(candidate_orders(layout)))  # ranks numbered in any order migration may choose

    return build()


@st.composite
def transitions(draw: st.DrawFn) -> tuple[HybridLayout, HybridLayout, IdentityMap]:
    old_world = draw(st.integers(1, 16))
    new_world = draw(st.integers(1, 16))
    old, new = draw(layouts(old_world)), draw(layouts(new_world))
    n_stay = draw(st.integers(0, min(old_world, new_world)))
    stayers = draw(st.permutations(range(old_world)))[:n_stay]
    new_ranks = draw(st.permutations(range(new_world)))
    nodes = draw(st.lists(st.integers(0, 2), min_size=old_world + new_world, max_size=old_world + new_world))
    procs = []
    for old_rank in range(old_world):  # pid = old rank; leavers (no new rank) still send
        new_rank = new_ranks[stayers.index(old_rank)] if old_rank in stayers else None
        procs.append(ProcessInfo(old_rank, nodes[old_rank], old_rank, new_rank))
    for j, new_rank in enumerate(new_ranks[n_stay:]):  # joiners
        procs.append(ProcessInfo(100 + j, nodes[old_world + j], None, new_rank))
    return old, new, IdentityMap(tuple(procs), old_world, new_world)


# -------------------------------------------------------------------------------------------- oracle
def arange(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)


def local_tensor(sharding: TensorSharding, rank: int | None) -> torch.Tensor | None:
    """A rank's local tensor, built from the full ``arange`` tensor by the geometry (already tested on its own)."""
    holding = None if rank is None else sharding.holding_of_rank(rank)
    if holding is None:
        return None
    full = arange(sharding.global_shape)
    local = torch.full(holding.local_shape, -1, dtype=torch.int64)
    for piece in holding.pieces:
        local[piece.local_slices(piece.global_box)] = full[
            piece.global_box.slices_within(ShardBox.full(full.shape))
        ]
    return local


def held_mask(sharding: TensorSharding, rank: int | None) -> torch.Tensor:
    mask = torch.zeros(sharding.global_shape, dtype=torch.int64)
    holding = None if rank is None else sharding.holding_of_rank(rank)
    for piece in holding.pieces if holding else ():
        mask[piece.global_box.slices_within(ShardBox.full(sharding.global_shape))] = 1
    return mask


def execute(tensors: list[TensorMigration], identity: IdentityMap, plans: dict[int, RankPlan]) -> None:
    """Run every plan on in-memory tensors and check each process ends with exactly its new shards."""
    for tensor in tensors:
        old = {p.pid: local_tensor(tensor.old, p.old_rank) for p in identity.processes}
        new = {p.pid: local_tensor(tensor.new, p.new_rank) for p in identity.processes}
        got = {pid: None if t is None else torch.full_like(t, -1) for pid, t in new.items()}
        hits = {pid: None if t is None else torch.zeros_like(t) for pid, t in new.items()}
        for plan in plans.values():
            for move in (*plan.copies, *plan.recvs):
                if move.tensor != tensor.name:
                    continue
                data = old[move.src][move.src_slices()]
                assert data.shape == move.box.shape, f"{move} reads outside the sender's old shard"
                got[move.dst][move.dst_slices()] = data
                hits[move.dst][move.dst_slices()] += 1
        for pid, expected in new.items():
            if expected is not None:
                assert bool((hits[pid] == 1).all()), f"{tensor.name}: process {pid} gets some element != once"
                assert torch.equal(got[pid], expected), f"{tensor.name}: process {pid} ends with wrong data"


def minimum_bytes(tensors: list[TensorMigration], identity: IdentityMap) -> tuple[int, int]:
    """(bytes that must cross the network, bytes already in place) for this identity map."""
    needed = kept = 0
    for tensor in tensors:
        for p in identity.processes:
            if p.new_rank is None:
                continue
            new = held_mask(tensor.new, p.new_rank)
            both = int((new * held_mask(tensor.old, p.old_rank)).sum())
            needed += (int(new.sum()) - both) * tensor.itemsize
            kept += both * tensor.itemsize
    return needed, kept


def check_plans(
    tensors: list[TensorMigration], identity: IdentityMap, options: PlanOptions
) -> dict[int, RankPlan]:
    plans = plan_all(tensors, identity, options)
    for pid in identity.pids:
        assert plan_for_rank(tensors, identity, pid, options) == plans[pid], (
            f"process {pid} plans differently"
        )
    for a in plans.values():
        assert list(a.sends) == sorted(a.sends, key=lambda t: (t.dst, t.tensor, t.box.bounds))
        assert list(a.recvs) == sorted(a.recvs, key=lambda t: (t.src, t.tensor, t.box.bounds))
        for b in plans.values():
            assert a.sends_to(b.pid) == b.recvs_from(a.pid)
        assert all(t.src != t.dst for t in (*a.sends, *a.recvs))
        assert all(t.src == t.dst == a.pid for t in a.copies)
    execute(tensors, identity, plans)
    needed, kept = minimum_bytes(tensors, identity)
    assert sum(p.bytes_received for p in plans.values()) == needed
    assert sum(p.bytes_sent for p in plans.values()) == needed
    assert sum(p.bytes_copied for p in plans.values()) == kept
    return plans


def check_same_node_preference(
    tensors: list[TensorMigration], identity: IdentityMap, plans: dict[int, RankPlan]
):
    by_name = {t.name: t for t in tensors}
    for plan in plans.values():
        me = identity.process(plan.pid)
        for move in plan.recvs:
            (source,) = [
                s for s in by_name[move.tensor].old.sources(move.box) if s.piece.global_box.contains(move.box)
            ]
            nodes = {p.node for p in (identity.by_old_rank(r) for r in source.ranks) if p is not None}
            if me.node in nodes:
                assert identity.process(move.src).node == me.node, f"{move} crosses nodes needlessly"


# -------------------------------------------------------------------------------------------- properties
@given(transitions(), st.sampled_from([0, 1 << 30]))
@settings(max_examples=150, deadline=None)
def test_plans_are_minimal_exact_and_agreed(case, split_min_bytes: int) -> None:
    old, new, identity = case
    tensors = migrations(old, new)
    options = PlanOptions(split_min_bytes=split_min_bytes)  # 0: split every fragment over its replicas
    plans = check_plans(tensors, identity, options)
    check_same_node_preference(tensors, identity, plans)


@given(transitions())
@settings(max_examples=40, deadline=None)
def test_the_chosen_rank_order_never_loses_to_the_default(case) -> None:
    old, new, identity = case
    choice = choose_rank_order(old, new, migrations, identity)
    assert choice.bytes_in_place >= choice.default_bytes_in_place
    assert choice.layout.degrees == new.degrees
    tensors = migrations(old, choice.layout)
    _, kept = minimum_bytes(tensors, identity)
    assert kept == choice.bytes_in_place  # the choice's count is what the planner copies locally
    nodes = [identity.by_new_rank(r).node for r in range(identity.new_world)]
    spread, default_spread = (groups_across_nodes(lay, nodes) for lay in (choice.layout, new.degrees))
    assert all(spread[axis] <= default_spread[axis] for axis in LOCAL_AXES)
    check_plans(tensors, identity, PlanOptions())


# --------------------------------------------------------------------------------------------- examples
def _same(world: int, old: dict[str, int], new: dict[str, int]) -> tuple[list[TensorMigration], IdentityMap]:
    tensors = migrations(HybridLayout(**old).resolve(world), HybridLayout(**new).resolve(world))
    return tensors, IdentityMap.same_processes(world)


def test_identity_transition_is_all_local_copies() -> None:
    tensors, identity = _same(4, {"dp_shard": 2, "tp": 2}, {"dp_shard": 2, "tp": 2})
    plans = check_plans(tensors, identity, PlanOptions())
    assert all(not p.sends and not p.recvs for p in plans.values())


def test_dp_shard_to_tp_moves_only_what_changes_hands() -> None:
    tensors, identity = _same(4, {"dp_shard": 4}, {"dp_shard": 2, "tp": 2})
    plans = check_plans(tensors, identity, PlanOptions())
    assert any(p.recvs for p in plans.values()) and all(p.copies for p in plans.values())


def test_replicas_share_the_sending() -> None:
    # 2 full replicas -> 4-way sharding with two joiners: each joiner's quarter can come from either replica.
    tensor = TensorMigration(
        "w",
        4,
        TensorSharding.create((64, 64), (2,), [Replicate()]),
        TensorSharding.create((64, 64), (4,), [Shard(0)]),
    )
    procs = (
        ProcessInfo(0, 0, 0, 0),
        ProcessInfo(1, 0, 1, 1),
        ProcessInfo(7, 0, None, 2),
        ProcessInfo(8, 0, None, 3),
    )
    identity = IdentityMap(procs, 2, 4)
    for options in (PlanOptions(split_min_bytes=0), PlanOptions(split_min_bytes=1 << 30)):
        plans = check_plans([tensor], identity, options)
        assert plans[0].bytes_sent == plans[1].bytes_sent == 64 * 64 * 4 // 4
    split = plan_all([tensor], identity, PlanOptions(split_min_bytes=0))
    assert {t.src for t in split[7].recvs} == {0, 1}  # a big fragment is split over both replicas


def test_a_source_on_the_receivers_node_is_preferred() -> None:
    tensor = TensorMigration(
        "w",
        4,
        TensorSharding.create((8, 8), (2,), [Replicate()]),
        TensorSharding.create((8, 8), (2,), [Shard(0)]),
    )
    procs = (ProcessInfo(0, "a", 0, None), ProcessInfo(1, "b", 1, None), ProcessInfo(5, "b", None, 0))
    procs += (ProcessInfo(6, "a", None, 1),)
    plans = check_plans([tensor], IdentityMap(procs, 2, 2), PlanOptions(split_min_bytes=0))
    assert {t.src for t in plans[5].recvs} == {1} and {t.src for t in plans[6].recvs} == {0}


def test_lost_state_fails_loudly_and_replicas_rescue_it() -> None:
    old = HybridLayout(dp_shard=2).resolve(2)
    tensors = migrations(old, HybridLayout().resolve(1))
    identity = IdentityMap((ProcessInfo(0, 0, 0, 0),), 2, 1)  # old rank 1 died
    assert identity.dead_old_ranks == (1,)
    with pytest.raises(StateLostError, match="no live process holds; restore them from a checkpoint"):
        plan_for_rank(tensors, identity, 0)
    plan = plan_for_rank(tensors, identity, 0, PlanOptions(allow_lost=True))
    assert plan.lost and all(f.box.start[0] > 0 for f in plan.lost if f.box.ndim)
    # with a replica of every shard (HSDP), the dead rank's shard comes from its replica
    tensors = migrations(
        HybridLayout(dp_replicate=2, dp_shard=2).resolve(4), HybridLayout(dp_shard=3).resolve(3)
    )
    procs = (ProcessInfo(0, 0, 0, 0), ProcessInfo(2, 0, 2, 1), ProcessInfo(3, 0, 3, 2))
    plans = check_plans(tensors, IdentityMap(procs, 4, 3), PlanOptions())
    assert 3 in {t.src for p in plans.values() for t in p.recvs}


def test_identity_map_is_validated() -> None:
    with pytest.raises(PlanError, match="both claim new_rank=0"):
        IdentityMap((ProcessInfo(0, 0, 0, 0), ProcessInfo(1, 0, 1, 0)), 2, 1)
    with pytest.raises(PlanError, match=r"new ranks \[1\] have no process"):
        IdentityMap((ProcessInfo(0, 0, 0, 0),), 1, 2)
    with pytest.raises(PlanError, match="old_rank=3, outside a world of 2"):
        IdentityMap((ProcessInfo(0, 0, 3, 0),), 2, 1)
    with pytest.raises(PlanError, match="global shape changes"):
        TensorMigration(
            "w",
            4,
            TensorSharding.create((4,), (1,), [Shard(0)]),
            TensorSharding.create((5,), (1,), [Shard(0)]),
        )
    tensors, identity = _same(2, {"dp_shard": 2}, {"tp": 2})
    with pytest.raises(PlanError, match="listed twice"):
        plan_for_rank([*tensors, tensors[0]], identity, 0)
    assert identity.union_rank(1) == 1
    with pytest.raises(PlanError, match=r"meshes span 2 -> 2 ranks but the identity map is for 3 -> 3"):
        plan_for_rank(tensors, IdentityMap.same_processes(3), 0)


def test_fsdp_to_stages_numbers_ranks_so_each_keeps_its_shard_within_a_node() -> None:
    """dp_shard 4 -> pp 2 x dp_shard 2 on four processes. Default order: stage 0 on ranks 0, 1, and rank 1 (which
    held the second quarter of every tensor) keeps nothing of stage 0's second half. With dp_shard slowest, stage 0
    is on ranks 0 and 2, stage 1 on 1 and 3, and every process keeps its quarter of its stage. Across two nodes that
    order would put every FSDP group across them: the default stays."""
    old, new = HybridLayout(dp_shard=4).resolve(4), HybridLayout(pp=2, dp_shard=2).resolve(4)
    one_node = IdentityMap.same_processes(4)
    choice = choose_rank_order(old, new, migrations, one_node)
    assert choice.layout.rank_order is not None
    assert choice.layout.rank_order.index("dp_shard") < choice.layout.rank_order.index("pp")
    assert choice.bytes_in_place > choice.default_bytes_in_place
    needed, _ = minimum_bytes(migrations(old, choice.layout), one_node)
    needed_default, _ = minimum_bytes(migrations(old, new), one_node)
    assert needed_default - needed == choice.bytes_saved
    two_nodes = IdentityMap.same_processes(4, nodes=[0, 0, 1, 1])
    assert choose_rank_order(old, new, migrations, two_nodes).layout == new


def test_a_ranks_planning_work_does_not_grow_with_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 7 plans its part of dp_shard W -> dp_shard W/2 x tp 2 (and of an HSDP change) with the same number of
    geometry steps at W = 1024 and W = 16384: cost follows its own shards and overlapping peers, not the world."""
    from lightning_emig.migration import geometry

    calls = {"n": 0}
    real_apply = geometry._apply

    def counting_apply(*args: Any) -> Any:
        calls["n"] += 1
        return real_apply(*args)

    monkeypatch.setattr(geometry, "_apply", counting_apply)
    for old_kwargs, new_kwargs in (
        ({"dp_shard": -1}, {"tp": 2}),
        ({"dp_replicate": 8}, {"dp_replicate": 4, "tp": 2}),
    ):
        work = []
        for world in (1024, 16384):
            old, new = HybridLayout(**old_kwargs).resolve(world), HybridLayout(**new_kwargs).resolve(world)
            tensors = [
                TensorMigration(t.name, 2, _scaled(t.old, 16384), _scaled(t.new, 16384))
                for t in migrations(old, new)
                if t.old.global_shape
            ]
            geometry._holding.cache_clear()
            geometry._sources.cache_clear()
            calls["n"] = 0
            plan = plan_for_rank(tensors, IdentityMap.same_processes(world), 7)
            assert plan.recvs and plan.sends
            work.append(calls["n"])
        assert work[0] == work[1], f"{old_kwargs} -> {new_kwargs}: {work}"


def _scaled(sharding: TensorSharding, factor: int) -> TensorSharding:
    shape = tuple(n * factor for n in sharding.global_shape)
    return TensorSharding(
        shape, sharding.mesh_shape, sharding.placements, sharding.axis_groups, sharding.stage
    )


def test_transfer_slices_address_local_tensors() -> None:
    move = Transfer("w", ShardBox(((4, 6), (0, 3))), 0, 1, (1, 0), (0, 2), 24)
    assert move.src_slices() == (slice(1, 3), slice(0, 3))
    assert move.dst_slices() == (slice(0, 2), slice(2, 5))


def test_planning_work_follows_the_kinds_of_tensor_not_their_number(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's hundreds of state tensors come in a handful of (old sharding, new sharding) kinds: a process works
    each kind's fragments out once per replica rotation, whether 8 or 64 tensors share it (the plans still match
    plan_all's, which works every tensor out on its own, replicas rotating over the tensors' indices)."""
    from lightning_emig.migration import planner

    calls = {"n": 0}

    def counting(real: Any) -> Any:
        def count(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return real(*args, **kwargs)
        return count

    monkeypatch.setattr(planner, "_fragment_transfers", counting(planner._fragment_transfers))
    monkeypatch.setattr(planner, "_share_of", counting(planner._share_of))
    old, new = HybridLayout(dp_replicate=3, dp_shard=2).resolve(6), HybridLayout(dp_replicate=2, dp_shard=4).resolve(8)
    identity = IdentityMap.first_ranks(6, 8)  # two joiners, three replicas to take each fragment from
    work = []
    for count in (8, 64):
        wide, narrow = (fsdp_tp_sharding((16, 4), layout, None, None) for layout in (old, new))
        tensors = [TensorMigration(f"t{i:03d}", 4, wide, narrow) for i in range(count)]
        calls["n"] = 0
        for pid in identity.pids:
            plan_for_rank(tensors, identity, pid)
        work.append(calls["n"])
        check_plans(tensors, identity, PlanOptions())
    assert work[0] == work[1] > 0, work
