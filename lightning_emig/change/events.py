"""Where a membership or layout event goes: the console, ``events.jsonl`` and every logger of the Trainer.

Invariants:

* only global rank 0 publishes (the strategy checks before calling :func:`publish_event`);
* ``<run_dir>/events.jsonl`` gets one JSON line per event, ``ReconfigureEvent.as_dict()`` plus ``time``
  (``time.time()`` when it was published) and ``run_id``: the wandb run id of the job
  (:func:`stable_run_id`), the same in every generation and restart, so the
  file outlives processes and joins with the wandb run;
* each logger gets the event's numbers as metrics at the event's step, named ``event/<field>`` and
  ``event/seconds/<phase>``; a :class:`~lightning.pytorch.loggers.WandbLogger` also gets ``event/kind`` and an
  ``events`` table holding every event of the job so far (read back from ``events.jsonl``, so it spans
  restarts too);
* publishing never fails training: a destination that raises is logged with its traceback and skipped.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.loggers import Logger, WandbLogger

from lightning_emig.jsonl import read_complete_lines
from lightning_emig.layout import HybridLayout
from lightning_emig.migration.change import ChangeRecord

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"

#: Numeric fields of an event record logged as ``event/<field>`` (those absent from a record are skipped).
METRIC_FIELDS = (
    "old_world", "new_world", "bytes_moved", "bytes_copied_locally", "total_seconds", "downtime_seconds",
    "steps_rolled_back", "generation",
)

#: Columns of the wandb ``events`` table, one row per event of the job.
TABLE_COLUMNS = (
    "time", "kind", "step", "generation", "old_world", "new_world", "old_layout", "new_layout", "bytes_moved",
    "downtime_seconds", "steps_rolled_back", "total_seconds", "seconds",
)


@dataclass(slots=True)
class ReconfigureEvent:
    """One structured record of a layout change (what issue trackers and dashboards read)."""

    kind: str
    step: int
    old_layout: dict[str, int]
    new_layout: dict[str, int]
    old_world: int
    new_world: int
    bytes_moved: int = 0
    bytes_copied_locally: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    generation: int | None = None
    """The launcher generation the change led to (membership changes only)."""
    downtime_seconds: float | None = None
    """Last step finished on the old world to first step finished on the new (membership changes only)."""
    steps_rolled_back: int | None = None
    """Steps done on the old world after the checkpoint a restart resumed from (recomputed on the new one)."""
    layout_choice: dict[str, Any] | None = None
    """Why the layout picker chose ``new_layout`` (None: the requested layout or the fixed rule)."""
    prepared_seconds: dict[str, float] | None = None
    """The phases a background preparation ran while the old layout trained (off the pause; None: built at the
    boundary)."""
    proven_digest: str | None = None
    """The digest of the state the new world holds (hex), proven equal to the one taken before the change (a live
    change's or a rollback's checkpoint; None: nothing to compare with, e.g. one survivor of a failure)."""

    @classmethod
    def of(cls, change: ChangeRecord, *, generation: int | None = None, downtime_seconds: float | None = None
           ) -> ReconfigureEvent:
        """The event of ``change`` (steps rolled back are reported for failures and restarts only)."""
        return cls(
            kind=change.kind, step=change.step, old_layout=change.old_layout.as_dict(),
            new_layout=change.new_layout.as_dict(), old_world=change.old_world, new_world=change.new_world,
            bytes_moved=change.bytes_moved, bytes_copied_locally=change.bytes_copied_locally,
            seconds=dict(change.seconds), generation=generation, downtime_seconds=downtime_seconds,
            steps_rolled_back=change.steps_rolled_back if change.kind in ("failure", "restart") else None,
        )

    def as_dict(self) -> dict[str, Any]:
        optional = (("generation", self.generation), ("downtime_seconds", self.downtime_seconds),
                    ("steps_rolled_back", self.steps_rolled_back), ("layout_choice", self.layout_choice),
                    ("prepared_seconds", self.prepared_seconds), ("proven_digest", self.proven_digest))
        extra = {k: v for k, v in optional if v is not None}
        return {
            "kind": self.kind, "step": self.step, "old_layout": self.old_layout, "new_layout": self.new_layout,
            "old_world": self.old_world, "new_world": self.new_world, "bytes_moved": self.bytes_moved,
            "bytes_copied_locally": self.bytes_copied_locally, "seconds": self.seconds,
            "total_seconds": sum(self.seconds.values()), **extra,
        }


def publish_event(trainer: pl.Trainer, event: ReconfigureEvent) -> dict[str, Any]:
    """Rank 0: write ``event`` to the console, ``events.jsonl`` and the Trainer's loggers; return its record."""
    run_dir = Path(trainer.default_root_dir)
    record = {**event.as_dict(), "time": time.time(), "run_id": stable_run_id(run_dir)}
    log.warning("%s", summary_line(record))
    try:
        append_event(run_dir, record)
    except OSError:
        log.exception("could not append the %s event to %s; training goes on", record["kind"], run_dir / EVENTS_FILE)
    for logger in trainer.loggers:
        try:
            _log_to(logger, record, run_dir)
        except Exception:  # an event is never worth a failed run; it is on the console and in events.jsonl
            log.exception("could not log the %s event to %s; training goes on", record["kind"], type(logger).__name__)
    return record


