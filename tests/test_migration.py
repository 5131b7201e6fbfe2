"""Live migration on real process groups: the full state is bit-identical after every change of layout or world.

Each scenario runs in one spawn (gloo on CPU; again on NCCL when there is a GPU per process): the model is built
under the first layout, trained for two AdamW steps so ``exp_avg``, ``exp_avg_sq`` and ``step`` are non-trivial, and
gathered full; then a sequence of migrations runs, each into a model built on the meta device under the next layout
and world, and after each the new world gathers the full state and compares it, bit for bit, with the state gathered
before the first migration (no training in between). Every process returns what it saw; each test below checks one
property of those records.

World changes run in one default group of as many processes as the largest world. The old model lives on a mesh over
the old world's processes and the new model on a mesh over the new world's (``build_mesh(..., ranks=...)``), the
migration runs over the union of both (the default group, or a sub-group when some processes take no part), and a
process's pid is its default-group rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_emig.layout import HybridLayout, LayoutMesh, build_mesh
from lightning_emig.migration.engine import MigrationFailedError, migrate
from lightning_emig.migration.identity import IdentityMap, ProcessInfo
from lightning_emig.migration.planner import StateLostError
from lightning_emig.migration.state import ShardingSpec, StateTensor, allocate_optimizer_state, training_state
from lightning_emig.migration.transfer import (
    IN_PLACE_MIN_BYTES,
    ChecksumMismatchError,
    TransferOptions,
    max_single_row_bytes,
)
from lightning_emig.models.llama import Llama, LlamaConfig, causal_lm_loss, get_model_config
from lightning_emig.testing.distributed import WorkerFailed, run_distributed
from lightning_emig.testing.llama import laid_out_llama, train_steps
from lightning_emig.testing.state import assert_states_equal, full_training_state

pytestmark = pytest.mark.multiprocess

SEED = 11
LR = 1e-2
SEQ_LEN = 16  # divisible by every TP degree below (sequence parallelism)
TINY = get_model_config("tiny")
#: No width divisible by 3, a vocabulary divisible by nothing used here; tp=2 still divides heads and FFN.
UNEVEN = LlamaConfig(dim=40, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=100, vocab_size=259, max_seq_len=32)
#: Loss of a parallelized model vs the single-process one: reduction order only (see test_parallel_parity).
LOSS_RTOL = 1e-5
SMALL_BUCKET = 4 << 10
IN_PLACE_SMALL = 64


# ---------------------------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class Move:
    """One migration: to ``layout`` on the default-group ranks ``ranks`` (new rank = position in the list)."""

    name: str
    layout: dict[str, int]
    ranks: tuple[int, ...]
    bucket_bytes: int = 256 << 20
    checksum: bool = False
    in_place_min_bytes: int = IN_PLACE_MIN_BYTES
    """Lowered in some moves so that most boxes of the tiny model leave from / land in the live tensors."""


@dataclass(frozen=True)
class Scenario:
    name: str
    world: int
    config: LlamaConfig
    start: dict[str, int]
    """Layout trained on, over all ``world`` processes."""
    moves: tuple[Move, ...]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.moves]


ALL4, ALL6 = (0, 1, 2, 3), (0, 1, 2, 3, 4, 5)

CHAIN = Scenario(
    name="chain",
    world=4,
    config=TINY,
    start={"dp_shard": 4},
    moves=tuple(
        Move(name, layout, ALL4, bucket_bytes=SMALL_BUCKET, in_place_min_bytes=IN_PLACE_SMALL)
        for name, layout in [
            ("tp2xdp_shard2", {"tp": 2, "dp_shard": 2}),
            ("dp_replicate2xdp_shard2", {"dp_replicate": 2, "dp_shard": 2}),
            ("tp4", {"tp": 4, "dp_shard": 1}),
            ("dp_shard4", {"dp_shard": 4}),
        ]
    ),
)

# Each world's processes are the previous one's for the next move; "6->4" and "1->2" only connect the others.
# 6->1: five leavers; 1->2 over a 2-process sub-group; 2->6: four joiners; 4->3 over a 5-process sub-group: two
# leavers, one joiner; 3->5: one leaver, three joiners. A process's new rank is its position among the new world's
# processes (a mesh's ranks must ascend, see build_mesh), which still differs from its old rank in most moves.
WORLD_CHANGES = Scenario(
    name="world_changes",
    world=6,
    config=TINY,
    start={"tp": 2, "dp_shard": 3},
    moves=(
        Move("6->1", {"dp_shard": 1}, (4,)),
        Move("1->2", {"tp": 2, "dp_shard": 1}, (1, 4)),
        Move("2->6", {"dp_replicate": 2, "dp_shard": 3}, ALL6, checksum=True),
        Move("6->4", {"tp": 2, "dp_shard": 2}, (0, 2, 3, 5), in_place_min_bytes=IN_PLACE_SMALL),
        Move("4->3", {"dp_shard": 3}, (1, 3, 5), bucket_bytes=SMALL_BUCKET),
        Move("3->5", {"dp_shard": 5}, (0, 1, 2, 4, 5)),
    ),
)

# FSDP2 over TP with dp_shard=3 on dims 3 does not divide (_StridedShard, uneven), dp_shard 6 and 4, HSDP.
UNEVEN_SHAPES = Scenario(
    name="uneven_shapes",
    world=6,
    config=UNEVEN,
    start={"tp": 2, "dp_shard": 3},
    moves=(
        Move("tp2xdp3->dp6", {"dp_shard": 6}, ALL6, bucket_bytes=1 << 10, checksum=True),
        Move("dp6->dp_replicate2xdp3", {"dp_replicate": 2, "dp_shard": 3}, ALL6),
        Move("dp_replicate2xdp3->tp2xdp3", {"tp": 2, "dp_shard": 3}, ALL6, bucket_bytes=SMALL_BUCKET),
        Move("6->4 dp4", {"dp_shard": 4}, ALL4, in_place_min_bytes=IN_PLACE_SMALL),
        Move("4->3 dp3", {"dp_shard": 3}, (3, 4, 5)),
        Move("3->6 tp2xdp3", {"tp": 2, "dp_shard": 3}, ALL6, bucket_bytes=SMALL_BUCKET),
    ),
)


# ------------------------------------------------------------------------------------- in the processes
def _device_type(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _mesh(layout: dict[str, int], ranks: Sequence[int], backend: str) -> LayoutMesh:
    """Every process calls this (sub-group creation is collective), members or not."""
    return build_mesh(HybridLayout(**layout).resolve(len(ranks)), _device_type(backend), ranks=ranks)


def _model(config: LlamaConfig, layout_mesh: LayoutMesh, backend: str, *, init: bool) -> Llama:
    return laid_out_llama(config, layout_mesh, _device(backend), seed=SEED if init else None)


def _train(model: Llama, layout_mesh: LayoutMesh, backend: str, steps: int = 2) -> torch.optim.Optimizer:
    """A few real AdamW steps; every data-parallel rank reads its own micro-batch (TP peers the same one)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    generator = torch.Generator().manual_seed(1000 + layout_mesh.dp_rank)
    train_steps(model, optimizer, (
        torch.randint(0, model.config.vocab_size, (2, SEQ_LEN + 1), generator=generator).to(_device(backend))
        for _ in range(steps)))
    return optimizer


