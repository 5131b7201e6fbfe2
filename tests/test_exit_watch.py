"""A peer's process that exits is taken for dead at once, not at the heartbeat timeout
(:mod:`lightning_emig.membership.exit_watch`).

Real processes and real sockets here: the watched peers are child processes listening as a worker does, killed with
SIGKILL (nothing of theirs runs: the kernel closes their sockets), frozen with SIGSTOP (alive: no mark), or holding
a forked child as a ``DataLoader`` worker would (it must not keep the dead parent's connections open). Then what
reads the marks: the death watch (a training process stops computing) and the survivors' decision (no wait for a
heartbeat). End to end through a user's script: ``tests/test_user_script.py::test_the_script_survives_a_killed_peer``
(``node_without_replicas``: node B killed whole is found dead by its process's exit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from lightning_emig.launcher.generation import (
    LAST_DEATH_KEY,
    GenerationInfo,
    NodeEntry,
    heartbeat_key,
    publish_generation,
)
from lightning_emig.membership.death_watch import DeathWatch, PeerDeathNoticed
from lightning_emig.membership.exit_watch import (
    ExitWatch,
    endpoint_key,
    entered_key,
    exited_key,
    member_exited,
)
from lightning_emig.membership.failure import _decide_survivors, report_key
from lightning_emig.membership.settings import FailureSettings
from lightning_emig.testing.netns import can_make_network_namespaces, host_behind_a_link

HOST = "127.0.0.1"

_PEER = """
import datetime, os, sys, time
import torch.distributed as dist
from lightning_emig.membership.exit_watch import ExitListener
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=datetime.timedelta(seconds=30))
listener = ExitListener(store, sys.argv[3], 0, sys.argv[6])  # the address published for peers
if sys.argv[5] != "-":
    listener.entered(int(sys.argv[5]))  # as the death watch's thread does once the process is in a generation
loader = os.fork() if sys.argv[4] == "fork" else 0  # a DataLoader worker's way: every descriptor inherited
if loader == 0 and sys.argv[4] == "fork":
    time.sleep(600)
    os._exit(0)
print(listener.endpoint, loader, flush=True)
time.sleep(600)
"""


class _Peer:
    """A child process listening as a worker does (optionally with a forked child of its own)."""

    def __init__(self, store: dist.TCPStore, node_id: str, *, fork: bool = False, entered: int | None = 0,
                 address: str = HOST, prefix: tuple[str, ...] | list[str] = (), store_host: str = HOST) -> None:
        """``prefix``: a command the process runs under (another network namespace, reaching the store at
        ``store_host``)."""
        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", _PEER, store_host, str(store.port), node_id,
                                      "fork" if fork else "-", "-" if entered is None else str(entered), address],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        host, port, pid, loader = self.proc.stdout.readline().split()
        self.endpoint, self.loader = f"{host} {port} {pid}", int(loader)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop_all(self) -> None:
        if self.loader:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.loader, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
        self.kill()


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    yield server


def _members(*node_ids: str) -> GenerationInfo:
    nodes = tuple(NodeEntry(node_id=n, ranks=(rank,), kept_workers=True) for rank, n in enumerate(node_ids))
    return GenerationInfo(generation=0, world_size=len(nodes), master_addr=HOST, master_port=1, nodes=nodes)


def _polls(watch: ExitWatch, members: GenerationInfo, seconds: float) -> list[str]:
    """Poll as the death watch's thread does (every 0.05 s here) for ``seconds``; what was noticed exiting."""
    noticed, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        exited = watch.poll(members.generation, lambda: members)
        if exited is not None:
            noticed.append(exited)
        time.sleep(0.05)
    return noticed


