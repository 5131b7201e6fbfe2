"""Downtime of one abrupt worker failure on simulated nodes, on the live path or torchrun's restart path.

:func:`measure_worker_failure` runs one job of two nodes on this host (:mod:`lightning_emig.testing.nodes`; A on
127.0.0.2 hosts the rendezvous store, B on 127.0.0.3, one worker each, ``layout=hsdp``: each node holds a whole
replica). Once the world of two has finished ``fail_after`` steps and holds a complete checkpoint, B's worker gets
SIGKILL; when training has gone ``steps_after`` steps beyond the event (plus what it recomputes) every agent is
stopped.

* ``live``: A's worker rebuilds everything from its own replica and trains on as a world of one (one ``failure``
  event, 2 -> 1, nothing rolled back); B's agent then rejoins with a fresh worker (a later ``join``, not measured);
* ``restart``: ``LIGHTNING_EMIG_LIVE_MEMBERSHIP=0``, torchrun's behaviour: every worker is stopped and started
  again, loads the newest checkpoint and recomputes the steps after it (one ``restart`` event, 2 -> 2).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_emig.strategy.events import read_events
from lightning_emig.strategy.resume import newest_checkpoint
from lightning_emig.testing.commands import descendants, is_alive, kill_tree
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.join_downtime import PATHS, event_record, last_step
from lightning_emig.testing.nodes import log_tail, start_node, wait_for

EVENT = {"live": ("failure", 2, 1), "restart": ("restart", 2, 2)}
"""(kind, old world, new world) of the event each path records for the failure."""


def measure_worker_failure(
    run_dir: Path, train_args: Sequence[str], path: str, *, model: str, fail_after: int, steps_after: int,
    timeout_s: float,
) -> dict[str, Any]:
    """One SIGKILL of node B's worker on ``path`` (``live`` or ``restart``); returns its record."""
    import os
    import signal

    port = free_port()
    agents: dict[str, subprocess.Popen] = {}
    args = [*train_args, "layout=hsdp"]
    for i, name in enumerate(("a", "b")):
        agents[name] = start_node(
            run_dir.parent, f"{run_dir.name}-{name}", local_addr=f"127.0.0.{i + 2}", port=port, run_dir=run_dir,
            train_args=args, nnodes="1:2", rdzv_id=run_dir.name, rdzv_conf=f"is_host={str(i == 0).lower()}",
            env=PATHS[path], max_restarts=1,
        )

    def alive() -> None:
        if any(p.poll() is not None for p in agents.values()):
            raise RuntimeError("an agent exited:\n" + "\n".join(
                log_tail(run_dir.parent, f"{run_dir.name}-{n}") for n in agents))

    def ready() -> bool:
        alive()
        return last_step(run_dir, 2) >= fail_after and newest_checkpoint(run_dir / "checkpoints") is not None

    def recovered() -> bool:
        alive()
        event = _event(run_dir, path)
        return event is not None and max(last_step(run_dir, w) for w in (1, 2)) >= (
            event["step"] + (event.get("steps_rolled_back") or 0) + steps_after)

    try:
        wait_for(ready, timeout_s, f"the world of two did not reach step {fail_after} with a checkpoint")
        for pid in [p for p in descendants(agents["b"].pid) if is_alive(p)]:
            os.kill(pid, signal.SIGKILL)
        wait_for(recovered, timeout_s, f"no {EVENT[path][0]} event within {timeout_s:.0f}s")
    finally:
        for proc in agents.values():
            kill_tree(proc.pid)
            proc.wait(timeout=30)
    event = _event(run_dir, path)
    assert event is not None
    return event_record(run_dir, "worker_failure", path, event, model=model)


def _event(run_dir: Path, path: str) -> dict[str, Any] | None:
    kind, old_world, new_world = EVENT[path]
    return next((e for e in read_events(run_dir)
                 if (e["kind"], e["old_world"], e["new_world"]) == (kind, old_world, new_world)), None)
