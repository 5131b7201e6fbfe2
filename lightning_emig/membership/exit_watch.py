"""A peer whose process is gone, noticed by one of its peers in a tenth of a second instead of at the heartbeat timeout.

When a worker dies its agent marks the node dead at once (:mod:`~lightning_emig.membership.death_watch`). When the
node goes *whole* — its agent killed with its workers: an OOM killer or a cancelled job step taking the process tree,
``kill -9`` of the agent — nobody marks it, and the survivors took it for dead only once its heartbeat had not changed
for ``elastic.heartbeat_timeout_s`` (10 s by default; :mod:`~lightning_emig.launcher.heartbeat`). Yet the host's kernel,
still running, closes a dead process's sockets at once. So:

* every worker under ``lightning-emig-run`` listens on a TCP socket of its node's address (:class:`ExitListener`;
  nothing is ever read or written on it) and publishes it as ``endpoint/<node_id>/<local_rank>`` =
  ``"<host> <port> <pid>"`` before it joins any generation;
* each worker keeps one connection open to the member after it in its generation's rank order (:class:`ExitWatch`,
  driven by the death watch's thread: no thread of its own, no call that blocks). When the connection ends (end of
  stream or reset), or a new one is refused, the process behind that endpoint has exited: the watcher writes
  ``exited/<node_id>/<local_rank>`` = that endpoint and :data:`~lightning_emig.launcher.generation.LAST_DEATH_KEY`
  (which every death watch reads), then watches the member after the one that exited (a ring: two dead neighbours
  are both found).

The failure's survivors (:mod:`~lightning_emig.membership.failure`) and every death watch take a member of their
generation for dead when a mark names its current endpoint and was written by a watcher of that generation or a later
one (:func:`member_exited`). A mark names a process, not a place: a fresh worker at the same node and local rank
publishes another endpoint as it starts, and an old mark says nothing about it; until it has, the dead one's endpoint
is still published, so a refused connection counts only once the endpoint's process said it entered the generation
watched (``entered/<node_id>/<local_rank>``), and a mark from an earlier generation never counts. A process that left
on purpose (a preempted node after its handoff, the end of the job) is marked too, truthfully; no generation it is
still a member of is trained in by then.

A host that vanished (power, kernel, network) closes nothing, and a frozen process keeps its sockets. So the
connection is probed (TCP keepalive every second, ended when nothing was acknowledged for
``elastic.unreachable_timeout_s``; a connection not answered for as long counts alike), and the watched member's
heartbeat is read every :data:`HEARTBEAT_READ_S`. A host that stopped answering is gone once the heartbeat has missed
:data:`SILENT_BEATS` beats too (one that still beats was a blip on that path: the watcher connects again); a
heartbeat unchanged for ``elastic.heartbeat_timeout_s`` on the watcher's clock is a frozen process (its kernel still
answers the probes). Either writes the same mark, saying how (``how``), and when the member was last known alive
(``alive_at``: its last beat, on its host's clock; where it never beat, the watcher's estimate). A heartbeat is judged
only for the process that said it entered the generation watched (the key may still hold an earlier process's beats at
that node and local rank), and reads further apart than :data:`HEARTBEAT_GAP_S` (a stalled store, a starved thread)
start its timer again. A listening socket is reachable wherever the
process group's own sockets are (gloo and NCCL listen on ephemeral ports of the same address), so a refusal means no
listener, not a firewall. ``elastic.watch_exits: false`` turns it off; so does torchrun's restart path
(``LIGHTNING_EMIG_LIVE_MEMBERSHIP=0``), where no agent marks a death either.

A ``DataLoader``'s worker processes are forked with every descriptor of their parent: they close this module's sockets
as they start (:func:`os.register_at_fork`), or a dead worker's connections would stay open for as long as its loader
processes live.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import select
import socket
import time
from collections.abc import Callable
from typing import Any

from lightning_emig.collective_sockets import not_a_group_socket
from lightning_emig.launcher.generation import LAST_DEATH_KEY, GenerationInfo, heartbeat_key
from lightning_emig.launcher.heartbeat import HeartbeatWatch, last_beat

log = logging.getLogger(__name__)

HEARTBEAT_READ_S = 0.5
"""How often a watcher reads the watched member's heartbeat (a frozen process is found this much after its timeout)."""

HEARTBEAT_GAP_S = 4 * HEARTBEAT_READ_S
"""Reads further apart than this (they failed: a store that stalled; or this thread was starved) start the heartbeat's
timer again: a stall is never taken for a heartbeat that stopped."""

SILENT_BEATS = 2
"""A host that stopped answering is gone once its worker's heartbeat has also missed this many beats; a heartbeat
that still changes meanwhile was a blip on the path between the two (the watcher connects again)."""

