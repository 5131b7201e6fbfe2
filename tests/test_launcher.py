"""``lightning-emig-run``: the publication protocol, the torchrun seam, and a live join of a second node.

The end-to-end test runs two agents on one host as simulated nodes (127.0.0.2 and 127.0.0.3). Node A starts
alone; node B joins; A's worker must keep its process (no restart), learn generation 1 from the control
store, re-form its process group with B's new worker and all-reduce with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.distributed.launcher.api as launcher_api
import torch.distributed.run as torch_run
from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from lightning_emig import run as emig_run
from lightning_emig.launcher.agent import MembershipAgent
from lightning_emig.launcher.control_store import ControlStoreError, find_tcp_store
from lightning_emig.launcher.generation import (
    GenerationError,
    GenerationInfo,
    NodeEntry,
    changes_nothing,
    current_identity_from_env,
    latest_generation,
    parse_host_port,
    publish_generation,
    read_generation,
    wait_for_generation,
    worker_env,
)
from lightning_emig.testing.commands import is_alive
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.nodes import stop_agents

REPO = Path(__file__).resolve().parents[1]


def _two_node_generation(generation: int = 1) -> GenerationInfo:
    return GenerationInfo(
        generation=generation, world_size=4, master_addr="127.0.0.3", master_port=29512,
        nodes=(
            NodeEntry(node_id="127.0.0.3_77", ranks=(0, 1), kept_workers=False),
            NodeEntry(node_id="127.0.0.2_42", ranks=(2, 3), kept_workers=True),
        ),
        rendezvous_seconds=1.5,
    )


# --- publication protocol (pure) -------------------------------------------------------------------


def test_generation_round_trips_through_its_encoding() -> None:
    info = _two_node_generation()
    decoded = GenerationInfo.decode(1, info.encode_world(), [n.encode() for n in info.nodes])
    assert decoded == info
    assert decoded.rank_of("127.0.0.2_42", 1) == 3
    assert decoded.rank_of("127.0.0.3_77", 0) == 0
    assert decoded.live and decoded.store_prefix == "gen1"


def test_generation_without_kept_workers_is_not_live() -> None:
    info = GenerationInfo(
        generation=0, world_size=1, master_addr="a", master_port=1,
        nodes=(NodeEntry(node_id="a_1", ranks=(0,), kept_workers=False),),
    )
    assert not info.live


@pytest.mark.parametrize(
    ("nodes", "world_size", "message"),
    [
        ((("a", (0, 1)), ("b", (1, 2))), 3, "permutation"),
        ((("a", (0,)), ("b", (2,))), 2, "permutation"),
        ((("a", (0,)), ("a", (1,))), 2, "appears twice"),
    ],
)
def test_inconsistent_generations_fail_loudly(nodes, world_size: int, message: str) -> None:
    entries = tuple(NodeEntry(node_id=nid, ranks=ranks, kept_workers=False) for nid, ranks in nodes)
    with pytest.raises(GenerationError, match=message):
        GenerationInfo(generation=1, world_size=world_size, master_addr="h", master_port=1, nodes=entries)


def test_unknown_worker_and_malformed_entries_are_errors() -> None:
    info = _two_node_generation()
    with pytest.raises(GenerationError, match="not part of generation 1"):
        info.rank_of("127.0.0.9_1", 0)
    with pytest.raises(GenerationError, match="node entries"):
        GenerationInfo.decode(1, info.encode_world(), [info.nodes[0].encode()])
    with pytest.raises(GenerationError, match="malformed"):
        GenerationInfo.decode(1, b"{not json", [])
    with pytest.raises(GenerationError, match="format"):
        GenerationInfo.decode(1, json.dumps({"format": 99}).encode(), [])


def _publish(store: dist.Store, info: GenerationInfo) -> int:
    return publish_generation(
        store, nodes=info.nodes, world_size=info.world_size, master_addr=info.master_addr,
        master_port=info.master_port, rendezvous_seconds=info.rendezvous_seconds,
    )


def test_publication_numbers_generations_and_is_read_back_whole() -> None:
    store = dist.PrefixStore("lightning_emig/run/", dist.HashStore())
    first = GenerationInfo(
        generation=0, world_size=2, master_addr="127.0.0.2", master_port=29500,
        nodes=(NodeEntry(node_id="127.0.0.2_42", ranks=(0, 1), kept_workers=False),),
    )
    assert latest_generation(store) == -1
    with pytest.raises(GenerationError, match="not published"):
        read_generation(store, 0)
    with pytest.raises(GenerationError, match="newer than -1"):
        wait_for_generation(store, -1, timeout_s=0.3, poll_s=0.1)
    assert _publish(store, first) == 0
    assert read_generation(store, 0) == first
    assert _publish(store, _two_node_generation(generation=1)) == 1
    assert wait_for_generation(store, 0, timeout_s=1) == 1
    assert read_generation(store, 1) == _two_node_generation(generation=1)
    assert read_generation(store, 0) == first  # a published generation is never rewritten


def test_a_live_round_that_changes_nothing_is_no_new_generation() -> None:
    store = dist.PrefixStore("lightning_emig/run/", dist.HashStore())
    started = NodeEntry(node_id="a_1", ranks=(0,), kept_workers=False)
    kept = NodeEntry(node_id="a_1", ranks=(0,), kept_workers=True)
    one = dict(world_size=1, master_addr="a", master_port=1, rendezvous_seconds=0.0)
    assert publish_generation(store, nodes=[started], **one) == 0
    assert changes_nothing(read_generation(store, 0), [kept])
    assert publish_generation(store, nodes=[kept], **one) == 0  # the joiner missed the round
    assert latest_generation(store) == 0
    assert publish_generation(store, nodes=[started], **one) == 1  # a restart round is always new
    joined = [kept, NodeEntry(node_id="b_2", ranks=(1,), kept_workers=False)]
    assert publish_generation(store, nodes=joined, world_size=2, master_addr="a", master_port=2,
                              rendezvous_seconds=0.0) == 2
    assert not changes_nothing(None, [kept])
    with pytest.raises(GenerationError, match="permutation"):
        publish_generation(store, nodes=[kept], world_size=2, master_addr="a", master_port=3,
                           rendezvous_seconds=0.0)
    assert latest_generation(store) == 2  # nothing written for the bad round


def test_worker_identity_round_trips_through_the_environment() -> None:
    env = worker_env(node_id="127.0.0.2_42", control_address="127.0.0.1:29400", prefix="lightning_emig/r/",
                     generation=3, join_live=True)
    me = current_identity_from_env({**env, "LOCAL_RANK": "1"})
    assert (me.node_id, me.local_rank, me.generation, me.join_live) == ("127.0.0.2_42", 1, 3, True)
    assert (me.control_address, me.control_prefix) == ("127.0.0.1:29400", "lightning_emig/r/")
    with pytest.raises(GenerationError, match="not started by lightning-emig-run"):
        current_identity_from_env({"LOCAL_RANK": "0"})


@pytest.mark.parametrize(("address", "expected"), [("h:1", ("h", 1)), ("[::1]:29400", ("::1", 29400))])
def test_parse_host_port(address: str, expected: tuple[str, int]) -> None:
    from lightning_emig.launcher.control_store import ControlStoreError

    assert parse_host_port(address) == expected
    with pytest.raises(ControlStoreError):
        parse_host_port("no-port")


def test_control_store_is_the_tcp_store_under_the_round_prefixes() -> None:
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    round_store = dist.PrefixStore("torch.rendezvous.r.1", dist.PrefixStore("outer", tcp))
    found = find_tcp_store(round_store)
    assert (found.host, found.port) == ("127.0.0.1", tcp.port)
    with pytest.raises(ControlStoreError, match="TCPStore-backed"):
        find_tcp_store(dist.PrefixStore("x", dist.HashStore()))


# --- the agent's one decision ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "holders_alive", "live", "survivors", "expected"),
    [
        ("HEALTHY", True, True, None, "live"),  # nodes wait, the state is held: carry the workers over
        # ... whoever waits, a node restarting after a failure too: its fresh workers join live (one story per
        # generation; no restart path while a live path exists)
        ("HEALTHY", False, True, None, "restart"),  # nobody holds the state any more: all restart, from a checkpoint
        ("HEALTHY", True, False, None, "restart"),  # LIGHTNING_EMIG_LIVE_MEMBERSHIP=0
        # Our workers failed; the survivors published a generation without us: rejoin as a new node.
        ("FAILED", True, True, ["b_2"], "stop+restart"),
        ("UNHEALTHY", True, True, ["b_2"], "stop+restart"),
        # ... nobody carries on (we were the whole job, no holder is left, or nothing was published): restart.
        ("FAILED", True, True, ["a_1"], "stop+restart+dead"),
        ("FAILED", False, True, ["a_1", "b_2", "c_3"], "stop+restart+dead"),
        ("FAILED", True, True, None, "stop+restart+dead"),
        ("FAILED", True, False, None, "restart"),  # LIGHTNING_EMIG_LIVE_MEMBERSHIP=0
    ],
)
def test_agent_carries_workers_over_whenever_the_state_is_held(
    monkeypatch: pytest.MonkeyPatch, state: str, holders_alive: bool, live: bool, survivors: list[str] | None,
    expected: str,
) -> None:
    from lightning_emig.launcher.generation import NodeEntry, dead_key, publish_generation, ready_key

    calls: list[str] = []
    monkeypatch.setattr(LocalElasticAgent, "_restart_workers", lambda self, wg: calls.append("restart"))
    monkeypatch.setattr(MembershipAgent, "_stop_workers", lambda self, wg, *a, **k: calls.append("stop"))
    monkeypatch.setattr(MembershipAgent, "_continue_workers_in_next_round", lambda self, wg: calls.append("live"))
    monkeypatch.setattr(MembershipAgent, "_live_holders", lambda self, fresh=False: holders_alive)
    agent = MembershipAgent.__new__(MembershipAgent)  # the decision needs no spec, store or workers
    # No holder left: it must not wait for survivors at all (an hour would time the test out).
    wait_s = 5.0 if holders_alive else 3600.0
    agent.live_membership, agent.generation, agent.node_id, agent.failure_wait_s = live, 4, "a_1", wait_s
    agent._notice_at = None
    agent._control = dist.PrefixStore("lightning_emig/r/", dist.HashStore())
    if survivors is not None:
        publish_generation(agent._control, nodes=[NodeEntry(node_id=n, ranks=(i,), kept_workers=True)
                                                  for i, n in enumerate(survivors)],
                           world_size=len(survivors), master_addr="h", master_port=1, rendezvous_seconds=0.0)
    group = SimpleNamespace(state=WorkerState[state], spec=SimpleNamespace(local_world_size=1))
    agent._control.set(ready_key("a_1", 0), "4")  # its worker was ready once
    agent._restart_workers(group)
    dead = agent._control.check([dead_key("a_1")])  # a rejoining node took its marker back: it was decided
    if "stop" in calls:  # its workers failed: none of them is ready to join anything
        assert not agent._control.check([ready_key("a_1", 0)])
    assert "+".join(calls + (["dead"] if dead else [])) == expected


def test_a_node_with_notice_leaves_the_round_instead_of_joining_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch starts a new round only once every participant of the current one left it: a leaving node that simply
    stayed out would block the joiners; one that joined would be counted with a worker that is about to exit."""
    calls: list[str] = []
    monkeypatch.setattr(LocalElasticAgent, "_restart_workers", lambda self, wg: calls.append("restart"))
    monkeypatch.setattr(MembershipAgent, "_continue_workers_in_next_round", lambda self, wg: calls.append("live"))
    monkeypatch.setattr(MembershipAgent, "_exit_rendezvous_round", lambda self: calls.append("left"))
    agent = MembershipAgent.__new__(MembershipAgent)
    agent.live_membership, agent.generation, agent.node_id, agent._notice_at = True, 4, "a_1", 12.0
    agent._control = dist.PrefixStore("lightning_emig/r/", dist.HashStore())
    agent._restart_workers(SimpleNamespace(state=WorkerState.HEALTHY))
    assert calls == ["left"]


