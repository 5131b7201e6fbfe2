"""Worker heartbeats in the control store: how survivors tell a dead peer from a slow one.

Under ``lightning-emig-run`` every worker runs one daemon thread that writes ``hb/<node_id>/<local_rank>`` =
``time.time()`` every ``interval_s`` through a control-store client of its own (the training thread's client is
never shared). After a collective fails, :mod:`~lightning_emig.membership.failure` reads these keys: a peer that
has not reported in and whose heartbeat is older than the configured timeout is taken for dead. Writing from a
thread keeps beating while the training thread is blocked in a collective (gloo releases the GIL), so a live
peer stuck behind the dead one still looks alive.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from lightning_emig.launcher.generation import ENV_NODE_ID, control_client_from_env, heartbeat_key

log = logging.getLogger(__name__)

_beating: Heartbeat | None = None


class Heartbeat:
    """The heartbeat thread of this process (one per process, started once, lives as long as the process)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.key = heartbeat_key(os.environ[ENV_NODE_ID], int(os.environ["LOCAL_RANK"]))
        self._client = control_client_from_env(timeout_s=max(10.0, 4 * interval_s))
        self._thread = threading.Thread(target=self._run, name="lightning-emig-heartbeat", daemon=True)
        self._client.set(self.key, str(time.time()))
        self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            try:
                self._client.set(self.key, str(time.time()))
            except Exception:  # noqa: BLE001 - the control store may be gone at the very end of the job
                log.debug("heartbeat write failed", exc_info=True)


def start_heartbeat(interval_s: float) -> Heartbeat:
    """Start this process's heartbeat (idempotent: later calls return the running one)."""
    global _beating
    if _beating is None:
        _beating = Heartbeat(interval_s)
    return _beating


def heartbeat_age(client: object, node_id: str, local_rank: int, now: float | None = None) -> float:
    """Seconds since worker ``(node_id, local_rank)`` last beat; ``inf`` if it never did."""
    key = heartbeat_key(node_id, local_rank)
    if not client.check([key]):  # type: ignore[attr-defined]
        return float("inf")
    return (time.time() if now is None else now) - float(client.get(key))  # type: ignore[attr-defined]
