"""Where membership and layout events go, and what the progress bar shows while one is in progress.

* every event is one console line, one line of ``events.jsonl`` (with ``time`` and the job's ``run_id``) and
  ``event/...`` metrics in every logger of the Trainer; wandb also gets an ``events`` table of the whole job;
* one wandb run id for the whole job: two Trainers in one process (a live membership change) and a Trainer in
  a new process (a restart) write to the same offline run id, and the last table holds all three events;
* a logger that fails is skipped, never raised into training;
* during a live reconfigure the progress bar says ``migrating: reconfigure ...``; afterwards it counts steps
  again, from the same step.

wandb runs offline only (``WANDB_MODE=offline``, every wandb directory under ``tmp_path``), in spawned
processes, so no wandb state leaks into the test process.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from lightning.pytorch.loggers import CSVLogger, Logger

from lightning_emig.change.events import ReconfigureEvent, publish_event, read_events, stable_run_id
from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.runs import quiet_lightning, tiny_config, with_schedule
from lightning_emig.training.builders import build_run

pytestmark = pytest.mark.multiprocess

ONE = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1}
TWO = {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1}


def _event(kind: str, step: int) -> ReconfigureEvent:
    return ReconfigureEvent(
        kind=kind, step=step, old_layout=ONE, new_layout=TWO, old_world=1, new_world=2, bytes_moved=4_000_000,
        seconds={"detect": 0.01, "agree": 0.02, "transfer": 0.5, "first_step": 0.3}, generation=step,
        downtime_seconds=1.25, steps_rolled_back=2 if kind == "restart" else None,
    )


def _wandb_env(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    # Spawned workers inherit the environment: offline, and nothing written outside tmp_path.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        path = root / name.lower()
        path.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(name, str(path))


def _publish_one_event_per_trainer(rank: int, world: int, root: str, events: list[tuple[str, int]]) -> dict[str, Any]:
    """What one process of a job does: a new Trainer (new loggers) per generation, each recording one event."""
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    quiet_lightning()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_emig.change.events").addHandler(handler)
    cfg = tiny_config(layout={"dp_shard": 1}, max_steps=20)
    cfg.logger.kind = "wandb"
    run_ids = []
    for kind, step in events:
        parts = build_run(cfg, Path(root))
        parts.strategy.record_event(parts.trainer, _event(kind, step))
        run_ids += [lg.experiment.id for lg in parts.trainer.loggers if isinstance(lg, WandbLogger)]
    wandb.finish()
    return {"run_ids": run_ids, "lines": lines}


@pytest.mark.timeout(300)
def test_every_generation_and_restart_writes_to_one_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _wandb_env(monkeypatch, tmp_path)
    run_dir = tmp_path / "run"
    live = run_distributed(_publish_one_event_per_trainer, 1, str(run_dir), [("join", 5), ("preempt", 9)],
                           timeout_s=120)[0]
    restart = run_distributed(_publish_one_event_per_trainer, 1, str(run_dir), [("restart", 12)], timeout_s=120)[0]
    run_id = stable_run_id(run_dir)

    # The console: one readable line per event.
    assert live["lines"][0].startswith("join at step 5: world 1 -> 2, dp_replicate=1 dp_shard=1 tp=1 pp=1 -> ")
    assert "4.0 MB moved" in live["lines"][0] and "downtime 1.25s" in live["lines"][0]
    assert "2 step(s) rolled back" in restart["lines"][0]

    # events.jsonl: the same format as before, plus time and the job's run id.
    records = read_events(run_dir)
    assert [(r["kind"], r["step"]) for r in records] == [("join", 5), ("preempt", 9), ("restart", 12)]
    assert all(r["run_id"] == run_id and r["time"] > 0 for r in records)
    assert records[2]["steps_rolled_back"] == 2 and records[0]["seconds"]["transfer"] == 0.5

    # wandb: one run id for both Trainers of the first process and the Trainer of the second.
    assert live["run_ids"] == [run_id, run_id] and restart["run_ids"] == [run_id]
    offline_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2, offline_runs  # one directory per process, both of the same run id
    assert all(d.name.endswith(f"-{run_id}") and (d / f"run-{run_id}.wandb").is_file() for d in offline_runs)
    tables = [json.loads(p.read_text()) for d in offline_runs for p in d.glob("files/media/table/events_*.json")]
    kinds = sorted(({tuple(row[1] for row in t["data"]) for t in tables}), key=len)
    assert kinds[-1] == ("join", "preempt", "restart")  # the restart's table holds the whole job

    # CSV: the event's numbers as metrics at its step, in one metrics.csv that every Trainer of the job appends to.
    with (run_dir / "csv" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(row["step"], float(row["event/bytes_moved"]), float(row["event/seconds/transfer"])) for row in rows] == [
        ("5", 4_000_000.0, 0.5), ("9", 4_000_000.0, 0.5), ("12", 4_000_000.0, 0.5)
    ]
    assert [row["event/steps_rolled_back"] for row in rows] == ["", "", "2"]  # a column the third Trainer added


class _BrokenLogger(Logger):
    name = "broken"
    version = "0"

    def log_metrics(self, metrics: Any, step: Any = None) -> None:
        raise RuntimeError("logger down")

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_a_failing_logger_is_skipped_and_the_event_still_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    csv_logger = CSVLogger(save_dir=str(tmp_path), name="csv", version="")
    trainer: Any = SimpleNamespace(default_root_dir=str(tmp_path), loggers=[_BrokenLogger(), csv_logger])
    with caplog.at_level(logging.WARNING, logger="lightning_emig.change.events"):
        record = publish_event(trainer, _event("reconfigure", 3))
    assert "could not log the reconfigure event to _BrokenLogger" in caplog.text
    assert read_events(tmp_path) == [record]
    assert "event/downtime_seconds" in (tmp_path / "csv" / "metrics.csv").read_text()


def _bar_during_reconfigure(rank: int, world: int, root: str) -> dict[str, Any]:
    from lightning_emig.change.progress import StepProgressBar

    quiet_lightning()
    cfg = with_schedule(tiny_config(layout={"dp_shard": 2}, max_steps=4, world_size=world),
                        [(2, {"dp_shard": 1, "tp": 2})])
    cfg.trainer.progress_bar = True
    cfg.elastic.prepare_ahead_steps = 0  # the model is built in the pause, where the bar is read
    parts = build_run(cfg, Path(root))
    bar = next(cb for cb in parts.trainer.callbacks if isinstance(cb, StepProgressBar))
    seen: list[tuple[int, str]] = []
    build_model = parts.module.configure_model

    def recording_build() -> None:
        if parts.strategy.migrating:  # configure_model called again by the live reconfigure
            seen.append((parts.trainer.global_step, bar.train_progress_bar.desc))
        build_model()

    parts.module.configure_model = recording_build  # type: ignore[method-assign]
    parts.trainer.fit(parts.module, train_dataloaders=parts.loader)
    return {"seen": seen, "desc": bar.train_progress_bar.desc, "n": bar.train_progress_bar.n}


@pytest.mark.timeout(240)
def test_the_progress_bar_says_migrating_during_a_live_reconfigure(tmp_path: Path) -> None:
    result = run_distributed(_bar_during_reconfigure, 2, str(tmp_path), timeout_s=180)[0]
    assert result["seen"] == [(2, "migrating: reconfigure to dp_replicate=1 dp_shard=1 tp=2 pp=1: ")]
    assert result["desc"] == "step: "  # back to counting steps after the next step
    assert result["n"] == 4
