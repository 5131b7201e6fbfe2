"""Downtime of node B leaving a job of two, abruptly or with notice, on the live path or torchrun's restart path.

:func:`measure_departure` runs one job of two nodes on this host (:mod:`lightning_emig.testing.nodes`; A on
127.0.0.2 hosts the rendezvous store, B on 127.0.0.3, one worker each). Once the world of two has finished
``after`` steps and holds a complete checkpoint, B leaves; when training has gone ``steps_after`` steps beyond the
event (plus what it recomputes) every agent is stopped. How B leaves:

* ``worker_failure``: B's worker gets SIGKILL, under ``layout=hsdp`` (each node holds a whole replica).
  ``live``: A's worker rebuilds everything from its own replica and trains on as a world of one (one ``failure``
  event, 2 -> 1, nothing rolled back); B's agent has no restart left, so B stays out and A's steps alone follow
  (a fresh worker rejoining would be a ``join``, another event, and would leave no steady step of the world of one).
  ``restart``: every worker is stopped and started again, loads the newest checkpoint and recomputes the steps
  after it (one ``restart`` event, 2 -> 2);
* ``node_failure``: B's agent and worker get SIGKILL, under ``layout=hsdp``: the whole node gone, so no agent marks
  it dead; the survivor sees B's process exit (:mod:`~lightning_emig.membership.exit_watch`). ``live`` only: as
  ``worker_failure`` (one ``failure`` event, 2 -> 1). There is no restart path to compare with: with B's agent gone,
  no agent sees a failure, and A's worker recovers by itself on either path (measured: the same ``failure`` event,
  rebuilt from the replica; on the restart path, which watches no exits, at the heartbeat timeout);
* ``node_frozen``: B's agent and worker get SIGSTOP, under ``layout=hsdp``: alive, sockets open, nothing answers, as
  a hung host; the survivor's watcher finds B's heartbeat stopped and ends the collectives waiting on B
  (:mod:`~lightning_emig.collective_sockets`). ``live`` only, as ``node_failure``; B is killed once measured;
* ``host_vanish``: B runs in a network namespace of its own (:mod:`~lightning_emig.testing.netns`; root only), whose
  link is cut, under ``layout=hsdp``: its processes live on, nothing is closed, no packet comes back, as when a host's
  power or network goes; the survivor's watcher finds B's host silent (``elastic.unreachable_timeout_s``). ``live``
  only; B is killed once measured;
* ``preemption``: B's agent gets SIGTERM (the notice a cloud gives a preempted VM), under the default sharded
  layout. ``live``: B's worker hands its shards over point to point and exits; A trains on alone (one ``preempt``
  event, 2 -> 1). ``restart``: the notice is torchrun's SIGTERM (B's agent kills its worker and exits); A's worker
  finds its peer gone and rolls back, in a world of one, to the newest checkpoint (one ``failure`` event, 2 -> 1,
  with ``load`` and the steps since the checkpoint recomputed). A checkpoint-based recovery, cheaper than
  torchrun's (which would also restart A's worker): the comparison is conservative.

``restart`` is ``LIGHTNING_EMIG_LIVE_MEMBERSHIP=0``: torchrun's own behaviour.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from lightning_emig.change.events import read_events
from lightning_emig.strategy.resume import newest_checkpoint
from lightning_emig.testing.commands import descendants, is_alive, kill_tree
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.join_downtime import PATHS, event_record, last_step
from lightning_emig.testing.netns import HostBehindALink, host_behind_a_link
from lightning_emig.testing.nodes import log_tail, start_node, wait_for

How = Literal["worker_failure", "node_failure", "node_frozen", "host_vanish", "preemption"]

EVENT: dict[tuple[How, str], tuple[str, int, int]] = {
    ("worker_failure", "live"): ("failure", 2, 1),
    ("worker_failure", "restart"): ("restart", 2, 2),
    ("node_failure", "live"): ("failure", 2, 1),
    ("node_frozen", "live"): ("failure", 2, 1),
    ("host_vanish", "live"): ("failure", 2, 1),
    ("preemption", "live"): ("preempt", 2, 1),
    ("preemption", "restart"): ("failure", 2, 1),
}
"""(kind, old world, new world) of the event each path records for each way of leaving."""

LAYOUT: dict[How, list[str]] = {"worker_failure": ["layout=hsdp"], "node_failure": ["layout=hsdp"],
                                 "node_frozen": ["layout=hsdp"], "host_vanish": ["layout=hsdp"], "preemption": []}
"""A live rebuild after a failure needs a replica; a drain moves shards, so the default sharded layout."""


def has_path(how: How, path: str) -> bool:
    """Whether leaving ``how`` can be measured on ``path`` (a node gone whole has no restart path)."""
    return (how, path) in EVENT


def measure_departure(
    run_dir: Path, train_args: Sequence[str], path: str, *, how: How, model: str, after: int, steps_after: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Node B leaves ``how`` on ``path`` (``live`` or ``restart``); returns the event's record."""
    if not has_path(how, path):
        raise ValueError(f"{how} has no {path} path to measure (see lightning_emig.testing.departure_downtime)")
    with host_behind_a_link() if how == "host_vanish" else contextlib.nullcontext() as host:
        _leave(run_dir, train_args, path, how=how, after=after, steps_after=steps_after, timeout_s=timeout_s, host=host)
    event = _event(run_dir, EVENT[how, path])
    assert event is not None
    return event_record(run_dir, how, path, event, model=model)


