"""The LightningModule that trains the reference Llama under whatever layout the strategy gives it.

What a module must do to be re-laid-out by the strategy (and this one does):
* build the model in ``configure_model`` from the mesh it is handed, on the meta device, every time it is
  called on a fresh module (never keep tensors from a previous layout);
* initialise deterministically from a seed so the full weights do not depend on the layout;
* compute the loss as a mean over its micro-batch: the strategy's batch plan and FSDP's gradient averaging
  turn that into the mean over the global batch.

Logged ``train/loss`` is the global-batch mean for each optimizer step (averaged over accumulation and the
data-parallel ranks), so curves from different layouts are directly comparable.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import override

from lightning_emig.layout import HybridLayout
from lightning_emig.models.llama import Llama, causal_lm_loss, get_model_config
from lightning_emig.parallelize import materialize_and_init, materialize_empty, parallelize_model
from lightning_emig.training.optim import OptimConfig, build_adamw, build_warmup_cosine

DTYPES = {"float32": torch.float32, "float64": torch.float64}
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class LlamaLightningModule(pl.LightningModule):
    """Causal language modelling on byte tokens.

    Args:
        model_size: A name from ``MODEL_SIZES`` (``tiny``, ``llama_25m``, ...).
        optim: Optimiser and schedule settings.
        max_steps: Length of the cosine schedule.
        seed: Seed of the deterministic initialisation.
        dtype: ``float32`` or ``float64``: the dtype of the parameters (and so of the optimizer state).
        compute_dtype: None (compute in ``dtype``), or ``bfloat16`` / ``float32`` for FSDP2 mixed precision
            (parameters stay in ``dtype``).
        activation_checkpointing: Recompute each decoder block in backward.
    """

    def __init__(self, model_size: str = "tiny", optim: OptimConfig | None = None, max_steps: int = 100,
                 seed: int = 0, dtype: str = "float32", compute_dtype: str | None = None,
                 activation_checkpointing: bool = False) -> None:
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"model.compute_dtype must be null or one of {sorted(COMPUTE_DTYPES)}, "
                             f"got {compute_dtype!r}")
        self.dtype_of_parameters = DTYPES[dtype]
        self.compute_dtype = COMPUTE_DTYPES[compute_dtype] if compute_dtype else self.dtype_of_parameters
        self.activation_checkpointing = activation_checkpointing
        self.model_config = get_model_config(model_size)
        self.optim_config = optim or OptimConfig()
        self.max_steps = max_steps
        self.seed = seed
        self.model: torch.nn.Module | None = None
        self.step_losses: dict[int, float] = {}
        """Global-batch mean loss of each optimizer step, keyed by the step index (0-based)."""
        self.step_end_times: dict[int, float] = {}
        """``time.perf_counter()`` when each optimizer step's gradients were ready (throughput)."""
        self._loss_sum: torch.Tensor | None = None
        self._micro_batches = 0

    def validate_layout(self, layout: HybridLayout) -> None:
        """The layouts this module's model can be split by (the strategy asks before any state moves)."""
        self.model_config.validate_layout(layout)

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        layout_mesh = self.trainer.strategy.layout_mesh
        with torch.device("meta"):
            model = Llama(self.model_config, activation_checkpointing=self.activation_checkpointing)
        model = parallelize_model(model.to(self.dtype_of_parameters), layout_mesh, mp_policy=self._mp_policy())
        if getattr(self.trainer.strategy, "migrating", False):
            # A live layout change overwrites every parameter: initialising first would be wasted work.
            materialize_empty(model, self.trainer.strategy.root_device)
        else:
            materialize_and_init(model, self.trainer.strategy.root_device, seed=self.seed)
        self.model = model

    def _mp_policy(self) -> MixedPrecisionPolicy | None:
        """bf16 compute, fp32 (``dtype``) gradient reduction; None: compute in the parameters' dtype."""
        if self.compute_dtype == self.dtype_of_parameters:
            return None
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.dtype_of_parameters)

    @override
    def on_train_start(self) -> None:
        # The module outlives a fit that a peer's failure cut short mid-step: drop that step's partial loss.
        self._loss_sum, self._micro_batches = None, 0

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.model is not None, "configure_model has not run"
        return self.model(tokens)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = causal_lm_loss(self(batch["inputs"]), batch["targets"])
        detached = loss.detach()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._micro_batches += 1
        return loss

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Runs once per optimizer step on every rank, after all accumulated backward passes.
        step_loss = self._global_batch_loss()
        self.step_losses[self.trainer.global_step] = step_loss
        self.step_end_times[self.trainer.global_step] = time.perf_counter()
        self.log("train/loss", step_loss, prog_bar=True, on_step=True, rank_zero_only=True)
        self.log("trainer/step", float(self.trainer.global_step), on_step=True, rank_zero_only=True)

    def _global_batch_loss(self) -> float:
        # Under pipeline stages only the last computed losses: None elsewhere (the strategy sends the mean to all).
        local = self._loss_sum / self._micro_batches if self._micro_batches else None
        self._loss_sum, self._micro_batches = None, 0
        step_loss = getattr(self.trainer.strategy, "step_loss", None)
        if dist.is_initialized() and step_loss is not None:
            return float(step_loss(local))
        assert local is not None, "no micro-batch loss was computed for this step"
        return float(local)

    @override
    def configure_optimizers(self) -> Any:
        optimizer = build_adamw(self.parameters(), self.optim_config)
        scheduler = build_warmup_cosine(optimizer, self.optim_config, self.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
