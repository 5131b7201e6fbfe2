"""``python -m lightning_emig.train`` end to end: Lightning's own launcher, torchrun, and config errors."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from lightning_emig.testing.commands import python_module_command, run_command

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
QUICK = ["data=synthetic", "trainer.max_steps=3", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
         "trainer.progress_bar=false", "trainer.pg_timeout_s=60"]


def _summary(run_dir: Path) -> dict[str, object]:
    return json.loads((run_dir / "summary.json").read_text())


def test_lightning_launcher_spawns_ranks_that_share_one_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = python_module_command("lightning_emig.train", "recipe=tiny_cpu", "trainer.devices=2", "layout.tp=2",
                                *QUICK, f"hydra.run.dir={run_dir}")
    result = run_command(cmd, timeout_s=240, cwd=REPO)
    assert result.returncode == 0, result.stdout[-4000:]
    summary = _summary(run_dir)
    assert summary["world_size"] == 2
    assert summary["steps"] == 3
    assert summary["layout"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "pp": 1}
    assert (run_dir / "checkpoints" / "last.ckpt").is_dir()


def test_torchrun_launches_the_same_script(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
    cmd = [torchrun, "--standalone", "--nproc-per-node=2", "-m", "lightning_emig.train", "recipe=tiny_cpu",
           "trainer.devices=null", "layout.tp=1", *QUICK, f"hydra.run.dir={run_dir}"]
    result = run_command(cmd, timeout_s=240, cwd=REPO)
    assert result.returncode == 0, result.stdout[-4000:]
    summary = _summary(run_dir)
    assert summary["world_size"] == 2
    assert summary["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1}


@pytest.mark.parametrize(
    ("override", "message"),
    [("layout.tpp=2", "Could not override 'layout.tpp'"), ("+layout.tpp=2", "tpp"),
     ("recipe=nope", "Could not find 'recipe/nope'"),
     ("elastic.picker.tpp=[2]", "Could not override 'elastic.picker.tpp'"),
     ("elastic.picker.enabled=true elastic.picker.tp=[3] elastic.picker.tp_within_node=false",
      "no allowed tp=[3] divides the model's heads")],
)
def test_bad_config_fails_with_a_clear_message(tmp_path: Path, override: str, message: str) -> None:
    cmd = python_module_command("lightning_emig.train", *override.split(), f"hydra.run.dir={tmp_path}")
    result = run_command(cmd, timeout_s=60, cwd=REPO)
    assert result.returncode != 0
    assert message in result.stdout


def test_the_config_loads_without_torch() -> None:
    """Hydra composes and checks the command line before torch loads (a second, not five, for a typo)."""
    probe = "import sys, lightning_emig.config; print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    result = run_command([sys.executable, "-c", probe], timeout_s=60, cwd=REPO)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout


def test_wandb_logs_offline_under_onestable_run_id(tmp_path: Path) -> None:
    from lightning_emig.change.events import stable_run_id

    run_dir = tmp_path / "run"
    cmd = python_module_command("lightning_emig.train", "logger=wandb", *QUICK, "trainer.global_batch_size=4",
                                f"hydra.run.dir={run_dir}")
    result = run_command(cmd, timeout_s=180, cwd=REPO, env={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stdout[-4000:]
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # The id is derived from the run directory, so restarts and later generations append to the same run.
    assert runs[0].name.endswith(stable_run_id(run_dir))
