"""Gradient clipping by the global norm, the same under every layout, pipeline stages included.

``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")`` makes Lightning's precision plugin clip with
``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters. Under pipeline stages those are one stage's, so
each stage would clip by its own norm. The strategy routes the plugin's norm clipping here (:func:`route_norm_clipping`):
the norm of every gradient (a DTensor's over its whole mesh: FSDP2 shards, TP pieces, replicas counted once), summed
in squares over the stages, one coefficient for every parameter of every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float,
                   stages: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that the norm of all of them (of every stage in ``stages``, the
    pipeline group; None: no stages) is at most ``max_norm``; returns that norm before clipping.

    A tensor-parallel plan that covers part of the model leaves some gradients DTensors (on the TP mesh, or FSDP's
    over it) and others plain tensors (replicated on every TP rank); torch's foreach norm and scale refuse such a mix.
    So the gradients are taken by mesh (:func:`_by_mesh`): each group's norm is its whole norm (a DTensor's over its
    mesh, a replicated plain tensor's where it lies), the squares are summed, and each group is scaled on its own."""
    groups = _by_mesh([p for p in parameters if p.grad is not None])
    squared = torch.zeros((), dtype=torch.float64)
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = squared.to(norm.device) + norm.double() ** 2
    if stages is not None and dist.get_world_size(stages) > 1:
        dist.all_reduce(squared, group=stages)
    dtype = groups[0][0].grad.dtype if groups else torch.float32
    norm = squared.sqrt().to(dtype)
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def _by_mesh(parameters: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``parameters`` grouped by their gradients' mesh (plain tensors form one group of their own), in first-seen
    order, so the result is the same on every rank."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return list(groups.values())


def route_norm_clipping(precision_plugin: object, stages: Callable[[], dist.ProcessGroup | None]) -> None:
    """Make ``precision_plugin``'s norm clipping :func:`clip_grad_norm` over ``stages()`` (the current layout's
    pipeline group, asked at each step: layouts change). Lightning offers no hook for the norm a plugin clips by; its
    ``clip_grad_by_norm`` is replaced on this instance only."""

    def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_norm(precision_plugin.main_params(optimizer), clip_val, stages())  # type: ignore[attr-defined]

    precision_plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[attr-defined]


__all__ = ["clip_grad_norm", "route_norm_clipping"]
