"""Applying a :class:`~lightning_emig.layout.HybridLayout` to a model built on the meta device.

Invariants:

* any ``nn.Module`` can be parallelized: the tensor-parallel plan and the FSDP2 blocks are arguments (or come from
  the model's own ``tensor_parallel_plan()`` / ``blocks()`` when it offers them);
* the order is fixed: validate the layout against the model, tensor parallelism, then FSDP2 — FSDP2 must see the
  TP DTensors to shard them further (and produces ``_StridedShard`` placements on TP-sharded dim 0);
* with ``pp > 1`` the model is first cut to this process's pipeline stage (:mod:`~lightning_emig.parallelize.pipeline`);
  with ``pp_virtual > 1`` each of its stages (a view of the model) is an FSDP2 root of its own;
* the model is transformed in place and returned, its parameter names unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_emig.layout import MeshAxis
from lightning_emig.models.base import blocks_of
from lightning_emig.parallelize.fsdp import apply_fsdp, data_parallel_mesh
from lightning_emig.parallelize.init import materialize_and_init, materialize_empty, parameter_seed
from lightning_emig.parallelize.pipeline import stage_chunks
from lightning_emig.parallelize.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.parallel import ParallelStyle

    from lightning_emig.layout import LayoutMesh
    from lightning_emig.models.base import TensorParallelPlan


def parallelize_model(
    model: nn.Module,
    layout_mesh: LayoutMesh,
    *,
    tp_plan: TensorParallelPlan | dict[str, ParallelStyle] | None = None,
    blocks: Sequence[nn.Module] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Apply TP then FSDP2 for ``layout_mesh.layout`` to ``model`` (in place, on the meta device); return it.

    Works for any ``nn.Module``:

    * ``tp_plan``: torch's ``parallelize_module`` plan, applied to the root (fqns may use ``*``, e.g.
      ``{"blocks.*.attn.q": ColwiseParallel()}``), or a :class:`TensorParallelPlan`. Default: the model's own
      ``tensor_parallel_plan()`` if it has one. Needed only when ``tp > 1``.
    * ``blocks``: the submodules each made one FSDP2 unit (one all-gather per block); the root takes the rest.
      Default: the model's ``blocks()`` if it has one, else the whole model is one unit.
    * a model with ``validate_layout(layout)`` is asked first (e.g. ``tp`` must divide its heads).
    """
    layout = layout_mesh.layout
    validate = getattr(model, "validate_layout", None)
    if callable(validate):
        validate(layout)
    if layout.pp > 1:  # this process's stage only, then TP and FSDP2 within the stage (its sub-meshes)
        from lightning_emig.parallelize.pipeline import keep_stage

        if not hasattr(model, "keep_stage"):
            raise ValueError(f"pp={layout.pp} needs a model that can be cut into stages: give "
                             f"{type(model).__name__} a keep_stage(blocks, first=, last=) method")
        coordinate = layout_mesh.root.get_coordinate()
        if coordinate is None:
            raise ValueError("this process is not on the layout's mesh: it has no pipeline stage to build")
        keep_stage(model, layout.pp, coordinate[0], layout.pp_virtual)
    if tp_plan is None and hasattr(model, "tensor_parallel_plan"):
        tp_plan = model.tensor_parallel_plan()  # type: ignore[operator]
    if blocks is None:
        blocks = blocks_of(model)
    elif layout.pp > 1:  # blocks listed before the cut: FSDP2 wraps the ones this stage kept
        kept = {id(m) for m in model.modules()}
        blocks = [block for block in blocks if id(block) in kept]
    apply_tensor_parallel(model, layout_mesh[MeshAxis.TP], tp_plan, blocks)
    apply_fsdp(model, layout_mesh, blocks=blocks, mp_policy=mp_policy, roots=stage_chunks(model))
    return model


__all__ = [
    "apply_fsdp",
    "apply_tensor_parallel",
    "data_parallel_mesh",
    "materialize_and_init",
    "materialize_empty",
    "parallelize_model",
    "parameter_seed",
]