# --- the seam into torchrun -----------------------------------------------------------------------


class _Stop(Exception):
    """Raised from the agent's run() so launch_agent stops right after building the agent."""


def test_seam_swaps_the_agent_class_only_inside_the_block() -> None:
    assert launcher_api.LocalElasticAgent is LocalElasticAgent
    with emig_run.install_agent():
        assert launcher_api.LocalElasticAgent is MembershipAgent
    assert launcher_api.LocalElasticAgent is LocalElasticAgent


def test_main_runs_torchruns_own_cli_with_our_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[MembershipAgent] = []

    def stop(self: MembershipAgent, role: str = "default") -> None:
        built.append(self)
        raise _Stop

    monkeypatch.setattr(MembershipAgent, "run", stop)
    for var in ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(_Stop):
        emig_run.main(["--standalone", "--nproc-per-node=3", "--local-addr=127.0.0.1", "-m", "some.module", "x"])
    (agent,) = built
    spec = agent.get_worker_group().spec
    assert (spec.local_world_size, spec.local_addr, spec.args[-2:]) == (3, "127.0.0.1", ("some.module", "x"))
    assert agent.live_membership and agent.node_id == f"127.0.0.1_{os.getpid()}"
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert launcher_api.LocalElasticAgent is LocalElasticAgent
    assert torch_run.get_args_parser().parse_args(["--nnodes=1:2", "x.py"]).nnodes == "1:2"


