"""Abrupt failure: a worker or a whole node dies without notice; the survivors carry on without a restart.

A killed worker with replicas (rebuilt from them, no step lost) and a killed node without replicas (rolled back to
the last checkpoint) are run end to end through a user's own script in ``tests/test_user_script.py``. Here: how
peers' failures are told from bugs, how the survivors agree on who died (heartbeats, dead markers, one decision),
and two runs of ``lightning_emig.train`` under ``lightning-emig-run`` (nodes A on 127.0.0.2, hosting the rendezvous
store, and B on 127.0.0.3):

* a node with no torchrun restart left: its agent exits non-zero without closing the rendezvous, the survivor
  rebuilds from its replica and a new node still joins;
* below the minimum: the survivor waits, with its state, for a joiner.

For both: A's worker keeps its process id, the job finishes, every step's loss equals the uninterrupted
single-process run to a relative 1e-4, the data ledger shows every sample of every step consumed exactly once, and
no process is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_emig.change.events import read_events
from lightning_emig.launcher.generation import (
    GenerationInfo,
    NodeEntry,
    dead_key,
    heartbeat_key,
    worker_env,
)
from lightning_emig.launcher.heartbeat import HeartbeatWatch
from lightning_emig.membership.failure import (
    _decide_survivors,
    is_peer_failure,
    report_key,
)
from lightning_emig.membership.settings import FailureSettings
from lightning_emig.testing.commands import descendants, is_alive, kill_tree
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.nodes import (
    assert_agents_succeed,
    start_node,
    start_reference,
    stop_agents,
    wait_for,
    wait_for_exit,
    worst_loss_gap,
)
from lightning_emig.testing.nodes import log_tail as _log

MAX_STEPS = 200
TRAIN = ["data=synthetic", "model=tiny", f"trainer.max_steps={MAX_STEPS}", "trainer.global_batch_size=8",
         "trainer.micro_batch_size=2", "trainer.progress_bar=false", "trainer.pg_timeout_s=60",
         "trainer.checkpoint_every_n_steps=10", "elastic.heartbeat_interval_s=0.5", "elastic.heartbeat_timeout_s=3"]
REL_TOL = 1e-4


# --- pure ------------------------------------------------------------------------------------------


def test_peer_failures_are_told_from_bugs() -> None:
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:26025: "
                        "Connection reset by peer.")
    assert is_peer_failure(gloo)
    assert is_peer_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert not is_peer_failure(ValueError("bad shape"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


_BUSY_HEARTBEAT_THEN_EXIT = """
import time
from lightning_emig.launcher.heartbeat import start_heartbeat
beat = start_heartbeat(1e-4, 10.0)  # the thread is nearly always inside a store call
time.sleep(0.2)
assert beat.running
"""


def test_a_process_exits_cleanly_while_its_heartbeat_writes() -> None:
    # A daemon thread caught inside a store call at interpreter exit aborts the process (SIGABRT); a preempted worker
    # that had handed its state over then exited as failed (seen once in CI). The heartbeat is joined at exit.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, **worker_env(node_id="n", control_address=f"127.0.0.1:{store.port}", prefix="hb-test",
                                      generation=0, join_live=False), "LOCAL_RANK": "0"}
    # Without the join at exit this aborted every time (the thread is nearly always inside a store call).
    result = subprocess.run([sys.executable, "-c", _BUSY_HEARTBEAT_THEN_EXIT], env=env, timeout=60,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(dist.PrefixStore("hb-test", store).get(heartbeat_key("n", 0))) > 0


def _generation(nodes: dict[str, list[int]]) -> GenerationInfo:
    entries = tuple(NodeEntry(node_id=n, ranks=tuple(r), kept_workers=True) for n, r in nodes.items())
    return GenerationInfo(generation=3, world_size=sum(len(r) for r in nodes.values()), master_addr="127.0.0.1",
                          master_port=1, nodes=entries)


def test_survivors_are_the_nodes_whose_every_worker_reported() -> None:
    store = dist.HashStore()
    info = _generation({"a": [0, 1], "b": [2, 3], "c": [4, 5]})
    for rank in (0, 1, 2, 4, 5):  # rank 3 (node b) never reports
        store.set(report_key("failure/3", rank), "{}")
    store.set(dead_key("b"), "{}")  # b's agent saw its worker die
    decision = _decide_survivors(store, info, FailureSettings(failure_timeout_s=5))
    # Rank 2 reported but its node failed: its agent stops it, so it is no survivor.
    assert decision == {"survivors": [0, 1, 4, 5], "dead_nodes": ["b"], "found_by": {"b": "its agent's mark"}}


def test_a_silent_worker_is_dead_once_its_heartbeat_is_stale() -> None:

    store = dist.HashStore()
    info = _generation({"a": [0], "b": [1], "c": [2]})
    store.set(report_key("failure/3", 0), "{}")
    store.set(report_key("failure/3", 2), "{}")
    started = time.monotonic()
    last_beat = time.time() - 1.0
    store.set(heartbeat_key("b", 0), str(last_beat))  # beat a second ago, then never again
    decision = _decide_survivors(store, info, FailureSettings(heartbeat_timeout_s=2.0, failure_timeout_s=10))
    # When it was last seen alive: the detect phase runs from there (see _detection_phases).
    assert decision == {"survivors": [0, 2], "dead_nodes": ["b"], "last_seen_alive": last_beat,
                        "found_by": {"b": "worker 0's heartbeat stopped"}}
    assert time.monotonic() - started >= 2.0  # it waited until the heartbeat had not changed for the timeout


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_heartbeats_are_judged_on_the_readers_clock_whatever_the_writers_clock_says() -> None:
    store, clock = dist.HashStore(), _Clock()
    watch = HeartbeatWatch(store, timeout_s=10.0, clock=clock)
    hour = 3600.0
    store.set(heartbeat_key("behind", 0), str(time.time() - hour))  # a clock an hour slow, still beating
    store.set(heartbeat_key("ahead", 0), str(time.time() + hour))  # a clock an hour fast, then silent
    silent_for = []
    for tick in range(5):  # what _decide_survivors does: look at every worker not accounted for, every 6 s here
        clock.now = 6.0 * tick
        store.set(heartbeat_key("behind", 0), str(time.time() - hour + clock.now))
        assert not watch.stale("behind", 0), "a live worker with a slow clock was taken for dead"
        silent_for.append((clock.now, watch.stale("ahead", 0), watch.stale("never", 0)))
    # The silent ones (one never beat) are dead once nothing changed for more than 10 s of our clock: not before.
    assert silent_for == [(0.0, False, False), (6.0, False, False), (12.0, True, True), (18.0, True, True),
                          (24.0, True, True)]


def test_the_first_decision_wins() -> None:
    store = dist.HashStore()
    info = _generation({"a": [0], "b": [1]})
    store.set("failure/3/decision", json.dumps({"survivors": [0], "dead_nodes": ["b"]}))
    store.set(report_key("failure/3", 0), "{}")
    store.set(report_key("failure/3", 1), "{}")  # b reported after all: too late, the decision stands
    assert _decide_survivors(store, info, FailureSettings(failure_timeout_s=5))["survivors"] == [0]


# --- end to end ------------------------------------------------------------------------------------


def _check_losses_and_ledger(tmp_path: Path, run_dir: Path, a_workers: list[int]) -> dict:
    from lightning_emig.testing.ledger import check_ledger

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["pid"] in a_workers, "node A's worker was restarted"
    losses = summary["step_losses"]
    assert sorted(int(k) for k in losses) == list(range(MAX_STEPS))
    worst = worst_loss_gap(tmp_path, TRAIN, losses)
    assert worst < REL_TOL, f"loss curve departs from the reference by {worst:.2e} (relative)"
    report = check_ledger(run_dir)
    report.assert_exactly_once()
    return {"summary": summary, "ledger": report, "worst": worst}


@pytest.mark.long  # a node lost whole: test_user_script's killed node
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_node_with_no_restart_left_leaves_the_job_open_for_a_new_node(tmp_path: Path) -> None:
    """B runs with ``--max-restarts=0``; its worker gets SIGKILL. B's agent marks the node dead and exits non-zero
    without closing the rendezvous (torchrun's way out would close it for good); A rebuilds from its replica and
    trains on; node C then joins the ``--nnodes=1:2`` job in B's place, live."""
    from lightning_emig.strategy.step_times import read_step_times
    from lightning_emig.testing.held_train import ENV_HOLD_STEPS_FOR_JOINERS

    start_reference(tmp_path, TRAIN)
    port = free_port()
    run_dir = tmp_path / "run"
    agents: dict[str, subprocess.Popen] = {}

    def node(name: str, addr: str) -> subprocess.Popen:
        # A waits for C's worker once it sees C's generation (A trains alone then): C cannot miss the short run.
        # (The hold is for worlds of one: no generation appears while A and B train, B has no restart to rejoin.)
        return start_node(tmp_path, name, local_addr=addr, port=port, run_dir=run_dir, rdzv_id="no-restart",
                          rdzv_conf=f"is_host={str(name == 'a').lower()}", max_restarts=0,
                          train_args=[*TRAIN, "layout=hsdp", "data.ledger=true"],
                          module="lightning_emig.testing.held_train", env={ENV_HOLD_STEPS_FOR_JOINERS: "1"})

    try:
        agents["a"], agents["b"] = node("a", "127.0.0.2"), node("b", "127.0.0.3")
        wait_for(lambda: sum(r["world"] == 2 for r in read_step_times(run_dir)) >= 10
                 or any(p.poll() is not None for p in agents.values()),
                 120, f"no 10 steps on the world of two:\n{_log(tmp_path, 'a')}\n{_log(tmp_path, 'b')}")
        a_workers = [p for p in descendants(agents["a"].pid) if is_alive(p)]
        for pid in descendants(agents["b"].pid):
            os.kill(pid, signal.SIGKILL)
        assert wait_for_exit(tmp_path, agents, 120, ["b"])["b"] != 0, "B's agent hid its worker's failure"
        assert "no restart left" in _log(tmp_path, "b")
        wait_for(lambda: any(e["kind"] == "failure" for e in read_events(run_dir)) or agents["a"].poll() is not None,
                 120, f"A did not carry on alone:\n{_log(tmp_path, 'a')}")
        agents["c"] = node("c", "127.0.0.4")
        assert_agents_succeed(tmp_path, agents, 200, ["a", "c"])
    finally:
        stop_agents(agents)

    events = read_events(run_dir)
    assert [(e["kind"], e["old_world"], e["new_world"]) for e in events][-2:] == [("failure", 2, 1), ("join", 1, 2)]
    assert events[-2]["steps_rolled_back"] == 0 and events[-1]["step"] < MAX_STEPS, events
    checked = _check_losses_and_ledger(tmp_path, run_dir, a_workers)
    assert set(checked["ledger"].rolled_back_steps) <= {events[-2]["step"]}, checked["ledger"].describe()
    assert checked["summary"]["world_size"] == 2


@pytest.mark.long  # a survivor's held state: test_user_script's killed peers
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_below_the_minimum_the_survivor_waits_with_its_state_for_a_joiner(tmp_path: Path) -> None:
    """``--nnodes=2:3``: node B is killed whole, A alone is below MIN. A keeps its state in memory and trains no step
    until node C (127.0.0.4) joins; then A hands its state to the world A + C and the job finishes there."""
    from lightning_emig.strategy.step_times import read_step_times

    start_reference(tmp_path, TRAIN)
    port = free_port()
    run_dir = tmp_path / "run"
    args = [*TRAIN, "layout=hsdp", "data.ledger=true"]
    agents: dict[str, subprocess.Popen] = {}

    def node(name: str, addr: str, host: bool) -> subprocess.Popen:
        return start_node(tmp_path, name, local_addr=addr, port=port, run_dir=run_dir, rdzv_id="below-min",
                          nnodes="2:3", rdzv_conf=f"is_host={str(host).lower()}", train_args=args)

    try:
        agents["a"] = node("a", "127.0.0.2", True)
        agents["b"] = node("b", "127.0.0.3", False)
        wait_for(lambda: len(read_step_times(run_dir)) >= 20 or any(p.poll() is not None for p in agents.values()),
                 120, f"no 20 steps on the world of two:\n{_log(tmp_path, 'a')}\n{_log(tmp_path, 'b')}")
        a_workers = [p for p in descendants(agents["a"].pid) if is_alive(p)]
        kill_tree(agents["b"].pid)
        wait_for(lambda: "BELOW MIN" in (tmp_path / "a.log").read_text() or agents["a"].poll() is not None,
                 60, f"A did not wait below MIN:\n{_log(tmp_path, 'a')}")
        steps_when_waiting = len(read_step_times(run_dir))
        agents["c"] = node("c", "127.0.0.4", False)
        assert_agents_succeed(tmp_path, agents, 200, ["a", "c"])
    finally:
        stop_agents(agents)

    times = read_step_times(run_dir)
    assert all(t["world"] == 2 for t in times), "a step ran on the world of one, below MIN"
    assert len(times) > steps_when_waiting
    kinds = [(e["kind"], e["old_world"], e["new_world"]) for e in read_events(run_dir)]
    assert kinds[-2:] == [("failure", 2, 1), ("join", 1, 2)], kinds
    checked = _check_losses_and_ledger(tmp_path, run_dir, a_workers)
    assert checked["summary"]["world_size"] == 2


def test_workers_under_torchrun_terminate_on_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's SIGTERM handler runs a collective and ignores the signal; under torchrun the default comes back."""
    from lightning_emig.strategy.hooks import terminate_on_sigterm_under_torchrun

    def ignore(signum: int, frame: object) -> None:  # what Lightning's handler amounts to
        pass

    previous = signal.signal(signal.SIGTERM, ignore)
    try:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        terminate_on_sigterm_under_torchrun()
        assert signal.getsignal(signal.SIGTERM) is ignore  # not launched by torchrun: Lightning's choice stands
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
        terminate_on_sigterm_under_torchrun()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


ADDRESSES_4 = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4", "d": "127.0.0.5"}


class _HeldRun:
    """Up to four nodes with rank 0 held at given steps (``held_train``), for failures at chosen worlds."""

    def __init__(self, tmp_path: Path, args: list[str], hold_at: str, rdzv_id: str, max_restarts: int = 0) -> None:
        self.tmp_path, self.run_dir, self.args, self.rdzv_id = tmp_path, tmp_path / "run", args, rdzv_id
        self.max_restarts = max_restarts
        self.port = free_port()
        self.env = {"LIGHTNING_EMIG_TEST_HOLD_AT_STEPS": hold_at, "LIGHTNING_EMIG_TEST_HOLD_DIR": str(tmp_path),
                    "LIGHTNING_EMIG_TEST_HOLD_STEPS_FOR_JOINERS": "1"}
        self.agents: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> None:
        self.agents[name] = start_node(
            self.tmp_path, name, local_addr=ADDRESSES_4[name], port=self.port, run_dir=self.run_dir, nnodes="2:4",
            rdzv_id=self.rdzv_id, rdzv_conf=f"is_host={str(name == 'a').lower()}", train_args=self.args,
            module="lightning_emig.testing.held_train", env=self.env, max_restarts=self.max_restarts)

    def logs(self, chars: int = 6000) -> str:
        """The last ``chars`` of every node's log."""
        return "".join(_log(self.tmp_path, n, chars) for n in self.agents)

    def held_at(self, step: int) -> None:
        """Rank 0, whichever node it is on, holds at ``step`` (until :meth:`release`)."""
        wait_for(lambda: any(f"test hold: step {step} waits" in _log(self.tmp_path, n, 10**6) for n in self.agents)
                 or any(p.poll() not in (None, 0) for n, p in self.agents.items() if n in "ab"), 180,
                 f"rank 0 never held at step {step}:\n{self.logs()}")

    def release(self, step: int | str) -> None:
        (self.tmp_path / f"release-{step}").touch()

    def workers(self, names: str) -> list[int]:
        return [p for n in names for p in descendants(self.agents[n].pid) if is_alive(p)]

    def kill_worker(self, name: str) -> None:
        for pid in descendants(self.agents[name].pid):
            os.kill(pid, signal.SIGKILL)

    def finish(self, killed_worker: str | None, timeout_s: float, killed_whole: str = "") -> None:
        """Every agent exits 0 but the ones killed whole and that of the node whose worker was killed (no restart
        left), which says so."""
        codes = wait_for_exit(self.tmp_path, self.agents, timeout_s)
        spared = {name: code for name, code in codes.items() if name != killed_worker and name not in killed_whole}
        assert all(code == 0 for code in spared.values()), (codes, self.logs())
        if killed_worker is not None:
            assert codes[killed_worker] != 0 and "no restart left" in _log(self.tmp_path, killed_worker, 10**6)

    def check(self, survivors: list[int], steps: int, layout_args: list[str], final_world: int = 2) -> list[dict]:
        """A or B finished as rank 0 of the final world, on the uninterrupted run's loss curve, every sample once
        apart from the steps rolled back; the failure events."""
        from lightning_emig.testing.ledger import check_ledger
        from lightning_emig.testing.nodes import reference_losses

        summary = json.loads((self.run_dir / "summary.json").read_text())
        assert summary["pid"] in survivors and summary["world_size"] == final_world
        reference = reference_losses(self.tmp_path, [a for a in self.args if a not in layout_args])  # one process
        losses = summary["step_losses"]
        assert sorted(int(k) for k in losses) == list(range(steps))
        worst = max(abs(losses[k] - reference[k]) / abs(reference[k]) for k in reference)
        assert worst < REL_TOL, f"loss curve departs from the reference by {worst:.2e} (relative)"
        report = check_ledger(self.run_dir)
        report.assert_exactly_once()
        events = read_events(self.run_dir)
        # A rollback to step s redoes s .. s + steps rolled back (and the step a failure interrupted, at most).
        rolled_back = {s for e in events for s in range(e["step"], e["step"] + (e.get("steps_rolled_back") or 0) + 1)}
        assert set(report.rolled_back_steps) <= rolled_back, (report.describe(), events)
        return [e for e in events if e["kind"] == "failure"]


def _args(steps: int, layout: list[str]) -> list[str]:
    """A global batch of 24: 1, 2, 3 and 4 data-parallel ranks share it."""
    return [*[a for a in TRAIN if not a.startswith(("trainer.global_batch_size", "trainer.max_steps"))],
            "trainer.global_batch_size=24", f"trainer.max_steps={steps}", *layout, "data.ledger=true"]


@pytest.mark.long  # rebuild from replicas and rollback: test_user_script's killed peers
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_failures_at_worlds_of_four_and_three_recover_live_or_roll_back(tmp_path: Path) -> None:
    """Four nodes, ``layout=hsdp``, ``--nnodes=2:4``. At step 20, in the world of four (2 replicas x 2 shards), node
    D's worker is killed: a survivor blocked in FSDP's all-reduce on a mesh sub-group must fail at the configured
    timeout, not torch's 30 minutes, and the three survivors rebuild D's shards from the replicas — no step lost —
    into a world of three (FSDP, no replicas). At step 45 node C is killed whole: C's shards have no copy, so A and B
    roll back to the step-40 checkpoint, one the world of three saved after the live change, and finish as two."""
    from lightning_emig.strategy.resume import is_complete

    layout = ["layout=hsdp"]
    start_reference(tmp_path, _args(60, []))  # the run's arguments but the layout: what check() compares with
    run = _HeldRun(tmp_path, _args(60, layout), "20,45", "worlds-4-3")
    try:
        for name in "abcd":
            run.start(name)
        run.held_at(20)
        assert "world 4 on 4 node(s)" in _log(tmp_path, "a", 10**6), "the four nodes never formed one world"
        survivors = run.workers("ab")
        run.kill_worker("d")
        run.release(20)
        run.held_at(45)
        wait_for(lambda: is_complete(run.run_dir / "checkpoints" / "step000040.ckpt"), 60, "no step-40 checkpoint")
        kill_tree(run.agents["c"].pid)
        run.release(45)
        run.finish("d", 240, killed_whole="c")
    finally:
        stop_agents(run.agents)
    events = run.check(survivors, 60, layout)
    assert [(e["old_world"], e["new_world"], e["step"], e["steps_rolled_back"]) for e in events] == [
        (4, 3, 20, 0), (3, 2, 40, 5)], events
    assert [e["old_layout"]["dp_replicate"] for e in events] == [2, 1]
    # Periodic checkpoints keep working on the uneven world the rebuild made (FSDP over three: shards of unequal rows).
    for step in (30, 40):
        assert is_complete(run.run_dir / "checkpoints" / f"step{step:06d}.ckpt"), f"checkpoint of step {step}"
    assert "CHECKPOINT FAILED" not in run.logs(chars=10**8)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.long  # its cases (a rollback where nothing else holds the shards, a rebuild from replicas) run in the
# test above at other worlds, in tests/test_user_script.py and in the chaos run; 80 s of make test
@pytest.mark.timeout(480)
def test_failures_at_a_world_of_four_without_replicas_and_three_with_them(tmp_path: Path) -> None:
    """The other half of the table: three nodes with three replicas (``layout.dp_replicate=3``, which no world of
    four fits: FSDP there). At step 20 node D joins (3 -> 4, no replicas). At step 45 D's worker is killed: nothing
    else holds its shards, so A, B and C roll back to the step-40 checkpoint the world of four saved, into three
    replicas again. At step 70 node C is killed whole: A and B rebuild from the replicas, no step lost."""
    layout = ["layout=hsdp", "layout.dp_replicate=3"]
    run = _HeldRun(tmp_path, _args(90, layout), "20,45,70", "worlds-3-4-3")
    try:
        for name in "abc":
            run.start(name)
        run.held_at(20)
        run.start("d")  # its round is published while rank 0 holds; the held step then waits for D's worker
        wait_for(lambda: "world 4 on 4 node(s)" in _log(tmp_path, "a", 10**6), 60, f"no round with D:\n{run.logs()}")
        run.release(20)
        run.held_at(45)
        joins = [(e["old_world"], e["new_world"]) for e in read_events(run.run_dir) if e["kind"] == "join"]
        assert joins == [(3, 4)], f"D did not join before step 45:\n{run.logs()}"
        survivors = run.workers("ab")
        run.kill_worker("d")
        run.release(45)
        run.held_at(70)
        kill_tree(run.agents["c"].pid)
        run.release(70)
        run.finish("d", 240, killed_whole="c")
    finally:
        stop_agents(run.agents)
    events = run.check(survivors, 90, layout)
    assert [(e["old_world"], e["new_world"], e["step"], e["steps_rolled_back"]) for e in events] == [
        (4, 3, 40, 5), (3, 2, 70, 0)], events
    assert [e["old_layout"]["dp_replicate"] for e in events] == [1, 3]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_when_every_holder_of_the_live_state_is_gone_the_next_generation_resumes_from_the_checkpoint(
        tmp_path: Path) -> None:
    """Issue 34's etcd hang, on c10d: A and B (``layout=hsdp``) hold the state, rank 0 held at step 12; C joins and
    waits for admission; then A's and B's workers are killed. Nobody is left to admit C: A's and B's agents mark
    their workers gone and stop waiting for survivors, C's agent (or its joiner) restarts C's worker, and the three
    nodes form one generation that resumes from the step-10 checkpoint — every rank alike. Node C is then killed
    before that restart's first step: A and B roll back to the checkpoint again and finish on the uninterrupted run's
    loss curve (steps 10 and 11, trained twice, both times). The restart happened all the same: its event (no
    downtime: no step on its world) comes before the failure's, whose old world it left."""
    from lightning_emig.strategy.step_times import read_step_times
    from lightning_emig.testing.nodes import reference_losses

    steps, layout = 30, ["layout=hsdp", "elastic.heartbeat_timeout_s=5", "elastic.heartbeat_interval_s=0.5"]
    start_reference(tmp_path, _args(steps, []))
    run = _HeldRun(tmp_path, [*_args(steps, []), *layout], "12", "no-holder", max_restarts=1)
    run.env["LIGHTNING_EMIG_TEST_HOLD_RESTARTED_FIT"] = "1"
    try:
        run.start("a")
        run.start("b")
        run.held_at(12)
        run.start("c")
        wait_for(lambda: "waits for admission" in _log(tmp_path, "c", 10**6), 120, f"C never waited:\n{run.logs()}")
        for name in "ab":
            run.kill_worker(name)
        run.release(12)
        wait_for(lambda: any("test hold: restarted fit waits" in _log(tmp_path, n, 10**6) for n in "abc"), 180,
                 f"the restarted fit never held:\n{run.logs()}")
        kill_tree(run.agents["c"].pid)
        run.release("restart")
        codes = wait_for_exit(tmp_path, run.agents, 240)
    finally:
        stop_agents(run.agents)
    assert codes["a"] == 0 and codes["b"] == 0, (codes, run.logs())
    for name in "ab":  # their agents marked the workers gone: no heartbeat timeout to wait for
        assert "no worker holds the live state any more" in _log(tmp_path, name, 10**6), run.logs()
    for name in "abc":  # C's waiting joiner too (its agent, or the joiner itself, found nobody to admit it)
        assert re.search(r"generation \d+: world 3 on 3 node\(s\).*workers started\n",
                         _log(tmp_path, name, 10**6)), _log(tmp_path, name)
    events = read_events(run.run_dir)
    assert [(e["kind"], e["step"], e["old_world"], e["new_world"]) for e in events] == [
        ("restart", 10, 2, 3), ("failure", 10, 3, 2)], events
    assert "downtime_seconds" not in events[0] and "first_step" not in events[0]["seconds"], events[0]
    reference = reference_losses(tmp_path, _args(steps, []))
    trained = [(r["step"] - 1, r["loss"]) for r in read_step_times(run.run_dir)]
    assert sorted({s for s, _ in trained}) == list(range(steps))
    assert sorted(s for s, _ in trained if s in (10, 11)) == [10, 10, 11, 11]  # trained before and after the restart
    worst = max(abs(loss - reference[str(s)]) / abs(reference[str(s)]) for s, loss in trained)
    assert worst < REL_TOL, f"loss departs from the reference by {worst:.2e}"
    check_ledger_after_rollback(run.run_dir, events)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_worker_that_dies_while_a_fresh_generation_forms_its_groups_restarts_the_job_without_a_wait(
        tmp_path: Path) -> None:
    """The chaos schedule's hang: A, B and C start the job (``--nnodes=3:4``); C's worker dies right before its
    layout's mesh is built, while A's and B's build theirs, a gloo connection to C that would wait for the group's
    timeout (``trainer.pg_timeout_s=600``: longer than this test may run). Nobody holds live state yet: A's and B's
    death watches end their workers with the no-holders code at once, their agents mark them gone and restart them
    without spending a restart (``--max-restarts=1``, spent by C), C's agent finds nobody holding the state (not
    waiting for workers that look still starting up), and the three nodes train from step 0 to the end on the
    uninterrupted run's loss curve."""
    from lightning_emig.testing.held_train import ENV_DIE_BEFORE_MESH
    from lightning_emig.testing.nodes import reference_losses

    steps = 6
    args = [*_args(steps, []), "trainer.pg_timeout_s=600"]
    start_reference(tmp_path, _args(steps, []))
    port, run_dir, agents = free_port(), tmp_path / "run", {}
    try:
        for name in "abc":
            env = {ENV_DIE_BEFORE_MESH: str(tmp_path / "c-died")} if name == "c" else {}
            agents[name] = start_node(
                tmp_path, name, local_addr=ADDRESSES_4[name], port=port, run_dir=run_dir, nnodes="3:4",
                rdzv_id="dies-before-mesh", rdzv_conf=f"is_host={str(name == 'a').lower()}", train_args=args,
                module="lightning_emig.testing.held_train", env=env, max_restarts=1)
        codes = wait_for_exit(tmp_path, agents, 240)
    finally:
        stop_agents(agents)
    logs = "".join(_log(tmp_path, n, 10**6) for n in "abc")
    assert codes == {"a": 0, "b": 0, "c": 0}, (codes, logs)
    assert "dies before its layout's mesh is built" in _log(tmp_path, "c", 10**6), logs
    # A's and B's workers, which never held anything, are marked gone: C's agent does not wait for them to start up.
    assert "no worker holds the live state any more" in _log(tmp_path, "c", 10**6), logs
    for name in "ab":
        log = _log(tmp_path, name, 10**6)
        assert "lost a member while this process formed its groups" in log, log
        assert "nobody holds the live state any more: restarting this node's workers" in log, log
        assert "WORKER FAILURE" not in log, log  # no restart spent, nothing marked dead
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 3
    reference = reference_losses(tmp_path, _args(steps, []))
    worst = max(abs(loss - reference[k]) / abs(reference[k]) for k, loss in summary["step_losses"].items())
    assert sorted(int(k) for k in summary["step_losses"]) == list(range(steps))
    assert worst < REL_TOL, f"loss departs from the reference by {worst:.2e}"


def check_ledger_after_rollback(run_dir: Path, events: list[dict]) -> None:
    from lightning_emig.testing.ledger import check_ledger

    report = check_ledger(run_dir)
    report.assert_exactly_once()
    rolled_back = {s for e in events for s in range(e["step"], e["step"] + (e.get("steps_rolled_back") or 0) + 1)}
    assert set(report.rolled_back_steps) <= rolled_back, (report.describe(), events)


@pytest.mark.long  # the path it ends on (every node leaves: the state is saved) runs in test_user_script in make test
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_lone_survivor_below_min_that_gets_a_notice_saves_the_state_and_leaves(tmp_path: Path) -> None:
    """etcd-v2, ``--nnodes=2:2``: B's worker is killed at step 12 (no restart left), A is left alone below MIN and
    waits for a joiner with the live state. A then gets a notice: it stops waiting, trains on to the next step
    boundary (13), finds nobody to hand the state to, saves it there and leaves with exit 0 — not when its grace
    period runs out, with the state lost. C and D start later and resume from step 13: no step lost."""
    from lightning_emig.strategy.step_times import read_step_times
    from lightning_emig.testing.etcd import etcd_server, has_etcd
    from lightning_emig.testing.nodes import reference_losses

    if not has_etcd():
        pytest.skip("needs the etcd extra: pip install '.[etcd]'")
    steps, args = 30, _args(30, [])
    start_reference(tmp_path, args)
    env = {"LIGHTNING_EMIG_TEST_HOLD_AT_STEPS": "12", "LIGHTNING_EMIG_TEST_HOLD_DIR": str(tmp_path)}
    agents: dict[str, subprocess.Popen] = {}
    with etcd_server() as endpoint:
        def start(name: str) -> None:
            agents[name] = start_node(
                tmp_path, name, local_addr=ADDRESSES_4[name], port=0, run_dir=tmp_path / "run", nnodes="2:2",
                rdzv_id="lone-survivor", rdzv_backend="etcd-v2", rdzv_endpoint=endpoint, env=env,
                train_args=[*args, "layout=hsdp", "elastic.heartbeat_timeout_s=5"],
                module="lightning_emig.testing.held_train")
        try:
            start("a")
            start("b")
            wait_for(lambda: "test hold: step 12 waits" in _log(tmp_path, "a", 10**6) + _log(tmp_path, "b", 10**6),
                     180, "rank 0 never held at step 12")
            for pid in descendants(agents["b"].pid):
                os.kill(pid, signal.SIGKILL)
            (tmp_path / "release-12").touch()
            wait_for(lambda: "BELOW MIN" in _log(tmp_path, "a", 10**6), 120, "A never waited below MIN")
            os.kill(agents["a"].pid, signal.SIGTERM)
            codes = wait_for_exit(tmp_path, agents, 120)
            assert codes["a"] == 0, _log(tmp_path, "a")
            start("c")
            start("d")
            codes = wait_for_exit(tmp_path, agents, 240, names=["c", "d"])
        finally:
            stop_agents(agents)
    assert codes == {"c": 0, "d": 0}, codes
    log_a = _log(tmp_path, "a", 10**6)
    assert "got a preemption notice: training on to the next step boundary" in log_a
    assert "nobody to hand the live state to; saving it" in log_a and "GRACE PERIOD" not in log_a
    events = read_events(tmp_path / "run")
    assert [(e["kind"], e["step"], e.get("steps_rolled_back")) for e in events][-1] == ("restart", 13, 0), events
    reference = reference_losses(tmp_path, args)
    trained = [(r["step"] - 1, r["loss"]) for r in read_step_times(tmp_path / "run")]
    assert sorted({s for s, _ in trained}) == list(range(steps))
    worst = max(abs(loss - reference[str(s)]) / abs(reference[str(s)]) for s, loss in trained)
    assert worst < REL_TOL, f"loss departs from the reference by {worst:.2e}"
