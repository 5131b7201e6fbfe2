"""A fixed schedule of layout changes (``elastic.schedule=[{step: 50, layout: {tp: 2}}]``).

Exercises live reconfiguration without any membership change: after optimizer step ``step`` has completed
(``trainer.global_step == step``), the strategy switches to ``layout``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_emig.layout import HybridLayout


class LayoutSchedule(Callback):
    def __init__(self, schedule: Sequence[tuple[int, HybridLayout]]) -> None:
        steps = [step for step, _ in schedule]
        if any(step < 1 for step in steps):
            raise ValueError(f"elastic.schedule steps must be >= 1 (after that many optimizer steps), got {steps}")
        if steps != sorted(set(steps)):
            raise ValueError(f"elastic.schedule steps must be strictly increasing, got {steps}")
        self.schedule = dict(schedule)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        layout = self.schedule.get(trainer.global_step)
        strategy: Any = trainer.strategy
        if layout is not None and strategy.layout != layout.resolve(strategy.world_size):
            strategy.reconfigure(layout)
