"""A layout change prepared while the old layout trains: the new mesh, model and plan built in a background thread.

When a change of layout on the same processes is known before the step boundary where it takes effect (a
schedule's entry, ``strategy.prepare_reconfigure(layout)``), a :class:`LayoutPreparation` builds, in a background
thread, while the old layout keeps training:

1. the new mesh: its sub-groups (each a rendezvous over the store: nothing runs on the default group that the
   training's collectives use);
2. the new model: the LightningModule's ``configure_model`` runs on a *stand-in* (the module's attributes with its
   own registries of children, parameters and buffers, so the training model is untouched), the strategy's
   ``layout_mesh`` and ``migrating`` as that thread alone sees them (:class:`ShadowView`); where the request leaves
   the rank order open, the order that keeps the most state in place is chosen, and built, there too;
3. the plan: this process's transfer list, cached where ``migrate`` looks for it.

The new model is built on the meta device: where ``configure_model`` allocates it through
:func:`~lightning_emig.parallelize.materialize_empty`, that call is deferred to the boundary (``install``), so the
preparation holds no new state and the new storage is allocated where a change built in the pause allocates it. On
the CPU this matters: storage allocated in the thread, next to the old state, got fresh pages that the transfer's
first writes then mapped, in the pause (``llama_125m``, FSDP 2 -> TP 2: the prepared transfer 0.84 s against 0.59 s
built, medians of 3); writing those pages in the thread instead halved that transfer but cost 2.2-2.8 s of the
thread's CPU per process, taken from the overlapped step on two busy cores (about 15 % of a 10 s step).

Not for a change to or from pipeline stages: there each process knows its own stage's specs only, and the rank order
and the plan need every process's (a collective on the default group, which the training thread uses).

At the boundary :func:`~lightning_emig.change.reconfigure.reconfigure_live` waits for the thread (reported as the
``prepare wait`` phase), every process says how its preparation went (one small all-gather), and the mesh and the
built children are swapped in; the optimizer, the transfer and the restore follow as without a preparation. Where a
preparation failed after its meshes were built on every process, every process builds at the boundary instead.

Rules and costs:

* every rank prepares the same layouts in the same order and creates no other process group meanwhile (torch names
  groups by a per-process counter); a preparation is only used for the same old layout it was prepared from;
* memory: a model built through ``materialize_empty`` is allocated at the boundary, as a change built there is;
  one that ``configure_model`` allocates otherwise (``to_empty`` of its own) is allocated in the thread, so until
  the boundary a process holds its old state and the new parameters;
* the thread takes CPU time from the steps it overlaps (``tools/bench_prepare.py`` measures the steps' slowdown).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_emig.change.rebuild import (
    check_built_again,
    check_rebuilt,
    clear_children,
    drop_model,
    rank_order_keeping_state,
)
from lightning_emig.layout import HybridLayout, LayoutMesh, build_mesh
from lightning_emig.migration.engine import plan_ahead
from lightning_emig.migration.identity import IdentityMap
from lightning_emig.migration.state import ShardingSpec, planned_optimizer_specs, training_state
from lightning_emig.parallelize.init import materialization_deferred

if TYPE_CHECKING:
    from torch import nn

    from lightning_emig.change.host import PrepareHost

log = logging.getLogger(__name__)

_REGISTRIES = ("_modules", "_parameters", "_buffers")


class ShadowView(threading.local):
    """What a preparing thread sees as the strategy's ``layout_mesh`` and ``migrating`` (None / False: the
    strategy's own, which every other thread sees)."""

    layout_mesh: LayoutMesh | None = None
    migrating: bool = False


@dataclass(slots=True)
class PreparedLayout:
    """What a preparation built: swapped in at the boundary."""

    layout: HybridLayout
    """The requested layout, resolved, in the rank order chosen."""
    layout_mesh: LayoutMesh
    children: dict[str, nn.Module]
    """The module's children that hold state, built for ``layout``."""
    attributes: dict[str, Any]
    """Other attributes ``configure_model`` set on the stand-in."""
    identity: IdentityMap
    materialize: list[Callable[[], None]]
    """The ``materialize_empty`` calls ``configure_model`` made, deferred to :meth:`install`."""
    seconds: dict[str, float] = field(default_factory=dict)
    """The background phases (off the critical path)."""

    def install(self, strategy: PrepareHost, module: Any) -> None:
        """Put the prepared mesh and children in place of the old ones (the old state must be captured first)."""
        strategy.install_mesh(self.layout_mesh, strategy.elastic_settings.plan_for(self.layout))
        dropped = drop_model(module, strategy.kept_children)
        for name, child in self.children.items():
            setattr(module, name, child)
        for materialize in self.materialize:
            materialize()
        module.__dict__.update(self.attributes)
        check_rebuilt(module, dropped)


@dataclass(frozen=True, slots=True)
class _Outcome:
    """How one process's preparation went (what the processes agree on at the boundary)."""

    usable: bool
    """Prepared for this change, from this layout."""
    ok: bool
    meshes_built: int
    """Meshes completed: where every process completed the same number, their group counters agree."""
    mesh_failed: bool
    error: str | None = None


