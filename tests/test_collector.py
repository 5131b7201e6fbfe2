"""The objects alive when a fit starts are left out of the collector's scans during the fit, and given back after."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.runs import quiet_lightning, tiny_config, with_schedule
from lightning_emig.training.builders import build_run


class _FrozenDuringFit(Callback):
    def __init__(self) -> None:
        self.frozen_at_start = 0
        self.old_model_collected = False
        self._old: weakref.ref | None = None  # the model the change after step 2 replaces

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001 - Lightning's hook
        self.frozen_at_start = gc.get_freeze_count()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == 1 and self._old is None:
            self._old = weakref.ref(pl_module.model)
        elif trainer.global_step >= 2 and self._old is not None and self._old() is not None:
            gc.collect()  # what an automatic collection does: the old model is not frozen, so it goes
            self.old_model_collected = self._old() is None


def _fit(rank: int, world: int, root: str) -> dict[str, object]:
    quiet_lightning()
    cfg = with_schedule(tiny_config(layout={"dp_shard": 2}, max_steps=4, world_size=world), [(2, {"tp": 2})])
    parts = build_run(cfg, Path(root))
    probe = _FrozenDuringFit()
    parts.trainer.callbacks.append(probe)
    parts.trainer.fit(parts.module, train_dataloaders=parts.loader)
    return {"during": probe.frozen_at_start, "after": gc.get_freeze_count(),
            "old_model_collected": probe.old_model_collected}


def test_a_fit_freezes_what_exists_and_the_replaced_model_is_still_collected(tmp_path: Path) -> None:
    for result in run_distributed(_fit, 2, str(tmp_path), timeout_s=180):
        assert result["during"] > 100_000  # torch, Lightning, the Trainer, the data: frozen as the fit began
        assert result["after"] == 0  # and given back to the collector when it ended
        assert result["old_model_collected"]  # built during the fit: a change's old model is collectable
