"""Downtime of one node join on simulated nodes, on the live path or torchrun's restart path (benchmarks, demo).

:func:`measure_join` runs one job on this host (:mod:`lightning_emig.testing.nodes`): ``nodes_before`` nodes start
together (127.0.0.2 hosts the rendezvous store, then 127.0.0.3, ...); once the world of ``nodes_before`` processes
has finished ``join_after`` optimizer steps one more node starts; when the new world has finished ``steps_after``
steps beyond the event (plus the steps it recomputes) every agent is stopped. The job is not run to the end: only
the event is measured.

* ``live``: the default ``lightning-emig-run``: the running workers keep training while the new one starts, then
  hand their state over point to point (``events.jsonl``: one ``join`` event);
* ``restart``: ``LIGHTNING_EMIG_LIVE_MEMBERSHIP=0``, torchrun's own behaviour: every worker is stopped, all start
  again, load the newest checkpoint resharded for the new world and recompute the steps after it (one ``restart``
  event with ``steps_rolled_back``).

:func:`join_record` turns the run directory into one record (see ``tools/bench_elastic.py`` for its fields).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_emig.change.events import read_events
from lightning_emig.change.lost_time import lost_time, recovery_span
from lightning_emig.strategy.resume import newest_checkpoint
from lightning_emig.strategy.step_times import read_step_times
from lightning_emig.testing.commands import kill_tree
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.nodes import log_tail, start_node, wait_for

PATHS: dict[str, dict[str, str]] = {"live": {}, "restart": {"LIGHTNING_EMIG_LIVE_MEMBERSHIP": "0"}}
"""Agent environment of each path."""
EVENT_KIND = {"live": "join", "restart": "restart"}
"""The event each path records for a join."""
NODE_ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6")


def measure_join(
    run_dir: Path, train_args: Sequence[str], path: str, *, model: str, join_after: int, steps_after: int,
    timeout_s: float, nodes_before: int = 1,
) -> dict[str, Any]:
    """One join of node ``nodes_before + 1`` on ``path`` (``live`` or ``restart``); returns its record.

    Node logs go next to ``run_dir`` as ``<run_dir.name>-<letter>.log``. Every agent is stopped on return or error.
    """
    if not 1 <= nodes_before < len(NODE_ADDRESSES):
        raise ValueError(f"nodes_before must be 1..{len(NODE_ADDRESSES) - 1}, got {nodes_before}")
    port = free_port()
    kind = EVENT_KIND[path]
    agents: dict[str, subprocess.Popen] = {}
    names = [f"{run_dir.name}-{chr(ord('a') + i)}" for i in range(nodes_before + 1)]

    def start(i: int) -> None:
        agents[names[i]] = start_node(
            run_dir.parent, names[i], local_addr=NODE_ADDRESSES[i], port=port, run_dir=run_dir,
            train_args=train_args, nnodes=f"1:{nodes_before + 1}", rdzv_id=run_dir.name,
            rdzv_conf=f"is_host={str(i == 0).lower()}", env=PATHS[path],
        )

    def check_agents(ok: tuple[int | None, ...]) -> None:
        if any(p.poll() not in ok for p in agents.values()):
            raise RuntimeError("an agent exited:\n" + "\n".join(log_tail(run_dir.parent, n) for n in agents))

    def ready() -> bool:
        # A complete checkpoint first: the restart path resumes from it (a newer one may still be in flight).
        check_agents((None,))
        return last_step(run_dir, nodes_before) >= join_after and newest_checkpoint(run_dir / "checkpoints") is not None

    def joined() -> bool:
        check_agents((None, 0))
        event = _join_event(run_dir, kind, nodes_before)
        return event is not None and last_step(run_dir, nodes_before + 1) >= event["step"] + steps_after + \
            event.get("steps_rolled_back", 0)

    try:
        for i in range(nodes_before):
            start(i)
        wait_for(ready, timeout_s, f"the world of {nodes_before} did not reach step {join_after}")
        joiner_started = time.time()
        start(nodes_before)
        wait_for(joined, timeout_s, f"no {kind} event within {timeout_s:.0f}s")
    finally:
        for proc in agents.values():
            kill_tree(proc.pid)
            proc.wait(timeout=30)
    return join_record(run_dir, path, model=model, old_world=nodes_before, joiner_started=joiner_started)


def join_record(run_dir: Path, path: str, *, model: str, old_world: int = 1,
                joiner_started: float | None = None) -> dict[str, Any]:
    """The record of the join from ``old_world`` to ``old_world + 1`` processes in ``run_dir``."""
    event = _join_event(run_dir, EVENT_KIND[path], old_world)
    if event is None:
        raise RuntimeError(f"no {EVENT_KIND[path]} event from world {old_world} in {run_dir}")
    return event_record(run_dir, "join", path, event, model=model, preparing_from=joiner_started)


def event_record(run_dir: Path, name: str, path: str, event: dict[str, Any], *, model: str,
                 preparing_from: float | None = None) -> dict[str, Any]:
    """One benchmark record of ``event`` (a line of ``events.jsonl``), its step times read from ``run_dir``.

    ``preparing_from`` (``time.time()``): when the change became known (a joiner's start); the old world's steps
    from then to the change are its steps *while preparing*, compared with its steps before."""
    times = read_step_times(run_dir)
    span = recovery_span(event, times)
    if span is None:
        raise RuntimeError(f"no step beyond step {event['step']} after the {event['kind']} event in {run_dir}")
    last_old, run = span
    # None where the next event came right after the first step beyond (no steady step of the new world).
    lost = lost_time(event, times, partial=True)
    old = [t for t in times if t["world"] == event["old_world"] and t["time"] <= last_old["time"]]
    new = [t for t in times if t["time"] > last_old["time"]]
    before = [t for t in old if preparing_from is None or t["time"] <= preparing_from]
    # The step in flight when the change became known counts as a step while preparing.
    preparing = old[len(before) - 1:] if preparing_from is not None and before else []
    return {
        "event": name,
        "path": path,
        "model": model,
        "old_world": event["old_world"],
        "new_world": event["new_world"],
        "step": event["step"],
        "steps_rolled_back": event.get("steps_rolled_back") or 0,
        "lost_seconds": lost.lost_seconds if lost is not None else None,
        "downtime_seconds": event["downtime_seconds"],
        "downtime_from_step_times": new[0]["time"] - last_old["time"],
        "recovery_seconds": run[0]["time"] - last_old["time"],
        "phases": event["seconds"],
        "first_step_excess_seconds": lost.first_step_excess_seconds if lost is not None else None,
        "lost_cpu_seconds": lost.lost_cpu_seconds if lost is not None else None,
        "extra_page_faults": lost.extra_page_faults if lost is not None else None,
        "first_step_parts_excess": lost.first_step_parts_excess if lost is not None else None,
        "pause_seconds": lost.pause_seconds if lost is not None else None,
        "steady_step_spread_seconds": lost.steady_step_spread_seconds if lost is not None else None,
        # A failure's goal: lose the step in flight (last boundary to the death) and at most a second more.
        "lost_beyond_in_flight_seconds": (lost.lost_seconds - event["seconds"]["in_flight"]
                                          if lost is not None and "in_flight" in event["seconds"] else None),
        "bytes_moved": event["bytes_moved"],
        "step_seconds_old": median_step_seconds(before),
        "step_seconds_preparing": median_step_seconds(preparing),
        "step_seconds_new": lost.steady_step_seconds if lost is not None else None,
        "steady_steps": lost.steady_steps if lost is not None else 0,
        "run_dir": str(run_dir),
    }


def last_step(run_dir: Path, world: int) -> int:
    """The highest step finished on a world of ``world`` processes (0 if none)."""
    return max((r["step"] for r in read_step_times(run_dir) if r["world"] == world), default=0)


def median_step_seconds(records: list[dict[str, Any]]) -> float | None:
    """Median time between consecutive steps of ``step_times.jsonl`` records (``None`` without such a pair)."""
    gaps = [b["time"] - a["time"] for a, b in zip(records, records[1:], strict=False) if b["step"] == a["step"] + 1]
    return statistics.median(gaps) if gaps else None


def _join_event(run_dir: Path, kind: str, old_world: int) -> dict[str, Any] | None:
    return next((e for e in read_events(run_dir)
                 if e["kind"] == kind and e["old_world"] == old_world and e["new_world"] == old_world + 1), None)