RETRY_S = 1.0
"""How long a watcher waits before it tries again to reach a member whose endpoint is not published yet or whose
connection could not be made (no answer: that host may have vanished; the heartbeat decides then)."""

_open_sockets: list[socket.socket] = []
"""Every socket of this module in this process, closed in a forked child (see the module)."""


def _close_in_forked_child() -> None:
    for sock in _open_sockets:
        sock.close()  # this process's copy only: the parent's socket stays open, no end of stream is sent
    _open_sockets.clear()


os.register_at_fork(after_in_child=_close_in_forked_child)


def _track(sock: socket.socket) -> socket.socket:
    _open_sockets.append(sock)
    not_a_group_socket(sock)  # a peer's exit is seen here: never shut down with the process groups' connections
    return sock


def _close(sock: socket.socket) -> None:
    sock.close()
    if sock in _open_sockets:
        _open_sockets.remove(sock)


def endpoint_key(node_id: str, local_rank: int) -> str:
    return f"endpoint/{node_id}/{local_rank}"


def entered_key(node_id: str, local_rank: int) -> str:
    """The last generation the process behind ``endpoint/`` entered (written as it enters one)."""
    return f"entered/{node_id}/{local_rank}"


def exited_key(node_id: str, local_rank: int) -> str:
    return f"exited/{node_id}/{local_rank}"


def member_exited(client: Any, node_id: str, local_rank: int, generation: int) -> dict[str, Any] | None:
    """The ``exited/`` mark of a member of ``generation`` (``{"endpoint", "time", "by", "generation"}``), or None: not
    marked, or the mark names an earlier process at that node and local rank — another endpoint, or one seen exiting
    by a watcher of an earlier generation (a fresh process that has not published its endpoint yet leaves the dead
    one's in place)."""
    mark_key, current_key = exited_key(node_id, local_rank), endpoint_key(node_id, local_rank)
    if not client.check([mark_key]) or not client.check([current_key]):
        return None
    mark = json.loads(client.get(mark_key))
    current = mark.get("endpoint") == client.get(current_key).decode()
    return mark if current and int(mark.get("generation", -1)) >= generation else None


CLOSED, REFUSED, UNREACHABLE = "its connection closed", "its endpoint refused a connection", "its host stopped answering"
"""How a watcher saw a process go (a mark's ``how``); a heartbeat that stopped says for how long."""


def seen_exiting(mark: dict[str, Any]) -> bool:
    """Whether the process a mark names was seen to exit (its host's kernel closed or refused its connection), rather
    than found silent (its host stopped answering, its heartbeat stopped: nothing of it was closed)."""
    return mark.get("how", CLOSED) in (CLOSED, REFUSED)


def gone_how(mark: dict[str, Any]) -> str:
    """How the process a mark names went, for the logs: ``exited``, or ``is gone: ...`` (see :func:`seen_exiting`)."""
    return "exited" if seen_exiting(mark) else f"is gone: {mark['how']}"


def _read_int(client: Any, key: str) -> int:
    return int(client.get(key)) if client.check([key]) else -1


