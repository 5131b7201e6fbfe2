"""What must hold after a chaos run (:class:`~lightning_emig.testing.chaos.ChaosRun`), checked from what the job
left behind: agents' exit codes and logs, ``events.jsonl``, the data ledger, the run's ``summary.json`` and its
checkpoints, and the processes still alive.

:func:`check_run` gives a :class:`ChaosResult`: agents that were not killed exited 0; the data ledger is exactly
once apart from the rollbacks events declare; no rollback where replicas existed; the loss within
:data:`LOSS_REL_TOL` of the uninterrupted run; ``events.jsonl`` one event per change,
worlds chaining; periodic checkpoints complete after every live change (a save a failure cut short excused); no
process left — and a summary (events played, rollbacks, steps lost, downtime per change, loss gap) as markdown.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_emig.change.events import read_events
from lightning_emig.strategy.resume import is_complete
from lightning_emig.strategy.step_times import read_step_times
from lightning_emig.testing.chaos import HOST, ChaosRun, Played
from lightning_emig.testing.ledger import LedgerReport, check_ledger
from lightning_emig.testing.nodes import log_tail, reference_losses

LOSS_REL_TOL = 1e-4
"""Documented tolerance of an elastic run's loss against the uninterrupted run (relative, per step)."""


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str
    logs: tuple[str, ...] = ()
    """Agents whose logs explain a failure."""


@dataclass(slots=True)
class ChaosResult:
    seed: int
    played: list[Played]
    events: list[dict[str, Any]]
    checks: list[Check]
    ledger: str
    loss_gap: float | None
    loss_tolerance: float
    steps_lost: int

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def explain(self, run: ChaosRun) -> str:
        """Every failed check, with the tails of the logs of the agents concerned (for an assertion message)."""
        lines = [f"chaos seed {self.seed}: {len(self.failed())} check(s) failed"]
        lines += [f"FAILED {check.name}: {check.detail}" for check in self.failed()]
        lines += ["schedule as played:"] + [f"  {p.at_s:6.1f}s step {p.step:4d} {p.event.describe()} {p.note}"
                                            for p in self.played]
        names = dict.fromkeys(name for check in self.failed() for name in check.logs)
        return "\n".join([*lines, run.logs(list(names))])

    def markdown(self, title: str, command: str = "") -> str:
        """The results as a markdown page: checks, the schedule as played, the events the job recorded, totals."""
        out = [f"# {title}", "", f"Seed {self.seed}, {len(self.played)} events played." + (
            f" Command: `{command}`" if command else ""), "", "## Checks", ""]
        out += [f"- {'PASS' if c.ok else 'FAIL'} **{c.name}**: {c.detail}" for c in self.checks]
        gap = "n/a" if self.loss_gap is None else f"{self.loss_gap:.1e}"
        downtimes = sorted(e["downtime_seconds"] for e in self.events if e.get("downtime_seconds") is not None)
        spread = (f"median {downtimes[len(downtimes) // 2]:.2f}s, max {downtimes[-1]:.2f}s over {len(downtimes)}"
                  if downtimes else "none recorded")
        detects = [e["seconds"]["detect"] for e in self.events if e["kind"] == "failure" and "detect" in e["seconds"]]
        detect = f"max {max(detects):.2f}s over {len(detects)} failure(s)" if detects else "no failure event"
        out += ["", f"Rollbacks: {sum(_is_rollback(e) for e in self.events)}, steps lost (declared): "
                    f"{self.steps_lost}. Downtime per change: {spread}. Failure detection (last seen alive to the "
                    f"survivors' decision): {detect}. Worst relative loss gap: {gap} "
                    f"(tolerance {self.loss_tolerance:.1e}). Ledger: {self.ledger}", "",
                "## Schedule as played", "", "| # | at (s) | step | event | note |", "|---|---|---|---|---|"]
        out += [f"| {i} | {p.at_s:.1f} | {p.step} | {p.event.describe()} | {p.note} |"
                for i, p in enumerate(self.played)]
        out += ["", "## Events recorded (`events.jsonl`)", "",
                "| kind | step | generation | world | layout | downtime (s) | steps rolled back |",
                "|---|---|---|---|---|---|---|"]
        out += [_event_row(e) for e in self.events]
        return "\n".join(out) + "\n"


