"""Materializing a meta-device model and initializing it identically under every layout.

Invariants:

* the full value of every parameter is a function of ``(seed, parameter name)`` only: it is generated on the CPU
  from its own ``torch.Generator``, then each rank copies the slice it holds. The same seed therefore gives the
  same full weights for any layout, world size or device, and adding a parameter does not shift the others;
* the local slice is cut by our shard geometry (``TensorSharding``), which follows the parameter's own placements
  exactly as FSDP2 stores them — including uneven ``_StridedShard`` on TP-sharded dims — and communicates nothing;
* non-persistent buffers (RoPE tables) are recomputed by the model's ``init_buffers`` hook;
* works without ``torch.distributed`` initialized (plain tensors).

Cost: every rank generates every full parameter once (CPU time ~ model size, memory ~ the largest parameter).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

    from lightning_emig.models.base import ParallelizableModel


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one parameter, stable across processes and Python runs (unlike ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_initial_value(model: ParallelizableModel, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The full float32 initial value of parameter ``name`` (on the CPU)."""
    generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    full = torch.empty(shape, dtype=torch.float32)
    model.init_full_parameter(name, full, generator)
    return full


def local_slice(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that this rank holds for ``param`` (all of it for a plain tensor).

    The slice is cut from our own shard geometry, not by ``distribute_tensor``: for FSDP2 over TP with an
    uneven split (``dp_shard >= 3`` on a dim it does not divide) ``distribute_tensor`` either refuses the
    ``_StridedShard`` or cuts a different slice than the one FSDP2 stores, while
    :class:`~lightning_emig.migration.geometry.TensorSharding` describes exactly what FSDP2 stores.
    """
    from torch.distributed.tensor import DTensor

    from lightning_emig.migration.geometry import TensorSharding

    if not isinstance(param, DTensor):
        return full
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError("this rank is not on the parameter's device mesh; it holds no slice to initialize")
    holding = TensorSharding.create(tuple(full.shape), tuple(mesh.shape), param.placements).holding(coordinate)
    assert holding is not None  # no pipeline stage given, so every coordinate holds something (maybe empty)
    local = torch.empty(holding.local_shape, dtype=full.dtype, device=full.device)
    for piece in holding.pieces:
        local[tuple(slice(a, b) for a, b in piece.local_box.bounds)] = full[
            tuple(slice(a, b) for a, b in piece.global_box.bounds)
        ]
    return local


def materialize_and_init(model: ParallelizableModel, device: torch.device | str, seed: int) -> None:
    """Allocate ``model``'s (possibly sharded) storage on ``device`` and fill it deterministically from ``seed``."""
    from torch.distributed.tensor import DTensor

    module: nn.Module = model  # type: ignore[assignment]
    module.to_empty(device=device)
    with torch.no_grad():
        for name, param in module.named_parameters():
            full = full_initial_value(model, name, param.shape, seed).to(param.dtype)
            local = param.to_local() if isinstance(param, DTensor) else param
            piece = local_slice(param, full)
            if piece.shape != local.shape:
                raise RuntimeError(
                    f"initial slice of {name} has shape {tuple(piece.shape)} but this rank holds "
                    f"{tuple(local.shape)} (placements {getattr(param, 'placements', None)})"
                )
            local.copy_(piece)
        model.init_buffers()


def materialize_empty(model: ParallelizableModel, device: torch.device | str) -> None:
    """Allocate ``model``'s storage on ``device`` without initializing parameters (a migration fills them).

    Non-persistent buffers, which are not migrated, are still computed.
    """
    module: nn.Module = model  # type: ignore[assignment]
    module.to_empty(device=device)
    with torch.no_grad():
        model.init_buffers()
