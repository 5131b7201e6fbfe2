"""bf16 compute (FSDP2 ``MixedPrecisionPolicy``) and activation checkpointing as training options, through live
layout changes.

Two processes train the tiny model with ``model.compute_dtype=bfloat16`` and ``model.activation_checkpointing=true``
and change layout live twice: ``dp_shard=2`` -> ``dp_replicate=2`` (HSDP) after step 3 -> ``tp=2`` (data-parallel
degree 1: FSDP2 then wraps over the 1-rank axis, so the compute stays bf16) after step 5. Specification:

* the fp32 master weights and AdamW's fp32 moments after each change equal those before it, bit for bit (what a
  change moves is the master state, never a bf16 copy);
* the blocks' linear layers compute with bf16 weights under every layout, and each block's forward runs twice per
  micro-batch (once in forward, once recomputed in backward);
* the losses are finite and the run reaches ``max_steps``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lightning_emig.change.boundary import at_step_boundary
from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.runs import build_run, quiet_lightning, tiny_config, with_schedule
from lightning_emig.testing.state import full_training_state

pytestmark = pytest.mark.multiprocess

STEPS = 7
CHANGES = {3: {"dp_replicate": 2, "dp_shard": 1}, 5: {"dp_shard": 1, "tp": 2}}


class _Watch(Callback):
    """Captures the master state at the boundary before each change and right after it; counts what the blocks
    compute with."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.weight_dtypes: dict[int, set[torch.dtype]] = {}
        self.block_calls: dict[int, int] = {}
        self._hooked: object = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step in self.before and step not in self.after:  # the first micro-batch after the change
            self.after[step] = full_training_state(pl_module.model, trainer.optimizers[0])
        if self._hooked is not pl_module.model:  # a change rebuilt the model: hook its first block again
            self._hooked = pl_module.model
            block = pl_module.model.layers["0"]
            block.attention.wq.register_forward_hook(self._seen)
            block.attention.register_forward_hook(self._counted)
        self._step = step

    def _seen(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        weight = module.weight
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        self.weight_dtypes.setdefault(self._step, set()).add(local.dtype)

    def _counted(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.block_calls[self._step] = self.block_calls.get(self._step, 0) + 1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if at_step_boundary(trainer) and trainer.global_step in CHANGES:
            self.before[trainer.global_step] = full_training_state(pl_module.model, trainer.optimizers[0])


def _run(rank: int, world: int, root: str) -> dict[str, Any]:
    quiet_lightning()
    cfg = tiny_config(layout={"dp_shard": 2}, max_steps=STEPS, world_size=world)
    cfg.model.compute_dtype = "bfloat16"
    cfg.model.activation_checkpointing = True
    with_schedule(cfg, sorted(CHANGES.items()))
    parts = build_run(cfg, Path(root))
    watch = _Watch()
    parts.trainer.callbacks.insert(0, watch)  # before the schedule's callback: it sees the state before a change
    parts.trainer.fit(parts.module, train_dataloaders=parts.loader)
    mismatched = {step: sorted(k for k in watch.before[step] if not torch.equal(watch.before[step][k],
                                                                               watch.after[step][k]))
                  for step in CHANGES}
    dtypes = {k: t.dtype for k, t in watch.after[3].items()}
    accumulation = {step: cfg.trainer.global_batch_size // cfg.trainer.micro_batch_size // dp
                    for step, dp in ((0, 2), (3, 2), (5, 1))}
    return {"mismatched": mismatched, "dtypes": sorted(set(dtypes.values()), key=str),
            "weight_dtypes": {s: sorted(map(str, d)) for s, d in watch.weight_dtypes.items()},
            "block_calls": watch.block_calls, "accumulation": accumulation,
            "losses": [parts.module.step_losses[k] for k in sorted(parts.module.step_losses)],
            "layout": parts.strategy.layout.as_dict(), "compared": len(watch.before[3])}


def test_bf16_compute_and_activation_checkpointing_train_and_migrate_the_master_state_bit_for_bit(
        tmp_path: Path) -> None:
    results = run_distributed(_run, 2, str(tmp_path), timeout_s=300)
    for result in results:
        assert result["compared"] > 0
        assert result["mismatched"] == {3: [], 5: []}, "a change altered the master state"
        assert result["dtypes"] == [torch.float32], "the master state is not fp32"
        assert result["layout"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "pp": 1}
        assert set(result["weight_dtypes"]) == set(range(STEPS))
        assert all(d == ["torch.bfloat16"] for d in result["weight_dtypes"].values()), result["weight_dtypes"]
        for step, calls in result["block_calls"].items():
            micro_batches = result["accumulation"][0 if step < 3 else 3 if step < 5 else 5]
            assert calls == 2 * micro_batches, f"step {step}: {calls} forward calls, {micro_batches} micro-batches"
        assert len(result["losses"]) == STEPS and all(torch.isfinite(torch.tensor(result["losses"])))
