"""The restart path: a node joins a job whose launcher restarts workers (torchrun's behaviour), and it resumes.

``LIGHTNING_EMIG_LIVE_MEMBERSHIP=0`` makes ``lightning-emig-run`` take torchrun's own path on a join: every worker
is stopped and started again in the new rendezvous round. Node A starts alone and checkpoints every 5 steps;
once its step-10 checkpoint exists node B starts. Specification:

* both agents exit 0; A's worker was restarted (the steps before and after the join were written by different
  processes) and the job reaches ``max_steps``;
* ``events.jsonl`` holds exactly one ``restart`` event, world 1 -> 2, from a checkpoint at a multiple of 5, with
  the steps done after that checkpoint (recomputed) reported as ``steps_rolled_back`` and a downtime;
* the log says so: ``RESTART``, the checkpoint and its step, the old and new world;
* the resumed run's losses (from the checkpoint step on) equal the uninterrupted single-process run's to a relative
  1e-4 (same global batch and data order; two FSDP ranks sum gradients in another order).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lightning_emig.change.events import read_events
from lightning_emig.strategy.resume import (
    FoundCheckpoint,
    newest_checkpoint,
    resolve_checkpoint,
    restart_reason,
)
from lightning_emig.testing.commands import (
    descendants,
    is_alive,
)
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.ledger import check_ledger
from lightning_emig.testing.nodes import (
    assert_agents_succeed,
    log_tail,
    start_node,
    start_reference,
    stop_agents,
    wait_for,
    worst_loss_gap,
)

MAX_STEPS = 120
EVERY = 5
TRAIN = ["data=synthetic", "model=tiny", f"trainer.max_steps={MAX_STEPS}", "trainer.global_batch_size=8",
         "trainer.micro_batch_size=2", "trainer.progress_bar=false", "trainer.pg_timeout_s=60",
         f"trainer.checkpoint_every_n_steps={EVERY}"]
REL_TOL = 1e-4
RESTART_PATH = {"LIGHTNING_EMIG_LIVE_MEMBERSHIP": "0"}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_join_under_torchrun_restarts_workers_and_resumes_from_the_newest_checkpoint(tmp_path: Path) -> None:
    start_reference(tmp_path, TRAIN)
    port = free_port()
    run_dir = tmp_path / "run"
    agents: dict[str, subprocess.Popen] = {}
    node = {"port": port, "run_dir": run_dir, "train_args": [*TRAIN, "data.ledger=true"], "rdzv_id": "restart-train",
            "env": RESTART_PATH}
    try:
        agents["a"] = start_node(tmp_path, "a", local_addr="127.0.0.2", **node)
        wait_for(lambda: (run_dir / "checkpoints" / "step000010.ckpt").exists() or agents["a"].poll() is not None,
                 90, f"node A did not reach step 10:\n{log_tail(tmp_path, 'a')}")
        assert agents["a"].poll() is None, log_tail(tmp_path, "a")
        a_workers = [p for p in descendants(agents["a"].pid) if is_alive(p)]
        agents["b"] = start_node(tmp_path, "b", local_addr="127.0.0.3", **node)
        assert_agents_succeed(tmp_path, agents, 150)
    finally:
        stop_agents(agents)

    events = read_events(run_dir)
    assert [(e["kind"], e["old_world"], e["new_world"]) for e in events] == [("restart", 1, 2)], events
    (restart,) = events
    resumed = restart["step"]
    assert resumed >= 10 and resumed % EVERY == 0 and resumed < MAX_STEPS
    # A save may be cut short by the stop, and the next save first waits for the previous one: two intervals.
    assert 0 <= restart["steps_rolled_back"] <= 2 * EVERY, restart
    assert restart["downtime_seconds"] > 0

    times = [json.loads(line) for line in (run_dir / "step_times.jsonl").read_text().splitlines() if line]
    old = [t for t in times if t["world"] == 1]
    new = [t for t in times if t["world"] == 2]
    assert {t["pid"] for t in old} <= set(a_workers), "the steps before the join were not A's first worker's"
    assert not {t["pid"] for t in new} & {t["pid"] for t in old}, "A's worker was not restarted"
    assert old[-1]["step"] - resumed == restart["steps_rolled_back"]
    assert [t["step"] for t in new] == list(range(resumed + 1, MAX_STEPS + 1))
    # The ledger holds both attempts of the recomputed steps (and of a step the stop cut short); the last counts.
    ledger = check_ledger(run_dir)
    ledger.assert_exactly_once()
    recomputed = set(range(resumed, old[-1]["step"]))
    assert recomputed <= set(ledger.rolled_back_steps) <= recomputed | {old[-1]["step"]}, ledger.describe()

    logs = log_tail(tmp_path, "a", 10**7) + log_tail(tmp_path, "b", 10**7)
    assert "RESTART" in logs and f"step{resumed:06d}.ckpt at step {resumed}: saved on 1 process(es)" in logs, logs[-4000:]
    assert "now 2 process(es)" in logs

    summary = json.loads((run_dir / "summary.json").read_text())
    losses = summary["step_losses"]
    assert sorted(int(k) for k in losses) == list(range(resumed, MAX_STEPS))
    worst = worst_loss_gap(tmp_path, TRAIN, losses, steps=losses)
    assert worst < REL_TOL, f"resumed loss curve departs from the reference by {worst:.2e} (relative)"
    print(
        f"\nrestart-path join: resumed at step {resumed}, {restart['steps_rolled_back']} step(s) recomputed, "
        f"downtime {restart['downtime_seconds']:.2f}s; phases "
        + ", ".join(f"{k} {v:.2f}s" for k, v in restart["seconds"].items())
        + f"; worst relative loss gap {worst:.1e}"
    )


# --- pure ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "is_restart"),
    [
        ({}, False),
        ({"TORCHELASTIC_RESTART_COUNT": "0"}, False),
        ({"TORCHELASTIC_RESTART_COUNT": "2"}, True),
        ({"LIGHTNING_EMIG_GENERATION": "1"}, True),  # lightning-emig-run, torchrun's restart path
        ({"LIGHTNING_EMIG_GENERATION": "1", "LIGHTNING_EMIG_JOIN_LIVE": "1"}, False),  # a live join
        ({"LIGHTNING_EMIG_GENERATION": "0"}, False),
        # restarted by its agent after a crash, into a generation whose holders kept running: a live join
        ({"TORCHELASTIC_RESTART_COUNT": "1", "LIGHTNING_EMIG_GENERATION": "3", "LIGHTNING_EMIG_JOIN_LIVE": "1"}, False),
    ],
)
def test_a_restart_is_told_from_the_environment(env: dict[str, str], is_restart: bool) -> None:
    assert (restart_reason(env) is not None) == is_restart


def _sharded(path: Path, *, complete: bool) -> None:
    path.mkdir(parents=True)
    (path / "meta.pt").write_bytes(b"")
    if complete:
        (path / ".metadata").write_bytes(b"")


def test_the_newest_complete_checkpoint_is_resumed_and_an_interrupted_save_is_skipped(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    _sharded(ckpts / "step000005.ckpt", complete=True)
    _sharded(ckpts / "step000010.ckpt", complete=True)
    _sharded(ckpts / "step000015.ckpt", complete=False)  # the worker was stopped while saving
    assert newest_checkpoint(ckpts) == FoundCheckpoint(ckpts / "step000010.ckpt", 10)
    # one whose state failed its proof (InconsistentStateError at its restore) is never resumed from again
    refused = frozenset({(ckpts / "step000010.ckpt").resolve()})
    assert newest_checkpoint(ckpts, refused) == FoundCheckpoint(ckpts / "step000005.ckpt", 5)
    restarted = {"LIGHTNING_EMIG_GENERATION": "1", "RANK": "1"}
    assert resolve_checkpoint(None, tmp_path, restarted) == str(ckpts / "step000010.ckpt")
    assert resolve_checkpoint(None, tmp_path, {}) is None  # a first start ignores old checkpoints
    assert resolve_checkpoint(None, tmp_path / "empty", restarted) is None


def test_a_failure_before_a_restarts_fit_began_its_event_begins_it_from_the_run_directory(tmp_path: Path) -> None:
    """A peer dies while a restart's fit sets up or restores its checkpoint, before the fit began its ``restart``
    change: the restart happened all the same (its world formed), so the step-times callback begins it from the run
    directory (the last event's world, the last step's line, the checkpoint being restored: the newest complete one)
    for the survivors to record before the failure; once, and never after the fit began it itself."""
    from types import SimpleNamespace

    from lightning_emig.layout import HybridLayout
    from lightning_emig.strategy.step_times import StepTimeRecorder

    run_dir = tmp_path / "run"
    _sharded(run_dir / "checkpoints" / "step000025.ckpt", complete=True)
    one = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1}
    (run_dir / "events.jsonl").write_text(json.dumps({"kind": "failure", "step": 25, "old_world": 2, "new_world": 1,
                                                      "old_layout": one, "new_layout": one}) + "\n")
    (run_dir / "step_times.jsonl").write_text(json.dumps({"step": 27, "time": 100.0, "world": 1}) + "\n")
    begun: list[tuple] = []
    strategy = SimpleNamespace(
        start_reason="torchrun restart #1", resumed_from=None, world_size=3, has_layout=True,
        layout=HybridLayout(dp_replicate=1, dp_shard=3, tp=1, pp=1),
        checkpoint_dir=lambda _trainer: run_dir / "checkpoints",
        begin_restart_event=lambda record, **walls: begun.append((record, walls)))
    trainer = SimpleNamespace(strategy=strategy, global_rank=0)
    strategy.lightning_module = SimpleNamespace(trainer=trainer)
    recorder = StepTimeRecorder(run_dir)
    recorder.on_exception(trainer, strategy.lightning_module, RuntimeError("Connection closed by peer"))
    assert len(begun) == 1, begun
    record, walls = begun[0]
    assert (record.kind, record.step, record.old_world, record.new_world) == ("restart", 25, 1, 3)
    assert record.steps_rolled_back == 2 and walls["last_step_wall"] == 100.0
    assert record.old_layout.as_dict() == one and record.new_layout == strategy.layout
    recorder.on_exception(trainer, strategy.lightning_module, RuntimeError("again"))
    assert len(begun) == 1, "begun twice"

    def peer_gone(_value: object) -> None:
        raise RuntimeError("Connection closed by peer")

    cut_in_broadcast = StepTimeRecorder(run_dir)  # the fit's own begin fails in its broadcast: begun on the exception
    strategy.broadcast = peer_gone
    with pytest.raises(RuntimeError):
        cut_in_broadcast.on_train_start(trainer, strategy.lightning_module)
    cut_in_broadcast.on_exception(trainer, strategy.lightning_module, RuntimeError("Connection closed by peer"))
    assert len(begun) == 2, begun

    began_itself = StepTimeRecorder(run_dir)  # the fit began it at its start (nothing resumed here: no event)
    strategy.broadcast = lambda value: value
    began_itself.on_train_start(trainer, strategy.lightning_module)
    began_itself.on_exception(trainer, strategy.lightning_module, RuntimeError("Connection closed by peer"))
    assert len(begun) == 2, "begun after the fit settled it"
