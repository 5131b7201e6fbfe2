"""Two membership events close together, end to end: three ``lightning-emig-run`` agents on one host as nodes.

Nodes A (127.0.0.2, hosts the rendezvous store: ``is_host=true``, it must not be the one preempted), B (127.0.0.3)
and C (127.0.0.4) run one worker each, ``--nnodes=1:3``, the tiny model, a global batch of 12 (a whole number of
micro-batches of 2 on 1, 2 or 3 data-parallel ranks) and ``data.ledger=true``.

1. *Quick succession*: A and B train as a world of two; then C starts and B gets SIGTERM (an announced
   preemption) either half a second later (B's worker, once it has handed its state over, is slow to exit: it
   exits when C's generation is published), or the moment B's agent has seen C waiting and runs C's rendezvous
   round (the notice lands while the agents form the generation that still counts B).
2. *A join while a migration is running*: A trains alone, B joins; C starts when A hands its live state over to
   the generation with B, and that migration (on A and on B) is held until C's generation is published
   (:mod:`lightning_emig.testing.held_train`), so C's join lands during it on any machine.

Specification, for both:

* every agent exits 0, A's worker is never restarted and finishes ``max_steps``; the final world is A+C (1) or
  A+B+C (2);
* ``events.jsonl`` shows the changes: (1) exactly one ``preempt`` and the ``join`` that brought C, (2) the joins
  1 -> 2 -> 3; every event starts from the world the previous one left;
* every step's loss equals the uninterrupted single-process run's to a relative 1e-4 (same global batch and data
  order; data-parallel ranks sum gradients in another order than one process accumulating);
* the data ledger shows every sample of the global batch of every step trained exactly once, nothing rolled back;
* no process is left behind: every process any agent started is gone once the agents have exited.

What these caught (fixed): a preempted node's agent that still took part in the next rendezvous round (its
departed worker was kept in the new generation); a drain that published the survivors' generation past the one
the agents had just published with the joiner; a live join that kept the old world's micro-batch counters (the
first step after a 2 -> 3 join ran on one micro-batch whenever the counter was odd).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from lightning_emig.change.events import read_events
from lightning_emig.strategy.resume import is_complete
from lightning_emig.strategy.step_times import read_step_times
from lightning_emig.testing.commands import descendants, is_alive
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.held_train import (
    ENV_DIE_AFTER_JOIN,
    ENV_DIE_BEFORE_JOIN,
    ENV_HOLD_ADMISSION_UNTIL_GENERATION,
    ENV_HOLD_BEFORE_DONE,
    ENV_HOLD_LEAVING_EXIT,
    ENV_HOLD_STEPS_FOR_JOINERS,
    ENV_HOLD_TRAINING_UNTIL_GENERATION,
    ENV_HOLD_UNTIL_GENERATION,
)
from lightning_emig.testing.ledger import check_ledger
from lightning_emig.testing.nodes import (
    log_tail,
    start_node,
    start_reference,
    stop_agents,
    wait_for,
    worst_loss_gap,
)

TIMED_STEPS = 200
"""A run whose events follow a node's start-up, not a hold: training must outlast it on a slow machine."""
HELD_STEPS = 60
"""A run whose events the holds of :mod:`lightning_emig.testing.held_train` pin to its first steps: what follows
them only has to reach a periodic checkpoint (steps on a world of three cost about 0.27 s on two cores)."""
REJOIN_STEPS = 400
"""A run in which a node's agent starts a fresh worker after its first one died and that worker must still join:
the survivor's steps must outlast the restart (on 2026-12-07's fast host A trained 60 steps in 2.5 s, B's fresh
worker was ready 7.2 s after the death, and A had finished)."""
CHECKPOINT_EVERY = 50


def _train(max_steps: int) -> list[str]:
    return ["data=synthetic", "model=tiny", f"trainer.max_steps={max_steps}", "trainer.global_batch_size=12",
            "trainer.micro_batch_size=2", "trainer.progress_bar=false", "trainer.pg_timeout_s=30", "data.ledger=true",
            f"trainer.checkpoint_every_n_steps={CHECKPOINT_EVERY}"]