def summary_line(record: dict[str, Any]) -> str:
    """One readable line: kind, step, worlds, layouts, bytes, seconds per phase, downtime, steps rolled back."""
    phases = ", ".join(f"{phase} {seconds:.3f}s" for phase, seconds in record["seconds"].items())
    line = (
        f"{record['kind']} at step {record['step']}: world {record['old_world']} -> {record['new_world']}, "
        f"{HybridLayout(**record['old_layout']).describe()} -> {HybridLayout(**record['new_layout']).describe()}, "
        f"{record['bytes_moved'] / 1e6:.1f} MB moved in {record['total_seconds']:.3f}s ({phases})"
    )
    if record.get("downtime_seconds") is not None:
        line += f", downtime {record['downtime_seconds']:.2f}s"
    if record.get("steps_rolled_back") is not None:
        line += f", {record['steps_rolled_back']} step(s) rolled back"
    if record.get("generation") is not None:
        line += f", generation {record['generation']}"
    return line


def append_event(run_dir: Path, record: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / EVENTS_FILE).open("a") as f:
        f.write(json.dumps(record) + "\n")


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every complete line of ``events.jsonl`` (a process killed mid-write leaves a partial last line)."""
    return read_complete_lines(run_dir / EVENTS_FILE)


def event_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of an event record as logger metrics: ``event/<field>`` and ``event/seconds/<phase>``."""
    metrics = {f"event/{name}": record[name] for name in METRIC_FIELDS if record.get(name) is not None}
    metrics.update({f"event/seconds/{phase}": seconds for phase, seconds in record["seconds"].items()})
    return metrics


def _log_to(logger: Logger, record: dict[str, Any], run_dir: Path) -> None:
    step = record["step"]
    if isinstance(logger, WandbLogger):
        logger.log_metrics({**event_metrics(record), "event/kind": record["kind"]}, step=step)
        history = read_events(run_dir)
        if not history or history[-1] != record:  # events.jsonl could not be written
            history.append(record)
        logger.log_table(key="events", columns=list(TABLE_COLUMNS), data=[_table_row(r) for r in history], step=step)
        return
    logger.log_metrics(event_metrics(record), step=step)
    logger.save()  # the CSV logger buffers until its flush interval; an event should be on disk now


def _table_row(record: dict[str, Any]) -> list[Any]:
    row = []
    for column in TABLE_COLUMNS:
        value = record.get(column)
        if column in ("old_layout", "new_layout") and value is not None:
            value = HybridLayout(**value).describe()
        elif column == "seconds" and value is not None:
            value = json.dumps(value)
        row.append(value)
    return row


def stable_run_id(run_dir: Path) -> str:
    """The wandb run id of a run directory: the same for every restart and generation of the job."""
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
