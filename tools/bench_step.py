"""Step time of ElasticMigrationStrategy vs Lightning's own ModelParallelStrategy, same 2-D layout, one run.

Both train the same model on the same synthetic batches with the same global batch and micro batch, under
FSDP2 (dp_shard) x TP on the same processes; the two are run alternately (ours, Lightning's, ours, ...) so
machine noise hits both alike. A step is timed from its first micro-batch to the end of its optimizer step;
the first WARMUP steps of each run are dropped.

    .venv/bin/python tools/bench_step.py --model tiny --steps 12 --out bench_results/step.json

``--defer`` times ours once per ``defer_grad_sync`` choice in each round (the gradient reductions that wait for a
step's last micro-batch); ``--replicate R`` trains ours as ``R`` HSDP replicas, which Lightning's strategy cannot
(its run is then left out):

    .venv/bin/python tools/bench_step.py --world 2 --tp 1 --replicate 2 --global-batch 24 --steps 20 \\
        --defer none replicas all --out bench_results/grad_sync.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from lightning_emig.layout import GRAD_SYNC_DEFERRALS

WARMUP = 3


def _timing_callback() -> Any:
    from lightning.pytorch.callbacks import Callback

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._start: float | None = None
            self._step = 0

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if self._start is None:
                self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step != self._step:  # an optimizer step just finished
                self._step = trainer.global_step
                self.seconds.append(time.perf_counter() - self._start)
                self._start = None

    return StepTimer()


def _lightning_baseline_module(model_size: str, seed: int) -> Any:
    """What Lightning's docs have a user write for ModelParallelStrategy: TP then FSDP2 in configure_model."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from lightning_emig.parallelize import apply_tensor_parallel, materialize_and_init
    from lightning_emig.training.module import LlamaLightningModule

    class BaselineModule(LlamaLightningModule):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            from lightning_emig.models.llama import Llama

            mesh = self.device_mesh
            with torch.device("meta"):
                model = Llama(self.model_config)
            apply_tensor_parallel(model, mesh["tensor_parallel"])
            for block in model.blocks():
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(model, mesh=mesh["data_parallel"])
            materialize_and_init(model, self.trainer.strategy.root_device, seed=self.seed)
            self.model = model

        def _global_batch_loss(self) -> float:
            # The same per-step loss all-reduce as ours, over Lightning's data-parallel group: equal work.
            import torch.distributed as dist

            assert self._loss_sum is not None
            mean = self._loss_sum / self._micro_batches
            group = self.device_mesh["data_parallel"].get_group()
            dist.all_reduce(mean, group=group)
            self._loss_sum, self._micro_batches = None, 0
            return float(mean) / dist.get_world_size(group)

    return BaselineModule(model_size=model_size, seed=seed, max_steps=10_000)


def _our_layout(args: argparse.Namespace, world: int) -> dict[str, int]:
    return {"dp_replicate": args.replicate, "dp_shard": world // (args.tp * args.replicate), "tp": args.tp}


def _run_ours(args: argparse.Namespace, world: int, root: Path, defer: str) -> list[float]:
    from lightning_emig.testing.runs import quiet_lightning, tiny_config
    from lightning_emig.training.builders import build_run

    quiet_lightning()
    cfg = tiny_config(layout=_our_layout(args, world), max_steps=args.steps,
                      global_batch_size=args.global_batch, micro_batch_size=args.micro_batch, world_size=world)
    cfg.trainer.defer_grad_sync = defer
    cfg.model.size = args.model
    cfg.data.seq_len = args.seq_len
    parts = build_run(cfg, root)
    timer = _timing_callback()
    parts.trainer.callbacks.append(timer)
    parts.trainer.fit(parts.module, train_dataloaders=parts.loader)
    return timer.seconds


def _run_lightning(args: argparse.Namespace, world: int, root: Path) -> list[float]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    from lightning_emig.data.datasets import SyntheticDataset
    from lightning_emig.testing.runs import quiet_lightning

    quiet_lightning()
    dp = world // args.tp
    dataset = SyntheticDataset(4096, args.seq_len, seed=0)
    timer = _timing_callback()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1,
        strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=args.tp),
        max_steps=args.steps, accumulate_grad_batches=args.global_batch // (args.micro_batch * dp),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[timer],
        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(root),
    )
    loader = DataLoader(dataset, batch_size=args.micro_batch, shuffle=True)
    trainer.fit(_lightning_baseline_module(args.model, seed=0), train_dataloaders=loader)
    return timer.seconds


def _bench(rank: int, world: int, args: argparse.Namespace, root: str) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {f"ours_{defer}": [] for defer in args.defer}
    if args.replicate == 1:
        runs["lightning"] = []
    for round_ in range(args.rounds):
        for defer in args.defer:
            runs[f"ours_{defer}"] += _run_ours(args, world, Path(root) / f"ours_{defer}{round_}", defer)[WARMUP:]
        if "lightning" in runs:
            runs["lightning"] += _run_lightning(args, world, Path(root) / f"lightning{round_}")[WARMUP:]
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--replicate", type=int, default=1, help="HSDP replicas of ours (> 1: no Lightning run)")
    parser.add_argument("--defer", nargs="+", default=["replicas"], choices=GRAD_SYNC_DEFERRALS,
                        help="defer_grad_sync choices to time ours with, each in every round")
    parser.add_argument("--out", type=Path, default=Path("bench_results/step.json"))
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    if args.world % (args.tp * args.replicate):
        parser.error(f"--world {args.world} is not a multiple of --tp x --replicate")

    import tempfile

    from lightning_emig.testing.distributed import run_distributed

    with tempfile.TemporaryDirectory() as root:
        runs = run_distributed(_bench, args.world, args, root, timeout_s=3600)[0]
    medians = {name: statistics.median(seconds) for name, seconds in runs.items()}
    result: dict[str, Any] = {
        "model": args.model, "world": args.world, "layout": _our_layout(args, args.world),
        "global_batch": args.global_batch, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        "step_seconds": runs, "median_s": medians,
    }
    lines = [f"{name}: median step {median:.4f}s over {len(runs[name])} timed steps" for name, median in medians.items()]
    if "lightning" in medians:
        result["ratio_ours_over_lightning"] = {f"ours_{d}": medians[f"ours_{d}"] / medians["lightning"]
                                               for d in args.defer}
        lines.append(f"ours / Lightning ModelParallelStrategy: {result['ratio_ours_over_lightning']}")
    if "none" in args.defer:
        result["ratio_over_none"] = {f"ours_{d}": medians[f"ours_{d}"] / medians["ours_none"] for d in args.defer}
        lines.append(f"each choice / none: {result['ratio_over_none']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("\n".join(lines) + f"\n-> {args.out}")


if __name__ == "__main__":
    main()
