"""A layout change asked for during a fit (``strategy.reconfigure``, ``strategy.prepare_reconfigure``), from the
request to the event.

:class:`LayoutRequests` keeps what was asked and not yet done: the layout to switch to at the next optimizer-step
boundary, and the preparation building a layout in the background. At the boundary
(:class:`~lightning_emig.change.boundary.StepBoundaryHook`) it proves the state, carries the change out
(:func:`~lightning_emig.change.reconfigure.reconfigure_live`), proves the state again and records the event.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lightning_emig.change.boundary import at_step_boundary
from lightning_emig.change.consistency import prove
from lightning_emig.change.fit_start import check_can_be_staged
from lightning_emig.change.prepare import LayoutPreparation
from lightning_emig.change.rebuild import node_of_every_rank
from lightning_emig.change.reconfigure import reconfigure_live
from lightning_emig.consistency import check_same_state
from lightning_emig.layout import HybridLayout
from lightning_emig.migration.identity import IdentityMap
from lightning_emig.migration.state import training_state

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_emig.change.host import RequestHost

log = logging.getLogger(__name__)


class LayoutRequests:
    """The layout changes asked of ``host`` during a fit and not yet carried out."""

    def __init__(self, host: RequestHost) -> None:
        self._host = host
        self._pending: HybridLayout | None = None
        self._preparation: LayoutPreparation | None = None

    @property
    def pending(self) -> bool:
        """A layout change waits for the end of the current step."""
        return self._pending is not None

    def reconfigure(self, layout: HybridLayout | dict[str, int]) -> None:
        """Switch to ``layout`` at the next optimizer-step boundary: at once when called at one (see
        ``ElasticMigrationStrategy.reconfigure``)."""
        layout = HybridLayout(**layout) if isinstance(layout, dict) else layout
        trainer = self._training_trainer("reconfigure(layout) works during Trainer.fit; change the layout argument "
                                         "instead")
        if layout.pp != 1:  # pp=-1 fills the world with stages
            check_can_be_staged(self._host.lightning_module)
        self._pending = layout
        if at_step_boundary(trainer):
            self.apply(trainer)

    def prepare(self, layout: HybridLayout | dict[str, int]) -> None:
        """Start building ``layout`` in a background thread (see ``ElasticMigrationStrategy.prepare_reconfigure``)."""
        host = self._host
        layout = HybridLayout(**layout) if isinstance(layout, dict) else layout
        self._training_trainer("prepare_reconfigure(layout) works during Trainer.fit")
        resolved = layout.resolve(host.world_size)
        host.elastic_settings.validate_layout(resolved)
        self.discard_preparation()
        if resolved.pp > 1 or host.layout.pp > 1:
            # Where a layout has stages each process knows its own stage's specs only: the rank order and the plan
            # need every process's (a collective on the default group, which the training thread uses).
            log.info("a change to or from pipeline stages is built at the step boundary, not prepared")
            return
        old_specs = {k: t.spec for k, t in training_state(host.lightning_module, host.optimizers[0]).items()}
        identity = IdentityMap.same_processes(host.world_size, node_of_every_rank())
        self._preparation = LayoutPreparation(host, layout, old_specs=old_specs, identity=identity)

    def take_preparation(self) -> LayoutPreparation | None:
        """The pending preparation, handed to the change that uses or discards it."""
        preparation, self._preparation = self._preparation, None
        return preparation

    def discard_preparation(self) -> None:
        """Wait for a pending preparation's thread and drop what it built (its groups stay, like any old mesh's)."""
        preparation = self.take_preparation()
        if preparation is not None:
            preparation.wait(self._host.timeout.total_seconds())

    def apply(self, trainer: pl.Trainer) -> None:
        """Carry out the pending layout change now (at an optimizer-step boundary)."""
        host = self._host
        layout, self._pending = self._pending, None
        if layout is None:
            return
        if host.pending_handoff is not None:  # its state is handed over as it is; the next fit picks the layout
            log.warning("layout change to %s skipped: a membership change is handing the state over", layout.describe())
            return
        host.last_boundary = None  # its tensors are released by the change; the next boundary captures anew
        before = prove(trainer, "before a layout change")
        event = reconfigure_live(host, trainer, layout)
        check_same_state(before, prove(trainer, "after a layout change"), what="the layout change")
        if event is not None:
            host.record_event(trainer, event)

    def _training_trainer(self, refusal: str) -> pl.Trainer:
        module = self._host.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is None or not trainer.training:
            raise RuntimeError(refusal)
        return trainer