def _catches_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def test_a_notice_while_the_launcher_starts_ends_it_with_exit_0(tmp_path: Path) -> None:
    """SIGTERM as soon as the launcher handles it, while it still imports torch (a node preempted right after it
    started): exit 0, not death by the signal. Before, nothing handled SIGTERM until the agent ran, a second or two
    in, and the launcher died with -15 (chaos seed 6: a node preempted 0.7 s after it joined)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "lightning_emig.run", "--standalone", "--nproc-per-node=1", "--local-addr=127.0.0.1",
         "-m", "lightning_emig.testing.membership_worker"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _catches_sigterm(process.pid):
            assert process.poll() is None and time.monotonic() < deadline, "the launcher never handled SIGTERM"
            time.sleep(0.002)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert "SIGTERM) while the launcher was starting" in stderr, stderr


# --- two simulated nodes: a live join --------------------------------------------------------------


def _start_agent(tmp_path: Path, name: str, local_addr: str, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "lightning_emig.run", "--nnodes=1:2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=live-join",
        "--rdzv-conf=last_call_timeout=1", f"--local-addr={local_addr}", "--max-restarts=0",
        "--monitor-interval=0.2", "-m", "lightning_emig.testing.membership_worker", "--out", str(tmp_path),
        "--timeout-s=45",
    ]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process below
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def _log(tmp_path: Path, name: str) -> str:
    return (tmp_path / f"{name}.log").read_text()[-4000:]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_joining_node_is_handed_to_the_live_worker_without_restart(tmp_path: Path) -> None:
    port = free_port()
    agents: dict[str, subprocess.Popen] = {}
    workers: set[int] = set()
    try:
        agents["a"] = _start_agent(tmp_path, "a", "127.0.0.2", port)
        _wait_for(lambda: list(tmp_path.glob("127.0.0.2_*.starts")), 60, "node A's worker did not start")
        joined_at = time.monotonic()
        agents["b"] = _start_agent(tmp_path, "b", "127.0.0.3", port)
        for name, proc in agents.items():
            try:
                proc.wait(timeout=max(1.0, 75 - (time.monotonic() - joined_at)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"agent {name} did not finish; its log:\n{_log(tmp_path, name)}")
        elapsed = time.monotonic() - joined_at
        for name, proc in agents.items():
            assert proc.returncode == 0, f"agent {name} failed:\n{_log(tmp_path, name)}"

        (a_starts,) = tmp_path.glob("127.0.0.2_*.starts")
        (b_starts,) = tmp_path.glob("127.0.0.3_*.starts")
        a_pids = [int(p) for p in a_starts.read_text().split()]
        b_pids = [int(p) for p in b_starts.read_text().split()]
        workers.update(a_pids + b_pids)
        a = json.loads(a_starts.with_suffix(".json").read_text())
        b = json.loads(b_starts.with_suffix(".json").read_text())
    finally:
        stop_agents(agents)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    assert len(a_pids) == 1 and a["pid"] == a_pids[0], "node A's worker was restarted"
    assert len(b_pids) == 1 and b["pid"] == b_pids[0]
    assert (a["start_generation"], a["join_live"], b["start_generation"], b["join_live"]) == (0, False, 1, True)
    assert a["generation"] == b["generation"] == 1
    assert a["world_size"] == b["world_size"] == 2
    assert {a["rank"], b["rank"]} == {0, 1}
    assert a["all_reduce"] == b["all_reduce"] == 3.0
    assert not [pid for pid in workers if is_alive(pid)], "a worker outlived its agent"

    changed = re.search(r"live membership change: generation 0 -> 1 .* ([\d.]+)s", _log(tmp_path, "a"))
    assert changed, _log(tmp_path, "a")
    print(
        f"\nlive join: agent A re-rendezvous {float(changed.group(1)):.2f}s (rank-0 agent round to publication "
        f"{a['rendezvous_seconds']:.2f}s); A's worker switched groups {a['switch_seconds']:.2f}s after seeing "
        f"generation 1; B start to both agents done {elapsed:.1f}s"
    )


def test_latest_generation_only_grows_whoever_publishes_last() -> None:
    from lightning_emig.launcher.generation import _raise_latest, latest_generation

    store = dist.PrefixStore("lightning_emig/r/", dist.HashStore())
    for published, expected in ((0, 0), (3, 3), (2, 3), (4, 4)):  # a slower publisher of 2 must not undo 3
        _raise_latest(store, published)
        assert latest_generation(store) == expected


def test_an_agent_knows_whether_it_hosts_the_rendezvous_store_and_warns_when_that_node_gets_a_notice(caplog) -> None:
    """With c10d one agent hosts the job's store; a notice to that node is the one departure the job cannot survive,
    and the agent says so (the others say nothing)."""
    import logging
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_emig.launcher.store_host import hosts_port, warn_if_hosting
    from lightning_emig.testing.distributed import free_port

    hosted = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    elsewhere = free_port()
    assert hosts_port(hosted.port) is True
    assert hosts_port(elsewhere) is False
    with caplog.at_level(logging.ERROR, logger="lightning_emig.launcher.store_host"):
        warn_if_hosting(f"127.0.0.1:{elsewhere}", "n")
        assert not caplog.records
        warn_if_hosting(f"127.0.0.1:{hosted.port}", "n")
    assert "THIS NODE HOSTS THE RENDEZVOUS STORE" in caplog.text


def test_a_round_without_an_alive_holder_of_the_live_state_is_refused() -> None:
    """The generation the holders committed to has nodes a, b, c, d. A round of a and new node n misses b (alive: its
    heartbeat moves), c (marked dead) and d (leaving): only b makes the round one to refuse. A round with b is fine,
    and so is any round before a commitment (the first one)."""
    import threading

    from lightning_emig.launcher.generation import (
        ACTIVE_GENERATION_KEY,
        dead_key,
        heartbeat_key,
        leaving_key,
    )
    from lightning_emig.launcher.rounds import holders_missing

    store = dist.HashStore()
    round_nodes = [NodeEntry(node_id="a", ranks=(0,), kept_workers=True),
                   NodeEntry(node_id="n", ranks=(1,), kept_workers=False)]
    assert holders_missing(store, round_nodes, window_s=0.5) == []  # nothing committed yet
    holders = [NodeEntry(node_id=n, ranks=(r,), kept_workers=False) for r, n in enumerate("abcd")]
    publish_generation(store, nodes=holders, world_size=4, master_addr="h", master_port=1, rendezvous_seconds=0.0)
    store.set(ACTIVE_GENERATION_KEY, "0")
    store.set(dead_key("c"), "{}")
    store.set(leaving_key("d"), "{}")
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            store.set(heartbeat_key("b", 0), str(time.time()))

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        assert holders_missing(store, round_nodes, window_s=2.0) == ["b"]
        with_b = [*round_nodes, NodeEntry(node_id="b", ranks=(2,), kept_workers=True)]
        assert holders_missing(store, with_b, window_s=2.0) == []
    finally:
        stop.set()
        beating.join()
    assert holders_missing(store, round_nodes, window_s=1.0) == []  # b's heartbeat stopped: b is dead


def test_a_preempted_node_whose_grace_period_runs_out_leaves_with_exit_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its workers did not hand off in time (they were recovering from a peer's failure, say): the agent stops them,
    marks the node dead for the survivors and leaves the job as a preempted node does (``_LeaveJob``: exit 0), not by
    torchrun's SIGTERM path (exit 1)."""
    from lightning_emig.launcher.agent import _LeaveJob
    from lightning_emig.launcher.generation import dead_key, leaving_key

    calls: list[str] = []
    monkeypatch.setattr(MembershipAgent, "_stop_workers", lambda self, wg, *a, **k: calls.append("stop"))
    agent = MembershipAgent.__new__(MembershipAgent)
    agent.node_id, agent.grace_s, agent.generation = "a_1", 5.0, 3
    agent._control = dist.PrefixStore("lightning_emig/r/", dist.HashStore())
    agent._control_address = "etcd://127.0.0.1:2379"  # no node hosts the store: no warning to give
    agent._notice_at, agent._leaving_deadline = time.monotonic() - 10.0, None
    group = SimpleNamespace(spec=SimpleNamespace(local_world_size=1))
    agent._announce_leaving(group)  # the notice is published first, with its deadline
    assert agent._control.check([leaving_key("a_1")]) and calls == []
    with pytest.raises(_LeaveJob, match="grace period ran out"):
        agent._announce_leaving(group)  # the next monitor tick: the deadline passed
    assert calls == ["stop"] and agent._control.check([dead_key("a_1")])
