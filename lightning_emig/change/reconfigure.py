"""Live layout change inside a running ``Trainer.fit``, at an optimizer-step boundary, on the same processes.

The steps, in order (each timed into the event):

1. ``validate``: resolve the layout for the world, check the model accepts it and the global batch still
   divides — before anything is touched, so a bad request changes nothing;
2. ``prepare wait`` and ``install``, where the change was prepared while the old layout trained
   (:mod:`~lightning_emig.change.prepare`: the mesh, the model and the plan built in the background): wait for
   that thread, agree that every process prepared it, swap the new mesh and model in; steps 3 and 4 are skipped;
3. ``mesh``: build the new DeviceMesh on the existing process group;
4. ``build``: drop the module's child modules and call its ``configure_model`` again under the new mesh, with
   ``strategy.migrating`` set so it may skip initialisation (the migration overwrites every parameter);
   ``rank order``: where the request leaves the rank order open, the new model's specs say which order keeps the
   most state in place (:mod:`lightning_emig.migration.rank_order`); when that is not the default one, the mesh
   and the model are built again under it (a meta build: far cheaper than the bytes it saves on the wire);
5. ``optimizers``: call ``configure_optimizers`` for the new parameters, allocate the optimizer state;
6. ``transfer``: :func:`lightning_emig.migration.engine.migrate` moves parameters and optimizer state;
7. ``restore``: optimizer hyper-parameters and scheduler state, gradient accumulation, data topology, the
   data fetcher's iterator (its prefetched batch belonged to the old layout) and the batch counters.

What a LightningModule must do to be re-laid-out: see :mod:`~lightning_emig.change.rebuild`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from lightning_emig.change.events import ReconfigureEvent
from lightning_emig.change.prepare import take_prepared
from lightning_emig.change.progress import show_migration
from lightning_emig.change.rebuild import (
    ModuleSetup,
    node_of_every_rank,
    rank_order_keeping_state,
    rebuild_model,
)
from lightning_emig.layout import HybridLayout, build_mesh
from lightning_emig.migration.change import execute_change, whole_state_specs
from lightning_emig.migration.identity import IdentityMap
from lightning_emig.migration.state import StateTensor, allocate_optimizer_state, training_state

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_emig.change.host import ReconfigureHost


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def reconfigure_live(
    strategy: ReconfigureHost, trainer: pl.Trainer, requested: HybridLayout
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
    timer.lap("validate")

    old_optimizer = strategy.optimizers[0]
    # The LightningModule is the root: its parameter names are stable whatever its children are rebuilt as.
    old_state = training_state(module, old_optimizer)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in old_optimizer.param_groups]
    schedulers = [cfg.scheduler.state_dict() for cfg in strategy.lr_scheduler_configs]
    setup = ModuleSetup.of(module)

    preparation = strategy.take_preparation()
    prepared = take_prepared(strategy, preparation, requested)
    if preparation is not None:
        timer.lap("prepare wait")
    if prepared is not None:
        new_layout, identity = prepared.layout, prepared.identity
        prepared.install(strategy, module)
        timer.lap("install")
    else:
        new_layout, identity = _build_at_boundary(strategy, module, requested, new_layout, old_state, timer)
    setup.apply(module)

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
    # No gc.collect(): the transfer freed every old shard's storage as it left (release_old), so a collection would
    # free no state; the old modules' cycles go with the next automatic collection, which walks only the objects
    # created since the fit started (lightning_emig.collector).
    del old_state, old_optimizer
    timer.lap("transfer")

    _restore_optimizer_settings(strategy, hyper, schedulers)
    strategy.restart_data(trainer)
    timer.lap("restore")
    event = ReconfigureEvent.of(dataclasses.replace(record, seconds=timer.seconds))
    event.prepared_seconds = prepared.seconds if prepared is not None else None
    return event


def _build_at_boundary(strategy: ReconfigureHost, module: Any, requested: HybridLayout,
                       new_layout: HybridLayout, old_state: dict[str, StateTensor], timer: _Timer
                       ) -> tuple[HybridLayout, IdentityMap]:
    """Build the mesh and the model for ``new_layout`` now, in the rank order that keeps the most state in place
    where ``requested`` leaves it open; returns the layout built and the processes' identities."""
    old_layout = strategy.layout
    plan = strategy.elastic_settings.plan_for(new_layout)
    strategy.install_mesh(build_mesh(new_layout, strategy.root_device.type, timeout=strategy.timeout), plan)
    timer.lap("mesh")
    rebuild_model(strategy, module)
    timer.lap("build")
    identity = IdentityMap.same_processes(strategy.world_size, node_of_every_rank())
    if requested.rank_order is None and strategy.world_size > 1:
        old_specs = {k: t.spec for k, t in old_state.items()}
        ordered = rank_order_keeping_state(module, old_specs, old_layout, new_layout, identity)
        if ordered != new_layout:
            new_layout = ordered
            strategy.install_mesh(build_mesh(new_layout, strategy.root_device.type, timeout=strategy.timeout), plan)
            rebuild_model(strategy, module)
        timer.lap("rank order")
    return new_layout, identity


def _restore_optimizer_settings(
    strategy: ReconfigureHost, hyper: list[dict[str, Any]], schedulers: list[dict[str, Any]]
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
