"""Tensor parallelism: apply a tensor-parallel plan (torch's ``parallelize_module`` form, or a model's own
:class:`~lightning_emig.models.base.TensorParallelPlan`).

Invariants:

* the model, not this module, knows which submodule is split how; this module only applies the plan, first to the
  root and then to every block in ``model.blocks()`` (so a pipeline stage holding a subset of blocks works);
* with a TP degree of 1 nothing changes: parameters stay plain tensors and no DTensor appears;
* TP runs before FSDP2, on a model whose parameters may still be on the meta device;
* with sequence parallelism an input whose sequence length the TP degree does not divide is refused before the
  forward starts: gloo aborts the process on such uneven reduce-scatters instead of raising.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

    from lightning_emig.models.base import TensorParallelPlan


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TensorParallelPlan | dict[str, ParallelStyle] | None = None,
    blocks: Sequence[nn.Module] | None = None,
) -> None:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` (no-op when its size is 1).

    ``plan``: a ``parallelize_module`` plan for the root (fqns may use ``*``), or a :class:`TensorParallelPlan`
    whose ``block`` part is applied to each of ``blocks`` (default: ``model.blocks()``); default: the model's own
    ``tensor_parallel_plan()``.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D tensor-parallel mesh, got {tp_mesh.ndim} axes")
    if tp_mesh.size() == 1:
        return
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_emig.models.base import TensorParallelPlan, blocks_of

    if plan is None:
        if not hasattr(model, "tensor_parallel_plan"):
            raise ValueError(
                f"tp={tp_mesh.size()} needs a tensor-parallel plan: pass tp_plan={{fqn: ColwiseParallel() | "
                f"RowwiseParallel() | ...}} (torch's parallelize_module form) or give {type(model).__name__} a "
                "tensor_parallel_plan() method"
            )
        plan = model.tensor_parallel_plan()  # type: ignore[operator]
    if isinstance(plan, dict):
        plan = TensorParallelPlan(root=plan, block={})
    # A pipeline stage lacks the embedding or the head: the root plan applies to the submodules it holds.
    parallelize_module(model, tp_mesh, {fqn: style for fqn, style in plan.root.items() if _holds(model, fqn)})
    if plan.block:
        for block in blocks_of(model) if blocks is None else blocks:
            parallelize_module(block, tp_mesh, plan.block)
    if plan.sequence_dim is not None:
        model.register_forward_pre_hook(_sequence_length_check(plan.sequence_dim, tp_mesh.size()))


def _holds(model: nn.Module, fqn: str) -> bool:
    if "*" in fqn:
        return True
    try:
        return model.get_submodule(fqn) is not None
    except AttributeError:
        return False


def _sequence_length_check(dim: int, tp: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
    def check(module: nn.Module, args: tuple[Any, ...]) -> None:
        length = args[0].shape[dim]
        if length % tp:
            raise ValueError(
                f"sequence length {length} is not divisible by the tensor-parallel degree {tp}; "
                "sequence parallelism needs equal slices: pad or crop the batch to a multiple of tp"
            )

    return check
