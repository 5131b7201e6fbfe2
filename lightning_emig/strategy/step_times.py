"""Wall-clock time of every optimizer step, and the ``restart`` event of the restart path.

:class:`StepTimeRecorder` (global rank 0) appends one JSON line per optimizer step to ``<run_dir>/step_times.jsonl``:
``{"step": steps completed, "time": time.time(), "world": world size, "pid": process id, "cpu": time.thread_time(),
"faults": page faults so far, "parts": {...}, "loss": that step's loss}`` (``cpu``: the CPU seconds of the thread that runs
Lightning's loop, so that a change's lost time splits into that thread's work and its waiting; ``faults``: the
process's minor page faults, every thread's — memory it touched for the first time, which a change's first step may
meet cold; ``parts``: where rank 0's training thread spent the step, in seconds — ``forward`` (each micro-batch's
start to its backward), ``backward``, ``optimizer`` (from the optimizer step's hook to the step's end: clipping, the
step, the callbacks' hooks there — a first step's completion of the proof among them), summed over the
micro-batches; with pipeline stages the schedule runs forward and backward in one call, all counted as ``forward``;
the rest of the step's time went to the data, the loop and the callbacks, the last boundary's work among them;
``loss`` where the module keeps ``step_losses``, as ours do). The strategy installs it for every fit, in the
Trainer's ``default_root_dir`` (the directory its events go to). The file outlives processes, so it spans every
generation and every restart of a job: downtime of any membership change is "last line of the old world" to "first
line of the new one", whichever path the change took, and the loss of every step trained, whichever process was
rank 0 then (a step trained again after a rollback has a line each time).

Once the steady steps after an event with downtime are done, rank 0 reports its lost time (see
:mod:`lightning_emig.change.lost_time`): a console line and ``event/lost_seconds`` to every logger.

After a restart-path resume (see :mod:`lightning_emig.strategy.resume`) it also begins, when the fit starts, the
``restart`` change that the strategy records at the first step on the new world (or, if a failure ends the fit
before it, at once with no downtime; see :mod:`lightning_emig.change.record`; a failure before the fit began it, in
its setup or its restore, begins it then: :meth:`StepTimeRecorder.on_exception`): the checkpoint step, the steps rolled
back (done on the old world after that checkpoint, recomputed now), old and new world and layout, the downtime and
its phases (``stop_and_start``: last old step to this process's start; ``startup``: start to checkpoint load;
``load``: reading and resharding the checkpoint; ``first_step``: load to the first step's end).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_emig.change.boundary import at_step_boundary
from lightning_emig.change.events import read_events
from lightning_emig.change.lost_time import STEP_TIMES_FILE, lost_time, recovery_span
from lightning_emig.layout import HybridLayout
from lightning_emig.migration.change import ChangeRecord
from lightning_emig.strategy.resume import process_start_wall

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


def read_step_times(run_dir: Path) -> list[dict[str, Any]]:
    """Every complete line of ``step_times.jsonl`` (a process killed mid-write leaves a partial last line)."""
    from lightning_emig.jsonl import read_complete_lines

    return read_complete_lines(run_dir / STEP_TIMES_FILE)


class _StepParts:
    """The ``parts`` of one step's line: seconds per part, summed as the training thread passes the hooks."""

    def __init__(self) -> None:
        self._part: str | None = None
        self._since = 0.0
        self._seconds: dict[str, float] = {}

    def begin(self, part: str) -> None:
        self.end()
        self._part, self._since = part, time.perf_counter()

    def end(self) -> None:
        if self._part is not None:
            self._seconds[self._part] = self._seconds.get(self._part, 0.0) + time.perf_counter() - self._since
            self._part = None

    def take(self) -> dict[str, float]:
        self.end()
        taken, self._seconds = {k: round(v, 4) for k, v in self._seconds.items()}, {}
        return taken


