"""A fixed schedule of layout changes (``elastic.schedule=[{step: 50, layout: {tp: 2}}]``).

Exercises live reconfiguration without any membership change: after optimizer step ``step`` has completed
(``trainer.global_step == step``), the strategy switches to ``layout``. By default the new layout is built at that
boundary. With ``prepare_ahead_steps=N`` (N >= 1) the strategy starts building it N steps before, in a background
thread (:meth:`~lightning_emig.strategy.elastic.ElasticMigrationStrategy.prepare_reconfigure`), so the switch pauses
for the transfer only. That thread runs the LightningModule's ``configure_model`` while training's collectives run:
ask for it only for a ``configure_model`` that makes no collective (a broadcast of pretrained weights), no barrier
and no change to the global RNG (``torch.manual_seed``): each of those could hang the job or disturb training. The
helpers of :mod:`lightning_emig.parallelize` meet this (their initialisation draws from generators of their own). An entry that does not fit the world a membership change left is
skipped with a warning (one that does not fit the world the training started with is an error).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_emig.layout import HybridLayout, LayoutError

log = logging.getLogger(__name__)


class LayoutSchedule(Callback):
    def __init__(self, schedule: Sequence[tuple[int, HybridLayout]], *, prepare_ahead_steps: int = 0) -> None:
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
        self._first_world: int | None = None
        self._skipped: set[int] = set()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._first_world is None:  # a fit after a membership change keeps the first one's
            self._first_world = trainer.strategy.world_size

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        layout = self.schedule.get(step)
        strategy: Any = trainer.strategy
        world = strategy.world_size
        if layout is not None and (resolved := self._resolved(step, world)) is not None and strategy.layout != resolved:
            strategy.reconfigure(layout)
        upcoming = min((s for s in self.schedule if s > step), default=None)
        if upcoming is None or upcoming - step > self.prepare_ahead_steps or upcoming == self._prepared_for:
            return
        target = self.schedule[upcoming]
        # The layout at that step is the last one scheduled before it (this one's, if this step changed nothing).
        if (resolved := self._resolved(upcoming, world)) is not None and strategy.layout != resolved:
            strategy.prepare_reconfigure(target)
            self._prepared_for = upcoming

    def _resolved(self, step: int, world: int) -> HybridLayout | None:
        """The entry at ``step`` laid out on ``world`` processes; None where it cannot be on a world a membership
        change brought (skipped with a warning: the job goes on in its current layout). One that cannot on the world
        the training started with is a wrong schedule (raised)."""
        try:
            return self.schedule[step].resolve(world)
        except LayoutError as exc:
            if world == self._first_world or self._first_world is None:
                raise
            if step not in self._skipped:
                self._skipped.add(step)
                log.warning("layout schedule: the change after step %d is skipped, it does not fit the %d "
                            "process(es) the job now has (%s)", step, world, exc)
            return None


def stages_later(trainer: pl.Trainer, requested: HybridLayout, picker: Any) -> bool:
    """A layout this job is told of may have pipeline stages: the ``requested`` one, a ``LayoutSchedule``'s or the
    ``picker``'s (a :class:`~lightning_emig.picker.policy.LayoutPicker`, or None)."""
    scheduled = [layout for callback in trainer.callbacks if isinstance(callback, LayoutSchedule)
                 for layout in callback.schedule.values()]
    picked = picker is not None and picker.may_stage()
    return picked or any(layout.pp != 1 for layout in (requested, *scheduled))
