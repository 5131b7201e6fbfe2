"""What a change of world or layout would refuse, refused when ``fit`` starts: before the first step.

A script trains under :class:`~lightning_emig.strategy.ElasticMigrationStrategy` as it trains under Lightning's
``ModelParallelStrategy``, or it is refused here with what to do instead; never at its first change, which may come
in a preemption's grace period. Checked once the model and the optimizer are built:

* the model is built in ``configure_model`` (``ModelParallelStrategy`` itself refuses a module without one): the
  strategy builds it again there for every new layout;
* children built elsewhere (in ``__init__`` or ``setup``: a loss with a class weight, a metric, a frozen teacher)
  are kept as they are across changes, and their state moves to joining processes like the model's. They must hold
  no parallelized state (a model built in ``__init__`` and sharded in ``configure_model`` cannot be built again for
  another layout) and, like parameters on the LightningModule itself, no trainable parameter: no data-parallel
  layout reduces its gradient, so its replicas would drift apart (under ``ModelParallelStrategy`` they do, silently);
* one optimizer, stepped by Lightning (automatic optimization): the state and schedule carried across a change are
  those of one optimizer, stepped once per global batch (Lightning itself refuses several optimizers without manual
  optimization);
* an optimizer whose state can be migrated (per-parameter tensors, each shaped like its parameter or a scalar):
  a new optimizer of the same class and settings takes two steps on small parameters (one per number of dimensions
  the real one holds) and its state is checked by the rule the migration applies;
* a model that a later layout (the requested one, a ``LayoutSchedule``'s, or the picker's with ``allow_pp``)
  cuts into pipeline stages declares them (``blocks()``, ``keep_stage``) and ties no weights across its blocks;
* every epoch whole: ``limit_train_batches`` / ``overfit_batches`` count each process's batches, whose number per
  global batch a change of world changes;
* no callback that keeps its own copy of the model (Lightning's ``WeightAveraging``, ``StochasticWeightAveraging``):
  the copy is made once, for the first layout, and no change can lay it out again.
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from torch.distributed.tensor import DTensor

from lightning_emig.migration.state import UnsupportedStateError, check_optimizer_state, local_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

MODEL_COPYING_CALLBACKS = (WeightAveraging, StochasticWeightAveraging)


class NotElasticError(ValueError):
    """A script that a change of world or layout could not carry on: refused when ``fit`` starts."""


def check_fit_start(trainer: pl.Trainer, module: pl.LightningModule, kept: frozenset[str], *,
                    stages_later: bool = False) -> None:
    """Refuse, with what to do instead, what a change would refuse (see the module docstring); ``kept`` are the
    children built outside ``configure_model``; ``stages_later``: a later layout may have pipeline stages."""
    _check_kept_state(module, kept)
    if stages_later:
        check_can_be_staged(module)
    _check_optimization(module)
    _check_epoch_limit(trainer)
    probe_optimizer(trainer.optimizers[0])


def _check_epoch_limit(trainer: pl.Trainer) -> None:
    # Lightning counts the limit in each process's batches (micro-batches here), whose number per global batch
    # changes with the world: an epoch cut so would change length at every change of world, or end in the middle of
    # a global batch (Lightning then steps on part of one).
    limit = trainer.limit_train_batches
    if limit != 1.0:
        raise NotElasticError(
            f"Trainer(limit_train_batches={limit!r}) (or overfit_batches) counts each process's batches, and a change "
            "of world changes how many of them make a global batch; train on a smaller dataset instead (e.g. "
            "torch.utils.data.Subset) or stop by max_steps"
        )


def _check_kept_state(module: torch.nn.Module, kept: frozenset[str]) -> None:
    for child_name in sorted(kept):
        child = getattr(module, child_name)
        parallelized = next((n for n, t in (*child.named_parameters(), *child.named_buffers())
                             if isinstance(t, DTensor)), None)
        if parallelized is not None:
            raise NotElasticError(
                f"{child_name}.{parallelized} was made a DTensor by configure_model, but {child_name} was built before "
                f"it ran (in __init__ or setup): the strategy builds the model again for every layout, so build "
                f"{child_name} inside configure_model whenever it is None"
            )
    outside = [name for name, p in module.named_parameters()
               if p.requires_grad and ("." not in name or name.split(".", 1)[0] in kept)]
    if outside:
        raise NotElasticError(
            f"trainable parameter(s) {outside} are not in the model configure_model builds: no data-parallel layout "
            "reduces their gradients, so each process would train its own copy (under ModelParallelStrategy too). "
            "Build them inside the model that configure_model parallelizes, or freeze them (requires_grad=False)"
        )


def check_can_be_staged(module: torch.nn.Module) -> None:
    """Refuse a module whose model cannot be cut into pipeline stages: when ``fit`` starts for a layout the job is
    told of, or when ``reconfigure`` is asked for one (the cut itself tries every stage's ``keep_stage`` on a meta
    copy before any state moves, but by then a change has begun)."""
    from lightning_emig.models.base import declares_blocks
    from lightning_emig.parallelize.pipeline import check_ties_stay_in_a_block

    model = next((m for m in module.modules() if declares_blocks(m)), None)
    if model is None or not callable(getattr(model, "keep_stage", None)):
        raise NotElasticError(
            "a later layout has pipeline stages (pp > 1), but no model in the module declares blocks() and "
            "keep_stage(blocks, first=, last=): give the model configure_model builds those methods (see "
            "lightning_emig.parallelize.pipeline), or keep pp=1 in the layouts, the schedule and the picker"
        )
    if getattr(model, "pipeline_split", None) is None:  # a model already cut was checked by its cut
        check_ties_stay_in_a_block(model, 2)


def _check_optimization(module: pl.LightningModule) -> None:
    # Several optimizers: Lightning itself refuses them without manual optimization.
    if not module.automatic_optimization:
        raise NotElasticError(
            "manual optimization (automatic_optimization = False) is not supported: the strategy carries the state "
            "of one optimizer that Lightning steps once per global batch; let Lightning step it (training_step "
            "returns the loss; one optimizer, with parameter groups for parts that need their own lr)"
        )


def check_callbacks(trainer: pl.Trainer) -> None:
    """Refuse a callback that keeps its own copy of the model; called before the callbacks' ``setup`` (where
    ``WeightAveraging`` makes its copy)."""
    for callback in trainer.callbacks:
        if isinstance(callback, MODEL_COPYING_CALLBACKS):
            raise NotElasticError(
                f"the {type(callback).__name__} callback keeps its own copy of the model, made once for the first "
                "layout: no change of world or layout can lay it out again; remove it (average the weights inside "
                "the model that configure_model builds, e.g. as buffers updated in on_before_zero_grad)"
            )


def probe_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Step a new optimizer of ``optimizer``'s class and settings on small parameters and check its state by
    the migration's rule. An optimizer that cannot be built or stepped so is checked at the first change instead."""
    held = [local_of(p) for group in optimizer.param_groups for p in group["params"]]
    device = held[0].device if held else torch.device("cpu")
    # One small parameter per number of dimensions the optimizer holds (some take matrices only).
    params = [torch.nn.Parameter(torch.ones((3, 5, 2, 2)[:dims] or (), device=device))
              for dims in sorted({t.dim() for t in held} or {2})]
    name = type(optimizer).__name__
    try:
        probe = type(optimizer)(params, **_constructor_settings(optimizer))
        for _ in range(2):  # some optimizers create part of their state on a later step
            probe.step(_closure(probe, params))
    except Exception as exc:  # noqa: BLE001 - any failure of the probe leaves the check to the first change
        log.warning("could not probe %s's state (%s: %s): it is checked at the first change instead", name,
                    type(exc).__name__, exc)
        return
    for param in params:
        for key, value in probe.state.get(param, {}).items():
            try:
                check_optimizer_state(f"<{tuple(param.shape)} parameter>/{key}", value, param)
            except UnsupportedStateError as exc:
                raise NotElasticError(
                    f"{name} cannot be migrated: {exc}. Use an optimizer whose state is per-parameter tensors "
                    "(SGD, Adam, AdamW, Adagrad, RMSprop, ...)"
                ) from exc


def _constructor_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.defaults`` that its constructor takes (torch's AdamW records ``decoupled_weight_decay``, which
    only Adam's constructor takes)."""
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}


def _closure(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> Any:
    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        with torch.enable_grad():
            loss = sum((p * p).sum() for p in params)
            loss.backward()  # type: ignore[union-attr]
        return loss  # type: ignore[return-value]

    return closure
