"""Chaos: a seeded random schedule of membership events played against simulated nodes, and what must hold after.

Three parts, used by ``tests/test_chaos.py``:

* :func:`make_schedule` (pure): from a seed, a list of :class:`ChaosEvent` — ``join`` (a fresh agent),
  ``preempt`` (an announced notice: SIGTERM to the agent, or the agent's ``LIGHTNING_EMIG_PREEMPT_FILE``
  appearing), ``kill_worker`` (SIGKILL of a node's worker; its agent rejoins with a fresh one, using one of
  ``--max-restarts``) and ``kill_node`` (SIGKILL of the agent and its worker). Every schedule holds bursts (events
  less than :data:`BURST_S` apart) and overlapping rounds (a join while the previous joiner is still starting), and
  respects the job's limits: node ``a`` hosts the c10d rendezvous store (``is_host=true``) and is never acted on —
  with the c10d backend losing it ends the job, a documented limitation — so the job never drops to zero nodes; it
  never counts more than MAX nodes; after a dip below MIN the next event is a join, and it ends with at least MIN.
  A node that left can come back only as a fresh agent (a new name; its address is reused once its processes are
  gone).
* :class:`ChaosRun`: starts the nodes, plays the schedule against wall time, waits for training to finish and, in
  every case, stops every process it started (agents, and workers by process id, even those an agent's death
  orphaned). Agents are started from the calling thread: they ask for their parent's death signal, which the kernel
  sends when the *thread* that started them ends.
* :func:`check_run`: a :class:`ChaosResult` — agents that were not killed exited 0; the data ledger is exactly once
  apart from the rollbacks events declare; no rollback where replicas existed; the loss within
  :data:`LOSS_REL_TOL` (or a tolerance the caller measured) of the uninterrupted run; ``events.jsonl`` one event per change, worlds chaining; no process
  left — and a summary (events played, rollbacks, steps lost, downtime per change, loss gap) as markdown.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_emig.strategy.events import read_events
from lightning_emig.strategy.resume import is_complete
from lightning_emig.testing.commands import descendants, is_alive, kill_tree
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.ledger import LedgerReport, check_ledger
from lightning_emig.testing.nodes import log_tail, start_node, worst_loss_gap
from lightning_emig.training.step_times import read_step_times

Kind = Literal["join", "preempt", "kill_worker", "kill_node"]

HOST = "a"
"""The node that hosts the rendezvous store: started first, never acted on."""
HOST_ADDRESS = "127.0.0.2"
ADDRESSES = tuple(f"127.0.0.{i}" for i in range(3, 10))
"""Loopback addresses of the other nodes (b .. h)."""
BURST_S = 1.5
"""Events closer than this form a burst."""
STARTING_S = 6.0
"""A join this soon after another lands while the previous joiner is still starting (its worker imports torch)."""
WEIGHTS: dict[Kind, float] = {"join": 3.0, "preempt": 1.0, "kill_worker": 1.5, "kill_node": 1.0}
"""How often each kind is drawn where the job allows it (joins most: the job should reach MAX now and then)."""
REUSE_AFTER_S = 30.0
"""A node's address is drawn for a join this long after the node left at the earliest: a preempted agent takes a
while to hand its state over and exit (the run still waits for it to be gone, shifting the rest of the schedule)."""
LOSS_REL_TOL = 1e-4
"""Documented tolerance of an elastic run's loss against the uninterrupted run (relative, per step)."""


# --- the schedule (pure) -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChaosEvent:
    kind: Kind
    node: str
    """The agent acted on: address letter and incarnation, e.g. ``c2`` (the second agent on 127.0.0.4)."""
    address: str
    delay_s: float
    """Seconds after the previous event (after the start of training for the first)."""
    notice: Literal["", "sigterm", "file"] = ""
    """How a preemption is announced."""

    def describe(self) -> str:
        how = f" ({self.notice})" if self.notice else ""
        return f"+{self.delay_s:.1f}s {self.kind} {self.node}{how}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleSpec:
    seed: int
    events: int
    min_nodes: int = 2
    max_nodes: int = 4
    max_restarts: int = 2
    """Each agent's ``--max-restarts``: how many times its worker may be killed (each rejoin uses one)."""
    addresses: tuple[str, ...] = ADDRESSES
    gap_s: tuple[float, float] = (5.0, 12.0)
    """Range of an ordinary gap between events (long enough for most changes to land)."""


