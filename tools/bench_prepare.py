"""A live layout change prepared while the old layout trains vs built in the pause: the pause, the time lost, and
what the preparation costs the steps it overlaps; both measured in one run, alternating.

For every model, ``--rounds`` times each way: ``--world`` processes train under ``--old``, switch to ``--new`` after
optimizer step ``--change-at`` (an ``elastic.schedule`` entry) and stop ``--steps-after`` steps later; ``built``
builds the mesh and the model in the pause (``elastic.prepare_ahead_steps=0``), ``prepared`` starts building them
(and the plan) in the background ``--ahead`` steps before (:mod:`lightning_emig.change.prepare`).

Per run, from the event and rank 0's ``step_times.jsonl`` (a step's line is written before the schedule's change, so
the pause lies in the span of the first step on the new layout):

* ``pause_seconds``: the event's phases summed (validate to restore); ``prepared_seconds``: the background phases;
* ``step_seconds_old``: median of the steps before the preparation (the first step, warm-up, left out);
  ``step_seconds_preparing``: median of the ``--ahead`` steps the preparation overlapped (same steps in ``built``);
  ``step_seconds_new``: median of the steps after the first one on the new layout;
* ``lost_seconds``: from the end of step ``change-at - ahead`` to the end of step ``change-at + 1``, minus ``ahead``
  old steps and one new step (the same window for both ways: what the preparation costs the steps it overlaps
  counts against it).

    .venv/bin/python tools/bench_prepare.py --models tiny llama_125m --out bench_results/prepare.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Last, not first: a checkout put on PYTHONPATH (the code before a change, measured side by side) must be the one
# imported, and its agents then start from its own directory (lightning_emig.testing.nodes.REPO).
sys.path.append(str(REPO))

from lightning_emig.change.lost_time import STEP_TIMES_FILE  # noqa: E402
from lightning_emig.testing.distributed import run_distributed  # noqa: E402
from lightning_emig.testing.runs import fit, tiny_config, with_schedule  # noqa: E402

WAYS = {"built": 0, "prepared": None}
"""``elastic.prepare_ahead_steps`` per way (None: ``--ahead``)."""


def _layout(text: str) -> dict[str, int]:
    """``dp_shard=2,tp=1`` -> {"dp_shard": 2, "tp": 1}."""
    return {k: int(v) for k, v in (part.split("=") for part in text.split(",") if part)}


def _train(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any] | None:
    cfg = tiny_config(layout=spec["old"], max_steps=spec["change_at"] + 1 + spec["steps_after"], world_size=world,
                      global_batch_size=spec["global_batch_size"], micro_batch_size=spec["micro_batch_size"])
    cfg.model.size = spec["model"]
    cfg.data.seq_len = spec["seq_len"]
    cfg.trainer.pg_timeout_s = 600
    with_schedule(cfg, [(spec["change_at"], spec["new"])])
    cfg.elastic.prepare_ahead_steps = spec["ahead"]
    parts = fit(cfg, Path(spec["run_dir"]))
    if rank != 0:
        return None
    (event,) = [e.as_dict() for e in parts.strategy.events]
    return event


def _step_seconds(run_dir: Path) -> dict[int, float]:
    """Step -> seconds it took (end of the step before to end of this one), from rank 0's step times."""
    lines = [json.loads(line) for line in (run_dir / STEP_TIMES_FILE).read_text().splitlines()]
    times = {r["step"]: r["time"] for r in lines}
    return {s: times[s] - times[s - 1] for s in sorted(times) if s - 1 in times}


def record(way: str, model: str, event: dict[str, Any], steps: dict[int, float], change_at: int, ahead: int
           ) -> dict[str, Any]:
    old = statistics.median(steps[s] for s in range(2, change_at - ahead + 1))
    preparing = statistics.median(steps[s] for s in range(change_at - ahead + 1, change_at + 1))
    new = statistics.median(s for k, s in steps.items() if k > change_at + 1)
    window = sum(steps[s] for s in range(change_at - ahead + 1, change_at + 2))
    return {
        "model": model, "way": way, "change_at": change_at, "ahead": ahead,
        "old_layout": event["old_layout"], "new_layout": event["new_layout"],
        "pause_seconds": event["total_seconds"], "phases": event["seconds"],
        "prepared_seconds": event.get("prepared_seconds"),
        "step_seconds_old": old, "step_seconds_preparing": preparing, "step_seconds_new": new,
        "slowdown_while_preparing": preparing / old - 1.0,
        "lost_seconds": window - ahead * old - new, "step_seconds": steps,
    }


def summary(records: list[dict[str, Any]]) -> str:
    lines = []
    for model in dict.fromkeys(r["model"] for r in records):
        by_way = {way: [r for r in records if r["model"] == model and r["way"] == way] for way in WAYS}
        if not all(by_way.values()):
            continue

        def med(way: str, key: str) -> float:
            return statistics.median(r[key] for r in by_way[way])  # noqa: B023 - used at once

        lines.append(
            f"{model}: pause {med('prepared', 'pause_seconds'):.3f} s prepared vs {med('built', 'pause_seconds'):.3f}"
            f" s built ({med('built', 'pause_seconds') / med('prepared', 'pause_seconds'):.1f}x); lost "
            f"{med('prepared', 'lost_seconds'):.3f} vs {med('built', 'lost_seconds'):.3f} s; steps while preparing "
            f"{med('prepared', 'slowdown_while_preparing'):+.1%} (built, same steps: "
            f"{med('built', 'slowdown_while_preparing'):+.1%}); medians of {len(by_way['built'])} runs each way")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--old", type=_layout, default=_layout("dp_shard=2"))
    p.add_argument("--new", type=_layout, default=_layout("dp_shard=1,tp=2"))
    p.add_argument("--change-at", type=int, default=6)
    p.add_argument("--ahead", type=int, default=1, help="the prepared way's elastic.prepare_ahead_steps")
    p.add_argument("--steps-after", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="built then prepared, this many times per model")
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before giving up")
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "prepare.json")
    args = p.parse_args()
    if args.change_at - args.ahead < 2 or args.steps_after < 2:
        p.error("needs a steady old step before the preparation (change-at - ahead >= 2) and steps-after >= 2")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_prepare_") as work:
        for model in args.models:
            for round_ in range(args.rounds):
                for way, ahead in WAYS.items():
                    run_dir = Path(work) / f"{model}-{way}-{round_}"
                    spec = {"model": model, "old": args.old, "new": args.new, "change_at": args.change_at,
                            "ahead": args.ahead if ahead is None else ahead, "steps_after": args.steps_after,
                            "global_batch_size": args.global_batch_size, "micro_batch_size": args.micro_batch_size,
                            "seq_len": args.seq_len, "run_dir": str(run_dir)}
                    event = run_distributed(_train, args.world, spec, timeout_s=args.timeout, pg_timeout_s=600)[0]
                    records.append(record(way, model, event, _step_seconds(run_dir), args.change_at, args.ahead))
                    r = records[-1]
                    print(f"{model} {way}: pause {r['pause_seconds']:.3f} s {r['phases']}, lost {r['lost_seconds']:.3f}"
                          f" s, steps old {r['step_seconds_old']:.3f} preparing {r['step_seconds_preparing']:.3f} new "
                          f"{r['step_seconds_new']:.3f} s", flush=True)
                    args.out.write_text(json.dumps(records, indent=1))
    print(summary(records))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