def _event_row(e: dict[str, Any]) -> str:
    layout = f"{_short(e['old_layout'])} -> {_short(e['new_layout'])}"
    downtime = "" if e.get("downtime_seconds") is None else f"{e['downtime_seconds']:.2f}"
    return (f"| {e['kind']} | {e['step']} | {e.get('generation', '')} | {e['old_world']} -> {e['new_world']} | "
            f"{layout} | {downtime} | {e.get('steps_rolled_back') or 0} |")


def _short(layout: dict[str, int]) -> str:
    return f"{layout['dp_replicate']}x{layout['dp_shard']}"


def check_run(run: ChaosRun, seed: int) -> ChaosResult:
    """What must hold once :meth:`ChaosRun.run` returned (each check names the agents whose logs explain it).
    ``loss_tolerance``: relative, per step, against the uninterrupted one-process run."""
    events = read_events(run.run_dir)
    summary_path = run.run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    ledger = check_ledger(run.run_dir) if summary is not None else None
    loss_check, gap = _check_loss(run, summary, LOSS_REL_TOL)
    checks = [
        Check("run", not run.stopped_early, run.stopped_early or "schedule played, every agent exited",
              tuple(run.agents) if run.stopped_early else ()),
        _check_agents(run),
        _check_ledger(ledger, events),
        _check_rollbacks(events, run.played),
        loss_check,
        _check_events(events, summary),
        _check_checkpoints(run, events, summary),
        _check_processes(run),
    ]
    return ChaosResult(seed=seed, played=run.played, events=events, checks=checks,
                       ledger=ledger.describe() if ledger else "no ledger (training did not finish)",
                       loss_gap=gap, loss_tolerance=LOSS_REL_TOL, steps_lost=sum(_declared(e) for e in events))


def _check_agents(run: ChaosRun) -> Check:
    """Agents not killed by the schedule (preempted ones too) exit 0."""
    codes = {n: c for n, c in run.exit_codes.items() if n not in run.killed}
    bad = {n: c for n, c in codes.items() if c != 0}
    return Check("agents", not bad, f"exit codes {codes} ({sorted(run.killed)} killed)" if not bad
                 else f"agents that did not exit 0 (None: still running when stopped): {bad}", tuple(bad))


def _declared(event: dict[str, Any]) -> int:
    return int(event.get("steps_rolled_back") or 0)


def _is_rollback(event: dict[str, Any]) -> bool:
    """Training went back to a checkpoint: a restart, or a failure that loaded one or declared steps lost."""
    return event["kind"] == "restart" or _declared(event) > 0 or (
        event["kind"] == "failure" and "load" in event.get("seconds", {}))


def _check_ledger(ledger: LedgerReport | None, events: list[dict[str, Any]]) -> Check:
    """Exactly once, and the steps trained again are those the events declare: a failure at step s may redo s
    (cut short); a rollback from step s over n steps redoes s .. s + n."""
    if ledger is None:
        return Check("ledger", False, "no summary.json: training did not finish")
    if not ledger.ok:
        return Check("ledger", False, f"{ledger.describe()}: " + "; ".join(ledger.problems[:10]), (HOST,))
    allowed: set[int] = set()
    for e in events:
        if e["kind"] in ("failure", "restart"):
            allowed.update(range(e["step"], e["step"] + _declared(e) + 1))
    undeclared = sorted(set(ledger.rolled_back_steps) - allowed)
    false = sorted({s for e in events for s in range(e["step"], e["step"] + _declared(e))}
                   - set(ledger.rolled_back_steps))
    problems = ([f"steps trained again that no event declares: {_ranges(undeclared)}"] if undeclared else []) + (
        [f"steps declared rolled back that were not trained again: {_ranges(false)}"] if false else [])
    return Check("ledger", not problems, "; ".join(problems) or ledger.describe(), (HOST,) if problems else ())


