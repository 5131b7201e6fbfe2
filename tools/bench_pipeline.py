"""Steady step time of layouts with and without pipeline stages, side by side in one run, through ``Trainer.fit``.

    .venv/bin/python tools/bench_pipeline.py --model llama_25m --processes 2 --layouts s2,p2:gpipe,p2:1f1b

Each layout trains the same model, data and global batch for ``--steps`` steps in fresh processes (gloo on CPU);
the step time is the mean of the steps after the first two (``LlamaLightningModule.step_end_times``), the slowest
rank's. A layout is ``r``/``s``/``t``/``p``/``v`` + degree joined (``p2s2``: two stages, FSDP over two inside each;
``p2v2``: four stages, two a process), with ``:gpipe``, ``:1f1b`` or ``:interleaved_1f1b`` for the schedule.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from lightning_emig.layout import LayoutError, degrees_from_short
from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.runs import fit, tiny_config


def parse_layout(text: str) -> tuple[dict[str, int], str]:
    spec, _, schedule = text.partition(":")
    try:
        degrees = degrees_from_short(spec)
    except LayoutError as error:
        raise SystemExit(f"{error} (then :schedule, e.g. p2s2:1f1b)") from None
    return {"dp_shard": 1, **degrees}, schedule or "gpipe"


def _step_seconds(rank: int, world: int, root: str, layout: dict[str, int], schedule: str,
                  args: argparse.Namespace) -> float:
    cfg = tiny_config(layout=layout, max_steps=args.steps, world_size=world, global_batch_size=args.global_batch,
                      micro_batch_size=args.micro_batch)
    cfg.model.size = args.model
    cfg.trainer.pipeline_schedule = schedule
    ends = fit(cfg, Path(root)).module.step_end_times
    steps = sorted(ends)
    return (ends[steps[-1]] - ends[steps[1]]) / (len(steps) - 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--layouts", default="s2,p2:gpipe,p2:1f1b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--out", type=Path, help="JSON records")
    args = parser.parse_args()
    if args.steps < 4:
        raise SystemExit("--steps must be at least 4 (the first two are not steady)")
    records = []
    with tempfile.TemporaryDirectory() as scratch:
        for text in args.layouts.split(","):
            layout, schedule = parse_layout(text)
            seconds = max(run_distributed(_step_seconds, args.processes, f"{scratch}/{text}", layout, schedule, args,
                                          timeout_s=1800))
            records.append({"model": args.model, "layout": layout, "schedule": schedule, "step_seconds": seconds,
                            "global_batch": args.global_batch, "micro_batch": args.micro_batch})
    first = records[0]["step_seconds"]
    print(f"{'layout':16s} {'step s':>8s} {'vs first':>9s}")
    for text, record in zip(args.layouts.split(","), records, strict=True):
        print(f"{text:16s} {record['step_seconds']:8.3f} {record['step_seconds'] / first:9.2f}")
    if args.out:
        args.out.write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