class ExitListener:
    """This process's listening socket (see the module). Connections are accepted, held and never read; the kernel
    completes them before they are accepted, so :meth:`accept_pending` is called only to keep the queue short."""

    def __init__(self, client: Any, node_id: str, local_rank: int, host: str) -> None:
        """Listen on every interface, as the rendezvous store does: ``host`` (the node's address, as peers reach it)
        is published, not bound, so a name this host resolves to itself otherwise (``127.0.1.1``) reaches it too."""
        dual = socket.has_dualstack_ipv6()
        self._sock = _track(socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET,
                                                 backlog=64, dualstack_ipv6=dual))
        self._sock.setblocking(False)
        self._held: list[socket.socket] = []
        self._client, self._entered_key = client, entered_key(node_id, local_rank)
        self._entered = -1
        port = self._sock.getsockname()[1]
        self.endpoint = f"{host} {port} {os.getpid()}"
        client.delete_key(self._entered_key)  # an earlier process's: this one entered nothing yet
        client.set(endpoint_key(node_id, local_rank), self.endpoint)

    def entered(self, generation: int) -> None:
        """This process is in ``generation`` now: a watcher may take a refused connection for its exit (before, the
        refusal might be an earlier process's endpoint's)."""
        if generation > self._entered:
            self._client.set(self._entered_key, str(generation))
            self._entered = generation

    def accept_pending(self) -> None:
        """Accept what is queued; let go of the connections their watchers closed (they moved to another member)."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            conn.setblocking(False)
            self._held.append(_track(conn))
        for conn in [c for c in self._held if _ended(c)]:
            self._held.remove(conn)
            _close(conn)

    def close(self) -> None:
        for sock in [self._sock, *self._held]:
            _close(sock)
        self._held.clear()


def _ended(conn: socket.socket) -> str | None:
    """How the other end of a connection has gone (end of stream, reset, no answer), or None; never blocks."""
    readable, _, _ = select.select([conn], [], [], 0)
    if not readable:
        return None
    try:
        # nothing is ever sent here: readable means the end (or a stray byte: alive)
        return CLOSED if conn.recv(1) == b"" else None
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as exc:  # timed out: the keepalive's probes went unanswered (see _keep_alive)
        return UNREACHABLE if exc.errno in (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH) else CLOSED


def _keep_alive(sock: socket.socket, timeout_s: float) -> None:
    """Probe the peer's host every second while the connection is idle, and end the connection when nothing has been
    acknowledged for ``timeout_s`` (Linux's ``TCP_USER_TIMEOUT``): a host that vanished is found in that time, where
    without it an idle connection to it would stay open for hours. The probes are answered by the peer's kernel, so
    a live but busy (or frozen) process never fails them."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", max(1, math.ceil(timeout_s))),
                          ("TCP_USER_TIMEOUT", max(1, int(timeout_s * 1000)))):
        if hasattr(socket, option):  # Linux; elsewhere the system's keepalive defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class ExitWatch:
    """One process's watch over the member after it (see the module). :meth:`poll` never blocks: the connection is
    made without waiting and looked at again on the next poll; the store is read only when the member watched
    changes (another generation, an exit seen)."""

    def __init__(self, client: Any, node_id: str, local_rank: int, *, heartbeat_interval_s: float = 1.0,
                 heartbeat_timeout_s: float = 10.0, unreachable_timeout_s: float = 2.0) -> None:
        self._client = client
        self._heartbeat_interval_s, self._heartbeat_timeout_s = heartbeat_interval_s, heartbeat_timeout_s
        self._unreachable_timeout_s = unreachable_timeout_s
        self._beats: HeartbeatWatch | None = None
        """The watched process's heartbeat, judged on this process's clock."""
        self._beats_of: str | None = None
        """The endpoint whose heartbeat :attr:`_beats` follows."""
        self._beats_read_at = -math.inf
        self._unchanged: float | None = None
        """How long the watched heartbeat had not changed at the last read (None: not judged)."""
        self._silent = False
        """The connection ended unanswered: the host is gone once the heartbeat agrees (see :data:`SILENT_BEATS`)."""
        self._me = (node_id, local_rank)
        self._generation = -1
        self._ring: list[tuple[str, int]] = []
        """The members of the generation followed, in rank order."""
        self._gone: set[str] = set()
        """Endpoints this watch saw exit: the ring skips their members."""
        self._target: tuple[str, int] | None = None
        self._endpoint: str | None = None
        self._entered = -1
        """The last generation the watched endpoint's process said it entered (when the connection was made)."""
        self._sock: socket.socket | None = None
        self._connected = False
        self._connect_started = 0.0
        self._retry_at = 0.0

    def poll(self, generation: int, members: Callable[[], GenerationInfo]) -> str | None:
        """Follow the member after this process in ``generation`` (-1: none), whose members ``members`` reads when
        the generation is new; returns what was noticed exiting this time (a message), if anything."""
        if generation != self._generation:
            self._drop()
            self._generation, self._target = generation, None
            self._ring = list(members().members) if generation >= 0 else []
        if self._target is None:
            self._target = self._successor()
            if self._target is None:
                return None
        unchanged = self._heartbeat_unchanged()
        if unchanged is not None and unchanged > self._heartbeat_timeout_s:
            return self._exited(f"its heartbeat stopped for {self._heartbeat_timeout_s:g}s",
                                alive_at=last_beat(self._client, *self._target))
        if self._sock is None:
            return self._connect() if time.monotonic() >= self._retry_at else None
        if not self._connected:
            return self._finish_connect()
        if not self._silent:
            ended = _ended(self._sock)
            if ended != UNREACHABLE:
                return self._exited(ended) if ended is not None else None
            self._silent = True
        return self._judge_silence()

    def close(self) -> None:
        self._drop()

    def _judge_silence(self, *, connecting: bool = False) -> str | None:
        """The host stopped answering on the connection (``connecting``: answers no connection): gone once the
        heartbeat missed :data:`SILENT_BEATS` beats too (or, on a connection that was made, cannot be judged); a
        heartbeat that changes meanwhile means a blip on this path: connect again."""
        before = self._unchanged
        unchanged = self._heartbeat_unchanged(fresh=True)
        if unchanged is None and connecting:
            return self._failed_connect(errno.ETIMEDOUT)
        if unchanged is None or unchanged >= SILENT_BEATS * self._heartbeat_interval_s:
            last = last_beat(self._client, *self._target) if unchanged is not None else None
            return self._exited(UNREACHABLE, alive_at=last if last is not None else
                                time.time() - self._unreachable_timeout_s)  # the connection ends that long after
        if connecting or (before is not None and unchanged < before):
            log.warning("exit watch: %s stopped answering on its connection but still beats; connecting again",
                        self._endpoint)
            self._drop()
            self._retry_at = time.monotonic() + RETRY_S
        return None

    def _heartbeat_unchanged(self, *, fresh: bool = False) -> float | None:
        """How long the watched process's heartbeat has not changed, on this process's clock; read every
        :data:`HEARTBEAT_READ_S` (``fresh``: now). None where it is not judged: no endpoint known yet; its process has
        not said it entered the generation watched (the key may still be an earlier process's at that node and local
        rank); it never beat (not started, or not under the launcher)."""
        now = time.monotonic()
        if self._endpoint is None or self._target is None:
            return None
        if not fresh and now - self._beats_read_at < HEARTBEAT_READ_S:
            return self._unchanged
        if self._entered < self._generation:
            self._entered = _read_int(self._client, entered_key(*self._target))
        key = heartbeat_key(*self._target)
        if self._entered < self._generation or not self._client.check([key]):
            self._unchanged, self._beats_read_at = None, now
            return None
        if self._beats is None or self._beats_of != self._endpoint or now - self._beats_read_at > HEARTBEAT_GAP_S:
            self._beats, self._beats_of = HeartbeatWatch(self._client, self._heartbeat_timeout_s), self._endpoint
        self._unchanged, self._beats_read_at = self._beats.unchanged_s(key), now
        return self._unchanged

    def _successor(self) -> tuple[str, int] | None:
        if self._me not in self._ring:
            return None
        mine = self._ring.index(self._me)
        for step in range(1, len(self._ring)):
            candidate = self._ring[(mine + step) % len(self._ring)]
            if self._read_endpoint(candidate) not in self._gone:
                self._retry_at = 0.0
                return candidate
        return None

    def _read_endpoint(self, member: tuple[str, int]) -> str | None:
        key = endpoint_key(*member)
        return self._client.get(key).decode() if self._client.check([key]) else None

    def _connect(self) -> str | None:
        assert self._target is not None
        self._endpoint = self._read_endpoint(self._target)
        if self._endpoint is None:  # not started yet, or not under the launcher: look again later
            self._retry_at = time.monotonic() + RETRY_S
            return None
        self._entered = _read_int(self._client, entered_key(*self._target))
        host, port, _pid = self._endpoint.split()
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        except OSError as exc:  # the name does not resolve now: say nothing of the process, look again later
            return self._failed_connect(exc.errno or errno.EHOSTUNREACH)
        sock = _track(socket.socket(family, kind, proto))
        sock.setblocking(False)
        _keep_alive(sock, self._unreachable_timeout_s)
        self._sock, self._connected, self._connect_started = sock, False, time.monotonic()
        code = sock.connect_ex(address)
        if code in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            return self._finish_connect()
        return self._failed_connect(code)

    def _finish_connect(self) -> str | None:
        assert self._sock is not None
        _, writable, _ = select.select([], [self._sock], [], 0)
        if not writable:  # still connecting; for too long, the host is silent (or was: the SYN backs off)
            return self._judge_silence(connecting=True) if (
                time.monotonic() - self._connect_started > self._unreachable_timeout_s) else None
        code = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code == 0:
            self._connected = True
            return None
        return self._failed_connect(code)

    def _failed_connect(self, code: int) -> str | None:
        if code == errno.ECONNREFUSED and self._entered >= self._generation:  # nothing listens there any more
            return self._exited(REFUSED)
        log.debug("exit watch: could not reach %s (%s); trying again", self._endpoint, os.strerror(code))
        self._drop()
        self._retry_at = time.monotonic() + RETRY_S
        return None

    def _exited(self, how: str, alive_at: float | None = None) -> str:
        """Mark the watched member's process gone (``how``; ``alive_at``: when it was last known alive, if before
        now)."""
        assert self._target is not None and self._endpoint is not None
        node_id, local_rank = self._target
        now = time.time()
        mark = {"endpoint": self._endpoint, "time": now, "by": self._me[0], "generation": self._generation, "how": how,
                "alive_at": now if alive_at is None else alive_at}
        self._client.set(exited_key(node_id, local_rank), json.dumps(mark))
        self._client.set(LAST_DEATH_KEY, json.dumps({"node_id": node_id, "time": now, "exited": True}))
        self._gone.add(self._endpoint)
        verb = "exited" if seen_exiting(mark) else "is gone"
        message = f"the process of node {node_id}'s worker {local_rank} {verb} ({how}, seen from node {self._me[0]})"
        self._drop()
        self._target = None  # the next poll moves on to the member after it
        return message

    def _drop(self) -> None:
        if self._sock is not None:
            _close(self._sock)
        self._sock, self._connected, self._endpoint, self._silent = None, False, None, False
