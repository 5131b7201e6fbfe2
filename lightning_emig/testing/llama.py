"""A Llama laid out on a mesh and trained a few real steps: the model the migration tests and benchmarks move."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_emig.layout import LayoutMesh
from lightning_emig.models.llama import Llama, LlamaConfig, causal_lm_loss
from lightning_emig.parallelize import materialize_and_init, materialize_empty, parallelize_model


def laid_out_llama(config: LlamaConfig, layout_mesh: LayoutMesh, device: torch.device | str = "cpu", *,
                   seed: int | None) -> Llama:
    """Built on the meta device, parallelized on ``layout_mesh``, then given storage on ``device``: initialised from
    ``seed``, or uninitialised where ``seed`` is None (a migration's target: the migration writes every
    parameter)."""
    with torch.device("meta"):
        model = Llama(config)
    parallelize_model(model, layout_mesh)
    if seed is None:
        materialize_empty(model, device)
    else:
        materialize_and_init(model, device, seed)
    return model


def train_steps(model: Llama, optimizer: torch.optim.Optimizer, batches: Iterable[torch.Tensor]) -> None:
    """One optimizer step per batch of token sequences (next-token loss: each sequence's last token is only a
    target)."""
    for tokens in batches:
        causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