def _eval_tokens(config: LlamaConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(5))


def _loss(model: Llama, config: LlamaConfig, backend: str) -> float:
    """Loss on a fixed batch (the same on every rank); FSDP2 modules are resharded after, so the model's
    parameters are its sharded DTensors again (a later migration reads them)."""
    from torch.distributed.fsdp import FSDPModule

    tokens = _eval_tokens(config).to(_device(backend))
    with torch.no_grad():
        loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).item()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return loss


def _reference_loss(config: LlamaConfig, full: dict[str, torch.Tensor]) -> float:
    """The same loss from the gathered full state, on one process without any parallelism."""
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    model.load_state_dict({k.removeprefix("param/"): v for k, v in full.items() if k.startswith("param/")})
    model.init_buffers()
    tokens = _eval_tokens(config)
    with torch.no_grad():
        return causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).item()


def _identity(old: Sequence[int], new: Sequence[int]) -> IdentityMap:
    union = sorted(set(old) | set(new))
    processes = tuple(
        ProcessInfo(
            pid, 0, old.index(pid) if pid in old else None, new.index(pid) if pid in new else None
        )
        for pid in union
    )
    return IdentityMap(processes, len(old), len(new))


def _scenario_worker(rank: int, world: int, scenario: Scenario, backend: str) -> list[dict[str, Any]]:
    config = scenario.config
    ranks: tuple[int, ...] = tuple(range(world))
    layout_mesh = _mesh(scenario.start, ranks, backend)
    model: Llama | None = _model(config, layout_mesh, backend, init=True)
    optimizer = _train(model, layout_mesh, backend)
    before = full_training_state(model, optimizer)
    # Keys and dtypes of the optimizer state, for allocating it under a new layout. Joiners have it here because
    # every process trained first; a real joiner receives it from the old world.
    template = {k: t.spec for k, t in training_state(model, optimizer).items()}
    reference_loss = _reference_loss(config, before)
    records = []
    for move in scenario.moves:
        identity = _identity(ranks, move.ranks)
        union = identity.pids
        group = None if len(union) == world else dist.new_group(list(union))  # collective: everyone calls it
        new_mesh = _mesh(move.layout, move.ranks, backend)
        record: dict[str, Any] = {"move": move.name, "pid": rank, "union": rank in union}
        new_model = new_optimizer = None
        new_state = None
        if rank in move.ranks:
            new_model = _model(config, new_mesh, backend, init=False)
            new_optimizer = torch.optim.AdamW(new_model.parameters(), lr=LR, weight_decay=0.1)
            new_state = training_state(new_model, None)
            new_state.update(allocate_optimizer_state(new_model, new_optimizer, template))
        if rank in union:
            old_state = training_state(model, optimizer) if rank in ranks else None
            options = TransferOptions(
                bucket_bytes=move.bucket_bytes, checksum=move.checksum, in_place_min_bytes=move.in_place_min_bytes
            )
            report = migrate(
                old_state=old_state, new_state=new_state, old_layout=layout_mesh.layout,
                new_layout=new_mesh.layout, identity=identity, pid=rank, group=group, transfer=options,
                release_old=True,
            )
            record.update(
                identity=identity,
                old_layout=layout_mesh.layout,
                new_layout=new_mesh.layout,
                bucket_bytes=move.bucket_bytes,
                bytes_received=report.stats.bytes_received,
                plan_bytes_received=report.plan.bytes_received,
                bytes_sent=report.stats.bytes_sent,
                plan_bytes_sent=report.plan.bytes_sent,
                peak_buffer_bytes=report.stats.peak_buffer_bytes,
                bytes_in_place=report.stats.bytes_in_place,
                max_row_bytes=max_single_row_bytes(report.plan),
                rounds=report.stats.rounds,
                seconds=report.seconds,
                old_specs={k: t.spec for k, t in old_state.items()} if old_state else None,
                new_specs={k: t.spec for k, t in new_state.items()} if new_state else None,
                released=None if old_state is None else all(
                    t.local.untyped_storage().size() == 0 for t in old_state.values() if t.local.numel()
                ),
            )
        if new_model is not None:
            try:
                assert_states_equal(before, full_training_state(new_model, new_optimizer))
                record["mismatch"] = None
            except AssertionError as exc:
                record["mismatch"] = str(exc)
            record["loss"], record["reference_loss"] = _loss(new_model, config, backend), reference_loss
        records.append(record)
        model, optimizer, layout_mesh, ranks = new_model, new_optimizer, new_mesh, move.ranks
    return records