REL_TOL = 1e-4
ADDRESSES = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4"}


class Nodes:
    """The simulated nodes of one job, and every process their agents started (watched until they are gone)."""

    def __init__(self, tmp_path: Path, *, rdzv_id: str, max_steps: int, module: str = "lightning_emig.train",
                 env: dict[str, str] | None = None) -> None:
        self.tmp_path, self.run_dir = tmp_path, tmp_path / "run"
        self.max_steps, self.train = max_steps, _train(max_steps)
        start_reference(tmp_path, self.train)  # every test checks the loss curve against it
        self.port, self.rdzv_id, self.module, self.env = free_port(), rdzv_id, module, env or {}
        self.agents: dict[str, subprocess.Popen] = {}
        self.started: dict[str, set[int]] = {}
        """Every descendant each agent ever had (polled), its workers first among them."""
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._poll, daemon=True)
        self._watch.start()

    def start(self, name: str, env: dict[str, str] | None = None, *, max_restarts: int = 0) -> subprocess.Popen:
        self.agents[name] = start_node(
            self.tmp_path, name, local_addr=ADDRESSES[name], port=self.port, run_dir=self.run_dir,
            train_args=self.train, nnodes="1:3", rdzv_id=self.rdzv_id, rdzv_conf=f"is_host={str(name == 'a').lower()}",
            env={"LIGHTNING_EMIG_GRACE_S": "180", **self.env, **(env or {})}, module=self.module,
            max_restarts=max_restarts,
        )
        self.started[name] = set()
        return self.agents[name]

    def started_workers(self, name: str, timeout_s: float = 60) -> list[int]:
        """Node ``name``'s workers once its agent has started one (it logs its generation just before)."""
        wait_for(lambda: self.workers(name) or self.any_exited(), timeout_s, f"{name} started no worker:\n{self.logs()}")
        return self.workers(name)

    def workers(self, name: str) -> list[int]:
        return [p for p in descendants(self.agents[name].pid) if is_alive(p)]

    def log(self, name: str) -> str:
        path = self.tmp_path / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {name}.log\n{log_tail(self.tmp_path, name)}" for name in self.agents)

    def any_exited(self) -> bool:
        return any(p.poll() is not None for p in self.agents.values())

    def wait_all(self, timeout_s: float) -> None:
        """Every agent exits 0 within ``timeout_s``; fails at the first that exits otherwise."""
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.agents.values()):
            failed = [name for name, p in self.agents.items() if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                what = f"agent(s) {failed} failed" if failed else "agents did not finish"
                pytest.fail(f"{what}:\n{self.logs()}")
            time.sleep(0.2)
        for name, proc in self.agents.items():
            assert proc.returncode == 0, f"agent {name} exited {proc.returncode}:\n{self.logs()}"

    def wait_for_log(self, name: str, text: str, timeout_s: float, what: str) -> None:
        """Until ``text`` is in node ``name``'s log; fails with ``what`` and every log if an agent exits first."""
        wait_for(lambda: text in self.log(name) or self.any_exited(), timeout_s, f"{what}:\n{self.logs()}")

    def finish(self, timeout_s: float) -> None:
        """Every agent exits 0, and no process any agent started is left behind."""
        self.wait_all(timeout_s)
        left = self.left_behind()
        assert not left, f"processes left behind: {left}"

    def left_behind(self) -> list[int]:
        """Processes any agent started that are still alive (call after the agents exited)."""
        self._stop.set()
        self._watch.join(timeout=5)
        return sorted(p for pids in self.started.values() for p in pids if is_alive(p))

    def close(self) -> None:
        stop_agents(self.agents)
        self._stop.set()

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            for name, proc in list(self.agents.items()):
                if proc.poll() is None:
                    self.started[name].update(descendants(proc.pid))


def _steps_on_world(run_dir: Path, world: int) -> int:
    return sum(1 for record in read_step_times(run_dir) if record["world"] == world)


def _check_run(nodes: Nodes, a_workers: list[int], *, final_world: int) -> tuple[list[dict], dict]:
    """What both tests require of the finished run (the ledger first: it names a wrong step); returns its events
    and summary."""
    run_dir = nodes.run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["pid"] in a_workers, "node A's worker was restarted (rank 0 of the final world is A's)"
    assert summary["world_size"] == final_world and summary["layout"]["dp_shard"] == final_world
    events = read_events(run_dir)
    for before, after in zip(events, events[1:], strict=False):
        assert after["old_world"] == before["new_world"], f"events do not chain: {events}"
        assert after["step"] >= before["step"], events
    assert events and events[-1]["new_world"] == final_world, events
    assert not [e for e in events if e["kind"] not in ("join", "preempt")], f"a failure or restart: {events}"

    report = check_ledger(run_dir)
    report.assert_exactly_once()
    assert report.rolled_back_steps == [], report.describe()
    degrees = [e["old_layout"]["dp_shard"] for e in events] + [final_world]
    assert set(report.dp_degrees.values()) == set(degrees), (report.describe(), events)

    losses = summary["step_losses"]
    assert sorted(int(k) for k in losses) == list(range(nodes.max_steps))
    worst = worst_loss_gap(nodes.tmp_path, nodes.train, losses)
    assert worst < REL_TOL, f"loss curve departs from the reference by {worst:.2e} (relative)"
    print(f"\n{[(e['kind'], e['old_world'], e['new_world'], e['step']) for e in events]}; worst relative loss gap "
          f"{worst:.1e}; ledger: {report.describe()}")
    return events, summary


# --- 1. a join and a preemption in quick succession --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("notice", ["as_c_starts", pytest.param("during_c_round", marks=pytest.mark.long)])
def test_a_join_and_a_preemption_in_quick_succession(tmp_path: Path, notice: str) -> None:
    started = time.monotonic()
    # as_c_starts: a preempted worker's teardown takes a moment; B's worker exits once C's generation is published.
    # during_c_round: A's poll waits until C's worker is ready, so the round that kept B goes first and B is drained
    # from it. Without the hold the drain could go first; C, left out, then came back with a fresh worker only after
    # A had finished training alone (seen once: final world 1). That path is the left-out test's below.
    hold = {ENV_HOLD_LEAVING_EXIT: "1"} if notice == "as_c_starts" else {ENV_HOLD_STEPS_FOR_JOINERS: "1"}
    nodes = Nodes(tmp_path, rdzv_id="succession", max_steps=TIMED_STEPS, module="lightning_emig.testing.held_train",
                  env=hold)
    try:
        a_workers = _join_and_preempt(nodes, notice)
    finally:
        nodes.close()
    events, _ = _check_run(nodes, a_workers, final_world=2)
    kinds = Counter(e["kind"] for e in events)
    assert kinds["preempt"] == 1 and kinds["join"] >= 1, events
    preempt = next(e for e in events if e["kind"] == "preempt")
    assert preempt["new_world"] == preempt["old_world"] - 1 and preempt["bytes_moved"] > 0
    print(f"quick succession ({notice}): {time.monotonic() - started:.0f}s")


def _join_and_preempt(nodes: Nodes, notice: str) -> list[int]:
    """A and B train as two; C starts and B gets SIGTERM; every agent exits 0. Returns A's worker pids."""
    nodes.start("a")
    nodes.start("b", env={"LOGLEVEL": "INFO"})  # torchrun's agent then logs when it sees a node waiting
    wait_for(lambda: _steps_on_world(nodes.run_dir, 2) >= 5 or nodes.any_exited(),
             120, f"A and B did not train as a world of two:\n{nodes.logs()}")
    assert not nodes.any_exited(), nodes.logs()
    a_workers, b_workers = nodes.workers("a"), nodes.workers("b")
    nodes.start("c")
    if notice == "as_c_starts":
        time.sleep(0.5)
    else:  # B's agent has seen C waiting: the notice lands while it runs the round that still counts B
        # (torchrun counts A's agent too when A entered the round first: "Detected 2 new nodes")
        wait_for(lambda: re.search(r"Detected \d+ new nodes", nodes.log("b")) is not None or nodes.any_exited(), 60,
                 f"B's agent never saw C waiting:\n{nodes.logs()}")
    os.kill(nodes.agents["b"].pid, signal.SIGTERM)
    nodes.finish(180)
    assert not any(is_alive(p) for p in b_workers), "B's worker outlived its agent"
    return a_workers


# --- 2. a join while a migration is running ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_join_while_a_migration_is_running(tmp_path: Path) -> None:
    started = time.monotonic()
    # Every live migration waits until generation 2 (C's) exists: the one into generation 1 (B's) is running then.
    # A short run: A's training waits for B's generation (it would otherwise end before B's worker started).
    nodes = Nodes(tmp_path, rdzv_id="join-in-migration", max_steps=HELD_STEPS,
                  module="lightning_emig.testing.held_train",
                  env={ENV_HOLD_UNTIL_GENERATION: "2", ENV_HOLD_TRAINING_UNTIL_GENERATION: "1"})
    try:
        nodes.start("a")
        nodes.wait_for_log("a", "generation 0: world 1", 60, "A did not start")
        nodes.start("b")  # A's worker starts up meanwhile; it trains alone until B's worker is ready
        nodes.wait_for_log("a", "generation 1 published: handing over live state", 120,
                           "A never handed its state to generation 1")
        a_workers = nodes.workers("a")
        nodes.start("c")
        nodes.finish(180)
    finally:
        nodes.close()

    held = [line for line in nodes.log("a").splitlines() if "test hold: generation 2 published" in line]
    assert held, f"A's migration into generation 1 was not running when generation 2 appeared:\n{nodes.logs()}"
    events, _ = _check_run(nodes, a_workers, final_world=3)
    # Periodic checkpoints keep working on the uneven world the joins made (3 ranks: shards of 86, 86, 84 rows).
    due = range(CHECKPOINT_EVERY * (events[-1]["step"] // CHECKPOINT_EVERY + 1), nodes.max_steps + 1,
                CHECKPOINT_EVERY)
    assert due, "no periodic checkpoint fell after the join into three"
    for step in due:
        assert is_complete(nodes.run_dir / "checkpoints" / f"step{step:06d}.ckpt"), f"checkpoint of step {step}"
    assert not any("CHECKPOINT FAILED" in nodes.log(name) for name in nodes.agents), nodes.logs()
    assert [(e["kind"], e["old_world"], e["new_world"], e["generation"]) for e in events] == [
        ("join", 1, 2, 1), ("join", 2, 3, 2)], events
    assert events[1]["step"] < nodes.max_steps - 1, "C joined too late to train on the world of three"
    print(f"join during a migration: {held[0].split('test hold: ')[-1]}; {time.monotonic() - started:.0f}s")


# --- 3. a round while a worker started by the previous one is still starting -------------------------------------


@pytest.mark.long  # rounds overlapping a join: the migration-running case above; every sequence: the chaos run
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_second_join_while_the_first_joiner_is_still_starting(tmp_path: Path) -> None:
    """A trains alone; B joins (generation 1) and its worker is still starting when C joins (generation 2, which
    lists B's worker as kept). A waits for both and goes from one process to three in one change; B's worker forms
    generation 2, not the generation 1 nobody forms, and is never restarted."""
    nodes = Nodes(tmp_path, rdzv_id="overlapping-joins", max_steps=HELD_STEPS,
                  module="lightning_emig.testing.held_train",
                  env={ENV_HOLD_TRAINING_UNTIL_GENERATION: "2"})
    try:
        nodes.start("a")
        nodes.wait_for_log("a", "generation 0: world 1", 60, "A did not start")
        a_workers = nodes.started_workers("a")
        nodes.start("b", env={ENV_HOLD_ADMISSION_UNTIL_GENERATION: "2"})  # B's start-up outlasts C's round
        nodes.wait_for_log("a", "generation 1: world 2", 60, "B's round was never published")
        nodes.start("c")
        nodes.finish(180)
    finally:
        nodes.close()
    assert "rounds overlapped" in nodes.log("b"), nodes.log("b")
    assert "rejoining" not in nodes.log("b"), "B's worker was restarted"
    events, _ = _check_run(nodes, a_workers, final_world=3)
    assert [(e["kind"], e["old_world"], e["new_world"], e["generation"]) for e in events] == [("join", 1, 3, 2)], events


@pytest.mark.long  # a drain with a join: the quick-succession case above
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_joiner_left_out_by_a_drain_comes_back_through_a_new_round(tmp_path: Path) -> None:
    """A and B train as two; C joins (generation 1) and is still starting when B is preempted: the drain does not wait
    for C (B's grace period runs), A goes on alone in generation 2, and C's worker, left out, exits; its agent brings
    a fresh one in (generation 3) without spending a restart (``--max-restarts=0``)."""
    nodes = Nodes(tmp_path, rdzv_id="left-out", max_steps=TIMED_STEPS,
                  module="lightning_emig.testing.held_train",
                  env={ENV_HOLD_TRAINING_UNTIL_GENERATION: "3"})
    try:
        nodes.start("a")
        nodes.start("b")
        wait_for(lambda: _steps_on_world(nodes.run_dir, 2) >= 5 or nodes.any_exited(),
                 120, f"A and B did not train as a world of two:\n{nodes.logs()}")
        a_workers = nodes.workers("a")
        nodes.start("c", env={ENV_HOLD_ADMISSION_UNTIL_GENERATION: "2"})  # C is starting until the drain is done
        nodes.wait_for_log("a", "generation 1: world 3", 60, "C's round was never published")
        os.kill(nodes.agents["b"].pid, signal.SIGTERM)
        nodes.finish(180)
    finally:
        nodes.close()
    assert "without this worker" in nodes.log("c") and "rejoining with fresh workers" in nodes.log("c"), nodes.log("c")
    events, _ = _check_run(nodes, a_workers, final_world=2)
    assert [(e["kind"], e["old_world"], e["new_world"], e["generation"]) for e in events] == [
        ("preempt", 2, 1, 2), ("join", 1, 2, 3)], events


# --- 5. a joiner that dies after its generation formed, before any state moved -----------------------------------


def _join_with_a_dying_worker(tmp_path: Path, die: str, *, rdzv_id: str) -> tuple[Nodes, list[int]]:
    """A trains alone; B joins with ``die`` set (its first worker dies in its live join; ``--max-restarts=1`` brings
    another). Every agent exits 0, nothing is left behind; the nodes and A's workers."""
    nodes = Nodes(tmp_path, rdzv_id=rdzv_id, max_steps=REJOIN_STEPS,
                  module="lightning_emig.testing.held_train",
                  env={ENV_HOLD_TRAINING_UNTIL_GENERATION: "1", ENV_HOLD_STEPS_FOR_JOINERS: "1"})
    try:
        nodes.start("a")
        nodes.wait_for_log("a", "generation 0: world 1", 60, "A did not start")
        a_workers = nodes.started_workers("a")
        nodes.start("b", env={die: str(tmp_path / "b-died")}, max_restarts=1)
        nodes.finish(240)
    finally:
        nodes.close()
    return nodes, a_workers


@pytest.mark.long  # a joiner's death: test_user_script's killed peers
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_joiner_that_dies_before_the_state_moves_costs_no_rollback(tmp_path: Path) -> None:
    """A trains alone; B joins (generation 1), and B's worker dies once generation 1's group has formed and the fit
    has set up, as its live join begins. A's state has not moved: A goes on alone in a generation of its own at its
    old rank (no event: nothing changed), and the worker B's agent starts again (``--max-restarts=1``) joins in a
    later generation. No step is rolled back."""
    nodes, a_workers = _join_with_a_dying_worker(tmp_path, ENV_DIE_BEFORE_JOIN, rdzv_id="dies-before-join")
    assert "this joiner dies before its live join" in nodes.log("b"), nodes.log("b")
    assert "go on in a generation of their own" in nodes.log("a"), nodes.log("a")
    events, _ = _check_run(nodes, a_workers, final_world=2)
    assert [(e["kind"], e["old_world"], e["new_world"]) for e in events] == [("join", 1, 2)], events
    assert events[0]["generation"] >= 3, events  # B's first generation failed; A's own came after it


@pytest.mark.long  # a failure after a join: test_user_script's killed peers
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_joiner_that_dies_right_after_the_state_moved_is_a_failure_after_a_join(tmp_path: Path) -> None:
    """The same, B's worker dying right after its live join, before the first step on the world of two: the join
    happened and is recorded, then the failure (B's shards had no copy: A rolls back, saying how far), then the join
    of B's restarted worker — one event per change, worlds chaining."""
    nodes, a_workers = _join_with_a_dying_worker(tmp_path, ENV_DIE_AFTER_JOIN, rdzv_id="dies-after-join")
    assert "this joiner dies after its live join" in nodes.log("b"), nodes.log("b")
    events = read_events(nodes.run_dir)
    assert [(e["kind"], e["old_world"], e["new_world"]) for e in events] == [
        ("join", 1, 2), ("failure", 2, 1), ("join", 1, 2)], events
    assert events[0].get("downtime_seconds") is None, events  # no step on the world of two
    summary = json.loads((nodes.run_dir / "summary.json").read_text())
    assert summary["pid"] in a_workers and summary["world_size"] == 2
    report = check_ledger(nodes.run_dir)
    report.assert_exactly_once()
    failure = events[1]
    declared = set(range(failure["step"], failure["step"] + (failure.get("steps_rolled_back") or 0) + 1))
    assert set(report.rolled_back_steps) <= declared, (report.describe(), events)
    worst = worst_loss_gap(nodes.tmp_path, nodes.train, summary["step_losses"])
    assert worst < REL_TOL, f"loss curve departs from the reference by {worst:.2e} (relative)"


# --- 6. a node that joins in the last steps ------------------------------------------------------------------------


@pytest.mark.long  # a late join: the join cases above
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_node_that_joins_as_training_ends_leaves_and_nobody_waits_for_it(tmp_path: Path) -> None:
    """A trains alone to the end; B joins after A's last membership check, before A's worker exits (A announces the
    end only once B's worker runs). B's worker must not wait to be admitted into a job that is over (it once did,
    for the holders' patience, and then failed, while A's agent waited for B's at the exit barrier): it leaves with
    exit 0, both agents exit 0, and the run is A's alone, every sample once."""
    nodes = Nodes(tmp_path, rdzv_id="joins-at-the-end", max_steps=HELD_STEPS,
                  module="lightning_emig.testing.held_train")
    try:
        nodes.start("a", env={ENV_HOLD_BEFORE_DONE: str(tmp_path)})
        nodes.wait_for_log("a", "test hold: training over", 180, "A never finished training")
        a_workers = nodes.workers("a")
        nodes.start("b")
        nodes.wait_for_log("b", "waits for admission", 120, "B's worker never got ready")
        (tmp_path / "release-done").touch()
        nodes.finish(120)
    finally:
        nodes.close()
    assert "finished training before this worker was admitted" in nodes.log("b"), nodes.log("b")
    summary = json.loads((nodes.run_dir / "summary.json").read_text())
    assert summary["pid"] in a_workers and summary["world_size"] == 1
    assert read_events(nodes.run_dir) == [], "B was never part of the training"
    check_ledger(nodes.run_dir).assert_exactly_once()
    worst = worst_loss_gap(nodes.tmp_path, nodes.train, summary["step_losses"])
    assert worst < REL_TOL, f"loss curve departs from the reference by {worst:.2e} (relative)"
