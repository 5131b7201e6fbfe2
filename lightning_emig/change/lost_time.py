"""Time lost to a change: the headline figure of every membership event, on either path.

*Lost time* is what the job would have had back without the event: from the last optimizer step finished on the
old world to the first step *beyond it* finished on the new one, minus one steady step on the new world (the
training a step is anyway). On the live path the first step beyond is the first step after the change; on the
restart path it comes after the rolled-back steps are recomputed, so those count as lost. *Downtime* (last step on
the old world to the first step on the new, whatever its number) stays the second figure.

Both are read from ``step_times.jsonl`` (one line per optimizer step, every generation and restart of the job)
and the event's line of ``events.jsonl``: one pure function, :func:`lost_time`, used by the running job (rank 0
reports each event's lost time once the steady steps after it are done), by :func:`events_with_lost_time` (a run
directory's events annotated afterwards), ``make demo`` and ``tools/bench_elastic.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_emig.change.events import read_events
from lightning_emig.jsonl import read_complete_lines

STEP_TIMES_FILE = "step_times.jsonl"
#: Steps after the first step beyond the change whose fastest is "one steady step on the new world": the fastest,
#: not the median, because a periodic checkpoint written in the background slows the one or two steps it overlaps
#: (measured at ``llama_125m`` on 2 cores: 6.7 s steps became 9.5-10.2 s) and a slowed "steady" step would hide
#: lost time (a negative figure, once). The fastest makes the figure, if anything, too high.
STEADY_STEPS = 3
#: The event's downtime is counted from the moment the old world's last step ended, as the rendezvous callback saw
#: it; that step's line in ``step_times.jsonl`` is written just before (the step times are the strategy's first
#: callback), or later by what the script's own callbacks before them do at the step's end: up to this long later,
#: and never as late as half the downtime (no step of the new world ends before the downtime does, and a small
#: model's or a GPU's steps are shorter than this lag: its first step's line would be taken for the old world's).
_LINE_LAG_S = 0.25


@dataclass(frozen=True, slots=True)
class LostTime:
    lost_seconds: float
    """``recovery_seconds`` minus ``steady_step_seconds``."""
    recovery_seconds: float
    """Last step on the old world to the first step beyond it on the new one."""
    steady_step_seconds: float
    """The fastest of the step times right after that first step beyond (``steady_steps`` of them)."""
    steady_steps: int
    last_old_step: int
    first_step_excess_seconds: float | None = None
    """How much slower the first step on the new world ran than a steady one (the event's ``first_step`` phase minus
    ``steady_step_seconds``): the part of the lost time spent after the pause, in a step that found something cold.
    None where the event has no ``first_step`` phase. On the restart path the first step is the restarted process's
    first (recomputed) step: its excess is what that process met cold."""
    lost_cpu_seconds: float | None = None
    """Of ``lost_seconds``, how much rank 0's training thread spent working (the CPU seconds from the old world's last
    step to the first step beyond, less those of the steady step): building, copying, caches met cold, the first
    step's own extra work. The rest it waited: for the wire, its peers or a core. None where those lines come from
    different processes (the restart path) or carry no ``cpu``."""
    extra_page_faults: int | None = None
    """Rank 0's page faults over the change and the first step beyond, less those of the steady step: memory touched
    for the first time (the transfer's new shards, a larger world's gradients...), each fault a 4 KiB page mapped and
    zeroed. None where ``lost_cpu_seconds`` is, or the lines carry no ``faults``."""
    first_step_parts_excess: dict[str, float] | None = None
    """Per part of a step (``forward``, ``backward``, ``optimizer``: see :mod:`~lightning_emig.strategy.step_times`),
    how much longer it ran in the first step beyond than in the steady one: where a first step's excess went. None
    where the lines carry no ``parts``."""
    steady_step_spread_seconds: float = 0.0
    """The slowest of the steady steps less the fastest: how far one step's time wanders on this host with nothing
    changing. A ``first_step_excess_seconds`` within it is not told apart from a steady step (on a shared 2-core VM
    the steps of one world differ by up to 2 s in 10)."""
    pause_seconds: float | None = None
    """The lost time that is neither the first step nor, after a failure, the step in flight: from the old world's
    last step (after a failure: from when the death was first known) to the state in place and proven
    (``recovery_seconds`` less the event's ``first_step`` and ``in_flight`` phases; on the restart path also the
    recomputed steps after the first). Unlike the first step's excess, host noise barely touches it. None where the
    event has no ``first_step`` phase."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def lost_time(event: dict[str, Any], times: list[dict[str, Any]], *, steady_steps: int = STEADY_STEPS,
              partial: bool = False) -> LostTime | None:
    """The lost time of ``event`` (a line of ``events.jsonl``) from the step times of its run.

    None for an event without downtime (a layout change inside one world, an interrupted join), and until the
    ``steady_steps`` steps after the first step beyond are done (with ``partial``: until one is; never where the
    next event came right after that first step: no steady step of that world exists).
    """
    span = recovery_span(event, times)
    if span is None:
        return None
    last_old, run = span
    gaps = [b["time"] - a["time"] for a, b in zip(run, run[1:], strict=False)][:steady_steps]
    if not gaps or (len(gaps) < steady_steps and not partial):
        return None
    fastest = min(range(len(gaps)), key=gaps.__getitem__)
    steady = gaps[fastest]
    recovery = run[0]["time"] - last_old["time"]
    phases = event.get("seconds") or {}
    first_step = phases.get("first_step")
    return LostTime(lost_seconds=recovery - steady, recovery_seconds=recovery, steady_step_seconds=steady,
                    steady_steps=len(gaps), last_old_step=int(last_old["step"]),
                    first_step_excess_seconds=first_step - steady if first_step is not None else None,
                    lost_cpu_seconds=_beyond_steady("cpu", last_old, run, fastest),
                    extra_page_faults=_beyond_steady("faults", last_old, run, fastest),
                    first_step_parts_excess=_parts_excess(last_old, run, fastest),
                    steady_step_spread_seconds=max(gaps) - steady,
                    pause_seconds=(recovery - first_step - phases.get("in_flight", 0.0)
                                   if first_step is not None else None))