@dataclass(slots=True)
class _Node:
    name: str
    address: str
    restarts_left: int


@dataclass(slots=True)
class _Plan:
    """The schedule being drawn and the job as it would be after its events."""

    spec: ScheduleSpec
    live: dict[str, _Node] = field(default_factory=dict)
    incarnations: dict[str, int] = field(default_factory=dict)
    events: list[ChaosEvent] = field(default_factory=list)
    clock_s: float = 0.0
    left_at: dict[str, float] = field(default_factory=dict)
    """Address -> when its node left (preempted, killed)."""

    def start(self, address: str) -> _Node:
        letter = chr(ord("a") + 1 + self.spec.addresses.index(address))
        self.incarnations[address] = self.incarnations.get(address, 0) + 1
        node = _Node(f"{letter}{self.incarnations[address]}", address, self.spec.max_restarts)
        self.live[node.name] = node
        return node

    def free_addresses(self) -> list[str]:
        """Addresses no node holds, nor held during the last :data:`REUSE_AFTER_S`."""
        used = {n.address for n in self.live.values()}
        return [a for a in self.spec.addresses
                if a not in used and self.clock_s - self.left_at.get(a, -REUSE_AFTER_S) >= REUSE_AFTER_S]

    def feasible(self) -> list[Kind]:
        """Kinds the job allows now (a join only below MIN: the job must not stay there)."""
        count = len(self.live) + 1  # + the host
        if count < self.spec.min_nodes:
            return ["join"]
        kinds: list[Kind] = ["join"] if count < self.spec.max_nodes and self.free_addresses() else []
        if self.live:
            kinds += ["preempt", "kill_node"]
        if any(n.restarts_left for n in self.live.values()):
            kinds.append("kill_worker")
        return kinds


def initial_nodes(min_nodes: int, addresses: Sequence[str] = ADDRESSES) -> list[tuple[str, str]]:
    """(name, address) of the nodes started before the schedule: the host, then MIN - 1 others."""
    return [(HOST, HOST_ADDRESS)] + [(f"{chr(ord('b') + i)}1", addresses[i]) for i in range(min_nodes - 1)]


def make_schedule(spec: ScheduleSpec) -> list[ChaosEvent]:
    """The seeded schedule of ``spec``: the first draw (seeds ``seed``, ``seed``-1, ...) that holds a burst, an
    overlapping join, every kind of event, and ends with at least MIN nodes."""
    if spec.min_nodes < 1 or spec.max_nodes < spec.min_nodes or spec.max_nodes - 1 > len(spec.addresses):
        raise ValueError(f"cannot schedule {spec.min_nodes}:{spec.max_nodes} nodes on {len(spec.addresses)} addresses")
    for attempt in range(1000):
        events = _draw(spec, random.Random(f"{spec.seed}-{attempt}"))
        if events is not None and _has_everything(events):
            return events
    raise ValueError(f"no schedule of {spec.events} events holds every pattern; ask for more events")


def _draw(spec: ScheduleSpec, rng: random.Random) -> list[ChaosEvent] | None:
    plan = _Plan(spec)
    for _, address in initial_nodes(spec.min_nodes, spec.addresses)[1:]:
        plan.start(address)
    for index in range(spec.events):
        gap = _gap(spec, rng, first=index == 0)
        plan.clock_s += gap
        kinds = plan.feasible()
        kind = rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
        plan.events.append(_apply(plan, kind, rng, gap))
    return plan.events if len(plan.live) + 1 >= spec.min_nodes else None


def _gap(spec: ScheduleSpec, rng: random.Random, *, first: bool) -> float:
    if first:
        return round(rng.uniform(*spec.gap_s), 1)
    draw = rng.random()
    if draw < 0.25:
        return round(rng.uniform(0.2, BURST_S - 0.1), 1)
    if draw < 0.5:
        return round(rng.uniform(BURST_S, STARTING_S - 0.5), 1)
    return round(rng.uniform(*spec.gap_s), 1)


