"""Chaos: a seeded random schedule of membership events played against simulated nodes, and what must hold after.

Three parts, used by ``tests/test_chaos.py`` (the first two here):

* :func:`make_schedule` (pure): from a seed, a list of :class:`ChaosEvent` — ``join`` (a fresh agent),
  ``preempt`` (an announced notice: SIGTERM to the agent, or the agent's ``LIGHTNING_EMIG_PREEMPT_FILE``
  appearing), ``kill_worker`` (SIGKILL of a node's worker; its agent rejoins with a fresh one, using one of
  ``--max-restarts``) and ``kill_node`` (SIGKILL of the agent and its worker). Every schedule holds bursts (events
  less than :data:`BURST_S` apart), overlapping rounds (a join while the previous joiner is still starting), a kill
  while the previous kill is being recovered from, a departure that takes the job below MIN during a failure's
  recovery, and a kill of node ``a``'s worker; it respects the job's limits: with the c10d backend node ``a`` hosts the
  rendezvous store (``is_host=true``) and never leaves (losing it ends the job, a documented limitation; its *worker*
  is killed like any other); with etcd no node is special and ``a``, the node started first, leaves in every
  schedule. The job never drops to zero nodes, never counts more than MAX; after a dip below MIN the next event is a
  join, and it ends with at least MIN.
  A node that left can come back only as a fresh agent (a new name; its address is reused once its processes are
  gone).
* :class:`ChaosRun`: starts the nodes, plays the schedule against wall time, waits for training to finish and, in
  every case, stops every process it started (agents, and workers by process id, even those an agent's death
  orphaned). Agents are started from the calling thread: they ask for their parent's death signal, which the kernel
  sends when the *thread* that started them ends.
* :func:`~lightning_emig.testing.chaos_checks.check_run` (its own module): what must hold after the run.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_emig.strategy.step_times import read_step_times
from lightning_emig.testing.commands import descendants, is_alive, kill_tree
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.nodes import log_tail, start_node

Kind = Literal["join", "preempt", "kill_worker", "kill_node"]
Backend = Literal["c10d", "etcd"]

HOST = "a"
"""The node started first: with c10d it hosts the rendezvous store and never leaves (its worker may be killed)."""
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
    backend: Backend = "c10d"
    """``etcd``: node ``a`` is like any other (it may be preempted or killed, and is, in every schedule)."""


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

    def leavable(self) -> list[str]:
        """Nodes that may leave now: never the last one, never the c10d store's host."""
        if len(self.live) < 2:
            return []
        return sorted(n for n in self.live if n != HOST or self.spec.backend == "etcd")

    def feasible(self) -> list[Kind]:
        """Kinds the job allows now (a join only below MIN: the job must not stay there)."""
        count = len(self.live)
        if count < self.spec.min_nodes:
            return ["join"]
        kinds: list[Kind] = ["join"] if count < self.spec.max_nodes and self.free_addresses() else []
        if self.leavable():
            kinds += ["preempt", "kill_node"]
        if any(n.restarts_left for n in self.live.values()):
            kinds.append("kill_worker")
        return kinds


def initial_nodes(min_nodes: int, addresses: Sequence[str] = ADDRESSES) -> list[tuple[str, str]]:
    """(name, address) of the nodes started before the schedule: ``a``, then MIN - 1 others."""
    return [(HOST, HOST_ADDRESS)] + [(f"{chr(ord('b') + i)}1", addresses[i]) for i in range(min_nodes - 1)]


def make_schedule(spec: ScheduleSpec) -> list[ChaosEvent]:
    """The seeded schedule of ``spec``: the first draw (seeds ``seed``, ``seed``-1, ...) that holds a burst, an
    overlapping join, every kind of event, and ends with at least MIN nodes."""
    if spec.min_nodes < 1 or spec.max_nodes < spec.min_nodes or spec.max_nodes - 1 > len(spec.addresses):
        raise ValueError(f"cannot schedule {spec.min_nodes}:{spec.max_nodes} nodes on {len(spec.addresses)} addresses")
    for attempt in range(5000):
        events = _draw(spec, random.Random(f"{spec.seed}-{attempt}"))
        if events is not None and _has_everything(events, spec):
            return events
    raise ValueError(f"no schedule of {spec.events} events holds every pattern; ask for more events")