def _beyond_steady(counter: str, last_old: dict[str, Any], run: list[dict[str, Any]], fastest: int) -> Any:
    """How much ``counter`` (a running count on each line: ``cpu``, ``faults``) grew to the first step beyond less what
    it grew in the steady step (``run[fastest]`` to the line after it), where one process wrote all of those lines."""
    lines = [last_old, run[0], run[fastest], run[fastest + 1]]
    if any(counter not in line for line in lines) or len({line["pid"] for line in lines}) != 1:
        return None
    return (run[0][counter] - last_old[counter]) - (run[fastest + 1][counter] - run[fastest][counter])


def _parts_excess(last_old: dict[str, Any], run: list[dict[str, Any]], fastest: int) -> dict[str, float] | None:
    """The first step beyond's ``parts`` less the steady step's (``run[fastest + 1]``); the rest of a step's time is
    left out: the first step beyond's rest holds the change's pause."""
    first, steady = run[0].get("parts"), run[fastest + 1].get("parts")
    if first is None or steady is None:
        return None
    return {part: round(seconds - steady.get(part, 0.0), 4) for part, seconds in first.items()}


def recovery_span(event: dict[str, Any], times: list[dict[str, Any]]
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """``(the old world's last step, the run of consecutive steps on the new world from the first step beyond it)``
    as records of ``step_times.jsonl``; None without downtime or before the first step beyond."""
    if event.get("downtime_seconds") is None or "time" not in event:
        return None
    old_end = event["time"] - event["downtime_seconds"] + min(_LINE_LAG_S, event["downtime_seconds"] / 2)
    # The last step before the change began: the old world's, or, where the old world never finished one (a change
    # refused as its fit started, then rolled back), the world's before it: the refused change's cost is counted too.
    before = [t for t in times if t["time"] <= old_end]
    if not before:
        return None
    last_old = max(before, key=lambda t: t["time"])
    later = [t for t in times if t["time"] > last_old["time"]]
    beyond = next((i for i, t in enumerate(later) if t["step"] > last_old["step"]), None)
    if beyond is None:
        return None
    run = [later[beyond]]
    for record in later[beyond + 1:]:
        if record["step"] != run[-1]["step"] + 1 or record["world"] != run[0]["world"]:
            break  # another event: its own lost time
        run.append(record)
    return last_old, run


def events_with_lost_time(run_dir: Path) -> list[dict[str, Any]]:
    """Every event of ``run_dir`` with ``lost_seconds``, ``recovery_seconds`` and ``steady_step_seconds`` added
    where the steps after it allow (fewer than :data:`STEADY_STEPS` steady steps are used when the run stopped
    sooner)."""
    times = read_complete_lines(run_dir / STEP_TIMES_FILE)
    out = []
    for event in read_events(run_dir):
        lost = lost_time(event, times, partial=True)
        out.append({**event, **(lost.as_dict() if lost is not None else {})})
    return out


__all__ = ["STEADY_STEPS", "LostTime", "events_with_lost_time", "lost_time", "recovery_span"]
