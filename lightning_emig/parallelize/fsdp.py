"""FSDP2 (``fully_shard``) over the data-parallel axes of a layout.

Invariants:

* every block (given, or the model's ``blocks()``) is its own FSDP2 unit (one all-gather / reduce-scatter per block), then the root takes what is
  left (embedding, final norm, output projection);
* parameters are sharded on dim 0 over ``dp_shard``; with ``dp_replicate > 1`` the mesh is the 2-D
  ``(dp_replicate, dp_shard)`` mesh (HSDP: replicate across the first axis, shard across the second);
* when the data-parallel degree is 1 FSDP2 is not applied at all, so a ``tp``-only layout keeps pure TP DTensors
  (unless a mixed-precision policy is given: then FSDP2 wraps over the 1-rank ``dp_shard`` axis);
* gradients come out averaged over the data-parallel ranks (FSDP2's default), so each rank's loss must be the
  mean over its own micro-batch for the result to equal the gradient of the global-batch mean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_emig.layout import MeshAxis
from lightning_emig.models.base import blocks_of

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_emig.layout import LayoutMesh


def data_parallel_mesh(layout_mesh: LayoutMesh) -> DeviceMesh | None:
    """The mesh FSDP2 shards over: 1-D ``dp_shard``, 2-D ``(dp_replicate, dp_shard)`` for HSDP, or None."""
    layout = layout_mesh.layout
    if layout.dp == 1:
        return None
    if layout.dp_replicate > 1:
        return layout_mesh.root[(MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value)]
    return layout_mesh[MeshAxis.DP_SHARD]


def apply_fsdp(
    model: nn.Module,
    layout_mesh: LayoutMesh,
    *,
    blocks: Sequence[nn.Module] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    roots: Sequence[nn.Module] | None = None,
) -> None:
    """Wrap each of ``blocks`` (default: ``model.blocks()`` if it has one), then the root, with ``fully_shard`` in
    place. ``roots`` (default: the model) are what runs forward: a process holding several pipeline stages runs
    each stage's view of the model, so each view is a root, wrapping the parameters it holds outside the blocks. With ``dp == 1`` nothing is done, unless ``mp_policy`` is given: FSDP2 is what casts the parameters to the
    compute dtype, so it then wraps over the 1-rank ``dp_shard`` axis (a layout change must not change the
    numerics)."""
    mesh = data_parallel_mesh(layout_mesh)
    if mesh is None and mp_policy is not None:
        mesh = layout_mesh[MeshAxis.DP_SHARD]
    if mesh is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if blocks is None:
        blocks = blocks_of(model)
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root's parameters are needed first in backward (output projection), so FSDP2 keeps them unsharded
    # after forward by default; leave that choice to it.
    for root in roots if roots is not None else (model,):
        fully_shard(root, mesh=mesh, mp_policy=policy)