# ------------------------------------------------------------------------------------------- in the test
BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.cuda)]


def _require(backend: str, world: int) -> None:
    if backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < world):
        pytest.skip(f"NCCL needs {world} GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}")


#: Scenarios that share one spawn (the start-up of the processes costs more than a scenario): by world size.
SESSIONS: dict[int, tuple[str, ...]] = {4: ("chain", "failures"), 6: ("world_changes", "uneven_shapes")}
SESSION_TIMEOUT_S = 240.0
_RESULTS: dict[tuple[str, str], Any] = {}


def _job(name: str, rank: int, world: int, backend: str) -> Any:
    scenarios = {s.name: s for s in (CHAIN, WORLD_CHANGES, UNEVEN_SHAPES)}
    if name == "failures":
        return _failures_worker(rank, world, backend)
    records = _scenario_worker(rank, world, scenarios[name], backend)
    return {move.name: record for move, record in zip(scenarios[name].moves, records, strict=True)}


def _session_worker(rank: int, world: int, names: tuple[str, ...], backend: str) -> dict[str, Any]:
    return {name: _job(name, rank, world, backend) for name in names}


def _results(name: str, backend: str) -> list[Any]:
    """One job's result from every process, spawning its session on first use (shared by the tests).

    A failed session fails every test that reads it, without spawning it again.
    """
    if (name, backend) not in _RESULTS:
        world = next(w for w, names in SESSIONS.items() if name in names)
        _require(backend, world)
        try:
            per_rank = run_distributed(
                _session_worker, world, SESSIONS[world], backend, backend=backend, timeout_s=SESSION_TIMEOUT_S
            )
        except WorkerFailed as exc:
            for job in SESSIONS[world]:
                _RESULTS[(job, backend)] = exc
            raise
        for job in SESSIONS[world]:
            _RESULTS[(job, backend)] = [result[job] for result in per_rank]
    result = _RESULTS[(name, backend)]
    if isinstance(result, WorkerFailed):
        raise WorkerFailed(f"the {name} session failed earlier (see the first test that ran it): {result}")
    return result


