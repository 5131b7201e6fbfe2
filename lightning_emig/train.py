"""Hydra entry point: ``python -m lightning_emig.train [recipe=NAME] [key=value ...]``.

Works under Lightning's own launcher (``trainer.devices=4`` spawns the processes) and under torchrun
(``torchrun --nproc-per-node=4 -m lightning_emig.train``), with one run directory shared by every rank.
At the end rank 0 prints and writes ``summary.json``: first and last loss, tokens per second, layout.

A thin Hydra front end over the public path: it builds a LightningModule, a DataLoader and a Trainer with
``ElasticMigrationStrategy`` and calls ``trainer.fit`` once; under ``lightning-emig-run`` the strategy itself
follows every membership change inside that call.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lightning_emig.config import register_configs

register_configs()


def run_training(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Build the run and call ``trainer.fit`` once: under ``lightning-emig-run`` the strategy carries it through every
    membership change (:mod:`lightning_emig.strategy.elastic_fit`), as it does for any user's script."""
    from lightning_emig.training.builders import build_run, resolve_resume

    start = time.perf_counter()
    parts = build_run(cfg, run_dir)  # type: ignore[arg-type]
    parts.trainer.fit(parts.module, train_dataloaders=parts.loader,
                      ckpt_path=resolve_resume(cfg, run_dir))  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    summary = _summary(parts, seconds, cfg)
    summary["events"] = [event.as_dict() for event in parts.strategy.events]
    summary["agree_seconds"] = _agree_seconds(parts)
    if parts.trainer.is_global_zero:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        _print_summary(summary)
    return summary


def _summary(parts: Any, seconds: float, cfg: DictConfig) -> dict[str, Any]:
    losses = parts.module.step_losses
    steps = sorted(losses)
    plan = parts.strategy.batch_plan
    times = parts.module.step_end_times
    # Throughput from the steady state: the first step pays for warm-up (allocation, first messages).
    timed_steps = len(steps) - 1
    span = times[steps[-1]] - times[steps[0]] if timed_steps > 0 else 0.0
    tokens_per_second = timed_steps * plan.tokens_per_step(cfg.data.seq_len) / span if span > 0 else 0.0
    return {
        "layout": parts.strategy.layout.as_dict(),
        "world_size": parts.strategy.world_size,
        "batch": plan.describe(),
        "steps": len(steps),
        "first_loss": losses[steps[0]] if steps else None,
        "last_loss": losses[steps[-1]] if steps else None,
        "step_losses": {str(k): losses[k] for k in steps},
        "seconds": seconds,
        "tokens_per_second": tokens_per_second,
        "run_dir": str(parts.run_dir),
        "pid": os.getpid(),
    }


def _agree_seconds(parts: Any) -> list[float]:
    from lightning_emig.strategy.rendezvous import RendezvousCallback

    for callback in parts.trainer.callbacks:
        if isinstance(callback, RendezvousCallback):
            return callback.agree_seconds
    return []


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lightning-emig run summary")
    table.add_column("what")
    table.add_column("value")
    table.add_row("layout", " ".join(f"{k}={v}" for k, v in summary["layout"].items()))
    table.add_row("processes", str(summary["world_size"]))
    table.add_row("batch", summary["batch"])
    table.add_row("steps", str(summary["steps"]))
    if summary["first_loss"] is not None:
        table.add_row("loss", f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}")
    table.add_row("tokens/s", f"{summary['tokens_per_second']:.0f}")
    table.add_row("run dir", summary["run_dir"])
    Console().print(table)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_training(cfg, run_dir)


if __name__ == "__main__":
    main()
