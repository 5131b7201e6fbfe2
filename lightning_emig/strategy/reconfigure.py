"""Live layout change inside a running ``Trainer.fit``, at an optimizer-step boundary, on the same processes.

The steps, in order (each timed into the event):

1. ``validate``: resolve the layout for the world, check the model accepts it and the global batch still
   divides — before anything is touched, so a bad request changes nothing;
2. ``mesh``: build the new DeviceMesh on the existing process group;
3. ``build``: drop the module's child modules and call its ``configure_model`` again under the new mesh, with
   ``strategy.migrating`` set so it may skip initialisation (the migration overwrites every parameter);
   ``rank order``: where the request leaves the rank order open, the new model's specs say which order keeps the
   most state in place (:mod:`lightning_emig.migration.rank_order`); when that is not the default one, the mesh
   and the model are built again under it (a meta build: far cheaper than the bytes it saves on the wire);
4. ``optimizers``: call ``configure_optimizers`` for the new parameters, allocate the optimizer state;
5. ``transfer``: :func:`lightning_emig.migration.engine.migrate` moves parameters and optimizer state;
6. ``restore``: optimizer hyper-parameters and scheduler state, gradient accumulation, data topology, the
   data fetcher's iterator (its prefetched batch belonged to the old layout) and the batch counters.

What a LightningModule must do to be re-laid-out: build its model in ``configure_model`` from
``self.trainer.strategy.layout_mesh`` whenever its model attribute is ``None`` (the strategy sets every direct
child module to ``None`` first), and hold no other reference to old parameters.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_emig.launcher.generation import ENV_NODE_ID
from lightning_emig.layout import HybridLayout, build_mesh
from lightning_emig.migration.change import ChangeRecord, execute_change, whole_state_specs
from lightning_emig.migration.engine import tensor_migrations
from lightning_emig.migration.planner import IdentityMap, TensorMigration
from lightning_emig.migration.rank_order import choose_rank_order
from lightning_emig.migration.state import StateTensor, allocate_optimizer_state, training_state
from lightning_emig.strategy.progress import show_migration

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_emig.strategy.elastic import ElasticMigrationStrategy

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReconfigureEvent:
    """One structured record of a layout change (what issue trackers and dashboards read)."""

    kind: str
    step: int
    old_layout: dict[str, int]
    new_layout: dict[str, int]
    old_world: int
    new_world: int
    bytes_moved: int = 0
    bytes_copied_locally: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    generation: int | None = None
    """The launcher generation the change led to (membership changes only)."""
    downtime_seconds: float | None = None
    """Last step finished on the old world to first step finished on the new (membership changes only)."""
    steps_rolled_back: int | None = None
    """Steps done on the old world after the checkpoint a restart resumed from (recomputed on the new one)."""
    layout_choice: dict[str, Any] | None = None
    """Why the layout picker chose ``new_layout`` (None: the requested layout or the fixed rule)."""

    @classmethod
    def of(cls, change: ChangeRecord, *, generation: int | None = None, downtime_seconds: float | None = None
           ) -> ReconfigureEvent:
        """The event of ``change`` (steps rolled back are reported for failures only)."""
        return cls(
            kind=change.kind, step=change.step, old_layout=change.old_layout.as_dict(),
            new_layout=change.new_layout.as_dict(), old_world=change.old_world, new_world=change.new_world,
            bytes_moved=change.bytes_moved, bytes_copied_locally=change.bytes_copied_locally,
            seconds=dict(change.seconds), generation=generation, downtime_seconds=downtime_seconds,
            steps_rolled_back=change.steps_rolled_back if change.kind == "failure" else None,
        )

    def as_dict(self) -> dict[str, Any]:
        optional = (("generation", self.generation), ("downtime_seconds", self.downtime_seconds),
                    ("steps_rolled_back", self.steps_rolled_back), ("layout_choice", self.layout_choice))
        extra = {k: v for k, v in optional if v is not None}
        return {
            "kind": self.kind, "step": self.step, "old_layout": self.old_layout, "new_layout": self.new_layout,
            "old_world": self.old_world, "new_world": self.new_world, "bytes_moved": self.bytes_moved,
            "bytes_copied_locally": self.bytes_copied_locally, "seconds": self.seconds,
            "total_seconds": sum(self.seconds.values()), **extra,
        }


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def reconfigure_live(
    strategy: ElasticMigrationStrategy, trainer: pl.Trainer, requested: HybridLayout
) -> ReconfigureEvent | None:
    """Switch ``strategy`` to ``requested`` now; returns the event, or None when the layout is unchanged."""
    timer = _Timer()
    module = strategy.lightning_module
    assert module is not None
    old_layout = strategy.layout
    new_layout = requested.resolve(strategy.world_size)
    if new_layout == old_layout or (requested.rank_order is None and new_layout.degrees == old_layout.degrees):
        return None
    show_migration(trainer, f"migrating: reconfigure to {new_layout.describe()}")
    settings = strategy.elastic_settings
    settings.validate_layout(new_layout)
    new_plan = settings.plan_for(new_layout)
    timer.lap("validate")

    old_optimizer = strategy.optimizers[0]
    # The LightningModule is the root: its parameter names are stable whatever its children are rebuilt as.
    old_state = training_state(module, old_optimizer)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in old_optimizer.param_groups]
    schedulers = [cfg.scheduler.state_dict() for cfg in strategy.lr_scheduler_configs]

    strategy.install_mesh(build_mesh(new_layout, strategy.root_device.type, timeout=strategy.timeout), new_plan)
    timer.lap("mesh")

    _rebuild_model(strategy, module)
    timer.lap("build")
    identity = IdentityMap.same_processes(strategy.world_size, _node_of_every_rank())
    if requested.rank_order is None and strategy.world_size > 1:
        ordered = _rank_order_keeping_state(module, old_state, old_layout, new_layout, identity)
        if ordered != new_layout:
            new_layout = ordered
            strategy.install_mesh(build_mesh(new_layout, strategy.root_device.type, timeout=strategy.timeout),
                                  new_plan)
            _rebuild_model(strategy, module)
        timer.lap("rank order")

    strategy.setup_optimizers(trainer)
    new_optimizer = strategy.optimizers[0]
    new_state = training_state(module, None)
    optim_template = whole_state_specs({k: t.spec for k, t in old_state.items() if k.startswith("optim/")},
                                       old_layout, new_layout)
    new_state.update(allocate_optimizer_state(module, new_optimizer, optim_template))
    timer.lap("optimizers")

    record = execute_change(
        kind="reconfigure", step=trainer.global_step, old_state=old_state, new_state=new_state, old_layout=old_layout,
        new_layout=new_layout, identity=identity, pid=strategy.global_rank,
        transfer=settings.transfer,
    )
    # No gc.collect(): the transfer freed every old shard's storage as it left (release_old), so a collection
    # (0.3-0.4 s over a trained process's objects) would free no state; the old modules' cycles go with the next
    # automatic collection.
    del old_state, old_optimizer
    timer.lap("transfer")

    _restore_optimizer_settings(strategy, hyper, schedulers)
    strategy.restart_data(trainer)
    timer.lap("restore")
    return ReconfigureEvent.of(dataclasses.replace(record, seconds=timer.seconds))


def _rank_order_keeping_state(module: Any, old_state: dict[str, StateTensor], old_layout: HybridLayout,
                              new_layout: HybridLayout, identity: IdentityMap) -> HybridLayout:
    """``new_layout`` in the rank order that keeps the most of the model's state in place (the optimizer's moments
    lie as their parameters do, so the parameters and buffers decide); the same answer on every process."""
    old_specs = whole_state_specs({k: t.spec for k, t in old_state.items() if not k.startswith("optim/")},
                                  old_layout, new_layout)
    new_specs = whole_state_specs({k: t.spec for k, t in training_state(module, None).items()}, old_layout, new_layout)

    def tensors_for(old: HybridLayout, new: HybridLayout) -> list[TensorMigration]:
        return tensor_migrations(old_specs, new_specs, old, new)

    choice = choose_rank_order(old_layout, new_layout, tensors_for, identity)
    if choice.bytes_saved:
        log.info("rank order %s keeps %.1f MB more of the model in place than the default",
                 ">".join(choice.layout.rank_order or ()), choice.bytes_saved / 1e6)
    return choice.layout


def _node_of_every_rank() -> list[str]:
    """Every rank's node (one small all-gather): the launcher's node id, else torchrun's host and agent."""
    import torch.distributed as dist

    mine = os.environ.get(ENV_NODE_ID) or f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}"
    nodes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, mine)
    return [str(n) for n in nodes]


