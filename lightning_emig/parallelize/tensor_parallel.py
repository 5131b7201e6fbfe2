"""Tensor parallelism: apply a model's own :class:`~lightning_emig.models.base.TensorParallelPlan`.

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
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_emig.models.base import ParallelizableModel


def apply_tensor_parallel(model: ParallelizableModel, tp_mesh: DeviceMesh) -> None:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` (no-op when its size is 1)."""
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D tensor-parallel mesh, got {tp_mesh.ndim} axes")
    if tp_mesh.size() == 1:
        return
    from torch.distributed.tensor.parallel import parallelize_module

    plan = model.tensor_parallel_plan()
    root: nn.Module = model  # type: ignore[assignment]
    parallelize_module(root, tp_mesh, plan.root)
    for block in model.blocks():
        parallelize_module(block, tp_mesh, plan.block)
    if plan.sequence_dim is not None:
        root.register_forward_pre_hook(_sequence_length_check(plan.sequence_dim, tp_mesh.size()))


def _sequence_length_check(dim: int, tp: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
    def check(module: nn.Module, args: tuple[Any, ...]) -> None:
        length = args[0].shape[dim]
        if length % tp:
            raise ValueError(
                f"sequence length {length} is not divisible by the tensor-parallel degree {tp}; "
                "sequence parallelism needs equal slices: pad or crop the batch to a multiple of tp"
            )

    return check
