"""What the modules that carry out a change read and call of the strategy, as typed views of it.

``ElasticMigrationStrategy`` is the one implementation of each view; the change modules (``rebuild``, ``prepare``,
``reconfigure``, ``requests``, ``live_join``, and the strategy's ``elastic_fit``) are typed on these and never import
the strategy, so the strategy depends on this package and not the other way round (no import circle, and nothing
here imports :mod:`lightning_emig.strategy`; a test keeps both so). Each view is the
membership layer's :class:`~lightning_emig.membership.settings.ElasticWorker` (the generation, the settings) plus
exactly what its module uses besides: a new need shows up here first.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lightning_emig.membership.settings import ElasticWorker

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_emig.change.events import ReconfigureEvent
    from lightning_emig.data.batching import BatchPlan
    from lightning_emig.layout import LayoutMesh
    from lightning_emig.membership.failure import Rollback
    from lightning_emig.membership.handoff import LiveHandoff


class RebuildHost(Protocol):
    """What :mod:`~lightning_emig.change.rebuild` reads: the children the module keeps, whether it migrates."""

    kept_children: frozenset[str]
    """The LightningModule's children with state that existed before ``configure_model`` ran (built in
    ``__init__`` or ``setup``): a change keeps them as they are instead of building them again."""

    @property
    def migrating(self) -> bool: ...


class _ModuleHost(ElasticWorker, Protocol):
    """What every change reads of the strategy (:class:`~lightning_emig.membership.settings.ElasticWorker`: its place
    in the generation, its settings), and the module it trains."""

    @property
    def lightning_module(self) -> Any: ...


class PrepareHost(RebuildHost, _ModuleHost, Protocol):
    """What :mod:`~lightning_emig.change.prepare` uses to build the next layout in the background."""

    shadow_view: Any
    """The strategy's :class:`~lightning_emig.change.prepare.ShadowView` (what a preparing thread sees)."""

    def install_mesh(self, layout_mesh: LayoutMesh, plan: BatchPlan) -> None: ...


class ReconfigureHost(_ModuleHost, Protocol):
    """What :mod:`~lightning_emig.change.reconfigure` uses to change the layout at a step boundary."""

    optimizers: list[Any]
    lr_scheduler_configs: list[Any]

    def install_mesh(self, layout_mesh: LayoutMesh, plan: BatchPlan) -> None: ...

    def setup_optimizers(self, trainer: pl.Trainer) -> None: ...

    def restart_data(self, trainer: pl.Trainer) -> None: ...

    def take_preparation(self) -> Any:
        """The :class:`~lightning_emig.change.prepare.LayoutPreparation` in flight, handed over (None: none)."""


class RequestHost(PrepareHost, ReconfigureHost, Protocol):
    """What :mod:`~lightning_emig.change.requests` uses to carry out a layout change asked for during a fit."""

    pending_handoff: LiveHandoff | None
    optimizers: list[Any]

    def record_event(self, trainer: pl.Trainer, event: ReconfigureEvent) -> None: ...


class JoinHost(_ModuleHost, Protocol):
    """What :mod:`~lightning_emig.change.live_join` uses to move the holders' state into a new generation."""

    seed: int
    optimizers: list[Any]
    live_transfer_started: bool
    """Set by the live join as the first byte of this fit's incoming state is about to move."""
    migrating: bool

    @property
    def local_rank(self) -> int: ...

    @property
    def batch_plan(self) -> BatchPlan: ...


class FitHost(ElasticWorker, Protocol):
    """What :mod:`~lightning_emig.strategy.elastic_fit` uses to run one ``Trainer.fit`` call as a sequence of fits."""

    kept_children: frozenset[str]
    pending_handoff: LiveHandoff | None
    """Set by ``RendezvousCallback`` when this fit stops to hand its state to a newer generation."""
    start_reason: str | None
    """Why this process's first fit is a restart of a running job (None: a first start, a live join); the later
    fits of one ``trainer.fit`` call are live changes, never restarts, whatever torchrun's environment says."""
    left_job: bool
    """This process's node was preempted and handed its state over: it is no longer part of the job."""

    @property
    def has_layout(self) -> bool: ...

    @property
    def awaiting_live_state(self) -> bool: ...

    @property
    def starting_fresh(self) -> bool: ...

    @property
    def incoming_handoff(self) -> LiveHandoff | None: ...

    def checkpoint_dir(self, trainer: pl.Trainer) -> Path | None: ...

    def finish_change_event(self, trainer: pl.Trainer, *, interrupted: bool = False) -> None: ...

    def record_prior_event(self, trainer: pl.Trainer, handoff: LiveHandoff) -> None: ...

    def prepare_next_fit(self, *, handoff: LiveHandoff | None = None, rollback: Rollback | None = None,
                         dropped: list[str] | None = None) -> None: ...