@pytest.fixture(params=BACKENDS)
def run(request: pytest.FixtureRequest) -> Callable[[Scenario], dict[str, list[dict[str, Any]]]]:
    """``run(scenario)[move name]``: that move's record from every process."""
    backend = request.param

    def get(scenario: Scenario) -> dict[str, list[dict[str, Any]]]:
        per_rank = _results(scenario.name, backend)
        return {move.name: [records[move.name] for records in per_rank] for move in scenario.moves}

    return get


def _check_bit_exact(records: list[dict[str, Any]], move: Move) -> None:
    members = [r for r in records if r["pid"] in move.ranks]
    assert len(members) == len(move.ranks)
    for r in members:
        assert r["mismatch"] is None, f"{move.name}, process {r['pid']}: {r['mismatch']}"
        # the migrated model computes what the single-process model computes from the gathered state
        assert r["loss"] == pytest.approx(r["reference_loss"], rel=LOSS_RTOL), (move.name, r["pid"])
    for r in records:
        if r["union"] and r["released"] is not None:
            assert r["released"], f"{move.name}: process {r['pid']} still holds old storage after release_old"


def _held_elements(old: Any, new: Any) -> int:
    """Elements of the new holding ``new`` already inside the old holding ``old`` (both may be several pieces)."""
    if new is None or old is None:
        return 0
    total = 0
    for a in old.pieces:
        for b in new.pieces:
            common = a.global_box.intersect(b.global_box)
            total += 0 if common is None else common.numel
    return total


def minimum_bytes(
    old_specs: dict[str, ShardingSpec],
    new_specs: dict[str, ShardingSpec],
    old_layout: HybridLayout,
    new_layout: HybridLayout,
    identity: IdentityMap,
) -> int:
    """The intersection minimum, from holdings alone: what each new rank needs minus what its process held."""
    total = 0
    for key, spec in old_specs.items():
        old, new = spec.on(old_layout), new_specs[key].on(new_layout)
        for p in identity.processes:
            if p.new_rank is None:
                continue
            need = new.holding_of_rank(p.new_rank)
            held = None if p.old_rank is None else old.holding_of_rank(p.old_rank)
            total += ((need.numel if need else 0) - _held_elements(held, need)) * spec.itemsize
    return total


def _check_bytes(records: list[dict[str, Any]]) -> None:
    union = [r for r in records if r["union"]]
    for r in union:
        assert r["bytes_received"] == r["plan_bytes_received"], r["pid"]
        assert r["bytes_sent"] == r["plan_bytes_sent"], r["pid"]
    old_specs = next(r["old_specs"] for r in union if r["old_specs"] is not None)
    new_specs = next(r["new_specs"] for r in union if r["new_specs"] is not None)
    first = union[0]
    expected = minimum_bytes(old_specs, new_specs, first["old_layout"], first["new_layout"], first["identity"])
    assert sum(r["bytes_received"] for r in union) == expected
    assert sum(r["bytes_sent"] for r in union) == expected


