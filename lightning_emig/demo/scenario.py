"""The elastic demo's script of events: three simulated nodes, one training job, a join, a preemption, a failure.

Nodes are ``lightning-emig-run`` agents with one worker each on distinct loopback addresses
(:mod:`lightning_emig.testing.nodes`), ``--nnodes=1:3``:

* A (127.0.0.2) hosts the rendezvous store, so it is never the one preempted or killed;
* A and B start together and train as a world of two;
* after ``steps_between`` steps C (127.0.0.4) starts: a live **join**, world 2 -> 3;
* after ``steps_between`` more steps B's agent gets SIGTERM: a **preemption with notice**, B hands its state
  to A and C and leaves, world 3 -> 2;
* after ``steps_between`` more steps node C is killed whole (SIGKILL of agent and worker): an abrupt **failure**,
  world 2 -> 1. A notices as C's process exits (its connection to C closes:
  :mod:`~lightning_emig.membership.exit_watch`; a host that vanished would be noticed by its stale heartbeat) and
  rebuilds from replicas (HSDP: A holds a whole copy) or, without replicas (FSDP), rolls back to the last periodic
  checkpoint;
* A trains alone to ``max_steps`` and writes ``summary.json``.

Every process started here is stopped by :meth:`DemoNodes.stop_all`, whatever happens (the caller wraps the run in
``try/finally``). Stages that do not happen in time, or an agent that exits when it should not, raise
:class:`DemoFailed` with the tails of the agents' logs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_emig.change.events import read_events
from lightning_emig.demo.report import recovery
from lightning_emig.testing.commands import kill_tree
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.join_downtime import last_step
from lightning_emig.testing.nodes import log_tail, start_node, wait_for

ADDRESSES = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4"}


class DemoFailed(RuntimeError):
    """The run did not go through the script (a stage timed out or an agent exited when it should not)."""


@dataclass(kw_only=True, slots=True)
class DemoSettings:
    layout: str = "hsdp"
    """``hsdp`` (2 replicas where the world allows: the failure is rebuilt from replicas) or ``fsdp`` (no
    replicas: the failure rolls back to the last checkpoint)."""
    model: str = "tiny"
    data: str = "stdlib"
    """``stdlib`` (Python's own sources, bytes: a loss curve that keeps falling) or ``synthetic``."""
    seq_len: int = 64
    max_steps: int = 500
    steps_between: int = 25
    """Optimizer steps on each world before the next event."""
    global_batch_size: int = 12
    """Divisible by micro batch x 1, 2 and 3 data-parallel ranks."""
    micro_batch_size: int = 2
    checkpoint_every: int = 10
    heartbeat_timeout_s: float = 3.0
    grace_s: float = 60.0
    stage_timeout_s: float = 240.0
    """Seconds each stage may take before the demo gives up."""

    def __post_init__(self) -> None:
        if self.data not in ("stdlib", "synthetic"):
            raise ValueError(f"data must be 'stdlib' or 'synthetic', got {self.data!r}")
        if self.layout not in ("hsdp", "fsdp"):
            raise ValueError(f"layout must be 'hsdp' or 'fsdp', got {self.layout!r}")
        for dp in (1, 2, 3):
            if self.global_batch_size % (self.micro_batch_size * dp):
                raise ValueError(f"global_batch_size {self.global_batch_size} is not a whole number of micro-batches "
                                 f"of {self.micro_batch_size} on {dp} data-parallel rank(s); try 12")

    def train_args(self, max_steps: int | None = None) -> list[str]:
        """The workers' overrides (the restart-path measurement passes a larger ``max_steps``)."""
        return [
            f"model={self.model}", f"data={self.data}", f"data.seq_len={self.seq_len}", f"layout={self.layout}",
            f"trainer.max_steps={max_steps or self.max_steps}",
            f"trainer.global_batch_size={self.global_batch_size}", f"trainer.micro_batch_size={self.micro_batch_size}",
            f"trainer.checkpoint_every_n_steps={self.checkpoint_every}", "trainer.progress_bar=false",
            "trainer.pg_timeout_s=60", "elastic.heartbeat_interval_s=0.5",
            f"elastic.heartbeat_timeout_s={self.heartbeat_timeout_s}",
        ]


@dataclass(slots=True)
class ScenarioOutcome:
    run_dir: Path
    exit_codes: dict[str, int | None]
    timeline: list[dict[str, Any]] = field(default_factory=list)


class DemoNodes:
    """The demo job's nodes: start them, preempt or kill one, notice an agent that exits out of turn."""

    def __init__(self, out_dir: Path, settings: DemoSettings, say: Callable[[str], None]) -> None:
        self.out_dir, self.settings, self._say = out_dir, settings, say
        self.run_dir = out_dir / "run"
        self.port = free_port()
        self.agents: dict[str, subprocess.Popen] = {}
        self.expected_exit: dict[str, int] = {}
        """Nodes told to go, and the exit code that means they went as told."""
        self.timeline: list[dict[str, Any]] = []
        self._started = time.monotonic()

    def note(self, action: str) -> None:
        elapsed = time.monotonic() - self._started
        self.timeline.append({"seconds": round(elapsed, 2), "time": time.time(), "action": action})
        self._say(f"[{elapsed:6.1f}s] {action}")

    def start(self, name: str) -> None:
        self.agents[name] = start_node(
            self.out_dir, name, local_addr=ADDRESSES[name], port=self.port, run_dir=self.run_dir,
            train_args=self.settings.train_args(), nnodes="1:3", rdzv_id=self.out_dir.name,
            rdzv_conf=f"is_host={str(name == 'a').lower()}",
            env={"LIGHTNING_EMIG_GRACE_S": str(self.settings.grace_s)},
        )

    def preempt(self, name: str) -> None:
        """SIGTERM to the agent: the notice of a preemption (its worker hands off its state, then both exit 0)."""
        self.expected_exit[name] = 0
        os.kill(self.agents[name].pid, signal.SIGTERM)

    def kill(self, name: str) -> None:
        """SIGKILL of the node's agent and worker: no notice at all."""
        self.expected_exit[name] = -signal.SIGKILL
        kill_tree(self.agents[name].pid)
        self.agents[name].wait(timeout=30)

    def check(self) -> None:
        """Raise :class:`DemoFailed` if an agent has exited out of turn or with the wrong code, or the run finished
        before the script was done (A's agent may then wait in torchrun's exit barrier for a late joiner)."""
        if "a" not in self.expected_exit and (self.run_dir / "summary.json").exists():
            raise DemoFailed(f"the run reached max_steps={self.settings.max_steps} before the script's events were "
                             "done; raise --max-steps")
        for name, proc in self.agents.items():
            code = proc.poll()
            if code is None or code == self.expected_exit.get(name):
                continue
            raise DemoFailed(f"node {name.upper()}'s agent exited with {code}")

    def wait(self, predicate: Callable[[], bool], what: str) -> None:
        def ready() -> bool:
            self.check()
            return predicate()

        try:
            wait_for(ready, self.settings.stage_timeout_s, what)
        except TimeoutError:
            raise DemoFailed(f"timed out after {self.settings.stage_timeout_s:.0f}s: {what}") from None

    def last_step(self, world: int) -> int:
        return last_step(self.run_dir, world)

    def event(self, kind: str, old_world: int, new_world: int) -> dict[str, Any] | None:
        return next((e for e in read_events(self.run_dir)
                     if (e["kind"], e["old_world"], e["new_world"]) == (kind, old_world, new_world)), None)

    def wait_event_and_steps(self, kind: str, old_world: int, new_world: int, steps: int) -> dict[str, Any]:
        """Wait for the event, then for ``steps`` optimizer steps on the new world after it."""
        self.wait(lambda: self.event(kind, old_world, new_world) is not None,
                  f"no {kind} event (world {old_world} -> {new_world})")
        event = self.event(kind, old_world, new_world)
        assert event is not None
        self.note(f"{kind} event at step {event['step']}: downtime {event['downtime_seconds']:.2f}s")
        target = event["step"] + (event.get("steps_rolled_back") or 0) + steps
        if steps:
            self.wait(lambda: self.last_step(new_world) >= target, f"no step {target} on the world of {new_world}")
        return event

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(f"----- node {name.upper()} ({self.out_dir / f'{name}.log'}), last {chars} chars -----\n"
                         + log_tail(self.out_dir, name, chars) for name in self.agents)

    def stop_all(self) -> None:
        for proc in self.agents.values():
            kill_tree(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


def run_scenario(nodes: DemoNodes) -> ScenarioOutcome:
    """Drive the script on ``nodes`` until A's agent has exited (the caller stops every node afterwards)."""
    s = nodes.settings
    nodes.note(f"start A ({ADDRESSES['a']}, hosts the rendezvous store) and B ({ADDRESSES['b']}): "
               f"{s.model} model, layout={s.layout}, {s.max_steps} steps")
    nodes.start("a")
    nodes.start("b")
    nodes.wait(lambda: nodes.last_step(2) >= s.steps_between,
               f"A and B did not reach step {s.steps_between} as a world of two (if A formed a world of one first, "
               f"its log says so)")
    nodes.note(f"world 2 at step {nodes.last_step(2)}: start C ({ADDRESSES['c']}) -> join")
    nodes.start("c")
    nodes.wait_event_and_steps("join", 2, 3, s.steps_between)

    nodes.note(f"world 3 at step {nodes.last_step(3)}: SIGTERM to B's agent -> preemption with notice")
    nodes.preempt("b")
    nodes.wait_event_and_steps("preempt", 3, 2, s.steps_between)
    nodes.wait(lambda: nodes.agents["b"].poll() is not None, "B's agent did not exit after its preemption")

    nodes.note(f"world 2 at step {nodes.last_step(2)}: SIGKILL to node C (agent and worker) -> failure")
    nodes.kill("c")
    failure = nodes.wait_event_and_steps("failure", 2, 1, 0)
    nodes.note(f"recovery: {recovery(failure)}; A trains on alone to step {s.max_steps}")
    nodes.expected_exit["a"] = 0
    nodes.wait(lambda: nodes.agents["a"].poll() is not None, f"A did not finish its {s.max_steps} steps")
    nodes.check()
    if not (nodes.run_dir / "summary.json").exists():
        raise DemoFailed("A's agent exited 0 but the run wrote no summary.json")
    nodes.note("A finished: run complete")
    return ScenarioOutcome(run_dir=nodes.run_dir, exit_codes={n: p.poll() for n, p in nodes.agents.items()},
                           timeline=nodes.timeline)