def drop_model(module: Any) -> list[str]:
    """Set every direct child of ``module`` that holds parameters or buffers to None (its ``configure_model`` builds
    them for the new layout; a child without state, e.g. a loss module, stays). Returns the names dropped."""
    dropped = [name for name, child in module.named_children()
               if any(True for _ in child.parameters()) or any(True for _ in child.buffers())]
    for name in dropped:
        setattr(module, name, None)
    return dropped


def check_rebuilt(module: Any, dropped: list[str]) -> None:
    """After ``configure_model``: every dropped child was built again."""
    missing = [name for name in dropped if getattr(module, name, None) is None]
    if missing:
        raise RuntimeError(
            f"configure_model left {missing} as None after a change of layout: it must build every child that holds "
            "parameters or buffers whenever it is None (the strategy drops them before a change)"
        )


def _rebuild_model(strategy: ElasticMigrationStrategy, module: Any) -> None:
    dropped = drop_model(module)
    strategy.migrating = True
    try:
        module.configure_model()
    finally:
        strategy.migrating = False
    check_rebuilt(module, dropped)
    if not any(True for _ in module.parameters()):
        raise RuntimeError(
            "configure_model built no parameters after the strategy reset the model: it must rebuild the model "
            "whenever its model attribute is None (see lightning_emig.strategy.reconfigure)"
        )


def _restore_optimizer_settings(
    strategy: ElasticMigrationStrategy, hyper: list[dict[str, Any]], schedulers: list[dict[str, Any]]
) -> None:
    optimizer = strategy.optimizers[0]
    if len(optimizer.param_groups) != len(hyper):
        raise RuntimeError(
            f"configure_optimizers made {len(optimizer.param_groups)} parameter groups after the layout change, "
            f"{len(hyper)} before; they must match"
        )
    for group, saved in zip(optimizer.param_groups, hyper, strict=True):
        group.update(saved)
    for cfg, state in zip(strategy.lr_scheduler_configs, schedulers, strict=True):
        cfg.scheduler.load_state_dict(state)
