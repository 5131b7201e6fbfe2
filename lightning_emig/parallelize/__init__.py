"""Applying a :class:`~lightning_emig.layout.HybridLayout` to a model built on the meta device.

Invariants:

* the order is fixed: validate the layout against the model, tensor parallelism, then FSDP2 — FSDP2 must see the
  TP DTensors to shard them further (and produces ``_StridedShard`` placements on TP-sharded dim 0);
* pipeline parallelism is refused loudly until it exists;
* the model is transformed in place and returned, its parameter names unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_emig.layout import MeshAxis
from lightning_emig.parallelize.fsdp import apply_fsdp, data_parallel_mesh
from lightning_emig.parallelize.init import materialize_and_init, materialize_empty, parameter_seed
from lightning_emig.parallelize.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from torch import nn

    from lightning_emig.layout import LayoutMesh


def parallelize_model(model: nn.Module, layout_mesh: LayoutMesh) -> nn.Module:
    """Apply TP then FSDP2 for ``layout_mesh.layout`` to ``model`` (in place); return it."""
    layout = layout_mesh.layout
    config = model.config
    layout.validate_for_model(
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        ffn_hidden=config.ffn_hidden,
        n_layers=config.n_layers,
    )
    if layout.pp > 1:
        raise NotImplementedError(
            f"pipeline parallelism (pp>1) is not yet supported; got {layout.describe()}. Use pp=1."
        )
    apply_tensor_parallel(model, layout_mesh[MeshAxis.TP])
    apply_fsdp(model, layout_mesh)
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
