"""Build and run small Lightning training runs inside an already-initialised process group (tests, benchmarks).

The same builders as ``python -m lightning_emig.train`` are used, with a config assembled in code, so a test
exercises exactly the production path: strategy, mesh, batch plan, data stream, Trainer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning_emig.config import TrainConfig
from lightning_emig.training.builders import RunParts, build_run


def tiny_config(
    *,
    layout: dict[str, int],
    max_steps: int,
    global_batch_size: int = 8,
    micro_batch_size: int = 2,
    world_size: int = 1,
    checkpoint_every_n_steps: int = 0,
    lr: float = 3e-3,
) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.size = "tiny"
    for axis, degree in layout.items():
        if not hasattr(cfg.layout, axis):
            raise ValueError(f"unknown layout axis {axis!r}")
        setattr(cfg.layout, axis, degree)
    cfg.data.source = "synthetic"
    cfg.data.seq_len = 32
    cfg.data.synthetic_samples = 1024
    cfg.trainer.devices = world_size
    cfg.trainer.num_nodes = 1
    cfg.trainer.max_steps = max_steps
    cfg.trainer.global_batch_size = global_batch_size
    cfg.trainer.micro_batch_size = micro_batch_size
    cfg.trainer.checkpoint_every_n_steps = checkpoint_every_n_steps
    cfg.trainer.progress_bar = False
    cfg.trainer.pg_timeout_s = 60
    cfg.optim.lr = lr
    cfg.optim.warmup_steps = 2
    return cfg


def quiet_lightning() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


def fit(cfg: TrainConfig, run_dir: Path, ckpt_path: str | None = None) -> RunParts:
    quiet_lightning()
    parts = build_run(cfg, run_dir)
    parts.trainer.fit(parts.module, train_dataloaders=parts.loader, ckpt_path=ckpt_path)
    return parts


def step_losses(parts: RunParts) -> list[float]:
    losses: dict[int, Any] = parts.module.step_losses
    return [losses[k] for k in sorted(losses)]


def with_schedule(cfg: TrainConfig, schedule: list[tuple[int, dict[str, int]]]) -> TrainConfig:
    """Add live layout changes after the given optimizer steps (what ``elastic.schedule`` does)."""
    from lightning_emig.config import LayoutSection, ScheduledLayout

    cfg.elastic.schedule = [ScheduledLayout(step=step, layout=LayoutSection(**layout)) for step, layout in schedule]
    return cfg
