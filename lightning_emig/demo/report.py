"""What the elastic demo shows: table rows, the loss plot and ``demo.json``, from the run's records (pure).

Inputs are the records the run leaves behind (see :mod:`lightning_emig.change.events` and
:mod:`lightning_emig.strategy.step_times`): event dicts as in ``events.jsonl``, per-step losses from
``summary.json`` and ``(step, world)`` pairs from ``step_times.jsonl``; the restart path's join is a record of
:func:`lightning_emig.testing.join_downtime.join_record`. Nothing here starts a process or reads a run directory
except :func:`load_losses`, so every function is tested on synthetic records.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

EVENT_COLUMNS = ("event", "step", "world", "layout", "MB moved", "lost s", "downtime s", "rolled back", "recovery")
"""Columns of :func:`event_rows`."""

FORCED_KILL_MARK = "forcefully exiting via 9"
"""What torchrun's agent logs when a worker has not exited within its grace period after SIGTERM."""

KIND_COLORS = {"join": "tab:green", "preempt": "tab:orange", "failure": "tab:red", "restart": "tab:purple",
               "reconfigure": "tab:blue"}


def layout_label(layout: dict[str, int]) -> str:
    """``rep=2 shard=1`` (``dp_replicate``, ``dp_shard``), with ``tp=`` / ``pp=`` only when above 1."""
    parts = [f"rep={layout['dp_replicate']}", f"shard={layout['dp_shard']}"]
    parts += [f"{axis}={layout[axis]}" for axis in ("tp", "pp") if layout.get(axis, 1) > 1]
    return " ".join(parts)


def is_rollback(event: dict[str, Any]) -> bool:
    """A recovery that reloaded a checkpoint (a ``failure`` rolled back, or a ``restart``) rather than live state.

    A rollback's phases include ``load`` (reading the checkpoint); a rebuild from replicas has none.
    """
    return event["kind"] == "restart" or (
        event["kind"] == "failure" and ("load" in event["seconds"] or (event.get("steps_rolled_back") or 0) > 0))


def recovery(event: dict[str, Any]) -> str:
    """How the job got over the event, in a few words."""
    kind, lost = event["kind"], event.get("steps_rolled_back") or 0
    if kind == "join":
        return "live: state moved to the joiner"
    if kind == "preempt":
        return "live: the leaver handed off its state"
    if kind == "reconfigure":
        return "live: re-laid out in place"
    if kind == "failure" and not is_rollback(event):
        return "rebuilt from replicas, no step lost"
    if kind == "failure":
        return f"ROLLED BACK to the step-{event['step']} checkpoint, {lost} step(s) lost"
    return f"every worker restarted from the step-{event['step']} checkpoint, {lost} step(s) recomputed"


def event_label(event: dict[str, Any]) -> str:
    return f"{event['kind']} {event['old_world']}->{event['new_world']}"


