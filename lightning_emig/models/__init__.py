"""Reference models and the hooks (:mod:`lightning_emig.models.base`) that parallelization relies on."""

from lightning_emig.models.base import ParallelizableModel, TensorParallelPlan
from lightning_emig.models.llama import (
    MODEL_SIZES,
    Llama,
    LlamaConfig,
    causal_lm_loss,
    get_model_config,
)

__all__ = [
    "MODEL_SIZES",
    "Llama",
    "LlamaConfig",
    "ParallelizableModel",
    "TensorParallelPlan",
    "causal_lm_loss",
    "get_model_config",
]
