"""What every change of world or layout needs to know, as one small object (the strategy hands it down).

The membership layer depends on this, never on the concrete strategy: :class:`ElasticSettings` holds the requested
layout, the batch sizes, the transfer options and the module's own layout check. Its
:meth:`~ElasticSettings.layout_for_world` is the one place that decides the layout of a new world, for a start, a
restart, a join, a drain and a rebuild alike, and it checks the layout against the model and the global batch *before*
any state moves (an impossible world fails loudly with the state still where it was).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lightning_emig.data.batching import BatchPlan
from lightning_emig.layout import HybridLayout
from lightning_emig.migration.transfer import TransferOptions

if TYPE_CHECKING:
    from datetime import timedelta

    import torch

    from lightning_emig.membership.handoff import LiveHandoff
    from lightning_emig.picker import PickResult
    from lightning_emig.picker.policy import LayoutPicker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FailureSettings:
    """How a dead peer is noticed and how long the survivors wait (``elastic.*`` in the configuration)."""

    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    failure_timeout_s: float = 120.0
    below_min_timeout_s: float = 300.0
    watch_exits: bool = True
    """Take a peer whose process exited, whose host stopped answering or whose heartbeat stopped for dead before any
    collective fails (:mod:`~lightning_emig.membership.exit_watch`)."""
    unreachable_timeout_s: float = 2.0


@dataclass(frozen=True, slots=True)
class ElasticSettings:
    requested_layout: HybridLayout
    """The layout asked for; ``-1`` in one degree fills the rest of each world."""
    global_batch_size: int
    micro_batch_size: int
    transfer: TransferOptions
    validate_layout: Callable[[HybridLayout], None]
    """Raises for a layout the model cannot be split by (see :func:`validate_layout_for_module`)."""
    picker: LayoutPicker | None = None
    """Chooses each world's layout (``elastic.picker``); None: :func:`layout_for_new_world`'s rule."""

    def layout_for_world(self, world_size: int, current: HybridLayout | None = None) -> tuple[HybridLayout, BatchPlan]:
        """The layout for ``world_size`` processes and its batch plan, both checked; raises before anything moves."""
        choice = self.choose(world_size, current)
        return choice.layout, choice.plan

    def choose(self, world_size: int, current: HybridLayout | None = None) -> LayoutChoice:
        """:meth:`layout_for_world` with the picker's explanation. ``current``: the layout the live state is in
        (the picker breaks near-ties by the bytes a change from it moves); None at a start or a rollback."""
        pick = None
        if self.picker is None:
            layout = layout_for_new_world(self.requested_layout, world_size)
        else:
            pick = self.picker.pick(world_size, global_batch_size=self.global_batch_size,
                                    micro_batch_size=self.micro_batch_size, current=current)
            layout = pick.layout
        self.validate_layout(layout)
        return LayoutChoice(layout, self.plan_for(layout), pick)

    def unworkable_worlds(self, worlds: list[int]) -> dict[int, str]:
        """Which of ``worlds`` the rule cannot lay out, and why. Raises when none of them can be: a job whose every
        possible world fails is refused at start, before anything is trained or written."""
        failing: dict[int, str] = {}
        for world in worlds:
            try:
                self.layout_for_world(world)
            except (ValueError, NotImplementedError) as exc:
                failing[world] = str(exc).splitlines()[0]
        if worlds and len(failing) == len(worlds):
            raise ValueError(
                "no world this job may have can be laid out (" + "; ".join(f"{w} processes: {why}" for w, why in
                                                                    failing.items()) + "): change the global batch, "
                "the micro batch or the layout, or --nnodes"
            )
        return failing

    def plan_for(self, layout: HybridLayout) -> BatchPlan:
        return BatchPlan(global_batch_size=self.global_batch_size, micro_batch_size=self.micro_batch_size,
                         dp_degree=layout.dp)


@dataclass(frozen=True, slots=True)
class LayoutChoice:
    """A world's layout, its batch plan, and the picker's result when the picker chose it."""

    layout: HybridLayout
    plan: BatchPlan
    pick: PickResult | None = None

    def record(self) -> dict[str, Any] | None:
        """What an event records of the choice (None: chosen by the fixed rule)."""
        if self.pick is None:
            return None
        chosen = self.pick.chosen
        return {"explanation": self.pick.explanation, "est_step_seconds": chosen.est_step_seconds,
                "est_memory_bytes": chosen.est_memory_bytes, "migration_bytes": chosen.migration_bytes,
                "candidates": sum(1 for c in self.pick.candidates if c.feasible)}


class ElasticWorker(Protocol):
    """What the membership layer reads of a training process (``ElasticMigrationStrategy`` is one): its place in the
    current generation, its last consistent state, and the settings of every change."""

    generation: int
    """The launcher generation this fit runs in (0 outside ``lightning-emig-run``)."""
    last_boundary: LiveHandoff | None
    """This process's live state and resume metadata at the last optimizer-step boundary (or right after a live
    join): what survives an abrupt failure of a peer (see :mod:`lightning_emig.membership.failure`)."""
    failure_settings: FailureSettings

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def layout(self) -> HybridLayout: ...

    @property
    def timeout(self) -> timedelta: ...

    @property
    def elastic_settings(self) -> ElasticSettings: ...

    @property
    def process_group_backend(self) -> str | None: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def reached_step(self) -> int:
        """Optimizer steps completed so far (-1 before training started)."""

    def release_process_groups(self) -> None:
        """Drop every reference to the current world's process groups (mesh, optimizers)."""

    def live_storages(self) -> frozenset[int]:
        """The storages (:func:`~lightning_emig.migration.state.storage_key`) of state the process still reads after
        its model was dropped (the LightningModule's own parameters and buffers): a handoff never frees them."""


def layout_for_new_world(requested: HybridLayout, world_size: int) -> HybridLayout:
    """The largest valid layout by a simple rule (until the picker lands), resolved for ``world_size``.

    Keep the requested ``tp``, ``pp`` (with its ``pp_virtual``) and ``dp_replicate`` when their product divides the
    new world and let ``dp_shard`` fill the rest; otherwise fall back to pure FSDP over the whole world.
    """
    fixed = requested.tp * requested.pp * requested.dp_replicate
    if all(d > 0 for d in (requested.tp, requested.pp, requested.dp_replicate)) and world_size % fixed == 0:
        return HybridLayout(
            dp_replicate=requested.dp_replicate, dp_shard=-1, tp=requested.tp, pp=requested.pp,
            pp_virtual=requested.pp_virtual,
        ).resolve(world_size)
    return HybridLayout(dp_shard=-1).resolve(world_size)


def validate_layout_for_module(module: Any, layout: HybridLayout) -> None:
    """Refuse ``layout`` by what the module declares: its ``validate_layout(layout)`` raises for a layout its model
    cannot be split by. A module that declares nothing is not checked (said once per class)."""
    validate = getattr(module, "validate_layout", None)
    if callable(validate):
        validate(layout)
    elif type(module) not in _WARNED_UNVALIDATED:
        _WARNED_UNVALIDATED.add(type(module))
        log.warning("%s has no validate_layout(layout) method: layouts are not checked against its model (a tp that "
                    "does not divide its heads fails later, inside configure_model)", type(module).__name__)


_WARNED_UNVALIDATED: set[type] = set()