# -------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("move", CHAIN.moves, ids=CHAIN.names)
def test_chain_of_live_reconfigures_is_bit_exact(run, move: Move) -> None:
    """dp_shard 4 -> tp 2 x dp_shard 2 -> dp_replicate 2 x dp_shard 2 -> tp 4 -> dp_shard 4 on the same 4
    processes; after each the state equals the state before the chain, and the old storage is gone."""
    _check_bit_exact(run(CHAIN)[move.name], move)


@pytest.mark.parametrize("move", WORLD_CHANGES.moves, ids=WORLD_CHANGES.names)
def test_world_change_is_bit_exact(run, move: Move) -> None:
    """6 -> 1 -> 2 -> 6 -> 4 -> 3 -> 5 processes through ``migrate`` with an identity map: leavers only send,
    joiners only receive, survivors change rank; after each move the new world's state is the original one."""
    records = run(WORLD_CHANGES)[move.name]
    _check_bit_exact(records, move)
    roles = {(r["identity"].process(r["pid"]).old_rank is None, r["pid"] in move.ranks) for r in records if r["union"]}
    if move.name in ("6->1", "4->3", "3->5"):
        assert (False, False) in roles, "a process that only sends"
    if move.name in ("2->6", "4->3", "3->5"):
        assert (True, True) in roles, "a process that only receives"


@pytest.mark.parametrize("move", UNEVEN_SHAPES.moves, ids=UNEVEN_SHAPES.names)
def test_uneven_shapes_migrate_bit_exact(run, move: Move) -> None:
    """Vocabulary 259, width 40, FFN 100: uneven FSDP2 shards, uneven _StridedShard (FSDP2 over TP with
    dp_shard=3), a 4 -> 3 and a 3 -> 6 world change; the migrated model's loss is the single-process loss."""
    _check_bit_exact(run(UNEVEN_SHAPES)[move.name], move)


@pytest.mark.parametrize(
    ("scenario", "move"),
    [(s, m) for s in (CHAIN, WORLD_CHANGES, UNEVEN_SHAPES) for m in s.moves],
    ids=[f"{s.name}-{m.name}" for s in (CHAIN, WORLD_CHANGES, UNEVEN_SHAPES) for m in s.moves],
)
def test_bytes_moved_are_the_intersection_minimum(run, scenario: Scenario, move: Move) -> None:
    """Each process receives (and sends) exactly what its plan says, and all of them together exactly the
    intersection minimum computed here from the holdings: nothing a process already holds is sent."""
    _check_bytes(run(scenario)[move.name])


def test_peak_buffer_memory_is_bounded_by_the_bucket(run) -> None:
    """With a 4 KiB budget (many rounds) the buffers of a round stay within the budget, still bit-exact."""
    records = run(CHAIN)
    for move in CHAIN.moves:
        for r in records[move.name]:
            assert r["bucket_bytes"] == SMALL_BUCKET
            assert r["peak_buffer_bytes"] <= SMALL_BUCKET + r["max_row_bytes"], (move.name, r["pid"])
            # rows wider than a pair's bucket are cut too, so the budget holds without the row allowance
            assert r["peak_buffer_bytes"] <= SMALL_BUCKET, (move.name, r["pid"])
        assert max(r["rounds"] for r in records[move.name]) >= 8, "the budget should force many rounds"
        _check_bit_exact(records[move.name], move)


def test_large_contiguous_boxes_travel_in_place_and_stay_bit_exact(run) -> None:
    """Moves with a lowered in-place threshold send from / receive into live tensors (the bit-exact tests above
    cover their results); a checksummed move stages everything, so corrupt bytes never land in live state."""
    for scenario in (CHAIN, WORLD_CHANGES, UNEVEN_SHAPES):
        records = run(scenario)
        for move in scenario.moves:
            in_place = sum(r["bytes_in_place"] for r in records[move.name] if r["union"])
            if move.checksum:
                assert in_place == 0, move.name
            elif move.in_place_min_bytes < IN_PLACE_MIN_BYTES:
                assert in_place > 0, move.name