def _poll_until_noticed(watch: ExitWatch, members: GenerationInfo, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        exited = watch.poll(members.generation, lambda: members)
        if exited is not None:
            return exited
        time.sleep(0.05)
    raise AssertionError(f"no exit noticed within {timeout_s}s")


def test_a_killed_peer_is_marked_a_frozen_one_is_not_and_the_ring_moves_on(store: dist.TCPStore) -> None:
    members = _members("a", "b", "c")  # this test is a; a watches b, and c once b is gone
    b, c = _Peer(store, "b", fork=True), _Peer(store, "c")
    try:
        watch = ExitWatch(store, "a", 0)
        assert _polls(watch, members, 0.5) == []  # connected, both alive
        os.kill(b.proc.pid, signal.SIGSTOP)  # frozen: the kernel keeps its sockets; the heartbeat's case
        assert _polls(watch, members, 0.5) == []
        assert member_exited(store, "b", 0, 0) is None
        os.kill(b.proc.pid, signal.SIGCONT)
        b.kill()  # its forked child lives on, as a DataLoader worker would for a while
        noticed = _poll_until_noticed(watch, members)
        assert "node b's worker 0 exited (its connection closed, seen from node a)" in noticed, noticed
        mark = member_exited(store, "b", 0, 0)
        assert mark is not None and mark["endpoint"] == b.endpoint and mark["by"] == "a"
        assert json.loads(store.get(LAST_DEATH_KEY))["node_id"] == "b"  # every death watch looks
        assert member_exited(store, "c", 0, 0) is None
        c.kill()  # the watch moved on to c
        assert "node c's worker 0 exited" in _poll_until_noticed(watch, members)
        fresh = _Peer(store, "b")  # a fresh worker at b's node and local rank: the old mark is not about it
        try:
            assert store.get(endpoint_key("b", 0)).decode() == fresh.endpoint
            assert member_exited(store, "b", 0, 0) is None
        finally:
            fresh.kill()
        watch.close()
    finally:
        b.stop_all()
        c.stop_all()


def test_an_endpoint_that_refuses_is_marked_once_its_process_entered_the_generation(store: dist.TCPStore) -> None:
    members = _members("a", "d")
    earlier = _Peer(store, "d", entered=None)  # an earlier process at d's place, dead before it entered generation 0
    earlier.kill()
    watch = ExitWatch(store, "a", 0)
    # Its endpoint refuses, but the member of generation 0 may be a fresh process that has not published its own yet.
    assert _polls(watch, members, 0.5) == []
    assert member_exited(store, "d", 0, 0) is None
    d = _Peer(store, "d")  # the member, in generation 0; gone before anyone connected: the host refuses
    d.kill()
    assert "node d's worker 0 exited (its endpoint refused a connection" in _poll_until_noticed(watch, members)
    assert member_exited(store, "d", 0, 0)["endpoint"] == d.endpoint  # type: ignore[index]
    assert member_exited(store, "d", 0, 1) is None  # a later generation's member at d's place is another process
    watch.close()


def test_a_peer_published_by_name_is_reached(store: dist.TCPStore) -> None:
    """A node known by a name (no ``--local-addr``), here ``localhost``: the watcher resolves it (to ``::1`` or
    ``127.0.0.1``, whichever comes first) and the listener, on every interface and both families, answers there. (The
    case it is built for, a host's own name resolving to ``127.0.1.1`` on itself and to its address elsewhere, needs
    two hosts.)"""
    members = _members("a", "e")
    e = _Peer(store, "e", address="localhost")
    try:
        watch = ExitWatch(store, "a", 0)
        assert _polls(watch, members, 0.5) == []  # connected: no refusal
        e.kill()
        assert "node e's worker 0 exited (its connection closed" in _poll_until_noticed(watch, members)
        watch.close()
    finally:
        e.stop_all()


def test_a_frozen_peer_is_marked_once_its_heartbeat_stops(store: dist.TCPStore) -> None:
    """A frozen process keeps its sockets (the kernel answers for it): its heartbeat, which the watcher reads, says
    it. Here the test beats for b, as b's heartbeat thread would, until b is frozen."""
    members = _members("a", "b")
    b = _Peer(store, "b")
    try:
        watch = ExitWatch(store, "a", 0, heartbeat_timeout_s=0.6)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # beating: alive, however long it is watched
            store.set(heartbeat_key("b", 0), str(time.time()))
            assert watch.poll(members.generation, lambda: members) is None
            time.sleep(0.05)
        os.kill(b.proc.pid, signal.SIGSTOP)
        noticed = _poll_until_noticed(watch, members)
        assert "node b's worker 0 is gone (its heartbeat stopped for 0.6s, seen from node a)" in noticed, noticed
        mark = member_exited(store, "b", 0, 0)
        assert mark is not None and mark["endpoint"] == b.endpoint
        watch.close()
    finally:
        b.stop_all()


@contextlib.contextmanager
def _beating(store: dist.TCPStore, node_id: str) -> Iterator[None]:
    """Beat for ``node_id``'s worker 0 every 0.1 s, as its heartbeat thread would (through a client of its own)."""
    client = dist.TCPStore(HOST, store.port, is_master=False)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            client.set(heartbeat_key(node_id, 0), str(time.time()))

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_a_heartbeat_that_cannot_speak_for_the_member_is_not_judged(store: dist.TCPStore) -> None:
    """The key of a fresh process that has not entered the generation yet may still hold an earlier process's beats,
    long stopped; and a watcher that could not read for a while (a stalled store, a starved thread) has not seen the
    heartbeat stop. Neither marks anyone; the member is marked once it entered and its heartbeat stopped in view."""
    members = _members("a", "g")
    g = _Peer(store, "g", entered=None)
    try:
        store.set(heartbeat_key("g", 0), "1.0")  # an earlier process's last beat
        watch = ExitWatch(store, "a", 0, heartbeat_timeout_s=0.6)
        assert _polls(watch, members, 1.5) == []
        store.set(entered_key("g", 0), "0")  # as the fresh process's death watch says once it is in generation 0
        store.set(heartbeat_key("g", 0), str(time.time()))
        assert _polls(watch, members, 0.3) == []
        time.sleep(2.5)  # no read for longer than HEARTBEAT_GAP_S: the timer starts again
        assert _polls(watch, members, 0.4) == []
        assert "its heartbeat stopped for 0.6s" in _poll_until_noticed(watch, members)
        watch.close()
    finally:
        g.stop_all()


@pytest.mark.skipif(not can_make_network_namespaces(), reason="needs root and network namespaces (ip netns)")
def test_a_peer_whose_host_vanished_is_marked_once_its_host_stops_answering(store: dist.TCPStore) -> None:
    """The peer runs behind a virtual link, which is cut: its process lives on, nothing is closed, no packet comes
    back. The watcher's connection ends by the keepalive's timeout (``elastic.unreachable_timeout_s``), not at the
    heartbeat timeout (an hour here)."""
    members = _members("a", "f")
    with host_behind_a_link() as host:
        f = _Peer(store, "f", address=host.there, prefix=host.prefix, store_host=host.here)
        try:
            watch = ExitWatch(store, "a", 0, heartbeat_interval_s=0.2, heartbeat_timeout_s=3600.0,
                              unreachable_timeout_s=1.0)
            assert _polls(watch, members, 0.5) == []  # connected, alive
            with _beating(store, "f"):  # the link cut, but its heartbeat still changes: a blip on this path
                host.cut()
                assert _polls(watch, members, 3.0) == []
                host.mend()
                assert _polls(watch, members, 1.5) == []
            host.cut()
            noticed = _poll_until_noticed(watch, members)
            assert "node f's worker 0 is gone (its host stopped answering, seen from node a)" in noticed, noticed
            assert member_exited(store, "f", 0, 0)["endpoint"] == f.endpoint  # type: ignore[index]
            watch.close()
        finally:
            f.stop_all()


def _mark_exited(store: dist.Store, node_id: str, endpoint: str, generation: int = 0) -> None:
    store.set(exited_key(node_id, 0), json.dumps({"endpoint": endpoint, "time": time.time(), "by": "x",
                                                  "generation": generation}))
    store.set(LAST_DEATH_KEY, json.dumps({"node_id": node_id, "time": time.time(), "exited": True}))


def test_the_death_watch_notices_a_member_whose_process_exited() -> None:
    store = dist.HashStore()
    generation = publish_generation(store, nodes=list(_members("a", "b").nodes), world_size=2, master_addr=HOST,
                                    master_port=1, rendezvous_seconds=0.0)
    assert generation is not None
    watch = DeathWatch(lambda: generation, node_id="a", client=store, poll_s=3600.0)  # polled by hand here
    try:
        store.set(endpoint_key("b", 0), "127.0.0.1 5 100")
        _mark_exited(store, "b", "127.0.0.1 4 99")  # an earlier process of b's: not the member's
        watch.look()
        watch.raise_if_noticed()
        _mark_exited(store, "b", "127.0.0.1 5 100", generation=-1)  # seen by a watcher of an earlier generation
        watch.look()
        watch.raise_if_noticed()
        _mark_exited(store, "b", "127.0.0.1 5 100")
        watch.look()
        with pytest.raises(PeerDeathNoticed, match="node b of generation 0 lost worker 0: its process exited"):
            watch.raise_if_noticed()
    finally:
        watch.stop()


def test_the_survivors_take_an_exited_member_for_dead_without_waiting_for_its_heartbeat() -> None:
    store = dist.HashStore()
    info = _members("a", "b")
    store.set(report_key("failure/0", 0), "{}")
    store.set(endpoint_key("b", 0), "127.0.0.1 5 100")
    settings = FailureSettings(heartbeat_timeout_s=3600.0)  # the heartbeat alone would decide nothing for an hour
    with pytest.raises(RuntimeError, match="could not tell the survivors"):
        _decide_survivors(store, info, settings, timeout_s=0.5)
    _mark_exited(store, "b", "127.0.0.1 5 100")
    decision = _decide_survivors(store, info, settings, timeout_s=5.0)
    assert decision["survivors"] == [0] and decision["dead_nodes"] == ["b"]
    assert decision["found_by"] == {"b": "worker 0's process exited"}


def test_elastic_watch_exits_false_leaves_every_worker_without_a_listening_socket() -> None:
    from hydra import compose, initialize_config_dir

    from lightning_emig.config import register_configs
    from lightning_emig.testing.nodes import REPO
    from lightning_emig.training.builders import failure_settings

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        assert failure_settings(compose("config")).watch_exits  # on by default
        settings = failure_settings(compose("config", overrides=["elastic.watch_exits=false"]))
    assert not settings.watch_exits
    store = dist.HashStore()
    for exits in (settings.watch_exits, True):  # what the strategy starts with each setting
        watch = DeathWatch(lambda: -1, node_id=f"{HOST}_{int(exits)}", local_rank=0, client=store, poll_s=3600.0,
                           exits=exits)
        watch.stop()
        assert store.check([endpoint_key(f"{HOST}_{int(exits)}", 0)]) == exits


def test_the_restart_path_is_told_from_the_environment_the_agents_give_their_workers() -> None:
    from lightning_emig.launcher.generation import ENV_LIVE_MEMBERSHIP, live_membership_from_env

    assert live_membership_from_env({}) and live_membership_from_env({ENV_LIVE_MEMBERSHIP: "1"})
    assert not live_membership_from_env({ENV_LIVE_MEMBERSHIP: "0"})  # no exit watch there (see the strategy)


def test_the_holders_of_a_change_that_failed_count_marks_from_their_own_generation() -> None:
    """A change to generation 3 failed before its state moved: the holders recover among themselves, accounted under
    generation 3, while the watchers that saw one of them exit still followed the holders' generation (2). Holders are
    the processes that published their endpoints long before: such a mark is about them (``exits_since=-1``, as
    :func:`lightning_emig.membership.failure._holders_of` sets it)."""
    store = dist.HashStore()
    info = dataclasses.replace(_members("a", "b"), generation=3)
    scope = "failure/3/holders"
    store.set(report_key(scope, 0), "{}")
    store.set(endpoint_key("b", 0), "127.0.0.1 5 100")
    _mark_exited(store, "b", "127.0.0.1 5 100", generation=2)
    settings = FailureSettings(heartbeat_timeout_s=3600.0)
    with pytest.raises(RuntimeError, match="could not tell the survivors"):  # a generation-3 member: not its mark
        _decide_survivors(store, info, settings, timeout_s=0.5, scope=scope)
    decision = _decide_survivors(store, info, settings, timeout_s=5.0, scope=scope, exits_since=-1)
    assert decision["dead_nodes"] == ["b"] and decision["found_by"] == {"b": "worker 0's process exited"}
