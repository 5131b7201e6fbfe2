"""Heartbeats in the control store: how survivors tell a dead peer from a slow one.

Under ``lightning-emig-run`` every worker runs one daemon thread that writes ``hb/<node_id>/<local_rank>`` =
``time.time()`` every ``interval_s`` through a control-store client of its own (the training thread's client is
never shared); every agent does the same under ``hb/<node_id>/agent`` (a joining node killed before its worker
beats once is told from a slow one by its agent's heartbeat: :mod:`~lightning_emig.membership.admission`). After a collective fails, :mod:`~lightning_emig.membership.failure` reads these keys: a peer that
has not reported in and whose heartbeat has not changed for the configured timeout (on the reader's own clock:
:class:`HeartbeatWatch`) is taken for dead. Writing from a thread keeps beating while the training thread is blocked
in a collective (gloo releases the GIL), so a live peer stuck behind the dead one still looks alive.

The thread is stopped and joined at interpreter exit (``atexit``): a daemon thread caught inside a store call (GIL
released) while the interpreter finalizes is ended with ``pthread_exit``, whose unwinding through torch's C++ aborts
the process (SIGABRT) — a worker that had cleanly handed its state over would then exit as failed.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning_emig.launcher.generation import (
    ENV_NODE_ID,
    HEARTBEAT_TIMEOUT_KEY,
    active_generation,
    agent_heartbeat_key,
    control_client_from_env,
    dead_key,
    heartbeat_key,
    holding_key,
    read_generation,
)

log = logging.getLogger(__name__)

_beating: Heartbeat | None = None


class Heartbeat:
    """The heartbeat thread of this process (one per process, started once, runs until :meth:`stop` or exit)."""

    def __init__(self, interval_s: float, key: str | None = None, client: Any = None,
                 timeout_s: float | None = None) -> None:
        """A worker's heartbeat (key and client from the environment), or ``key`` written through ``client`` (a
        control-store client this thread alone uses). ``timeout_s``: published for the readers that have no
        configuration of their own (:func:`heartbeat_timeout`)."""
        self.interval_s = interval_s
        self.key = key or heartbeat_key(os.environ[ENV_NODE_ID], int(os.environ["LOCAL_RANK"]))
        self._store_timeout_s = max(10.0, 4 * interval_s)
        self._client = client if client is not None else control_client_from_env(timeout_s=self._store_timeout_s)
        self._stopped = threading.Event()
        self._holding_key: str | None = None
        self._thread = threading.Thread(target=self._run, name="lightning-emig-heartbeat", daemon=True)
        self._client.set(self.key, str(time.time()))
        if timeout_s is not None:
            self._client.set(HEARTBEAT_TIMEOUT_KEY, str(timeout_s))
        self._thread.start()

    def hold(self) -> None:
        """From now on also beat ``holds/<node_id>/<local_rank>``: this worker holds the live state (joiners waiting
        for admission tell from it whether anyone is left to admit them). The thread writes it, from its next beat on:
        its client is its own."""
        self._holding_key = holding_key(os.environ[ENV_NODE_ID], int(os.environ["LOCAL_RANK"]))

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                now = str(time.time())
                self._client.set(self.key, now)
                if self._holding_key is not None:
                    self._client.set(self._holding_key, now)
            except Exception:  # noqa: BLE001 - the control store may be gone at the very end of the job
                log.debug("heartbeat write failed", exc_info=True)

    def stop(self) -> None:
        """End the thread and wait for it (at most one store call's timeout: a write may be in flight)."""
        self._stopped.set()
        self._thread.join(timeout=self._store_timeout_s + self.interval_s)
        if self._thread.is_alive():
            log.warning("heartbeat thread still inside a control-store call after %.0fs", self._store_timeout_s)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


def start_heartbeat(interval_s: float, timeout_s: float) -> Heartbeat:
    """Start this process's heartbeat (idempotent: later calls return the running one), and publish the timeout its
    readers judge it by (:func:`heartbeat_timeout`: the agents read it)."""
    global _beating
    if _beating is None:
        _beating = Heartbeat(interval_s, timeout_s=timeout_s)
        atexit.register(_beating.stop)  # before finalization ends daemon threads (see the module docstring)
    return _beating


def last_beat(client: Any, node_id: str, local_rank: int) -> float | None:
    """A worker's last heartbeat (its writer's ``time.time()``), or None when it never beat."""
    key = heartbeat_key(node_id, local_rank)
    return float(client.get(key)) if client.check([key]) else None


def heartbeat_timeout(client: Any, default_s: float = 10.0) -> float:
    """The heartbeat timeout the job's workers were configured with (``elastic.heartbeat_timeout_s``)."""
    return float(client.get(HEARTBEAT_TIMEOUT_KEY)) if client.check([HEARTBEAT_TIMEOUT_KEY]) else default_s


HOLDERS_POLL_S = 0.5
"""How often an agent's monitor loop looks at the holders' heartbeats (a few store reads each time)."""

GONE = b"gone"
"""The value an agent writes to its workers' ``holds/`` keys when those processes are gone (failed, stopped, replaced
by fresh ones): gone at once, not after the heartbeat timeout, and never taken for a process still starting up."""


def holders_alive(client: Any, watch: HeartbeatWatch) -> bool:
    """Whether some worker of the generation the holders committed to last still holds the live state, or will: its
    ``holds/`` heartbeat (:meth:`Heartbeat.hold`) changed within the watch's timeout; or, in a generation that starts
    from a checkpoint (no worker kept), it has not held yet — still starting up — and its node's agent beats and has
    not marked it dead. True before any generation was committed. Joiners waiting for admission and the agents ask
    it: when it is False, nobody is left to admit anyone, and the job must resume from its newest complete
    checkpoint."""
    active = active_generation(client)
    if active < 0:
        return True
    info = read_generation(client, active)
    alive = [_member_alive(client, watch, node_id, local_rank, starting=not info.live)  # each read: its timer
             for node_id, local_rank in info.members]  # starts at its first read, so none waits for another's
    return any(alive)


def _member_alive(client: Any, watch: HeartbeatWatch, node_id: str, local_rank: int, *, starting: bool) -> bool:
    key = holding_key(node_id, local_rank)
    if client.check([key]):
        return client.get(key) != GONE and not watch.stale_key(key)
    # Never held: a live generation's member that holds nothing (a joiner just admitted) keeps nobody's state alive.
    return starting and not client.check([dead_key(node_id)]) and not watch.stale_key(agent_heartbeat_key(node_id))


def forget_holders(client: Any, members: Any) -> None:
    """A generation whose workers all start afresh (from a checkpoint) was published: what its members' earlier
    processes held is gone, and their ``holds/`` keys must not make the new ones look dead while they start up."""
    for node_id, local_rank in members:
        client.delete_key(holding_key(node_id, local_rank))


def mark_gone(client: Any, node_id: str, local_ranks: range) -> None:
    """An agent's workers are gone (see :data:`GONE`)."""
    for local_rank in local_ranks:
        client.set(holding_key(node_id, local_rank), GONE)


def mark_holding() -> None:
    """This worker holds the live state (see :meth:`Heartbeat.hold`); nothing without a running heartbeat."""
    if _beating is not None:
        _beating.hold()


class HeartbeatWatch:
    """Which workers' heartbeats have stopped, judged on this process's own clock.

    A heartbeat is stale once its value has not changed for ``timeout_s`` since this watch first read it. The
    writers' wall-clock times are never compared with ours: hosts whose clocks disagree by more than the timeout
    would otherwise make a live peer look dead (it would be left out of the survivors) or a dead one look alive (the
    survivors would wait for it until ``failure_timeout_s``). The price: a peer long dead is taken for dead only
    ``timeout_s`` after the watch started, not at once.
    """

    def __init__(self, client: object, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.timeout_s, self.clock = client, timeout_s, clock
        self._last: dict[str, tuple[bytes | None, float]] = {}
        """Per key: the value last read, and when (our clock) it was first read with that value."""

    def stale(self, node_id: str, local_rank: int) -> bool:
        return self.stale_key(heartbeat_key(node_id, local_rank))

    def stale_key(self, key: str) -> bool:
        """Whether the heartbeat under ``key`` (a worker's or an agent's) has stopped."""
        return self.unchanged_s(key) > self.timeout_s

    def unchanged_s(self, key: str) -> float:
        """How long the value under ``key`` has been the one read now, on this watch's clock (0 at its first read)."""
        value = self.client.get(key) if self.client.check([key]) else None  # type: ignore[attr-defined]
        now = self.clock()
        last = self._last.get(key)
        if last is None or last[0] != value:
            self._last[key] = (value, now)
            return 0.0
        return now - last[1]


class HoldersMonitor:
    """An agent's view of :func:`holders_alive`, read at most every :data:`HOLDERS_POLL_S` by its monitor loop so
    that the watch's timers run all along and a decision (``fresh``) needs no heartbeat timeout of its own. True
    until the workers published their heartbeat timeout (before they start nobody holds anything to lose)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._watch: HeartbeatWatch | None = None
        self._read_at = -HOLDERS_POLL_S
        self._seen = True

    def alive(self, *, fresh: bool = False) -> bool:
        if self._watch is None:
            if not self.client.check([HEARTBEAT_TIMEOUT_KEY]):
                return True
            self._watch = HeartbeatWatch(self.client, heartbeat_timeout(self.client))
        now = time.monotonic()
        if fresh or now - self._read_at >= HOLDERS_POLL_S:
            self._read_at, self._seen = now, holders_alive(self.client, self._watch)
        return self._seen
