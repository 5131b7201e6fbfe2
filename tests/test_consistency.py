"""The consistency guard: a state digest that no layout changes, and the proof that every rank holds one state.

The same model state (initialised from one seed, one AdamW step on zero gradients: elementwise, so bit-identical
under every layout) is laid out under each 2-process layout: its digest is the same under all of them, and changes
with one element. The guard refuses a world whose ranks disagree on the step, or whose replicas differ."""

from __future__ import annotations

import dataclasses
import itertools
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_emig.change.consistency import PROOF_KEY
from lightning_emig.consistency import (
    InconsistentStateError,
    StateProof,
    begin_proof,
    check_same_state,
    prove_state,
)
from lightning_emig.layout import HybridLayout, build_mesh
from lightning_emig.migration import digest
from lightning_emig.migration.boxes import LocalPiece, ShardBox
from lightning_emig.migration.digest import replica_slots
from lightning_emig.migration.state import ShardingSpec, StateTensor, training_state
from lightning_emig.models.llama import get_model_config
from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.llama import laid_out_llama

LAYOUTS = ({"dp_shard": 2}, {"tp": 2}, {"dp_replicate": 2})


def _state(layout: HybridLayout) -> tuple[dict[str, StateTensor], Any]:
    model = laid_out_llama(get_model_config("tiny"), build_mesh(layout, "cpu"), seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return training_state(model, optimizer), model


def _prove(state: dict[str, StateTensor], layout: HybridLayout, rank: int, *, step: int = 4) -> StateProof | str:
    try:
        return prove_state(state, layout, rank=rank, step=step, data_offset=32, generation=1,
                           device=torch.device("cpu"), when="in the test")
    except InconsistentStateError as error:
        return f"refused: {error}"


def _every_case(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for degrees in LAYOUTS:
        layout = HybridLayout(**degrees).resolve(world)
        state, _ = _state(layout)
        results[layout.describe()] = _prove(state, layout, rank)
    layout = HybridLayout(dp_shard=2).resolve(world)
    state, model = _state(layout)
    at_once = _prove(state, layout, rank)
    in_flight = begin_proof(state, layout, rank=rank, step=4, data_offset=32, generation=1,
                            device=torch.device("cpu"), when="in the test",
                            read_only=lambda key: not key.startswith("optim/"))
    results["begun_then_completed"] = (in_flight.sums_later is not None, in_flight.result() == at_once)
    results["held_back"] = _proof_with_its_thread_held_back(state, layout, rank, at_once)
    results["step_differs"] = _prove(state, layout, rank, step=4 + rank)
    with torch.no_grad():  # one element of one shard (rank 1's): another state, still consistent
        if rank == 1:
            state["param/output.weight"].local.view(-1)[0] += 1.0
    results["one_element_changed"] = _prove(state, layout, rank)
    # a plain buffer that differs between ranks by design (BatchNorm's running statistics without SyncBatchNorm)
    per_rank = _scalar_state([float(rank), 1.0])["param/w"]
    state["buffer/bn.running_mean"] = StateTensor("buffer/bn.running_mean", per_rank.spec, per_rank.local)
    results["per_rank_buffer"] = _prove(state, layout, rank)
    layout = HybridLayout(dp_replicate=2).resolve(world)
    state, model = _state(layout)
    with torch.no_grad():  # one replica's copy of one element
        if rank == 1:
            state["param/norm.weight"].local.view(-1)[0] += 1.0
    results["replica_differs"] = _prove(state, layout, rank)
    return results


def _proof_with_its_thread_held_back(state: dict[str, StateTensor], layout: HybridLayout, rank: int,
                                     at_once: StateProof | str) -> dict[str, Any]:
    """The digest thread stopped before its first tensor until 0.3 s after the proof is awaited: the waiting thread
    sums every tensor itself, and the proof is the one taken at once."""
    released = threading.Event()

    def read_only(key: str) -> bool:
        if threading.current_thread().name.startswith("lightning-emig-proof") and not released.is_set():
            released.wait(timeout=30)
        return True

    in_flight = begin_proof(state, layout, rank=rank, step=4, data_offset=32, generation=1,
                            device=torch.device("cpu"), when="in the test", read_only=read_only)
    threading.Timer(0.3, released.set).start()
    proof = in_flight.result()
    assert in_flight.sums_later is not None
    thread_slots, thread_per_tensor = in_flight.sums_later.result()
    return {"same": proof == at_once, "thread_summed": int(thread_slots.abs().sum() + thread_per_tensor.abs().sum())}


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    return run_distributed(_every_case, 2, timeout_s=180)


def test_the_digest_of_one_state_is_the_same_under_every_layout(cases: list[dict[str, Any]]) -> None:
    proofs = [rank_result[HybridLayout(**d).resolve(2).describe()] for d in LAYOUTS for rank_result in cases]
    assert all(isinstance(p, StateProof) for p in proofs), proofs
    assert len({p.digest for p in proofs}) == 1, proofs


def test_a_plain_buffer_may_differ_between_ranks(cases: list[dict[str, Any]]) -> None:
    assert all(isinstance(rank_result["per_rank_buffer"], StateProof) for rank_result in cases), cases


def test_a_proof_summed_on_a_thread_is_the_proof_taken_at_once(cases: list[dict[str, Any]]) -> None:
    """Begun now, some tensors summed on a thread, completed later: the same proof."""
    assert [r["begun_then_completed"] for r in cases] == [(True, True), (True, True)]


def test_a_proof_awaited_before_its_thread_got_the_cpu_is_summed_by_the_waiting_thread(
        cases: list[dict[str, Any]]) -> None:
    """The thread that waits for a proof's sums takes the tensors the digest thread has not reached: a digest thread
    that got little CPU holds up the proof by one tensor at most."""
    for rank_result in cases:
        held = rank_result["held_back"]
        assert held["same"] and held["thread_summed"] == 0, held


def test_a_proof_whose_digest_never_finishes_says_what_it_waited_for() -> None:
    from concurrent.futures import Future

    from lightning_emig.consistency import ProofInFlight

    never: Future = Future()  # a thread that never delivers its sums
    empty = torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    in_flight = ProofInFlight(keys=[], same_keys=True, sums_now=empty, sums_later=never, world=1, step=7,
                              data_offset=0, generation=1, layout=HybridLayout().resolve(1),
                              when="when the fit started", timeout_s=0.05)
    with pytest.raises(TimeoutError, match=r"digest taken when the fit started \(step 7\) did not finish within 0s"):
        in_flight.result()
    in_flight.abandon()  # bounded as well: warns and returns


def test_one_element_changes_the_digest(cases: list[dict[str, Any]]) -> None:
    same = cases[0][HybridLayout(dp_shard=2).resolve(2).describe()]
    changed = cases[0]["one_element_changed"]
    assert isinstance(changed, StateProof) and changed.digest != same.digest
    with pytest.raises(InconsistentStateError, match="after a test change: before it step 4"):
        check_same_state(same, changed, what="a test change")


@pytest.mark.parametrize(("case", "message"), [
    ("step_differs", r"the ranks disagree on step 4\.\.5"),
    ("replica_differs", r"replicas of the training state differ \(2 different digests"),
])
def test_ranks_that_do_not_hold_one_state_are_refused_on_every_rank(cases: list[dict[str, Any]], case: str,
                                                                    message: str) -> None:
    for rank_result in cases:
        assert isinstance(rank_result[case], str), rank_result[case]
        assert re.search(message, rank_result[case]), rank_result[case]


def _scalar_state(values: list[float]) -> dict[str, StateTensor]:
    spec = ShardingSpec(global_shape=(len(values),), dtype=torch.float32, mesh_dim_names=(), placements=())
    return {"param/w": StateTensor("param/w", spec, torch.tensor(values))}


def _digest(values: list[float]) -> int:
    return digest.combined(replica_slots(_scalar_state(values), HybridLayout().resolve(1), 0, "cpu"))[0]


def test_the_digest_sees_a_swap_and_the_sign_of_zero() -> None:
    assert _digest([1.0, 2.0, 3.0]) == _digest([1.0, 2.0, 3.0])
    assert _digest([1.0, 2.0, 3.0]) != _digest([2.0, 1.0, 3.0])
    assert _digest([0.0, 1.0]) != _digest([-0.0, 1.0])


def test_a_proof_an_earlier_release_saved_is_checked_on_its_step_only(caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint's proof from before the two-halves digest (no ``digest_version``: 1) holds another number for the
    same state: it is compared on step and data offset, with a warning, never refused for its digest (a refused
    checkpoint is never resumed from again)."""
    saved = StateProof.from_dict({"step": 7, "data_offset": 56, "generation": 2, "layout": "old", "digest": 123})
    now = StateProof(step=7, data_offset=56, generation=3, layout="new", digest=456,
                     digest_version=digest.DIGEST_VERSION)
    assert saved.digest_version == 1 != now.digest_version
    check_same_state(saved, now, what="the checkpoint's restore")
    assert "another release's digest" in caplog.text
    with pytest.raises(InconsistentStateError, match="before it step 7"):
        check_same_state(saved, StateProof(step=8, data_offset=64, generation=3, layout="new", digest=456,
                                           digest_version=digest.DIGEST_VERSION), what="the checkpoint's restore")
    with pytest.raises(InconsistentStateError, match="digest"):
        check_same_state(dataclasses.replace(saved, digest_version=digest.DIGEST_VERSION), now, what="a change")


def _words(region: torch.Tensor) -> list[int]:
    """The region's 32-bit words in row-major order, the last dim's elements each ``size / 4`` words (the
    digest's definition), from the bytes themselves."""
    if region.element_size() < 4:
        as_int = {1: torch.uint8, 2: torch.int16}[region.element_size()]
        return region.contiguous().view(torch.uint8 if region.dtype == torch.bool else as_int).flatten().tolist()
    raw = bytes(region.contiguous().reshape(-1).view(torch.uint8).tolist())
    return [int.from_bytes(raw[i:i + 4], "little", signed=True) for i in range(0, len(raw), 4)]


def _weighted_words(region: torch.Tensor, box_starts: tuple[int, ...], global_shape: tuple[int, ...],
                    key: str) -> tuple[int, int]:
    """The digest's two halves of one piece, word by word (module docstring of ``digest``), modulo 2**32."""
    per_element = max(1, region.element_size() // 4)
    shape = (*region.shape[:-1], region.shape[-1] * per_element)
    starts = (*box_starts[:-1], box_starts[-1] * per_element)
    word_global = (*global_shape[:-1], global_shape[-1] * per_element)
    salt, seed = digest._salts(key)
    low = high = 0
    for word, position in zip(_words(region), itertools.product(*(range(n) for n in shape)), strict=True):
        global_position = [start + p for start, p in zip(starts, position, strict=True)]
        flat = 0
        for p, length in zip(global_position, word_global, strict=True):
            flat = flat * length + p
        low += word * (2 * (flat + salt) + 1)
        high += word * (sum((2 * p + 1) * digest._high_multiplier(seed, dim)
                            for dim, p in enumerate(global_position)) + digest._high_multiplier(seed, -1))
    return low % 2**32, high % 2**32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool,
                                   torch.uint8, torch.complex128])
def test_a_pieces_sum_is_the_digests_definition(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The halves per piece (reduced per dim in 32 bits, in chunks of rows) equal the words times their weights added
    one by one, for pieces at any offset of a local tensor that is not contiguous, across chunk boundaries, with
    values whose sums wrap around 2**32 many times."""
    monkeypatch.setattr(digest, "_CHUNK_ELEMENTS", 7)
    generator = torch.Generator().manual_seed(0)
    for shape in [(5,), (4, 6), (3, 5, 4), (2, 1, 3, 2)]:
        global_shape = tuple(2 * n + 1 for n in shape)
        full = torch.randn(global_shape, generator=generator, dtype=torch.float64) * 1e6
        full = full > 0 if dtype == torch.bool else full.to(dtype)
        local = full.transpose(0, -1).contiguous().transpose(0, -1)  # same values, strides not row-major
        starts = tuple(int(torch.randint(0, n + 2, (), generator=generator)) for n in shape)
        box = ShardBox(tuple((start, start + n) for start, n in zip(starts, shape, strict=True)))
        piece = LocalPiece(box, starts)
        key = f"param/{shape}"
        region = local[tuple(slice(start, start + n) for start, n in zip(starts, shape, strict=True))]
        assert digest._piece_sum(local, piece, global_shape, key) == _weighted_words(region, starts, global_shape, key)


# ------------------------------------------------------------------------------------ through the Trainer
def _corrupting(reconfigure_live: Any) -> Any:
    """``reconfigure_live`` that moves the state, then changes one element of rank 1's shard (a transfer that
    wrote a wrong value)."""

    def corrupted(strategy: Any, trainer: Any, layout: HybridLayout) -> Any:
        event = reconfigure_live(strategy, trainer, layout)
        if trainer.global_rank == 1:
            with torch.no_grad():
                trainer.lightning_module.model.output.weight.to_local().view(-1)[0] += 1.0
        return event

    return corrupted


def _fit_guarded(rank: int, world: int, root: str) -> dict[str, str]:
    import torch.distributed as dist

    from lightning_emig.change import requests
    from lightning_emig.testing.runs import build_run, fit, tiny_config, with_schedule

    outcome: dict[str, str] = {}
    base = Path(root)
    saved = fit(tiny_config(layout={"dp_shard": 2}, max_steps=3, world_size=world), base / "saved")
    checkpoint = base / "step3.ckpt"
    saved.trainer.save_checkpoint(checkpoint)
    resumed = fit(tiny_config(layout={"tp": 2}, max_steps=4, world_size=world), base / "resumed",
                  ckpt_path=str(checkpoint))  # the saved proof checked under another layout
    outcome["resumed_to_step"] = str(resumed.trainer.global_step)
    if rank == 0:  # a checkpoint whose state is not the one its proof names
        meta = torch.load(checkpoint / "meta.pt", weights_only=False)
        meta[PROOF_KEY]["digest"] ^= 1
        tensors = meta[PROOF_KEY]["tensors"]
        tensors[sorted(tensors)[-1]] ^= 1  # and the digest of the tensor it names
        torch.save(meta, checkpoint / "meta.pt")
    dist.barrier()
    tampered = build_run(tiny_config(layout={"tp": 2}, max_steps=4, world_size=world), base / "tampered")
    outcome["tampered"] = _error_of(lambda: tampered.trainer.fit(tampered.module, train_dataloaders=tampered.loader,
                                                                 ckpt_path=str(checkpoint)))
    # Its proof is summed during the first step's forward and backward, and refused before the optimizer step.
    outcome["tampered_step"] = str(tampered.trainer.global_step)
    requests.reconfigure_live = _corrupting(requests.reconfigure_live)
    outcome["corrupted_change"] = _error_of(lambda: fit(with_schedule(
        tiny_config(layout={"dp_shard": 2}, max_steps=4, world_size=world), [(2, {"dp_shard": 1, "tp": 2})]),
        base / "corrupted"))
    return outcome


def _error_of(run: Any) -> str:
    try:
        run()
    except InconsistentStateError as error:
        return str(error)
    return "not refused"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    return run_distributed(_fit_guarded, 2, str(tmp_path_factory.mktemp("guarded")), timeout_s=300)


def test_a_checkpoint_resumed_under_another_layout_proves_the_state_it_saved(guarded: list[dict[str, str]]) -> None:
    assert [r["resumed_to_step"] for r in guarded] == ["4", "4"]


def test_a_state_refused_when_its_fit_started_was_never_stepped_on(guarded: list[dict[str, str]]) -> None:
    assert [r["tampered_step"] for r in guarded] == ["3", "3"]


@pytest.mark.parametrize(("case", "message"), [
    # The tensors named: the one whose saved digest was changed (the last key) / the one the transfer wrote wrong.
    ("tampered", r"after the checkpoint.s restore: before it step 3, data offset -1, digest .*; tensors that differ: "
                 r"[^,]+$"),
    ("corrupted_change", r"after the layout change: before it step 2, data offset 16, digest .*; tensors that differ: "
                         r"\S*output\.weight$"),
])
def test_state_that_differs_from_where_it_came_from_is_never_trained_on(guarded: list[dict[str, str]], case: str,
                                                                         message: str) -> None:
    for rank_result in guarded:
        assert re.search(message, rank_result[case]), rank_result[case]