def _check_rollbacks(events: list[dict[str, Any]], played: list[Played]) -> Check:
    """No rollback where replicas existed: one node lost from a layout with ``dp_replicate >= 2`` — unless the
    schedule killed as many nodes as there were replicas while the job stood at the step the rollback came from
    (every copy gone before any survivor could record a change: a restart from the checkpoint is right then)."""
    bad, excused = [], []
    for event in (e for e in events if _is_rollback(e)):
        replicas = event["old_layout"]["dp_replicate"]
        if replicas < 2 or event["old_world"] - event["new_world"] > 1:
            continue
        killed = _nodes_killed_at(played, event["step"] + (event.get("steps_rolled_back") or 0))
        (excused if len(killed) >= replicas else bad).append((event, killed))
    rollbacks = [e for e in events if _is_rollback(e)]
    detail = (f"{len(rollbacks)} rollback(s), none where replicas existed" if not bad else
              "rolled back although replicas existed: " + "; ".join(_describe_event(e) for e, _ in bad))
    if excused:
        detail += "; " + "; ".join(f"{_describe_event(e)}: every replica's node was killed ({', '.join(k)})"
                                   for e, k in excused)
    return Check("rollbacks", not bad, detail, (HOST,) if bad else ())


def _nodes_killed_at(played: list[Played], step: int) -> list[str]:
    """The nodes whose worker or whole node the schedule killed while training stood at ``step`` (or one step before
    it: the step in flight); a kill that found no worker running does not count."""
    return sorted({p.event.node for p in played if p.event.kind in ("kill_worker", "kill_node")
                   and step - 1 <= p.step <= step and not p.note})


def _check_loss(run: ChaosRun, summary: dict[str, Any] | None, tolerance: float) -> tuple[Check, float | None]:
    """Every step's loss against the uninterrupted run, from ``step_times.jsonl``: it spans every process that was
    rank 0 (the store host's worker may die and rejoin), and a step trained again after a rollback or a restart is
    compared each time it was trained. Rank 0 writes a step's line after the step: a kill at that step may take rank
    0 before it writes (the survivors go on from the step, so nobody trains it again), and its line is excused."""
    if summary is None:
        return Check("loss", False, "no summary.json: training did not finish"), None
    trained = [(record["step"] - 1, record["loss"]) for record in read_step_times(run.run_dir) if "loss" in record]
    missing = sorted(set(range(_max_steps(run))) - {step for step, _ in trained})
    unexcused = [step for step in missing if not _nodes_killed_at(run.played, step + 1)]
    if unexcused:
        return Check("loss", False, f"no loss recorded for steps {_ranges(unexcused)}"), None
    reference = reference_losses(run.out_dir, run.settings.base_args)
    gaps = [(abs(loss - reference[str(step)]) / abs(reference[str(step)]), step) for step, loss in trained]
    gap, worst = max(gaps)
    again = len(trained) - len({step for step, _ in trained})
    excused = f"; no line for steps {_ranges(missing)}, each at a kill (of rank 0, before it wrote)" if missing else ""
    detail = (f"worst relative gap to the uninterrupted run {gap:.1e} at step {worst} over {len(trained)} steps "
              f"trained ({again} of them again after a rollback or restart; tolerance {tolerance:.1e}){excused}")
    return Check("loss", gap < tolerance, detail), gap


def _max_steps(run: ChaosRun) -> int:
    return next(int(a.split("=", 1)[1]) for a in run.settings.base_args if a.startswith("trainer.max_steps="))


def _check_events(events: list[dict[str, Any]], summary: dict[str, Any] | None) -> Check:
    """One event per change: each starts from the world the previous one left, generations only grow, the last
    one leaves the world that finished."""
    problems = []
    for before, after in zip(events, events[1:], strict=False):
        if after["old_world"] != before["new_world"]:
            problems.append(f"worlds do not chain: {_describe_event(before)}, then {_describe_event(after)}")
        if (after.get("generation") or 0) <= (before.get("generation") or 0):
            problems.append(f"generation does not grow: {_describe_event(before)}, then {_describe_event(after)}")
    if summary is not None and events and events[-1]["new_world"] != summary["world_size"]:
        problems.append(f"last event leaves world {events[-1]['new_world']}, training finished on "
                        f"{summary['world_size']}")
    detail = "; ".join(problems[:8]) or f"{len(events)} events, worlds chain"
    return Check("events", not problems, detail, (HOST,) if problems else ())


