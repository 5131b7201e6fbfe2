"""AdamW and the warmup + cosine learning-rate schedule (stepped once per optimizer step)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the config (OptimConfig) loads without it, so a bad
    # command line fails in a second, before torch would have loaded
    import torch
    from torch.optim.lr_scheduler import LambdaLR


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 10
    """Linear warmup from 0 to ``lr`` over this many optimizer steps."""
    min_lr_ratio: float = 0.1
    """The cosine decays to ``lr * min_lr_ratio`` at ``max_steps``."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def build_adamw(params: object, cfg: OptimConfig) -> torch.optim.AdamW:
    import torch

    return torch.optim.AdamW(
        params,  # type: ignore[arg-type]
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


def warmup_cosine_factor(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_warmup_cosine(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int) -> LambdaLR:
    from torch.optim.lr_scheduler import LambdaLR

    def factor(step: int) -> float:
        return warmup_cosine_factor(
            step, warmup_steps=cfg.warmup_steps, max_steps=max_steps, min_lr_ratio=cfg.min_lr_ratio
        )

    return LambdaLR(optimizer, factor)
