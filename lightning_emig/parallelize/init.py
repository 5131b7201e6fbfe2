"""Materializing a meta-device model and initializing it identically under every layout.

Invariants:

* the full value of every parameter is a function of ``(seed, parameter name)`` only: it is generated on the CPU
  from its own ``torch.Generator``, then each rank copies the slice it holds. The same seed therefore gives the
  same full weights for any layout, world size or device, and adding a parameter does not shift the others;
* the local slice is cut by our shard geometry (``TensorSharding``), which follows the parameter's own placements
  exactly as FSDP2 stores them — including uneven ``_StridedShard`` on TP-sharded dims — and communicates nothing;
* buffers are filled by an ``init_buffers`` hook (the model's by default): non-persistent ones (RoPE tables) are
  never migrated, persistent ones are then overwritten by a migration;
* works without ``torch.distributed`` initialized (plain tensors).

Cost: every rank generates every full parameter once (CPU time ~ model size, memory ~ the largest parameter).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

InitParameter = Callable[[str, torch.Tensor, torch.Generator], None]
"""Fills the full (unsharded) value of the named parameter in place from the generator."""


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one parameter, stable across processes and Python runs (unlike ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_initial_value(init: InitParameter, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The full float32 initial value of parameter ``name`` (on the CPU), filled by ``init``."""
    generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    full = torch.empty(shape, dtype=torch.float32)
    init(name, full, generator)
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


def materialize_and_init(
    model: nn.Module, device: torch.device | str, seed: int, *, init_parameter: InitParameter | None = None,
    init_buffers: Callable[[], None] | None = None,
) -> None:
    """Allocate ``model``'s (possibly sharded) storage on ``device`` and fill it deterministically from ``seed``.

    ``init_parameter(name, full, generator)`` fills the *full* (unsharded) CPU value of parameter ``name`` in place
    from ``generator`` (default: the model's ``init_full_parameter``); ``init_buffers()`` fills every buffer
    (default: the model's ``init_buffers``, if it has one). The same seed gives the same full weights under every
    layout.
    """
    from torch.distributed.tensor import DTensor

    init = init_parameter or _model_hook(model, "init_full_parameter")
    to_empty_keeping_ties(model, device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = full_initial_value(init, name, param.shape, seed).to(param.dtype)
            local = param.to_local() if isinstance(param, DTensor) else param
            piece = local_slice(param, full)
            if piece.shape != local.shape:
                raise RuntimeError(
                    f"initial slice of {name} has shape {tuple(piece.shape)} but this rank holds "
                    f"{tuple(local.shape)} (placements {getattr(param, 'placements', None)})"
                )
            local.copy_(piece)
        _fill_buffers(model, init_buffers)


def materialize_empty(model: nn.Module, device: torch.device | str, *,
                      init_buffers: Callable[[], None] | None = None) -> None:
    """Allocate ``model``'s storage on ``device`` without initializing parameters (a migration fills them, and its
    persistent buffers). Buffers are still filled by ``init_buffers`` (default: the model's, if any), so the
    non-persistent ones, which are not migrated, hold their values.

    Within :func:`materialization_deferred` (in that thread) it allocates nothing and records the call instead."""
    if _deferral.calls is not None:
        _deferral.calls.append(functools.partial(materialize_empty, model, device, init_buffers=init_buffers))
        return
    to_empty_keeping_ties(model, device)
    with torch.no_grad():
        _fill_buffers(model, init_buffers)


def to_empty_keeping_ties(model: nn.Module, device: torch.device | str) -> None:
    """``model.to_empty(device)``, with tied weights still one parameter: ``to_empty`` replaces each module's
    parameters on its own, so a parameter registered under two names (an embedding tied to the output head) would
    come back as two tensors, trained apart (and moved as two by a change)."""
    from lightning_emig.models.base import tied_parameter_names

    ties = tied_parameter_names(model)
    model.to_empty(device=device)
    for tied in ties:
        kept = model.get_parameter(tied[0])
        for name in tied[1:]:
            owner, _, attribute = name.rpartition(".")
            module = model.get_submodule(owner)
            if getattr(module, attribute) is not kept:
                setattr(module, attribute, kept)


class _Deferral(threading.local):
    calls: list[Callable[[], None]] | None = None


_deferral = _Deferral()


@contextmanager
def materialization_deferred() -> Iterator[list[Callable[[], None]]]:
    """Within it, in this thread only, :func:`materialize_empty` leaves its model on the meta device and records
    the call: the caller runs the recorded calls later, where the memory is better allocated (a layout change
    prepared in the background allocates its new model at the boundary, where the pages the old state gives back
    and the last step's freed ones are reused, not fresh pages written for the first time by the transfer)."""
    calls: list[Callable[[], None]] = []
    _deferral.calls = calls
    try:
        yield calls
    finally:
        _deferral.calls = None


def _fill_buffers(model: nn.Module, init_buffers: Callable[[], None] | None) -> None:
    hook = init_buffers or getattr(model, "init_buffers", None)
    if hook is not None:
        hook()
    elif any(True for _ in model.buffers()):
        raise ValueError(
            f"{type(model).__name__} has buffers but no init_buffers(): after to_empty they hold garbage; pass "
            "init_buffers= (a function that fills every buffer) or give the model an init_buffers() method"
        )


def _model_hook(model: nn.Module, name: str) -> Any:
    hook = getattr(model, name, None)
    if hook is None:
        raise ValueError(
            f"{type(model).__name__} has no {name}(name, full, generator): pass init_parameter= (a function that "
            "fills the full value of a parameter in place from a generator) to initialise it the same under "
            "every layout"
        )
    return hook