def event_rows(events: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row of :data:`EVENT_COLUMNS` per event, as strings."""
    rows = []
    for e in events:
        downtime, lost = e.get("downtime_seconds"), e.get("lost_seconds")
        rows.append((
            e["kind"],
            str(e["step"]),
            f"{e['old_world']} -> {e['new_world']}",
            f"{layout_label(e['old_layout'])} -> {layout_label(e['new_layout'])}",
            f"{e['bytes_moved'] / 1e6:.2f}",
            f"{lost:.2f}" if lost is not None else "-",
            f"{downtime:.2f}" if downtime is not None else "-",
            str(e.get("steps_rolled_back") or 0),
            recovery(e),
        ))
    return rows


def phase_rows(events: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(event at step, "phase 0.123 · phase 0.456 ...")`` per event, phases in the order they ran."""
    return [(f"{e['kind']} @ {e['step']}",
             " · ".join(f"{phase} {seconds:.3f}" for phase, seconds in e["seconds"].items()))
            for e in events]


def compare_join(live: dict[str, Any] | None, restart: dict[str, Any] | None) -> dict[str, Any] | None:
    """The live join's lost time and downtime next to the restart path's for a join of the same worlds; ``None``
    without both (``lost_ratio`` None where either lost time is unknown or the live one is not above zero)."""
    if live is None or restart is None:
        return None
    live_lost, restart_lost = live.get("lost_seconds"), restart.get("lost_seconds")
    return {
        "worlds": f"{live['old_world']} -> {live['new_world']}",
        "live_lost_seconds": live_lost,
        "restart_lost_seconds": restart_lost,
        "lost_ratio": restart_lost / live_lost if live_lost and restart_lost is not None and live_lost > 0 else None,
        "live_downtime_seconds": live["downtime_seconds"],
        "restart_downtime_seconds": restart["downtime_seconds"],
        "downtime_ratio": restart["downtime_seconds"] / live["downtime_seconds"],
        "restart_steps_rolled_back": restart["steps_rolled_back"],
        "restart_recovery_seconds": restart["recovery_seconds"],
        "restart_phases": restart["phases"],
        "restart_workers_force_killed": restart.get("workers_force_killed", 0),
    }


def forced_kills(log_texts: Iterable[str]) -> int:
    """How many workers torchrun had to SIGKILL because they did not exit on its SIGTERM (from the agents' logs)."""
    return sum(text.count(FORCED_KILL_MARK) for text in log_texts)


def find_event(events: Sequence[dict[str, Any]], kind: str, old_world: int | None = None) -> dict[str, Any] | None:
    return next((e for e in events if e["kind"] == kind and old_world in (None, e["old_world"])), None)


def load_losses(summary: dict[str, Any]) -> dict[int, float]:
    """``summary.json``'s ``step_losses`` keyed by int step, in step order."""
    return {int(step): loss for step, loss in sorted(summary["step_losses"].items(), key=lambda kv: int(kv[0]))}


SMOOTHING = 10
"""Steps in the running mean drawn over the raw loss."""


def running_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and up to ``window - 1`` before it (as long as the input)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_plot(
    path: Path, losses: dict[int, float], events: Sequence[dict[str, Any]], *,
    worlds: Sequence[tuple[int, int]] = (), restart: dict[str, Any] | None = None, title: str = "",
) -> Path:
    """Loss vs step with a line and label per event (world size shaded behind), and beside it each event's downtime
    next to the restart path's join (``restart``, a join record) when there is one. Written as PNG (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2.3, 1]})
    steps = list(losses)
    values = [losses[s] for s in steps]
    ax.plot(steps, values, color="black", linewidth=0.6, alpha=0.35, label="loss")
    if len(values) >= 2 * SMOOTHING:
        ax.plot(steps, running_mean(values, SMOOTHING), color="black", linewidth=1.4,
                label=f"mean of {SMOOTHING} steps")
        ax.legend(loc="lower left", fontsize=8, frameon=False)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    if worlds:
        world_ax = ax.twinx()
        xs, ys = zip(*worlds, strict=True)
        world_ax.fill_between(xs, ys, step="post", color="tab:blue", alpha=0.08, linewidth=0)
        world_ax.step(xs, ys, where="post", color="tab:blue", alpha=0.4, linewidth=0.8)
        world_ax.set_ylabel("processes", color="tab:blue")
        world_ax.set_ylim(0, max(ys) + 1)
        world_ax.set_yticks(range(0, max(ys) + 1))
        ax.set_zorder(world_ax.get_zorder() + 1)
        ax.patch.set_visible(False)
    top = max(losses.values()) if losses else 1.0
    for e in events:
        color = KIND_COLORS.get(e["kind"], "gray")
        ax.axvline(e["step"], color=color, linestyle="--", linewidth=1.2)
        lost = e.get("steps_rolled_back") or 0
        if lost:
            ax.axvspan(e["step"], e["step"] + lost, color=color, alpha=0.15)
        note = "replicas" if e["kind"] == "failure" and not is_rollback(e) else (f"-{lost} steps" if lost else "")
        ax.annotate(f"{event_label(e)}\n{note}".rstrip(), (e["step"], top), xytext=(3, -2),
                    textcoords="offset points", rotation=90, va="top", ha="left", fontsize=8, color=color)
    ax.set_title(title or "loss vs step, membership events marked")

    labels, seconds, colors = [], [], []
    for e in events:
        if e.get("lost_seconds", e.get("downtime_seconds")) is not None:
            labels.append(f"{event_label(e)} @ {e['step']}")
            seconds.append(e.get("lost_seconds", e["downtime_seconds"]))
            colors.append(KIND_COLORS.get(e["kind"], "gray"))
    if restart is not None:
        labels.append(f"join {restart['old_world']}->{restart['new_world']}\n(restart path)")
        seconds.append(restart.get("lost_seconds", restart["downtime_seconds"]))
        colors.append(KIND_COLORS["restart"])
    positions = list(range(len(labels)))[::-1]
    bars.barh(positions, seconds, color=colors)
    bars.set_yticks(positions, labels, fontsize=8)
    for y, s in zip(positions, seconds, strict=True):
        bars.annotate(f"{s:.2f} s", (s, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    bars.set_xlabel("time lost (s)")
    bars.set_xlim(min(0.0, *seconds) * 1.3, max(seconds, default=1.0) * 1.3)
    bars.set_title("time lost: last step on the old world to the first\nstep beyond it on the new, minus a steady "
                   "step", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def demo_record(
    *, settings: dict[str, Any], run_dir: Path, events: Sequence[dict[str, Any]], summary: dict[str, Any] | None,
    restart: dict[str, Any] | None, timeline: Sequence[dict[str, Any]], wall_seconds: float, files: dict[str, str],
) -> dict[str, Any]:
    """Everything ``demo.json`` holds."""
    live_join = find_event(events, "join", restart["old_world"] if restart else None)
    return {
        "settings": settings,
        "run_dir": str(run_dir),
        "events": [{**e, "recovery": recovery(e)} for e in events],
        "final": None if summary is None else {k: summary.get(k) for k in (
            "layout", "world_size", "steps", "first_loss", "last_loss", "tokens_per_second", "pid")},
        "restart_path_join": restart,
        "join_comparison": compare_join(live_join, restart),
        "timeline": list(timeline),
        "wall_seconds": wall_seconds,
        "files": files,
    }


def write_demo_json(path: Path, record: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    return path


def print_report(console: Any, record: dict[str, Any]) -> None:
    """The event table, seconds per phase, the recovery of each failure and the live vs restart join (rich)."""
    from rich.table import Table

    events = record["events"]
    table = Table(title="membership events (rep = dp_replicate, shard = dp_shard)", title_justify="left")
    for column in EVENT_COLUMNS:
        table.add_column(column, justify="right" if column in ("step", "MB moved", "lost s", "downtime s", "rolled back")
                         else "left", overflow="fold")
    for row in event_rows(events):
        table.add_row(*row, style="bold red" if row[0] == "failure" and "ROLLED" in row[-1] else None)
    console.print(table)

    phases = Table(title="seconds per phase", title_justify="left")
    phases.add_column("event")
    phases.add_column("phases (s)", overflow="fold")
    for label, text in phase_rows(events):
        phases.add_row(label, text)
    console.print(phases)

    for e in events:
        if e["kind"] == "failure":
            console.print(f"[bold]failure at step {e['step']}:[/bold] {recovery(e)}")
    comparison = record.get("join_comparison")
    if comparison is not None:
        c = comparison
        if c["lost_ratio"] is not None:
            console.print(
                f"[bold]join {c['worlds']}:[/bold] time lost live {c['live_lost_seconds']:.2f} s, restart path "
                f"{c['restart_lost_seconds']:.2f} s -> restart/live [bold]{c['lost_ratio']:.1f}x[/bold] (lost: last "
                "step on the old world to the first step beyond it on the new, minus one steady step)")
        console.print(
            f"[bold]join {c['worlds']}:[/bold] live downtime {c['live_downtime_seconds']:.2f} s, restart path "
            f"{c['restart_downtime_seconds']:.2f} s -> restart/live [bold]{c['downtime_ratio']:.1f}x[/bold] "
            f"(the restart path also recomputed {c['restart_steps_rolled_back']} step(s): "
            f"{c['restart_recovery_seconds']:.2f} s to regain the old step; its phases: "
            + " · ".join(f"{k} {v:.2f}" for k, v in c["restart_phases"].items()) + ")")
        if c["restart_workers_force_killed"]:
            console.print(f"  note: torchrun had to SIGKILL {c['restart_workers_force_killed']} worker(s) that did not "
                          "exit within its grace period after its SIGTERM (restart-*.log); that wait is part of "
                          "stop_and_start")
    elif record.get("restart_path_join") is None:
        console.print("restart path: not measured (--skip-restart)")
    final = record.get("final")
    if final is not None and final.get("first_loss") is not None:
        console.print(f"finished: {final['steps']} steps on world {final['world_size']} "
                      f"({layout_label(final['layout'])}), loss {final['first_loss']:.3f} -> {final['last_loss']:.3f}")