def _apply(plan: _Plan, kind: Kind, rng: random.Random, delay_s: float) -> ChaosEvent:
    if kind == "join":
        node = plan.start(rng.choice(plan.free_addresses()))
        return ChaosEvent("join", node.name, node.address, delay_s)
    if kind == "kill_worker":
        node = plan.live[rng.choice(sorted(n for n, v in plan.live.items() if v.restarts_left))]
        node.restarts_left -= 1
        return ChaosEvent("kill_worker", node.name, node.address, delay_s)
    node = plan.live.pop(rng.choice(sorted(plan.live)))
    plan.left_at[node.address] = plan.clock_s
    notice = rng.choice(["sigterm", "file"]) if kind == "preempt" else ""
    return ChaosEvent(kind, node.name, node.address, delay_s, notice)  # type: ignore[arg-type]


def _has_everything(events: Sequence[ChaosEvent]) -> bool:
    kinds = {e.kind for e in events}
    return kinds == {"join", "preempt", "kill_worker", "kill_node"} and has_burst(events) and has_overlap(events)


def has_burst(events: Sequence[ChaosEvent]) -> bool:
    return any(e.delay_s < BURST_S for e in events[1:])


def has_overlap(events: Sequence[ChaosEvent]) -> bool:
    """A join that follows another join by less than :data:`STARTING_S` (the first joiner is still starting)."""
    for i, event in enumerate(events):
        if event.kind != "join":
            continue
        elapsed = 0.0
        for later in events[i + 1:]:
            elapsed += later.delay_s
            if elapsed >= STARTING_S:
                break
            if later.kind == "join":
                return True
    return False


# --- the run -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ChaosSettings:
    base_args: tuple[str, ...]
    """Training arguments the uninterrupted reference run shares (model, data, batch, steps)."""
    elastic_args: tuple[str, ...] = ("layout=hsdp", "data.ledger=true")
    """Added for the elastic run only (the reference runs on one process)."""
    min_nodes: int = 2
    max_nodes: int = 4
    max_restarts: int = 2
    warmup_steps: int = 10
    """Steps the first world trains before the schedule's clock starts."""
    start_timeout_s: float = 180.0
    finish_timeout_s: float = 600.0
    """After the last event: how long the agents may take to finish training and exit."""
    reuse_timeout_s: float = 120.0
    """How long a join waits for the previous agent on its address to be gone."""
    env: tuple[tuple[str, str], ...] = (("LIGHTNING_EMIG_GRACE_S", "120"),)


@dataclass(slots=True)
class Played:
    event: ChaosEvent
    at_s: float
    """Seconds after the schedule's start."""
    step: int
    """The last optimizer step rank 0 had recorded when it was played (-1: none yet)."""
    note: str = ""
    """Why it was not played as drawn (e.g. no worker to kill), or empty."""


