"""Loading a sharded (DCP) checkpoint into a model that is not sharded: a world of one process.

A layout with ``dp == 1`` and ``tp == 1`` applies no FSDP2 or TP, so the model holds plain tensors; Lightning's
``ModelParallelStrategy.load_checkpoint`` refuses such a model ("Could not find a distributed model"). But a job that
shrinks to one process (a failure, a preemption, a restart with fewer nodes) must still resume from the checkpoints
its bigger worlds wrote. DCP itself reshards into whole tensors, so this is Lightning's sharded branch without the
DTensor requirement: the same keys (``state_dict``, ``optimizer_<i>``) and the same metadata file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def holds_dtensors(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def load_sharded_into_plain_model(
    path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], *, strict: bool
) -> dict[str, Any]:
    """Fill ``module`` and ``optimizers`` from the sharded checkpoint at ``path``; return the rest of its contents."""
    from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME, _distributed_checkpoint_load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    module_state = {"state_dict": get_model_state_dict(module)}
    _distributed_checkpoint_load(module_state, path)
    module.load_state_dict(module_state["state_dict"], strict=strict)
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}  # initialises empty state first
        _distributed_checkpoint_load(optimizer_state, path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key],
                                 options=StateDictOptions(cpu_offload=True))
    # RNG states are pickled Python objects, so the metadata cannot be weights_only (as for the sharded case).
    return torch.load(path / _METADATA_FILENAME, weights_only=False)
