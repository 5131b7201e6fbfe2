"""A fixed schedule of layout changes (``elastic.schedule=[{step: 50, layout: {tp: 2}}]``).

Exercises live reconfiguration without any membership change: after optimizer step ``step`` has completed
(``trainer.global_step == step``), the strategy switches to ``layout``. ``prepare_ahead_steps`` steps before (when
that many remain), the strategy starts building the layout in the background
(:meth:`~lightning_emig.strategy.elastic.ElasticMigrationStrategy.prepare_reconfigure`), so the switch pauses for
the transfer only; 0 builds it at the boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_emig.layout import HybridLayout


class LayoutSchedule(Callback):
    def __init__(self, schedule: Sequence[tuple[int, HybridLayout]], *, prepare_ahead_steps: int = 1) -> None:
        steps = [step for step, _ in schedule]
        if any(step < 1 for step in steps):
            raise ValueError(f"elastic.schedule steps must be >= 1 (after that many optimizer steps), got {steps}")
        if steps != sorted(set(steps)):
            raise ValueError(f"elastic.schedule steps must be strictly increasing, got {steps}")
        if prepare_ahead_steps < 0:
            raise ValueError(f"elastic.prepare_ahead_steps must be >= 0, got {prepare_ahead_steps}")
        self.schedule = dict(schedule)
        self.prepare_ahead_steps = prepare_ahead_steps
        self._prepared_for: int | None = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        layout = self.schedule.get(step)
        strategy: Any = trainer.strategy
        if layout is not None and strategy.layout != layout.resolve(strategy.world_size):
            strategy.reconfigure(layout)
        upcoming = min((s for s in self.schedule if s > step), default=None)
        if upcoming is None or upcoming - step > self.prepare_ahead_steps or upcoming == self._prepared_for:
            return
        target = self.schedule[upcoming]
        # The layout at that step is the last one scheduled before it (this one's, if this step changed nothing).
        if strategy.layout != target.resolve(strategy.world_size):
            strategy.prepare_reconfigure(target)
            self._prepared_for = upcoming
