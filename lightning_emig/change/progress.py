"""Lightning's TQDM progress bar counting optimizer steps (not micro-batches) towards the end of the fit.

Gradient accumulation turns several micro-batches into one step, and how many depends on the layout, so the stock
bar's "batches of this epoch" changes its total at every change. Counting ``trainer.global_step`` also keeps the bar right
when a run resumes from a checkpoint or changes its layout mid-run: it continues from the same step.

While a migration is in progress the bar says so: :func:`show_migration` replaces its "step" description (for
example by ``migrating: reconfigure``) until the next optimizer step finishes.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class StepProgressBar(TQDMProgressBar):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._status_step: int | None = None  # the step after which a shown status gives way to "step" again

    def show_status(self, text: str, step: int) -> None:
        """Describe the bar by ``text`` until an optimizer step after ``step`` finishes (no-op before it exists)."""
        bar = self._train_progress_bar
        if bar is None:
            return
        bar.set_description(text)
        self._status_step = step

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        self._status_step = None
        bar = self.train_progress_bar
        bar.reset(total=_total_steps(trainer))
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
            if self._status_step is not None and trainer.global_step > self._status_step:
                self._status_step = None
                bar.set_description("step", refresh=False)
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()


def show_migration(trainer: pl.Trainer, text: str) -> None:
    """Show ``text`` (``migrating (generation 3)``) in the Trainer's :class:`StepProgressBar`, if it has one,
    until the next optimizer step finishes; the strategy and the membership callback call it at a step boundary."""
    for callback in trainer.callbacks:
        if isinstance(callback, StepProgressBar):
            callback.show_status(text, trainer.global_step)


def _total_steps(trainer: pl.Trainer) -> int | None:
    """The optimizer steps the fit will take: ``max_steps``, or what ``max_epochs`` of the loader make (an epoch has
    the same number of global batches under every layout); none for an endless loader."""
    if trainer.max_steps > 0:
        return trainer.max_steps
    total = trainer.estimated_stepping_batches
    return int(total) if math.isfinite(total) else None