def test_mesh_over_a_subset_needs_ascending_distinct_ranks() -> None:
    """FSDP2 shards by process-group rank (torch sorts a group's ranks), DTensor by mesh coordinate: they agree
    only when a mesh's ranks ascend, so anything else is refused before a group is created."""
    from lightning_emig.layout import LayoutError

    with pytest.raises(LayoutError, match="ascending"):
        build_mesh(HybridLayout(dp_shard=3).resolve(3), "cpu", ranks=[3, 1, 5])
    with pytest.raises(LayoutError, match="3 distinct ranks"):
        build_mesh(HybridLayout(dp_shard=3).resolve(3), "cpu", ranks=[1, 1, 5])


# ----------------------------------------------------------------------------------------------------- failures
@dataclass
class _Corruptor:
    """Flips one byte of the first bucket this process sends in ``round_index`` (after its checksum is taken)."""

    round_index: int
    victim: list[int] = field(default_factory=list)

    def __call__(self, round_index: int, peer: int, packed: torch.Tensor) -> None:
        if round_index == self.round_index and not self.victim:
            packed[packed.numel() // 2] ^= 0x5A
            self.victim.append(peer)


def _failures_worker(rank: int, world: int, backend: str) -> dict[str, Any]:
    old_mesh = _mesh({"dp_shard": 4}, ALL4, backend)
    model = _model(TINY, old_mesh, backend, init=True)
    optimizer = _train(model, old_mesh, backend)
    before = full_training_state(model, optimizer)
    template = {k: t.spec for k, t in training_state(model, optimizer).items()}
    new_mesh = _mesh({"tp": 2, "dp_shard": 2}, ALL4, backend)
    identity = IdentityMap.same_processes(world)
    out: dict[str, Any] = {}

    def attempt(options: TransferOptions, drop: str | None = None) -> tuple[str | None, str, Llama, torch.optim.Optimizer]:
        new_model = _model(TINY, new_mesh, backend, init=False)
        new_optimizer = torch.optim.AdamW(new_model.parameters(), lr=LR, weight_decay=0.1)
        new_state = training_state(new_model, None)
        new_state.update(allocate_optimizer_state(new_model, new_optimizer, template))
        old_state = training_state(model, optimizer)
        for state in (old_state, new_state) if drop else ():  # this process's model lacks a tensor
            del state[drop]
        try:
            report = migrate(
                old_state=old_state, new_state=new_state, old_layout=old_mesh.layout,
                new_layout=new_mesh.layout, identity=identity, pid=rank, transfer=options, release_old=False,
            )
        except (ChecksumMismatchError, MigrationFailedError) as exc:
            return type(exc).__name__, str(exc), new_model, new_optimizer
        out["clean_rounds"] = report.stats.rounds
        return None, "", new_model, new_optimizer

    corruptor = _Corruptor(round_index=1)
    corrupt = TransferOptions(bucket_bytes=SMALL_BUCKET, checksum=True, corrupt_in_transit=corruptor)
    # only process 0 corrupts what it sends; its first victim in round 1 must notice, everyone must fail
    out["error"], out["message"], _, _ = attempt(corrupt if rank == 0 else TransferOptions(SMALL_BUCKET, True))
    out["victim"] = corruptor.victim[0] if corruptor.victim else None
    # release_old=False: after a failed migration the old state is intact and usable
    out["old_intact"] = _states_equal(before, full_training_state(model, optimizer))
    error, _, new_model, new_optimizer = attempt(TransferOptions(bucket_bytes=SMALL_BUCKET, checksum=True))
    out["clean_error"] = error
    out["clean_equal"] = _states_equal(before, full_training_state(new_model, new_optimizer))
    # Process 1 asks for another bucket size: gloo would abort on mismatched messages; every process refuses first.
    bucket = SMALL_BUCKET * 2 if rank == 1 else SMALL_BUCKET
    out["disagree_error"], out["disagree_message"], _, _ = attempt(TransferOptions(bucket_bytes=bucket, checksum=True))
    out["disagree_old_intact"] = _states_equal(before, full_training_state(model, optimizer))
    # Process 3 plans from its own specs (every process holds both sides, so none are broadcast) but its model lacks
    # a tensor: the specs' digests differ and every process refuses before any byte moves.
    out["specs_error"], out["specs_message"], _, _ = attempt(
        TransferOptions(bucket_bytes=SMALL_BUCKET), drop=sorted(template)[0] if rank == 3 else None)
    out["specs_old_intact"] = _states_equal(before, full_training_state(model, optimizer))
    out.update(_lost_state(rank, backend, model, optimizer, old_mesh, template))
    out["lost_old_intact"] = _states_equal(before, full_training_state(model, optimizer))
    if backend == "gloo":  # last: it releases the old state
        out.update(_local_error(rank, model, optimizer, old_mesh, new_mesh, template, backend))
    return out


def _local_error(
    rank: int, model: Llama, optimizer: torch.optim.Optimizer, old_mesh: LayoutMesh, new_mesh: LayoutMesh,
    template: dict[str, ShardingSpec], backend: str,
) -> dict[str, Any]:
    """Process 2 cannot free one old shard (its storage is not resizable) in the middle of the rounds."""
    old_state = training_state(model, optimizer)
    if rank == 2:
        key = next(k for k in sorted(old_state) if old_state[k].local.numel() > 0)
        held = old_state[key]
        old_state[key] = StateTensor(key, held.spec, torch.from_numpy(held.local.detach().numpy().copy()))
    new_model = _model(TINY, new_mesh, backend, init=False)
    new_optimizer = torch.optim.AdamW(new_model.parameters(), lr=LR)
    new_state = training_state(new_model, None)
    new_state.update(allocate_optimizer_state(new_model, new_optimizer, template))
    try:
        migrate(old_state=old_state, new_state=new_state, old_layout=old_mesh.layout, new_layout=new_mesh.layout,
                identity=IdentityMap.same_processes(4), pid=rank,
                transfer=TransferOptions(bucket_bytes=SMALL_BUCKET), release_old=True)
    except Exception as exc:
        return {"local_error": type(exc).__name__, "local_message": str(exc)}
    return {"local_error": None, "local_message": ""}


def _lost_state(
    rank: int, backend: str, model: Llama, optimizer: torch.optim.Optimizer, old_mesh: LayoutMesh,
    template: dict[str, ShardingSpec],
) -> dict[str, Any]:
    """Old rank 3 died without a replica: processes 0-2 go on as dp_shard=3 but its shard is nowhere."""
    survivors = (0, 1, 2)
    group = dist.new_group(list(survivors))
    new_mesh = _mesh({"dp_shard": 3}, survivors, backend)
    if rank not in survivors:
        return {"lost_error": None}
    identity = IdentityMap(tuple(ProcessInfo(pid, 0, pid, pid) for pid in survivors), 4, 3)
    new_model = _model(TINY, new_mesh, backend, init=False)
    new_optimizer = torch.optim.AdamW(new_model.parameters(), lr=LR)
    new_state = training_state(new_model, None)
    new_state.update(allocate_optimizer_state(new_model, new_optimizer, template))
    try:
        migrate(
            old_state=training_state(model, optimizer), new_state=new_state, old_layout=old_mesh.layout,
            new_layout=new_mesh.layout, identity=identity, pid=rank, group=group, release_old=True,
        )
    except (StateLostError, MigrationFailedError) as exc:
        return {"lost_error": type(exc).__name__, "lost_message": str(exc)}
    return {"lost_error": None}


def _states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    try:
        assert_states_equal(a, b)
    except AssertionError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_byte_in_transit_fails_every_process(backend: str) -> None:
    """A byte flipped after the checksum: the receiver raises ChecksumMismatchError, every other process
    MigrationFailedError, promptly (the receiver finishes the remaining rounds so no peer waits for the process
    group's timeout); the old state is untouched; and the same checksummed migration without corruption passes."""
    results = _results("failures", backend)
    victim = results[0]["victim"]
    assert victim is not None and victim != 0
    for pid, r in enumerate(results):
        expected = "ChecksumMismatchError" if pid == victim else "MigrationFailedError"
        assert r["error"] == expected, (pid, r["error"], r["message"])
        assert r["old_intact"] is None, (pid, r["old_intact"])
        assert r["clean_error"] is None and r["clean_equal"] is None, (pid, r)
        assert r["clean_rounds"] > 1
    assert "checksum mismatch in round 1 from process 0" in results[victim]["message"]
    assert "not accepted" in results[(victim + 1) % 4]["message"]


def test_an_error_on_one_process_mid_transfer_fails_every_process_naming_it() -> None:
    """Process 2 cannot free an old shard in the middle of the rounds: it still runs every round (its peers post
    them), then every process raises, the others naming process 2's error; nobody waits for the group's timeout."""
    results = _results("failures", "gloo")
    assert results[2]["local_error"] == "RuntimeError" and "not resizable" in results[2]["local_message"]
    for pid in (0, 1, 3):
        assert results[pid]["local_error"] == "MigrationFailedError", results[pid]["local_message"]
        assert "process 2: RuntimeError" in results[pid]["local_message"], results[pid]["local_message"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_processes_that_disagree_on_transfer_options_all_refuse_before_any_byte_moves(backend: str) -> None:
    results = _results("failures", backend)
    assert [r["disagree_error"] for r in results] == ["MigrationFailedError"] * 4, [r["disagree_message"] for r in results]
    assert all("disagree on the transfer options" in r["disagree_message"] for r in results)
    assert all(r["disagree_old_intact"] is None for r in results)
    assert [r["specs_error"] for r in results] == ["MigrationFailedError"] * 4, [r["specs_message"] for r in results]
    assert all("disagree on the state's tensors" in r["specs_message"] for r in results)
    assert all(r["specs_old_intact"] is None for r in results)


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_no_process_holds_fails_every_process_before_any_transfer(backend: str) -> None:
    """Old rank 3 is dead and had no replica: the process that needs its shard raises StateLostError, the others
    MigrationFailedError right away (they agree on the plan before transferring), and nothing was released
    although ``release_old=True``: the old state is intact."""
    results = _results("failures", backend)
    errors = [r["lost_error"] for r in results]
    assert errors[3] is None  # not part of the new world
    assert errors[2] == "StateLostError", results[2].get("lost_message")
    assert errors[:2] == ["MigrationFailedError"] * 2, [r.get("lost_message") for r in results]
    assert "no live process holds" in results[2]["lost_message"]
    assert all(r["lost_old_intact"] is None for r in results), [r["lost_old_intact"] for r in results]


def _join_with_known_specs(rank: int, world: int) -> dict[str, Any]:
    """1 -> 2: process 1 joins; both were given the old state's specs beforehand (as a join's announcement gives
    them), so the migration broadcasts none: a broadcast of specs here fails the test."""
    from lightning_emig.migration import engine

    def no_broadcast(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("specs were broadcast although every process was given them")

    engine._broadcast_specs = no_broadcast  # this worker process only
    old_mesh = _mesh({"dp_shard": 1}, (0,), "gloo")
    new_mesh = _mesh({"dp_shard": 2}, (0, 1), "gloo")
    old_state, before, specs = None, None, None
    if rank == 0:
        model = _model(TINY, old_mesh, "gloo", init=True)
        optimizer = _train(model, old_mesh, "gloo")
        old_state = training_state(model, optimizer)
        before = full_training_state(model, optimizer)
        specs = {k: t.spec for k, t in old_state.items()}
    box = [before, specs]
    dist.broadcast_object_list(box, src=0)
    before, specs = box
    new_model = _model(TINY, new_mesh, "gloo", init=False)
    new_optimizer = torch.optim.AdamW(new_model.parameters(), lr=LR, weight_decay=0.1)
    new_state = training_state(new_model, None)
    new_state.update(allocate_optimizer_state(new_model, new_optimizer,
                                              {k: s for k, s in specs.items() if k.startswith("optim/")}))
    identity = IdentityMap((ProcessInfo(0, 0, 0, 0), ProcessInfo(1, 0, None, 1)), 1, 2)
    migrate(old_state=old_state, new_state=new_state, old_layout=old_mesh.layout, new_layout=new_mesh.layout,
            identity=identity, pid=rank, release_old=True, old_specs=specs)
    return {"mismatch": _states_equal(before, full_training_state(new_model, new_optimizer))}


def test_a_joiner_given_the_old_specs_plans_from_them_and_nothing_is_broadcast() -> None:
    for result in run_distributed(_join_with_known_specs, 2, timeout_s=120):
        assert result["mismatch"] is None, result["mismatch"]
