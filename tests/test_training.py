"""Training under hybrid layouts through the real Trainer + strategy, compared with one process.

Tolerance: fp32 everywhere; layouts differ from the single process only in reduction order (sharded
reduce-scatter, TP partial sums), so per-step losses agree to a relative LOSS_RTOL. AdamW's normalisation
lets those last-bit differences grow slowly with steps, which is why the bound is not machine epsilon.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.runs import fit, step_losses, tiny_config
from lightning_emig.testing.state import assert_states_equal, full_training_state

pytestmark = pytest.mark.multiprocess

STEPS = 20
LOSS_RTOL = 1e-4
LAYOUTS_ON_4 = [
    {"dp_shard": 4},
    {"dp_shard": 2, "tp": 2},
    {"dp_replicate": 2, "dp_shard": 2},
    {"dp_replicate": 2, "dp_shard": 1, "tp": 2},
]


def _train(rank: int, world: int, layouts: list[dict[str, int]], root: str) -> list[list[float]]:
    curves = []
    for i, layout in enumerate(layouts):
        parts = fit(tiny_config(layout=layout, max_steps=STEPS, world_size=world), Path(root) / f"run{i}")
        curves.append(step_losses(parts))
    return curves


def _relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# The four layouts' gradients equal one process's in tests/test_parallel_parity.py, and Trainer-level parity over
# steps, epochs and optimizers is tests/test_lightning_parity.py's table: this whole-curve check runs by hand.
@pytest.mark.long
def test_four_layouts_follow_the_single_process_loss_curve(tmp_path: Path) -> None:
    reference = run_distributed(_train, 1, [{}], str(tmp_path / "single"), timeout_s=240)[0][0]
    assert len(reference) == STEPS
    assert reference[-1] < reference[0] * 0.9, f"the tiny model did not learn: {reference}"
    curves = run_distributed(_train, 4, LAYOUTS_ON_4, str(tmp_path / "four"), timeout_s=480)
    for layout, curve in zip(LAYOUTS_ON_4, curves[0], strict=True):
        assert len(curve) == STEPS
        gap = _relative_gap(curve, reference)
        assert gap < LOSS_RTOL, f"{layout}: loss curve deviates by {gap:.2e} (relative) from one process"
    # Every rank logs the same global-batch loss.
    assert curves[1] == curves[0]


def _checkpoint_resharding(rank: int, world: int, root: str) -> dict[str, object]:
    base = Path(root)
    saved = fit(tiny_config(layout={"dp_shard": 4}, max_steps=3, world_size=world), base / "a")
    ckpt = base / "a" / "step3.ckpt"
    saved.trainer.save_checkpoint(ckpt)
    before = full_training_state(saved.module.model, saved.trainer.optimizers[0])
    offset_before = saved.loader.state_dict()["sampler"]["offset"]

    resumed = fit(tiny_config(layout={"dp_shard": 2, "tp": 2}, max_steps=3, world_size=world), base / "b",
                  ckpt_path=str(ckpt))
    after = full_training_state(resumed.module.model, resumed.trainer.optimizers[0])
    assert_states_equal(before, after)
    scheduler = resumed.trainer.lr_scheduler_configs[0].scheduler
    return {
        "global_step": resumed.trainer.global_step,
        "offset_before": offset_before,
        "offset_after": resumed.loader.state_dict()["sampler"]["offset"],
        "scheduler_epoch": scheduler.last_epoch,
        "layout": resumed.strategy.layout.as_dict(),
    }


def test_checkpoint_saved_under_one_layout_loads_bit_exact_under_another(tmp_path: Path) -> None:
    results = run_distributed(_checkpoint_resharding, 4, str(tmp_path), timeout_s=300)
    for result in results:
        assert result["global_step"] == 3
        assert result["offset_before"] == 3 * 8
        assert result["offset_after"] == result["offset_before"]
        assert result["scheduler_epoch"] == 3
        assert result["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}
