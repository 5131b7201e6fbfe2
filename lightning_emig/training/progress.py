"""Lightning's TQDM progress bar counting optimizer steps (not micro-batches) towards ``max_steps``.

The training stream is infinite and gradient accumulation turns several micro-batches into one step, so the
stock bar's "batches of this epoch" has no total. Counting ``trainer.global_step`` also keeps the bar right
when a run resumes from a checkpoint or changes its layout mid-run: it continues from the same step.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class StepProgressBar(TQDMProgressBar):
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        bar = self.train_progress_bar
        bar.reset(total=trainer.max_steps if trainer.max_steps > 0 else None)
        bar.initial = 0
        bar.n = trainer.global_step
        bar.set_description("step")
        bar.refresh()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_progress_bar
        if bar.n != trainer.global_step:
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()