def _draw(spec: ScheduleSpec, rng: random.Random) -> list[ChaosEvent] | None:
    plan = _Plan(spec)
    plan.live[HOST] = _Node(HOST, HOST_ADDRESS, spec.max_restarts)
    for _, address in initial_nodes(spec.min_nodes, spec.addresses)[1:]:
        plan.start(address)
    for index in range(spec.events):
        gap = _gap(spec, rng, first=index == 0)
        plan.clock_s += gap
        kinds = plan.feasible()
        kind = rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
        plan.events.append(_apply(plan, kind, rng, gap))
    return plan.events if len(plan.live) >= spec.min_nodes else None


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
    node = plan.live.pop(rng.choice(plan.leavable()))
    plan.left_at[node.address] = plan.clock_s
    notice = rng.choice(["sigterm", "file"]) if kind == "preempt" else ""
    return ChaosEvent(kind, node.name, node.address, delay_s, notice)  # type: ignore[arg-type]


def _has_everything(events: Sequence[ChaosEvent], spec: ScheduleSpec) -> bool:
    kinds = {e.kind for e in events}
    host_acted_on = {e.kind for e in events if e.node == HOST}
    host_pattern = host_acted_on & {"preempt", "kill_node"} if spec.backend == "etcd" else "kill_worker" in host_acted_on
    return (kinds == {"join", "preempt", "kill_worker", "kill_node"} and has_burst(events) and has_overlap(events)
            and has_kill_in_recovery(events) and has_dip_in_recovery(events, spec.min_nodes) and bool(host_pattern))


def _within(events: Sequence[ChaosEvent], first: int, seconds: float) -> list[ChaosEvent]:
    """The events that follow ``events[first]`` by less than ``seconds``."""
    later, elapsed = [], 0.0
    for event in events[first + 1:]:
        elapsed += event.delay_s
        if elapsed >= seconds:
            break
        later.append(event)
    return later


def has_kill_in_recovery(events: Sequence[ChaosEvent]) -> bool:
    """A kill that lands while the job still recovers from the previous one (less than :data:`STARTING_S` later)."""
    kills = ("kill_worker", "kill_node")
    return any(e.kind in kills and any(f.kind in kills for f in _within(events, i, STARTING_S))
               for i, e in enumerate(events))


def has_dip_in_recovery(events: Sequence[ChaosEvent], min_nodes: int) -> bool:
    """A departure that takes the job below MIN while it recovers from a kill (less than :data:`STARTING_S` later)."""
    count, below = min_nodes, []  # below[i]: the job is below MIN after event i
    for event in events:
        count += {"join": 1, "preempt": -1, "kill_node": -1}.get(event.kind, 0)
        below.append(count < min_nodes)
    for i, event in enumerate(events):
        if event.kind not in ("kill_worker", "kill_node"):
            continue
        later = _within(events, i, STARTING_S)
        if any(f.kind in ("preempt", "kill_node") and below[i + 1 + j] for j, f in enumerate(later)):
            return True
    return False


def has_burst(events: Sequence[ChaosEvent]) -> bool:
    return any(e.delay_s < BURST_S for e in events[1:])


def has_overlap(events: Sequence[ChaosEvent]) -> bool:
    """A join that follows another join by less than :data:`STARTING_S` (the first joiner is still starting)."""
    return any(e.kind == "join" and any(f.kind == "join" for f in _within(events, i, STARTING_S))
               for i, e in enumerate(events))


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
    etcd_endpoint: str | None = None
    """``host:port`` of an etcd server: the job rendezvouses over ``etcd-v2`` (no node hosts the store); else c10d on
    node ``a``."""


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
            rdzv_conf=f"is_host={str(name == HOST).lower()}" if s.etcd_endpoint is None else "",
            rdzv_backend="c10d" if s.etcd_endpoint is None else "etcd-v2", rdzv_endpoint=s.etcd_endpoint,
            max_restarts=s.max_restarts,
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
        if self.settings.etcd_endpoint is None and self.agents[HOST].poll() is not None:
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