def _event(run_dir: Path, kind: tuple[str, int, int]) -> dict[str, Any] | None:
    return next((e for e in read_events(run_dir) if (e["kind"], e["old_world"], e["new_world"]) == kind), None)


def _leave(run_dir: Path, train_args: Sequence[str], path: str, *, how: How, after: int, steps_after: int,
           timeout_s: float, host: HostBehindALink | None) -> None:
    """Start A and B (B behind ``host``'s link when given), let B leave ``how`` once the world of two is ready, and
    stop both once the event's steps were trained."""
    port = free_port()
    agents: dict[str, subprocess.Popen] = {}
    # torchrun's restart path restarts every worker (a restart each); live, B's node stays out after its worker died,
    # so that A's steady steps alone follow the failure (B coming back would be a join, another event).
    b_stays_out = (how, path) == ("worker_failure", "live")
    for name, address in (("a", "127.0.0.2"), ("b", "127.0.0.3")):
        far = name == "b"
        agents[name] = start_node(
            run_dir.parent, f"{run_dir.name}-{name}", local_addr=address if host is None else host.address(far=far),
            port=port, run_dir=run_dir, train_args=[*train_args, *LAYOUT[how]], nnodes="1:2", rdzv_id=run_dir.name,
            rdzv_conf=f"is_host={str(name == 'a').lower()}",
            env={**PATHS[path], **({} if host is None else host.gloo_env(far=far))},
            max_restarts=0 if name == "b" and b_stays_out else 1,
            rdzv_endpoint=None if host is None else f"{host.here}:{port}",
            prefix=host.prefix if host is not None and far else (),
        )
    kind = EVENT[how, path]

    def alive(names: Sequence[str]) -> None:
        if any(agents[n].poll() is not None for n in names):
            raise RuntimeError("an agent exited:\n" + "\n".join(
                log_tail(run_dir.parent, f"{run_dir.name}-{n}") for n in agents))

    def ready() -> bool:
        alive(list(agents))
        return last_step(run_dir, 2) >= after and newest_checkpoint(run_dir / "checkpoints") is not None

    def recovered() -> bool:
        alive(["a"] if how != "worker_failure" or b_stays_out else list(agents))  # B's agent exits, or was killed
        event = _event(run_dir, kind)
        return event is not None and max(last_step(run_dir, w) for w in (1, 2)) >= (
            event["step"] + (event.get("steps_rolled_back") or 0) + steps_after)

    try:
        wait_for(ready, timeout_s, f"the world of two did not reach step {after} with a checkpoint")
        if how == "preemption":
            agents["b"].send_signal(signal.SIGTERM)
        elif how == "node_failure":
            kill_tree(agents["b"].pid)
        elif host is not None:
            host.cut()
        elif how == "node_frozen":  # the agent first: it must not see its worker stop
            for pid in [agents["b"].pid, *(p for p in descendants(agents["b"].pid) if is_alive(p))]:
                os.kill(pid, signal.SIGSTOP)
        else:
            for pid in [p for p in descendants(agents["b"].pid) if is_alive(p)]:
                os.kill(pid, signal.SIGKILL)
        wait_for(recovered, timeout_s, f"no {kind[0]} event within {timeout_s:.0f}s")
    finally:
        for proc in agents.values():
            kill_tree(proc.pid)
            proc.wait(timeout=30)