class LayoutPreparation:
    """One layout change being prepared by a background thread (see the module)."""

    def __init__(self, strategy: PrepareHost, requested: HybridLayout, *,
                 old_specs: dict[str, ShardingSpec], identity: IdentityMap) -> None:
        self.requested = requested
        self.old_layout = strategy.layout
        self._strategy = strategy
        self._old_specs = old_specs
        self._identity = identity
        self._result: PreparedLayout | None = None
        self._error: BaseException | None = None
        self._meshes_built = 0
        self._mesh_failed = False
        self._thread = threading.Thread(target=self._run, name="lightning-emig-prepare", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> None:
        """Until the thread has finished (a thread still building after ``timeout_s`` is an error: a peer never
        prepared the same layout, or died)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(
                f"the preparation of {self.requested.describe()} did not finish within {timeout_s:.0f} s: every rank "
                "must call prepare_reconfigure with the same layout at the same step"
            )

    def outcome(self, usable: bool) -> _Outcome:
        error = None if self._error is None else f"{type(self._error).__name__}: {self._error}"
        return _Outcome(usable, self._result is not None, self._meshes_built, self._mesh_failed, error)

    @property
    def result(self) -> PreparedLayout | None:
        return self._result

    def _run(self) -> None:
        try:
            self._result = self._prepare()
        except BaseException as exc:  # reported at the boundary, where every process learns of it
            log.warning("preparing %s failed (it is built at the step boundary instead)", self.requested.describe(),
                        exc_info=True)
            self._error = exc

    def _prepare(self) -> PreparedLayout:
        strategy, seconds = self._strategy, {}
        started = time.perf_counter()
        layout = self.requested.resolve(strategy.world_size)
        layout_mesh = self._mesh(layout)
        seconds["mesh"] = time.perf_counter() - started
        started = time.perf_counter()
        children, attributes, stand_in, materialize = _build_on_stand_in(strategy, layout_mesh)
        seconds["build"] = time.perf_counter() - started
        if self.requested.rank_order is None and strategy.world_size > 1:
            started = time.perf_counter()
            ordered = rank_order_keeping_state(stand_in, self._old_specs, self.old_layout, layout, self._identity)
            if ordered != layout:
                layout, layout_mesh = ordered, self._mesh(ordered)
                children, attributes, stand_in, materialize = _build_on_stand_in(strategy, layout_mesh)
            seconds["rank order"] = time.perf_counter() - started
        started = time.perf_counter()
        optim = {k: spec for k, spec in self._old_specs.items() if k.startswith("optim/")}
        new_specs = {k: t.spec for k, t in training_state(stand_in, None).items()}
        new_specs.update(planned_optimizer_specs(stand_in, optim))
        plan_ahead(self._old_specs, new_specs, self.old_layout, layout, self._identity, strategy.global_rank)
        seconds["plan"] = time.perf_counter() - started
        return PreparedLayout(layout, layout_mesh, children, attributes, self._identity, materialize, seconds)

    def _mesh(self, layout: HybridLayout) -> LayoutMesh:
        strategy = self._strategy
        try:
            mesh = build_mesh(layout, strategy.root_device.type, timeout=strategy.timeout)
        except BaseException:
            self._mesh_failed = True
            raise
        self._meshes_built += 1
        return mesh


def _build_on_stand_in(strategy: PrepareHost, layout_mesh: LayoutMesh
                       ) -> tuple[dict[str, nn.Module], dict[str, Any], Any, list[Callable[[], None]]]:
    """Run the module's ``configure_model`` on a stand-in under ``layout_mesh``; returns the children it built, the
    other attributes it set, the stand-in, and the ``materialize_empty`` calls it made (deferred)."""
    module = strategy.lightning_module
    stand_in = object.__new__(type(module))
    stand_in.__dict__.update(module.__dict__)
    for registry in _REGISTRIES:
        stand_in.__dict__[registry] = dict(module.__dict__[registry])
    before = dict(stand_in.__dict__)
    dropped = clear_children(stand_in, strategy.kept_children)  # the live model trains on: nothing of it is freed
    stand_in.__dict__["_device_mesh"] = layout_mesh.root
    view = strategy.shadow_view
    view.layout_mesh, view.migrating = layout_mesh, True
    try:
        with materialization_deferred() as materialize:
            stand_in.configure_model()
    finally:
        view.layout_mesh, view.migrating = None, False
    check_built_again(stand_in, dropped)
    if type(stand_in) is not type(module):
        raise RuntimeError("configure_model changed the LightningModule's own class (e.g. fully_shard on the module "
                           "itself): its model cannot be prepared on a stand-in")
    children = {name: stand_in._modules[name] for name in dropped}  # noqa: SLF001 - our own stand-in
    attributes = {k: v for k, v in stand_in.__dict__.items()
                  if k not in _REGISTRIES and k != "_device_mesh" and before.get(k, _MISSING) is not v}
    return children, attributes, stand_in, materialize


_MISSING = object()


def take_prepared(strategy: PrepareHost, preparation: LayoutPreparation | None,
                  requested: HybridLayout) -> PreparedLayout | None:
    """At the boundary of a change to ``requested``: the prepared layout, where every process prepared it from this
    layout and succeeded; else None, and every process builds at the boundary. Waits for the thread; every process of
    the default group calls it, with or without a preparation (one small all-gather)."""
    mine = None
    if preparation is not None:
        preparation.wait(strategy.timeout.total_seconds())
        usable = preparation.requested == requested and preparation.old_layout == strategy.layout
        mine = preparation.outcome(usable)
    outcomes: list[_Outcome | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, mine)
    if all(o is None for o in outcomes):
        return None
    if all(o is not None and o.usable and o.ok for o in outcomes):
        assert preparation is not None
        return preparation.result
    present = [o for o in outcomes if o is not None]
    if len(present) < len(outcomes) or any(o.mesh_failed for o in present) \
            or len({o.meshes_built for o in present}) > 1:
        raise RuntimeError(
            f"the preparations of {requested.describe()} differ between ranks ({outcomes}): every rank must call "
            "prepare_reconfigure with the same layout at the same step (their process groups no longer match)"
        )
    errors = sorted({o.error for o in present if o.error})
    log.warning("%s: building %s at the step boundary", "; ".join(errors) or "prepared for another change",
                requested.describe())
    return None
