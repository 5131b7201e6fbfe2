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
    pipeline group; None: no stages) is at most ``max_norm``; returns that norm before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if stages is not None and dist.get_world_size(stages) > 1:
        squared = norm.double() ** 2
        dist.all_reduce(squared, group=stages)
        norm = squared.sqrt().to(norm.dtype)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


def route_norm_clipping(precision_plugin: object, stages: Callable[[], dist.ProcessGroup | None]) -> None:
    """Make ``precision_plugin``'s norm clipping :func:`clip_grad_norm` over ``stages()`` (the current layout's
    pipeline group, asked at each step: layouts change). Lightning offers no hook for the norm a plugin clips by; its
    ``clip_grad_by_norm`` is replaced on this instance only."""

    def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_norm(precision_plugin.main_params(optimizer), clip_val, stages())  # type: ignore[attr-defined]

    precision_plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[attr-defined]


__all__ = ["clip_grad_norm", "route_norm_clipping"]
