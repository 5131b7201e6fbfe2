"""``python -m lightning_emig.demo`` (what ``make demo`` runs): the elastic demo, then the restart path's join.

Everything goes to ``outputs/demo-<timestamp>/`` (or ``--out-dir``): ``run/`` (the job's run directory:
``events.jsonl``, ``step_times.jsonl``, ``summary.json``, ``csv/``, ``checkpoints/``), ``a.log`` ``b.log``
``c.log`` (each node's agent and worker), ``restart/`` and ``restart-*.log`` (the restart path's join),
``loss.png`` and ``demo.json``. Every process started is stopped on the way out, Ctrl-C and SIGTERM included. Exit
status 1 when the run did not go through its events or the restart measurement failed (with the logs' tails), 130
when interrupted.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from lightning_emig.change.lost_time import events_with_lost_time
from lightning_emig.demo.report import (
    demo_record,
    forced_kills,
    load_losses,
    print_report,
    write_demo_json,
    write_plot,
)
from lightning_emig.demo.scenario import DemoFailed, DemoNodes, DemoSettings, run_scenario
from lightning_emig.strategy.step_times import read_step_times
from lightning_emig.testing.join_downtime import measure_join
from lightning_emig.testing.nodes import log_tail


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = DemoSettings()
    p = argparse.ArgumentParser(prog="python -m lightning_emig.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=("hsdp", "fsdp"), default=defaults.layout,
                   help="hsdp: the failure is rebuilt from replicas; fsdp: it rolls back to the last checkpoint")
    p.add_argument("--model", default=defaults.model)
    p.add_argument("--data", choices=("stdlib", "synthetic"), default=defaults.data)
    p.add_argument("--max-steps", type=int, default=defaults.max_steps)
    p.add_argument("--steps-between", type=int, default=defaults.steps_between,
                   help="optimizer steps on each world before the next event")
    p.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    p.add_argument("--stage-timeout", type=float, default=defaults.stage_timeout_s, help="seconds per stage")
    p.add_argument("--skip-restart", action="store_true", help="do not measure the restart path's join")
    p.add_argument("--out-dir", type=Path, default=None, help="default: outputs/demo-<timestamp>")
    return p.parse_args(argv)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = DemoSettings(layout=args.layout, model=args.model, data=args.data, max_steps=args.max_steps,
                            steps_between=args.steps_between, checkpoint_every=args.checkpoint_every,
                            stage_timeout_s=args.stage_timeout)
    out_dir = (args.out_dir or Path("outputs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out_dir.mkdir(parents=True, exist_ok=False)
    console = Console()
    if not console.is_terminal:  # piped or logged: rich would wrap the tables at 80 columns
        console = Console(width=150)

    def say(message: str) -> None:
        console.print(message, markup=False, highlight=False)

    signal.signal(signal.SIGTERM, _interrupt)  # `kill <demo pid>` stops the nodes like Ctrl-C does
    started = time.perf_counter()
    say(f"elastic demo: three simulated nodes on this host, writing to {out_dir}")
    nodes = DemoNodes(out_dir, settings, say)
    try:
        outcome = run_scenario(nodes)
    except DemoFailed as exc:
        console.print(f"[bold red]the demo run failed:[/bold red] {exc}")
        say(nodes.logs())
        say(f"everything is in {out_dir}")
        return 1
    except KeyboardInterrupt:
        say(f"interrupted: every node stopped; partial output in {out_dir}")
        return 130
    finally:
        nodes.stop_all()

    restart, restart_error = None, None
    if not args.skip_restart:
        nodes.note("restart path: the same join (world 2 -> 3) with LIGHTNING_EMIG_LIVE_MEMBERSHIP=0, "
                   "torchrun's stop-and-restart of every worker")
        try:
            restart = measure_join(out_dir / "restart", settings.train_args(max_steps=1_000_000), "restart",
                                   model=settings.model, join_after=settings.steps_between, steps_after=4,
                                   timeout_s=settings.stage_timeout_s, nodes_before=2)
            restart["workers_force_killed"] = forced_kills(p.read_text() for p in out_dir.glob("restart-*.log"))
            nodes.note(f"restart path: join at step {restart['step']}, downtime {restart['downtime_seconds']:.2f}s")
        except KeyboardInterrupt:
            say(f"interrupted: every node stopped; the live run's output is in {out_dir}")
            return 130
        except (RuntimeError, TimeoutError) as exc:
            restart_error = str(exc)
            console.print(f"[bold red]the restart-path measurement failed:[/bold red] {exc}")
            say("\n".join(f"----- {log.name} -----\n" + log_tail(out_dir, log.stem, 3000)
                          for log in sorted(out_dir.glob("restart-*.log"))))

    record = _report(out_dir, outcome.run_dir, settings, restart, nodes.timeline, time.perf_counter() - started)
    print_report(console, record)
    say(f"\nwall time {record['wall_seconds']:.0f}s; written to {out_dir}:")
    for what, path in record["files"].items():
        say(f"  {what:12s} {path}")
    return 1 if restart_error is not None else 0


def _report(out_dir: Path, run_dir: Path, settings: DemoSettings, restart: dict[str, Any] | None,
            timeline: list[dict[str, Any]], wall_seconds: float) -> dict[str, Any]:
    events = events_with_lost_time(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    by_step = {r["step"]: r["world"] for r in read_step_times(run_dir)}  # a recomputed step: its last world
    files = {"run dir": str(run_dir), "node logs": str(out_dir / "{a,b,c}.log"), "loss plot": str(out_dir / "loss.png"),
             "demo.json": str(out_dir / "demo.json")}
    if restart is not None:
        files["restart run"] = restart["run_dir"]
    write_plot(out_dir / "loss.png", load_losses(summary), events, worlds=sorted(by_step.items()), restart=restart,
               title=f"elastic demo: {settings.model} model, layout={settings.layout}, 3 simulated nodes")
    record = demo_record(settings=asdict(settings), run_dir=run_dir, events=events, summary=summary,
                         restart=restart, timeline=timeline, wall_seconds=wall_seconds, files=files)
    write_demo_json(out_dir / "demo.json", record)
    return record


if __name__ == "__main__":
    sys.exit(main())