class ChaosRun:
    """One job of simulated nodes under a schedule; :meth:`run` always stops every process it started."""

    def __init__(self, out_dir: Path, schedule: Sequence[ChaosEvent], settings: ChaosSettings) -> None:
        self.out_dir, self.run_dir = out_dir, out_dir / "run"
        self.schedule, self.settings = list(schedule), settings
        self.port = free_port()
        self.agents: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()
        """Agents killed by the schedule (their exit codes are not checked)."""
        self.played: list[Played] = []
        self.seen: dict[str, dict[int, str]] = {}
        """Every process each agent ever had (pid -> its /proc start time, so a reused pid is not taken for it)."""
        self.exit_codes: dict[str, int | None] = {}
        """Each agent's exit code when the run ended, before the harness stopped anything (None: still running)."""
        self.left_behind: list[int] = []
        """Processes alive after every agent had exited (the library's job), before the harness killed them."""
        self.stopped_early = ""
        """Why the run did not go to its end (a wait that timed out, training over before the schedule), or empty."""
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the watch thread adds to ``seen`` while the schedule reads it

    def run(self) -> None:
        """Start, play, wait for the end; a run that cannot go on stops, the reason in :attr:`stopped_early`."""
        watch = threading.Thread(target=self._watch, daemon=True)
        watch.start()
        try:
            for name, address in initial_nodes(self.settings.min_nodes):
                self._start(name, address)
            self._wait(lambda: len(read_step_times(self.run_dir)) >= self.settings.warmup_steps,
                       self.settings.start_timeout_s, "the first world never trained")
            self._play()
            self._wait(self._all_exited, self.settings.finish_timeout_s, "agents did not finish")
            # Workers die with their agent, by a death signal the kernel sends as the agent exits: a moment later.
            with contextlib.suppress(TimeoutError):
                self._wait(lambda: not self._alive(), 15, "")
        except (TimeoutError, RuntimeError) as err:
            self.stopped_early = str(err)
        finally:
            self.exit_codes = {name: proc.poll() for name, proc in self.agents.items()}
            self.left_behind = self._alive()
            self._stop.set()
            watch.join(timeout=5)
            self.stop_everything()

    def stop_everything(self) -> None:
        """Kill every agent's process tree and every process any agent had, by id; reap the agents."""
        for proc in self.agents.values():
            kill_tree(proc.pid)
        for pid in self._alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.agents.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def still_running(self) -> list[int]:
        """Processes of this run alive now (after :meth:`run`: must be none)."""
        return self._alive() + [p.pid for p in self.agents.values() if p.poll() is None]

    def logs(self, names: Sequence[str] | None = None, chars: int = 3000) -> str:
        return "\n".join(f"--- {n}.log\n{log_tail(self.out_dir, n, chars)}" for n in names or self.agents)

    def _start(self, name: str, address: str) -> None:
        s = self.settings
        self.agents[name] = start_node(
            self.out_dir, name, local_addr=address, port=self.port, run_dir=self.run_dir,
            train_args=[*s.base_args, *s.elastic_args], nnodes=f"{s.min_nodes}:{s.max_nodes}", rdzv_id="chaos",
            rdzv_conf=f"is_host={str(name == HOST).lower()}", max_restarts=s.max_restarts,
            env={**dict(s.env), "LIGHTNING_EMIG_PREEMPT_FILE": str(self._preempt_file(name))},
        )

    def _preempt_file(self, name: str) -> Path:
        return self.out_dir / f"preempt-{name}"

    def _play(self) -> None:
        started = due = time.monotonic()
        for event in self.schedule:
            due += event.delay_s
            time.sleep(max(0.0, due - time.monotonic()))
            self._check_still_training(event)
            at = time.monotonic() - started
            times = read_step_times(self.run_dir)
            step = times[-1]["step"] if times else -1
            self.played.append(Played(event, round(at, 1), step, self._act(event)))
            due = max(due, time.monotonic())  # an act that waited delays the rest: the gaps drawn stay as drawn

    def _act(self, event: ChaosEvent) -> str:
        if event.kind == "join":
            return self._join(event)
        agent = self.agents[event.node]
        if agent.poll() is not None:
            return f"its agent had already exited ({agent.returncode})"
        if event.kind == "preempt":
            if event.notice == "file":
                self._preempt_file(event.node).touch()
            else:
                os.kill(agent.pid, signal.SIGTERM)
            return ""
        if event.kind == "kill_node":
            self.killed.add(event.node)
            kill_tree(agent.pid)
            return ""
        workers = [p for p in descendants(agent.pid) if is_alive(p)]
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return "" if workers else "no worker was running"

    def _join(self, event: ChaosEvent) -> str:
        previous = [n for n in self.agents if n[0] == event.node[0]]
        waited = time.monotonic()
        self._wait(lambda: all(self.agents[n].poll() is not None for n in previous) and not self._alive(previous),
                   self.settings.reuse_timeout_s, f"the previous agent on {event.address} was not gone")
        self._start(event.node, event.address)
        waited = time.monotonic() - waited
        return f"waited {waited:.1f}s for {event.address} to be free" if waited > 0.5 else ""

    def _check_still_training(self, event: ChaosEvent) -> None:
        where = f"before event {len(self.played)} ({event.describe()})"
        if (self.run_dir / "summary.json").exists():
            raise RuntimeError(f"harness: training finished {where}; raise trainer.max_steps for this machine")
        if self.agents[HOST].poll() is not None:
            raise RuntimeError(f"the host's agent exited ({self.agents[HOST].returncode}) {where}: the job is over")

    def _all_exited(self) -> bool:
        return all(p.poll() is not None for p in self.agents.values())

    def _wait(self, predicate: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                running = [n for n, p in self.agents.items() if p.poll() is None]
                raise TimeoutError(f"{what} within {timeout_s:.0f}s (agents still running: {running})")
            time.sleep(0.2)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for name, proc in list(self.agents.items()):
                if proc.poll() is None:
                    found = {pid: _start_time(pid) for pid in descendants(proc.pid)}
                    with self._lock:
                        self.seen[name] = {**found, **self.seen.get(name, {})}

    def _alive(self, names: Sequence[str] | None = None) -> list[int]:
        """Processes any of ``names``' agents (default: all) ever had that are still alive."""
        with self._lock:
            seen = [(pid, started) for name in (self.seen if names is None else names)
                    for pid, started in self.seen.get(name, {}).items()]
        return sorted(pid for pid, started in seen if started and _start_time(pid) == started)


def _start_time(pid: int) -> str:
    """The process's start time (in clock ticks since boot), or "" when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return ""
    return "" if fields[0] == "Z" else fields[19]



# --- the checks ----------------------------------------------------------------------------------------------------


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
        out += ["", f"Rollbacks: {sum(_is_rollback(e) for e in self.events)}, steps lost (declared): "
                    f"{self.steps_lost}. Downtime per change: {spread}. Worst relative loss gap: {gap} "
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
    loss_check, gap = _check_loss(run, summary, events, LOSS_REL_TOL)
    checks = [
        Check("run", not run.stopped_early, run.stopped_early or "schedule played, every agent exited",
              tuple(run.agents) if run.stopped_early else ()),
        _check_agents(run),
        _check_ledger(ledger, events),
        _check_rollbacks(events),
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


def _check_rollbacks(events: list[dict[str, Any]]) -> Check:
    """No rollback where replicas existed: one node lost from a layout with ``dp_replicate >= 2``."""
    bad = [e for e in events if _is_rollback(e) and e["old_layout"]["dp_replicate"] >= 2
           and e["old_world"] - e["new_world"] <= 1]
    rollbacks = [e for e in events if _is_rollback(e)]
    detail = (f"{len(rollbacks)} rollback(s), none where replicas existed" if not bad else
              "rolled back although replicas existed: " + "; ".join(_describe_event(e) for e in bad))
    return Check("rollbacks", not bad, detail, (HOST,) if bad else ())


def _check_loss(run: ChaosRun, summary: dict[str, Any] | None, events: list[dict[str, Any]], tolerance: float
                ) -> tuple[Check, float | None]:
    """Every step's loss against the uninterrupted run. rank 0's ``summary.json`` holds the steps its process
    trained: after a restart (torchrun's restart path, a declared event) the steps before its checkpoint are not
    there and are not compared (said in the detail)."""
    if summary is None:
        return Check("loss", False, "no summary.json: training did not finish"), None
    losses = summary["step_losses"]
    restarts = [e["step"] for e in events if e["kind"] == "restart"]
    first = restarts[-1] if restarts else 0
    missing = sorted(set(range(first, _max_steps(run))) - {int(k) for k in losses})
    if missing:
        return Check("loss", False, f"no loss recorded for steps {_ranges(missing)}"), None
    steps = [k for k in losses if int(k) >= first]
    gap = worst_loss_gap(run.out_dir, run.settings.base_args, losses, steps)
    since = f" (steps {first}.. trained since the last restart)" if first else ""
    return Check("loss", gap < tolerance, f"worst relative gap to the uninterrupted run {gap:.1e}{since} "
                 f"(tolerance {tolerance:.1e})"), gap


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
