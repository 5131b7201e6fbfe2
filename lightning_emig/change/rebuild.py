"""Building a LightningModule's model again for a new layout, and choosing the rank order that keeps most state.

Shared by the live layout change (:mod:`~lightning_emig.change.reconfigure`, which builds at the step boundary)
and its preparation in the background (:mod:`~lightning_emig.change.prepare`, which builds on a stand-in of the
module while the old layout trains).

What a LightningModule must do to be re-laid-out: build its model in ``configure_model`` from
``self.trainer.strategy.layout_mesh`` whenever its model attribute is ``None`` (every direct child module that holds
state is set to ``None`` first), and hold no other reference to old parameters.

What the user set on the model after building it (a part frozen in ``setup``, ``on_fit_start`` or by a finetuning
callback; a submodule put in eval mode) is not rebuilt by ``configure_model``: :class:`ModuleSetup` carries each
parameter's ``requires_grad`` and each submodule's train/eval mode across the rebuild, by name.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_emig.launcher.generation import ENV_NODE_ID
from lightning_emig.migration.change import whole_state_specs
from lightning_emig.migration.engine import tensor_migrations
from lightning_emig.migration.identity import IdentityMap
from lightning_emig.migration.planner import TensorMigration
from lightning_emig.migration.rank_order import choose_rank_order
from lightning_emig.migration.state import ShardingSpec, training_state

if TYPE_CHECKING:
    from lightning_emig.change.host import RebuildHost
    from lightning_emig.layout import HybridLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModuleSetup:
    """What the user set on a module after building it, by name: every parameter's ``requires_grad`` and every
    submodule's ``training`` flag. Names are the same under every layout (:mod:`lightning_emig.models.base`); a name
    the rebuilt module does not hold (a pipeline stage's dropped blocks) is left alone."""

    requires_grad: dict[str, bool]
    training: dict[str, bool]

    @classmethod
    def of(cls, module: Any) -> ModuleSetup:
        return cls(requires_grad={name: p.requires_grad for name, p in module.named_parameters()},
                   training={name: m.training for name, m in module.named_modules()})

    def apply(self, module: Any) -> None:
        """Set the recorded flags on the rebuilt ``module`` (before its optimizers are made: ``configure_optimizers``
        often keeps only the parameters that require gradients)."""
        for name, p in module.named_parameters():
            if name in self.requires_grad:
                p.requires_grad_(self.requires_grad[name])
        for name, m in module.named_modules():  # each flag by itself: train() would set every submodule's
            if name in self.training:
                m.training = self.training[name]


def children_with_state(module: Any) -> frozenset[str]:
    """The direct children of ``module`` that hold parameters or buffers (read before ``configure_model`` runs: the
    children built elsewhere, which the strategy keeps across changes)."""
    return frozenset(name for name, child in module.named_children()
                     if next(child.parameters(), None) is not None or next(child.buffers(), None) is not None)


def clear_children(module: Any, keep: frozenset[str]) -> list[str]:
    """Set every direct child of ``module`` that holds parameters or buffers to None (its ``configure_model`` builds
    them for the new layout), but those in ``keep``: the children built outside ``configure_model`` (a loss with a
    class weight, a frozen teacher), which hold no layout and stay as they are. Returns the names cleared. The
    children themselves are left as they are: a stand-in of the module shares them with the live one, which trains
    on (:mod:`~lightning_emig.change.prepare`)."""
    cleared = sorted(children_with_state(module) - keep)
    for name in cleared:
        setattr(module, name, None)
    return cleared


def drop_model(module: Any, keep: frozenset[str], *, cut_short_by: BaseException | None = None) -> list[str]:
    """:func:`clear_children` of a model that is done with (a change's old model, at a step boundary or after a
    failure), freeing now what its children hold beyond the training state (which the change moves and frees), not
    beside the new model's first step. Returns the names dropped.

    Their gradients are released at once: Lightning clears them only before the next backward (measured at
    ``llama_125m``, FSDP 2 -> 1: 0.25 GB held through a preemption's pause). A step cut short by an error
    (``cut_short_by``, a failure) also left FSDP's unsharded parameters and gradient buffers in the dropped modules'
    reference cycles, reachable from the error's frames until it is handled (0.50-0.53 GB at ``llama_125m`` under
    HSDP, beside a 1.5 GB state): the frames' variables are cleared (the error keeps its message and its traceback's
    lines) and a collection frees the rest, walking only what was created since the fit started
    (:mod:`lightning_emig.collector`; 7-16 ms measured). A change at a step boundary takes none: it finds nothing
    there (measured)."""
    for name in children_with_state(module) - keep:
        for parameter in getattr(module, name).parameters():
            parameter.grad = None
    dropped = clear_children(module, keep)
    if cut_short_by is not None:
        _clear_frames(cut_short_by)
        gc.collect()
    return dropped


def _clear_frames(error: BaseException) -> None:
    """Drop the variables of the finished frames ``error`` and the errors it came from passed through (a running
    frame, the handler's own, is left as it is)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def check_rebuilt(module: Any, dropped: list[str]) -> None:
    """After ``configure_model``: every dropped child was built again."""
    missing = [name for name in dropped if getattr(module, name, None) is None]
    if missing:
        raise RuntimeError(
            f"configure_model left {missing} as None after a change of layout: it must build every child that holds "
            "parameters or buffers whenever it is None (the strategy drops them before a change)"
        )


def rebuild_model(strategy: RebuildHost, module: Any) -> None:
    """Drop ``module``'s model and build it again with ``configure_model``, under ``strategy.migrating`` (it may
    skip initialisation: a migration overwrites every parameter) and the strategy's current ``layout_mesh``."""
    dropped = drop_model(module, strategy.kept_children)
    strategy.migrating = True
    try:
        module.configure_model()
    finally:
        strategy.migrating = False
    check_built_again(module, dropped)


