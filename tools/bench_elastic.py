"""Downtime of membership events: the live path (``lightning-emig-run``) vs torchrun's restart path, same model and
same event, one run.

For every model, event and round, the event is run twice, one path after the other, on simulated nodes of this host
(``lightning_emig.testing.nodes``); the job is not run to the end: only the event is measured.

* ``join``: node A (127.0.0.2) trains alone; once it has finished ``--join-after`` optimizer steps node B
  (127.0.0.3) starts; stopped when the new world of 2 processes has finished ``--steps-after`` steps.
  ``live``: A's worker keeps running while B's starts up, then hands its state over point to point (one ``join``
  event); ``restart`` (``LIGHTNING_EMIG_LIVE_MEMBERSHIP=0``, torchrun's own behaviour): A's worker is stopped, both
  workers start, load the newest checkpoint resharded for the new world and recompute the steps after it (one
  ``restart`` event with ``steps_rolled_back``).
* ``failure``: A and B train as two HSDP replicas; after ``--join-after`` steps (and a complete checkpoint) B's
  worker gets SIGKILL (:mod:`lightning_emig.testing.departure_downtime`). ``live``: A rebuilds from its own replica
  and trains on alone (one ``failure`` event, 2 -> 1); ``restart``: torchrun restarts both workers from the newest
  checkpoint (one ``restart`` event, 2 -> 2).
* ``node_failure`` (only when asked for): the same, but B's agent is SIGKILLed with its worker, the whole node gone:
  nobody marks it dead; the survivor sees B's process exit (its host's kernel closes its sockets). Live path only: no
  agent sees that failure, and A's worker recovers by itself either way.
* ``node_frozen`` (only when asked for): the same, but B's agent and worker are frozen with SIGSTOP: alive, their
  sockets open, nothing answers; the survivor takes B for dead once its heartbeat has not changed for
  ``elastic.heartbeat_timeout_s`` (default 10 s), and ends its own collectives waiting on B. Live path only.
* ``host_vanish`` (only when asked for; root only): the same, but B runs in a network namespace of its own whose
  link is cut: its host silent, as when its power or network goes; the survivor's watcher finds it after
  ``elastic.unreachable_timeout_s`` (default 2 s). Live path only.
* ``preempt``: A and B train sharded (FSDP); after ``--join-after`` steps B's agent gets SIGTERM, a preemption
  notice. ``live``: B hands its shards to A and exits (one ``preempt`` event, 2 -> 1); ``restart``: the notice is
  torchrun's SIGTERM, and A rolls back alone to the newest checkpoint (a ``failure`` event, 2 -> 1; A's worker is
  not restarted, so this baseline is cheaper than torchrun's).

Both paths checkpoint every ``--checkpoint-every`` steps (the restart path needs it; the live path pays the same
steady-state cost). Each record (:func:`lightning_emig.testing.join_downtime.event_record`):

* ``lost_seconds``, the headline: last optimizer step finished on the old world to the first step *beyond it*
  finished on the new one, minus one steady step on the new world (the fastest of the next up to three;
  :mod:`lightning_emig.change.lost_time`). The restart path's recomputed ``steps_rolled_back`` count as lost;
* ``downtime_seconds``: last step on the old world to first step finished on the new one (from the event;
  ``downtime_from_step_times`` is the same span read from ``step_times.jsonl``, a cross-check);
* ``recovery_seconds``: lost time plus the steady step; ``phases``: the event's per-phase seconds;
* ``lost_cpu_seconds``: of the lost time, rank 0's training thread's work (its CPU seconds over the change and the
  first step beyond, less the steady step's); the rest it waited (the wire, its peers, a core). None where another
  process took over rank 0 (torchrun restarted the workers);
* ``extra_page_faults``: of rank 0's page faults, those over the change and the first step beyond less a steady
  step's (memory touched for the first time: at ~3 s per GiB on the development VMs, a cost of its own);
* ``first_step_parts_excess``: the first step beyond's forward, backward and optimizer step, each less the steady
  step's (where its excess went);
* ``lost_beyond_in_flight_seconds`` (a failure's): the lost time less the ``in_flight`` phase, the step in flight
  when the peer died (the goal: at most 1 s);
* ``first_step_excess_seconds``: the event's ``first_step`` phase minus the steady step (how much of the lost time
  the first step on the new world added; on the restart path, the restarted process's first, recomputed step): the
  gap to "pause = wire time" is ``lost_seconds`` against ``phases["transfer"]`` and this, read from one record;
* ``pause_seconds``: the lost time less the first step and the step in flight (the change's own time, which host
  noise barely touches); ``steady_step_spread_seconds``: the slowest steady step less the fastest, the noise floor a
  first step's excess is read against;
* ``step_seconds_old`` / ``step_seconds_new``: median step time before and after (steady state); for a join,
  ``step_seconds_old`` ends when the joining node starts and ``step_seconds_preparing`` is the old world's median
  step while the joiner starts and warms its memory (on this host the joiner shares the cores: on separate nodes
  it would not).

    .venv/bin/python tools/bench_elastic.py --models tiny llama_125m --out bench_results/elastic.json

The event itself is driven by :mod:`lightning_emig.testing.join_downtime` (shared with ``make demo``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Last, not first: a checkout put on PYTHONPATH (the code before a change, measured side by side) must be the one
# imported, and its agents then start from its own directory (lightning_emig.testing.nodes.REPO).
sys.path.append(str(REPO))

from lightning_emig.testing.departure_downtime import has_path, measure_departure  # noqa: E402
from lightning_emig.testing.join_downtime import PATHS, measure_join  # noqa: E402

EVENTS = ("join", "preempt", "failure", "node_failure", "node_frozen", "host_vanish")
DEPARTURES = {"preempt": "preemption", "failure": "worker_failure", "node_failure": "node_failure",
              "node_frozen": "node_frozen", "host_vanish": "host_vanish"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "llama_25m"])
    p.add_argument("--events", nargs="+", default=list(EVENTS[:3]), choices=EVENTS,
                   help="join: node B joins A (1 -> 2); preempt: B's agent gets a notice (2 -> 1); failure: B's "
                        "worker is SIGKILLed under HSDP (2 -> 1 live); node_failure: B's agent is SIGKILLed with its "
                        "worker (live only, not in the default set); node_frozen: B's agent and worker are frozen with "
                        "SIGSTOP (live only, not in the default set: found at the heartbeat timeout); host_vanish: B runs "
                        "in a network namespace whose link is cut (live only, root only, not in the default set)")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS),
                   help="live: the change moves the state between running workers; restart: torchrun's behaviour "
                        "(every worker restarts from the newest checkpoint); ratios need both")
    p.add_argument("--rounds", type=int, default=1, help="live then restart, this many times per model")
    p.add_argument("--join-after", type=int, default=5, help="B starts once A finished this many steps")
    p.add_argument("--steps-after", type=int, default=4,
                   help="steps beyond the event before stopping (1 + the steady steps lost time is measured against)")
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--timeout", type=float, default=600, help="seconds per event before giving up")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="run directories, each one's checkpoints removed once it is measured (default: a temporary one)")
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "elastic.json")
    return p.parse_args()


def train_args(args: argparse.Namespace, model: str) -> list[str]:
    return [
        "data=synthetic", f"model={model}", f"data.seq_len={args.seq_len}", "trainer.max_steps=1000000",
        f"trainer.global_batch_size={args.global_batch_size}", f"trainer.micro_batch_size={args.micro_batch_size}",
        "trainer.progress_bar=false", "trainer.pg_timeout_s=120",
        f"trainer.checkpoint_every_n_steps={args.checkpoint_every}",
    ]


def run_event(args: argparse.Namespace, event: str, model: str, path: str, run_dir: Path) -> dict[str, Any]:
    """One event on the given path; returns its record."""
    if event in DEPARTURES:
        return measure_departure(run_dir, train_args(args, model), path, how=DEPARTURES[event], model=model,
                                 after=args.join_after, steps_after=args.steps_after, timeout_s=args.timeout)
    return measure_join(run_dir, train_args(args, model), path, model=model, join_after=args.join_after,
                        steps_after=args.steps_after, timeout_s=args.timeout)


def main() -> None:
    args = parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_elastic-"))
    work.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    for model in args.models:
        for event in args.events:
            for round_index in range(args.rounds):
                for path in args.paths:
                    if event in DEPARTURES and not has_path(DEPARTURES[event], path):
                        print(f"{model:10s} {event:8s} {path:8s} round {round_index}: skipped (no {path} path: "
                              "with the whole node gone no agent sees a failure)", flush=True)
                        continue
                    run_dir = work / f"{model}-{event}-{path}-{round_index}"
                    record = run_event(args, event, model, path, run_dir)
                    # Measured: its checkpoints (2.8 GB a run at llama_125m) go; logs and events stay.
                    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
                    record["round"] = round_index
                    records.append(record)
                    print(f"{model:10s} {event:8s} {path:8s} round {round_index}: lost {_seconds(record['lost_seconds'])} "
                          f"(rank 0 working {_seconds(record['lost_cpu_seconds'])} of it, "
                          f"{_faults(record['extra_page_faults'])}, "
                          f"{_beyond_in_flight(record['lost_beyond_in_flight_seconds'])}downtime "
                          f"{record['downtime_seconds']:.2f}s, pause {_seconds(record['pause_seconds'])}, steady step "
                          f"{_seconds(record['step_seconds_new'])} "
                          f"(spread {_seconds(record['steady_step_spread_seconds'])}), "
                          f"first step's excess {_seconds(record['first_step_excess_seconds'])}, rolled back "
                          f"{record['steps_rolled_back']}) "
                          f"phases " + ", ".join(f"{k} {v:.2f}" for k, v in record["phases"].items())
                          + "; first step's excess by part " + ", ".join(
                              f"{k} {v:+.2f}" for k, v in (record["first_step_parts_excess"] or {}).items()),
                          flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "records": records},
                                   indent=2))
    ratios = summarize(records)
    args.out.write_text(json.dumps({
        "config": {k: str(v) for k, v in vars(args).items()}, "records": records, "ratios": ratios,
        "seconds": time.perf_counter() - started,
    }, indent=2))
    print(f"wrote {args.out}")


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median over rounds per (model, event, path); prints and returns the restart/live ratios of lost time and of
    downtime, keyed ``model`` (joins) and ``model/failure``."""
    ratios: dict[str, dict[str, float]] = {}
    for model, event in dict.fromkeys((r["model"], r["event"]) for r in records):
        same = [r for r in records if r["model"] == model and r["event"] == event]
        med = {
            path: {key: _median([r[key] for r in same if r["path"] == path])
                   for key in ("lost_seconds", "downtime_seconds", "step_seconds_new", "step_seconds_old",
                               "step_seconds_preparing", "first_step_excess_seconds", "lost_cpu_seconds",
                               "extra_page_faults", "lost_beyond_in_flight_seconds", "pause_seconds",
                               "steady_step_spread_seconds")}
            for path in PATHS
        }
        key = model if event == "join" else f"{model}/{event}"
        ratios[key] = {
            **{f"{path}_{name}": med[path][name] for path in PATHS for name in med[path]},
            "lost_ratio": _ratio(med["restart"]["lost_seconds"], med["live"]["lost_seconds"]),
            "downtime_ratio": _ratio(med["restart"]["downtime_seconds"], med["live"]["downtime_seconds"]),
        }
        r = ratios[key]
        lost, down = (f"{r[name]:.1f}x" if r[name] is not None else "n/a" for name in ("lost_ratio", "downtime_ratio"))
        print(f"{key}: time lost live {_seconds(r['live_lost_seconds'])} (pause {_seconds(r['live_pause_seconds'])}), "
              f"restart {_seconds(r['restart_lost_seconds'])} -> restart/live {lost}; "
              f"downtime live {_seconds(r['live_downtime_seconds'])}, restart "
              f"{_seconds(r['restart_downtime_seconds'])} ({down}); steady step "
              f"{_seconds(r['live_step_seconds_new'])}{_slowdown(r)}"
              + (f"; live lost {r['live_lost_beyond_in_flight_seconds']:.2f}s beyond the step in flight"
                 if r.get("live_lost_beyond_in_flight_seconds") is not None else ""))
    return ratios


def _faults(count: int | None) -> str:
    return "page faults n/a" if count is None else f"{count} extra page faults ({count * 4096 / 2**30:.2f} GiB of 4 KiB)"


def _beyond_in_flight(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.2f}s beyond the step in flight, "


def _slowdown(r: dict[str, Any]) -> str:
    before, preparing = r.get("live_step_seconds_old"), r.get("live_step_seconds_preparing")
    if before is None or preparing is None:
        return ""
    return f"; old world's step while the joiner prepares {preparing:.2f}s vs {before:.2f}s ({preparing / before - 1:+.0%})"


def _seconds(value: float | None) -> str:
    """Seconds, or why there is no figure: the path was not run, or the next event came right after the first step
    beyond this one."""
    return f"{value:.2f}s" if value is not None else "n/a"


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(restart: float | None, live: float | None) -> float | None:
    """restart / live; None where live lost nothing measurable (a ratio against noise is no figure)."""
    return restart / live if restart is not None and live is not None and live > 0 else None


if __name__ == "__main__":
    main()
