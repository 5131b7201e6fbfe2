"""Random-number-generator state across checkpoints and world changes.

The rule (documented in the README): after a restore, rank ``r`` takes the saved state of old rank ``r`` when
the old world had such a rank; a rank that did not exist before gets a fresh state derived from
``(seed, step, r)``. Either way every rank's stream is reproducible from the checkpoint alone, and two ranks
never share a stream by accident.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist


def capture_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def apply_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG state, indexed by rank (a collective: call it on all ranks)."""
    local = capture_rng_state()
    if not dist.is_initialized():
        return [local]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, local)
    return states


def restore_rng_for_rank(states: list[dict[str, Any]] | None, rank: int, *, seed: int, step: int) -> None:
    if states and rank < len(states):
        apply_rng_state(states[rank])
        return
    derived = hash((seed, step, rank)) & 0x7FFF_FFFF
    torch.manual_seed(derived)
    random.seed(derived)