def check_built_again(module: Any, dropped: list[str]) -> None:
    """After ``configure_model`` ran for a change of layout: every dropped child was built again, with parameters."""
    check_rebuilt(module, dropped)
    if not any(True for _ in module.parameters()):
        raise RuntimeError(
            "configure_model built no parameters after the strategy reset the model: it must rebuild the model "
            "whenever its model attribute is None (see lightning_emig.change.rebuild)"
        )


def rank_order_keeping_state(module: Any, old_specs: dict[str, ShardingSpec], old_layout: HybridLayout,
                             new_layout: HybridLayout, identity: IdentityMap) -> HybridLayout:
    """``new_layout`` in the rank order that keeps the most of the model's state in place (``module`` is built for
    ``new_layout``; the optimizer's moments lie as their parameters do, so the parameters and buffers decide); the
    same answer on every process. Communicates nothing."""
    old = whole_state_specs({k: spec for k, spec in old_specs.items() if not k.startswith("optim/")},
                            old_layout, new_layout)
    new = whole_state_specs({k: t.spec for k, t in training_state(module, None).items()}, old_layout, new_layout)

    def tensors_for(before: HybridLayout, after: HybridLayout) -> list[TensorMigration]:
        return tensor_migrations(old, new, before, after)

    choice = choose_rank_order(old_layout, new_layout, tensors_for, identity)
    if choice.bytes_saved:
        log.info("rank order %s keeps %.1f MB more of the model in place than the default",
                 ">".join(choice.layout.rank_order or ()), choice.bytes_saved / 1e6)
    return choice.layout


def node_of_every_rank() -> list[str]:
    """Every rank's node (one small all-gather on the default group): the launcher's node id, else torchrun's host
    and agent."""
    import torch.distributed as dist

    mine = os.environ.get(ENV_NODE_ID) or f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}"
    nodes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, mine)
    return [str(n) for n in nodes]