def _check_checkpoints(run: ChaosRun, events: list[dict[str, Any]], summary: dict[str, Any] | None) -> Check:
    """Periodic checkpoints keep working after every live change: no save failed that a failure did not cut short,
    and the first one due after each change that was not a rollback, on the world that change made, is complete
    (when that world trained past it and did not end in a failure right after it, which may abandon a save being
    written)."""
    every = int(_arg(run.settings.base_args, "trainer.checkpoint_every_n_steps"))
    last = int(_arg(run.settings.base_args, "trainer.max_steps"))
    failed = [name for name in run.agents
              if unexcused_failed_saves(log_tail(run.out_dir, name, 10**7), events, every)]
    missing, checked = [], []
    for event, after in zip(events, [*events[1:], None], strict=True):
        due = (event["step"] // every + 1) * every
        ends = after["step"] if after is not None else last + 1
        abandoned = after is not None and after["kind"] in ("failure", "restart") and ends - due < 5
        if _is_rollback(event) or due >= ends or due > last or abandoned or summary is None:
            continue
        checked.append(f"{due} (world {event['new_world']})")
        if not is_complete(run.run_dir / "checkpoints" / f"step{due:06d}.ckpt"):
            missing.append(f"step {due}, due after the {event['kind']} at step {event['step']}")
    problems = [f"CHECKPOINT FAILED in {failed}"] * bool(failed) + [f"incomplete: {', '.join(missing)}"] * bool(missing)
    return Check("checkpoints", not problems, "; ".join(problems) or f"complete after every change: {', '.join(checked)}",
                 tuple(failed) or ((HOST,) if missing else ()))


_FAILED_SAVE = re.compile(r"CHECKPOINT FAILED: writing .* \(step (\d+)\)")


def unexcused_failed_saves(log: str, events: list[dict[str, Any]], every: int) -> list[int]:
    """The steps of the saves ``log`` reports failed that no failure explains. A save is written in the background
    while training goes on; a node killed before it finished breaks the collectives that confirm it, and the save
    fails on the survivors as it should. So a failed save of step s is excused by a failure (or restart) that struck
    from step s until the next save was due (s + ``every``); any other failed save is the checkpoint's fault. A
    change that rolled back n steps to resume at step r struck at r + n."""
    cut_short = [e["step"] + _declared(e) for e in events if e["kind"] in ("failure", "restart")]
    steps = [int(m.group(1)) for m in _FAILED_SAVE.finditer(log)]
    return [s for s in steps if not any(s <= at < s + every for at in cut_short)]


def _arg(args: Sequence[str], key: str) -> str:
    """The value of the Hydra override ``key=value`` in ``args``."""
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"{key}="))


def _check_processes(run: ChaosRun) -> Check:
    """Nothing an agent started outlives the agents (the library's job), nor the run (the harness's)."""
    after_cleanup = run.still_running()
    if run.stopped_early:
        return Check("processes", not after_cleanup, f"run stopped early; alive after cleanup: {after_cleanup}")
    ok = not run.left_behind and not after_cleanup
    return Check("processes", ok, "none left" if ok else
                 f"left behind by exited agents: {run.left_behind}; alive after cleanup: {after_cleanup}")


def _describe_event(e: dict[str, Any]) -> str:
    return (f"{e['kind']} at step {e['step']} gen {e.get('generation')} world {e['old_world']}->{e['new_world']} "
            f"({_short(e['old_layout'])}->{_short(e['new_layout'])}, {_declared(e)} rolled back)")


def _ranges(steps: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` as ``3-5, 9``."""
    out: list[str] = []
    for step in steps:
        if out and int(out[-1].split("-")[-1]) == step - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{step}"
        else:
            out.append(str(step))
    return ", ".join(out)
