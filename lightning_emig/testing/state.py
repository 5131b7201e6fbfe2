"""Gather the full (unsharded) training state, the yardstick of every bit-exactness check.

``full_training_state`` turns a model and its optimizer, under any layout, into a flat ``{key: Tensor}`` of
full tensors on the CPU, keyed by parameter FQN (``param/<fqn>``) and optimizer state (``optim/<fqn>/<name>``).
It is a collective: every rank calls it and every rank gets the same dict. Two states are equal bit for bit
exactly when :func:`assert_states_equal` passes.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.tensor import DTensor

# Gathering an FSDP-over-TP parameter takes two all-gathers and torch logs a warning each time; for a
# test-only full gather that is expected, not news.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _full(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().to("cpu").clone()


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"param/{name}": _full(param) for name, param in model.named_parameters()}


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Per-parameter optimizer state, keyed by the parameter's name in ``model``."""
    names = {id(param): name for name, param in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{names[id(param)]}/{key}"] = _full(value)
    return out


def full_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    state = full_model_state(model)
    if optimizer is not None:
        state.update(full_optimizer_state(model, optimizer))
    return state


def assert_states_equal(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """Bit-for-bit equality of two full states; the message names the first differing tensor."""
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing or extra:
        raise AssertionError(f"state keys differ: missing {missing[:5]}, unexpected {extra[:5]}")
    for key in sorted(expected):
        a, b = expected[key], actual[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise AssertionError(f"{key}: {tuple(a.shape)}/{a.dtype} != {tuple(b.shape)}/{b.dtype}")
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            raise AssertionError(f"{key}: values differ (max abs diff {diff:.3e})")
