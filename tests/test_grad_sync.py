"""Gradient reductions deferred to a step's last micro-batch (``defer_grad_sync``), through the Trainer.

Counted as the collectives the processes issue (every ``c10d`` op seen by a dispatch mode around ``fit``), on four
processes as two HSDP replicas of two shards, two micro-batches a step: ``replicas`` saves one all-reduce per FSDP
unit and accumulating micro-batch and no reduce-scatter, ``all`` saves the reduce-scatters too; the losses stay
those of ``none`` to rounding.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.runs import fit, step_losses, tiny_config

STEPS = 2
MICRO_BATCHES = 2  # global batch 16 = micro-batch 2 x 4 data-parallel ranks x 2


def _count_collectives(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.namespace == "c10d":
                self.counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    runs: dict[str, Any] = {}
    for defer in ("none", "replicas", "all"):
        cfg = tiny_config(layout={"dp_replicate": 2, "dp_shard": 2}, max_steps=STEPS, global_batch_size=16,
                          world_size=world)
        cfg.trainer.defer_grad_sync = defer
        with Collectives() as seen:
            parts = fit(cfg, Path(root) / defer)
        assert parts.trainer.accumulate_grad_batches == MICRO_BATCHES
        units = sum(isinstance(m, FSDPModule) for m in parts.module.modules())
        runs[defer] = {"counts": dict(seen.counts), "losses": step_losses(parts), "units": units}
    return runs


@pytest.mark.multiprocess
def test_deferred_reductions_leave_the_collectives_they_name_to_a_steps_last_micro_batch(tmp_path: Path) -> None:
    for runs in run_distributed(_count_collectives, 4, str(tmp_path), timeout_s=300):
        none, replicas, every = (runs[k]["counts"] for k in ("none", "replicas", "all"))
        units = runs["none"]["units"]
        assert units >= 2, runs
        saved = STEPS * (MICRO_BATCHES - 1) * units  # one per unit and micro-batch that only accumulates
        assert none["allreduce_"] - replicas["allreduce_"] == saved, runs
        assert replicas["_reduce_scatter_base_"] == none["_reduce_scatter_base_"], runs
        assert none["_reduce_scatter_base_"] - every["_reduce_scatter_base_"] == saved, runs
        assert every["allreduce_"] == replicas["allreduce_"], runs
        for defer in ("replicas", "all"):
            gap = max(abs(a - b) / abs(b) for a, b in zip(runs[defer]["losses"], runs["none"]["losses"], strict=True))
            assert gap < 1e-6, (defer, runs)


def test_an_unknown_choice_is_refused() -> None:
    from lightning_emig.strategy.elastic import ElasticMigrationStrategy

    with pytest.raises(ValueError, match="defer_grad_sync must be one of 'replicas', 'all', 'none'"):
        ElasticMigrationStrategy(global_batch_size=8, micro_batch_size=2, defer_grad_sync="sometimes")  # type: ignore[arg-type]


def test_the_picker_plans_for_the_deferral_training_runs() -> None:
    from lightning_emig.models.llama import MODEL_SIZES
    from lightning_emig.picker.policy import LayoutPicker
    from lightning_emig.strategy.elastic import ElasticMigrationStrategy

    picker = LayoutPicker.from_section({"enabled": True}, model=MODEL_SIZES["tiny"], seq_len=32, defer_grad_sync="all")
    assert picker is not None and picker.constraints.defer_grad_sync == "all"
    with pytest.raises(ValueError, match="the layout picker plans for defer_grad_sync='all' but the strategy runs"):
        ElasticMigrationStrategy(global_batch_size=8, micro_batch_size=2, picker=picker)