class StepTimeRecorder(Callback):
    """Rank 0 writes each optimizer step's end time; after a restart-path resume, every rank begins the ``restart``
    change (recorded by the strategy at the first step)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._previous: dict[str, Any] | None = None
        self._events_seen = 0
        """Events of this process's strategy already looked at for their lost time."""
        self._awaiting: list[dict[str, Any]] = []
        """Published events (lines of ``events.jsonl``) whose lost time is not known yet."""
        self._write_failed = False
        self._parts = _StepParts()
        self._restart_settled = False
        """The restart change of the first fit was begun, or found to be none (see :meth:`on_exception`)."""

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            records = read_step_times(self.run_dir)
            self._previous = records[-1] if records else None
            strategy: Any = trainer.strategy
            reason = getattr(strategy, "start_reason", None)  # a restart only for the first fit of a process
            if reason is not None and getattr(strategy, "resumed_from", "n/a") is None and self._previous is not None:
                # Restarted, but no complete checkpoint to resume from (e.g. the newest was still being written
                # when the workers were stopped): the job starts over, and that is a restart event too.
                from lightning_emig.strategy.checkpoint_file import ResumedCheckpoint

                log.warning("RESTART (%s) from step 0: no complete checkpoint; %d step(s) will be recomputed",
                            reason, self._previous["step"])
                strategy.resumed_from = ResumedCheckpoint(
                    # Without a checkpoint the old layout is unknown here: the new one stands in.
                    path="", step=0, old_layout=strategy.layout.as_dict(), old_world=int(self._previous["world"]),
                    load_started=time.time(), load_seconds=0.0, restart_reason=reason,
                )  # replaced when a checkpoint is restored (after this hook)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._parts = _StepParts()  # a step a failure cut short ends with its fit: its parts are no next step's
        self._begin_restart(trainer)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
                             ) -> None:
        self._parts.begin("forward")

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._parts.begin("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._parts.end()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._parts.begin("optimizer")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank != 0 or not at_step_boundary(trainer):
            self._parts.end()
            return
        now = time.time()
        strategy: Any = trainer.strategy
        record = {"step": trainer.global_step, "time": now, "world": strategy.world_size, "pid": os.getpid(),
                  "cpu": time.thread_time(), "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                  "parts": self._parts.take()}
        loss = getattr(pl_module, "step_losses", {}).get(trainer.global_step - 1)  # the step that just ended
        if loss is not None:
            record["loss"] = loss
        if self._append(record):
            self._report_lost_time(trainer, strategy)

    def _append(self, record: dict[str, Any]) -> bool:
        """Append ``record``; a line that cannot be written is never worth a failed run (logged once)."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)  # Lightning creates default_root_dir only to write in it
            with (self.run_dir / STEP_TIMES_FILE).open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError:
            if not self._write_failed:
                log.exception("could not append to %s: no lost time is reported for this run; training goes on",
                              self.run_dir / STEP_TIMES_FILE)
            self._write_failed = True
            return False
        return True

    def _report_lost_time(self, trainer: pl.Trainer, strategy: Any) -> None:
        events = getattr(strategy, "events", [])
        if len(events) > self._events_seen:  # new events since the last step: their published lines
            new = len(events) - self._events_seen
            self._events_seen = len(events)
            self._awaiting += [e for e in read_events(self.run_dir)[-new:] if e.get("downtime_seconds") is not None]
        if not self._awaiting:
            return
        times = read_step_times(self.run_dir)
        for event in list(self._awaiting):
            span = recovery_span(event, times)
            # Another event ended the steady steps after this one: report what there is (or nothing), stop waiting.
            cut_short = span is not None and span[1][-1] is not times[-1]
            lost = lost_time(event, times, partial=cut_short)
            if lost is None and not cut_short:
                continue
            self._awaiting.remove(event)
            if lost is None:
                continue
            pause = "" if lost.pause_seconds is None else f"; the change itself {lost.pause_seconds:.2f}s"
            log.warning("%s at step %d: %.2fs of training lost (%.2fs to pass step %d again, minus a steady step of "
                        "%.2fs%s); downtime %.2fs", event["kind"], event["step"], lost.lost_seconds,
                        lost.recovery_seconds, lost.last_old_step, lost.steady_step_seconds, pause,
                        event["downtime_seconds"])
            metrics = {"event/lost_seconds": lost.lost_seconds, "event/recovery_seconds": lost.recovery_seconds}
            if lost.pause_seconds is not None:
                metrics["event/pause_seconds"] = lost.pause_seconds
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A failure ended a restart's fit before its ``restart`` change was begun (in its setup, or while the
        # checkpoint was being restored): the restart happened all the same (its processes formed the new world),
        # so every rank begins it now, from the files rank 0 would have read; the survivors record it, with no
        # downtime, before the failure's event, whose old world it made.
        strategy: Any = trainer.strategy
        if self._restart_settled or getattr(strategy, "start_reason", None) is None:
            return
        self._restart_settled = True
        if not hasattr(strategy, "begin_restart_event") or not getattr(strategy, "has_layout", False):
            return  # no layout: the process exits (nothing recovers), and the event has no new layout to name
        records = read_step_times(self.run_dir)
        restart = _restart_change(strategy, self.run_dir, records[-1] if records else None, strategy.resumed_from)
        if restart is not None:
            record, last_step_wall, in_place_wall = restart
            strategy.begin_restart_event(record, last_step_wall=last_step_wall, in_place_wall=in_place_wall)

    def _begin_restart(self, trainer: pl.Trainer) -> None:
        strategy: Any = trainer.strategy
        # Alike on every rank: the first fit of a worker group that torchrun's restart path started.
        if getattr(strategy, "start_reason", None) is None or not hasattr(strategy, "begin_restart_event"):
            self._restart_settled = True
            return
        # At the fit's start the restore has run: nothing resumed means no restart to record (the newest-checkpoint
        # reading of _restart_change is for a fit a failure cut short before it, on_exception).
        resumed = strategy.resumed_from
        restart = (_restart_change(strategy, self.run_dir, self._previous, resumed, announce=True)
                   if trainer.global_rank == 0 and resumed is not None else None)
        # Every rank holds the event until the first step: a failure before it leaves a survivor to record it. A
        # failure in the broadcast itself leaves it to on_exception.
        restart = strategy.broadcast(restart)
        self._restart_settled = True
        strategy.resumed_from = None  # used: a later fit of this process is no restart
        if restart is not None:
            record, last_step_wall, in_place_wall = restart
            strategy.begin_restart_event(record, last_step_wall=last_step_wall, in_place_wall=in_place_wall)


def _restart_change(strategy: Any, run_dir: Path, previous: dict[str, Any] | None, resumed: Any, *,
                    announce: bool = False) -> tuple[ChangeRecord, float, float] | None:
    """The ``restart`` change a fit resumed with (``resumed``: its :class:`ResumedCheckpoint`, None if the restore
    never happened: then the newest complete checkpoint, the one it was restoring), the wall time of the last step
    before it (``previous``: the last line of ``step_times.jsonl``) and of the state in place; None if the fit
    resumed nothing or nothing was trained before. ``announce``: log it (rank 0, at the fit's start)."""
    if previous is None or (resumed is not None and resumed.restart_reason is None):
        return None
    started = process_start_wall()
    if resumed is None:  # cut short before the restore: nothing was loaded, no load time
        from lightning_emig.strategy.resume import newest_checkpoint

        directory = strategy.checkpoint_dir(strategy.lightning_module.trainer)
        found = newest_checkpoint(directory) if directory is not None else None
        step, old_world, old_layout = (found.step if found is not None else 0), previous["world"], None
        load_started, load_seconds = time.time(), 0.0
    else:
        step, old_world, old_layout = resumed.step, resumed.old_world, resumed.old_layout
        load_started, load_seconds = resumed.load_started, resumed.load_seconds
    in_place_wall = load_started + load_seconds
    seconds = {"stop_and_start": started - previous["time"], "startup": load_started - started, "load": load_seconds}
    rolled_back = int(previous["step"]) - step
    if announce:
        log.warning("RESTART: resumed on world %d from the step-%d checkpoint %.2fs after the last step on world %d; "
                    "%d step(s) after it are being recomputed", strategy.world_size, step,
                    in_place_wall - previous["time"], previous["world"], rolled_back)
    recorded = read_events(run_dir)
    if recorded:  # the world that held the state last is the one the last change left (e.g. a failure's)
        old_world, old_layout = recorded[-1]["new_world"], recorded[-1]["new_layout"]
    record = ChangeRecord(
        kind="restart", step=step,
        old_layout=strategy.layout if old_layout is None else HybridLayout(**old_layout), new_layout=strategy.layout,
        old_world=int(old_world), new_world=strategy.world_size, seconds=seconds, steps_rolled_back=rolled_back,
    )
    return record, float(previous["time"]), in_place_wall
