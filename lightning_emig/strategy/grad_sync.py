"""Gradient reduction while a step's micro-batches accumulate (FSDP2).

Lightning enters ``strategy.block_backward_sync()`` around each micro-batch that only accumulates (every one of a
step but the last). Its ``ModelParallelStrategy`` does nothing there, so FSDP2 reduce-scatters the gradients after
every micro-batch and, under HSDP, all-reduces them across replicas after every micro-batch too. What waits for the
step's last micro-batch instead (:data:`~lightning_emig.layout.GRAD_SYNC_DEFERRALS`):

* ``"replicas"`` (the default): the all-reduce across replicas. The reduce-scatter still runs after every
  micro-batch, so gradients stay sharded and memory does not grow; FSDP2 adds the partial sums up and all-reduces
  them once. Only HSDP (``dp_replicate > 1``) has such an all-reduce.
* ``"all"``: the reduce-scatter too. Each rank then keeps the unsharded gradients of its FSDP units (in the reduce
  dtype) until the step's last micro-batch: one reduction per step, for a whole model's gradient of memory per rank.
* ``"none"``: nothing (Lightning's behaviour): the least memory, the most collectives.

The gradient a step ends with is the same sum either way, added up in another order (equal to rounding). Under
pipeline stages the schedule runs every micro-batch's backward within the step's last call, outside the block, and
torch's schedule itself defers every reduction of an FSDP2 stage to its last backward, whatever the choice; with
``dp == 1`` FSDP2 has nothing to reduce.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Literal

from torch.distributed.fsdp import FSDPModule

from lightning_emig.layout import GRAD_SYNC_DEFERRALS

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torch import nn

    from lightning_emig.layout import HybridLayout

DeferGradSync = Literal["replicas", "all", "none"]


def check_defer_choice(defer: str) -> None:
    if defer not in GRAD_SYNC_DEFERRALS:
        raise ValueError(f"defer_grad_sync must be one of {', '.join(map(repr, GRAD_SYNC_DEFERRALS))}, "
                         f"got {defer!r}")


@contextlib.contextmanager
def accumulating(model: nn.Module, layout: HybridLayout, defer: DeferGradSync) -> Iterator[None]:
    """Within: the micro-batches' backward passes leave the reductions ``defer`` names to the step's last one."""
    if layout.pp > 1 or defer == "none" or (defer == "replicas" and layout.dp_replicate == 1):
        yield
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    _set(units, defer, required=False)
    try:
        yield
    finally:  # also when a peer fails mid-step: the next step (or the rebuilt model) reduces as usual
        _set(units, defer, required=True)


def _set(units: list[FSDPModule], defer: DeferGradSync, *, required: bool) -> None:
    for unit in units:
        if defer == "all":
            unit.set_requires_gradient_sync(required, recurse=False)
        else:
            unit.set_requires_all_reduce(required, recurse=False)
