"""Sharded checkpoints written in the background with ``torch.distributed.checkpoint.async_save``.

What lands on disk is exactly what Lightning's ``ModelParallelStrategy.save_checkpoint`` writes: a directory with
DCP's shard files and ``.metadata``, and Lightning's ``meta.pt`` (every entry of the checkpoint dict but the model
and optimizer state), so ``load_checkpoint`` and :func:`lightning_emig.strategy.resume.newest_checkpoint` read it
unchanged.

Invariants:

* ``meta.pt`` is the completion marker. Global rank 0 writes it (to a temporary file, then renamed) only once its
  DCP save has returned, i.e. after DCP's coordinator wrote ``.metadata``, which DCP does only after every rank
  reported its shards written. Before a save into an existing directory starts, rank 0 deletes that directory's
  ``meta.pt`` and ``.metadata``. So :func:`~lightning_emig.strategy.resume.is_complete` (both files present) never
  takes an in-flight, failed or abandoned save for a complete one.
* The state is copied to CPU memory before :meth:`AsyncCheckpointWriter.save` returns: training may change every
  parameter right away.
* The background thread's collectives (DCP's plan and result exchange) run on a gloo group of their own, created
  once per writer by every rank at its first save, never on the default group: they cannot interleave with
  training's collectives.
* At most one save is in flight: a new save, :meth:`~AsyncCheckpointWriter.wait` and
  :meth:`~AsyncCheckpointWriter.close` wait for the previous one first. ``wait`` returns True on every rank only once
  the whole checkpoint, ``meta.pt`` included, is on disk (the ranks agree by one ``all_reduce`` on that group).
* A failed background save (an I/O error, a peer that died and broke the group) is logged as an error and stays
  incomplete; training is not stopped by it. An abandoned save is no longer waited for; it becomes complete only if
  every rank's write still finishes.
"""

from __future__ import annotations

import io
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch.distributed.checkpoint import async_save

from lightning_emig.collective_sockets import recording_group_sockets

log = logging.getLogger(__name__)

#: DCP's global metadata file, written by its coordinator once every rank's shards are written.
DCP_METADATA = ".metadata"


@dataclass(slots=True)
class _InFlight:
    path: Path
    step: int | None
    started: float
    done: Future[bool]
    """True once the whole checkpoint (``meta.pt`` last) is written; False when the save failed."""


class AsyncCheckpointWriter:
    """Writes Lightning's sharded checkpoints in the background, one at a time (see the module's invariants).

    Args:
        timeout: Timeout of the checkpoint group's collectives: a peer that dies mid-save fails the save after it.
    """

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.closed = False
        """Set by :meth:`close`: the fit this writer served is over."""
        self._group: dist.ProcessGroup | None = None
        self._in_flight: _InFlight | None = None

    @property
    def in_flight(self) -> Path | None:
        """The checkpoint being written, if any."""
        return self._in_flight.path if self._in_flight is not None else None

    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """Start writing Lightning's ``checkpoint`` dict to the directory ``path`` (a collective: every rank calls it).

        Returns once the state is staged in CPU memory. Like Lightning, pops ``state_dict`` and
        ``optimizer_states`` from ``checkpoint``.
        """
        path = Path(path)
        if self.closed:
            raise RuntimeError("this AsyncCheckpointWriter is closed; its fit is over")
        self.wait()
        staging_started = time.perf_counter()
        group = self._checkpoint_group()
        rank = dist.get_rank()
        _prepare_directory(path, rank, group)
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        meta = _serialize(checkpoint) if rank == 0 else None
        step = checkpoint.get("global_step")
        flight = _InFlight(path=path, step=step, started=staging_started, done=Future())
        upload = async_save(tensors, checkpoint_id=path, process_group=group)
        self._in_flight = flight
        upload.add_done_callback(lambda upload: _finish(flight, upload, meta, group))
        if rank == 0:
            log.info("checkpoint %s (step %s): staged in %.3fs, writing in the background",
                     path, step, time.perf_counter() - staging_started)

    def wait(self) -> bool | None:
        """Wait for the save in flight: True once complete, False if it failed (logged), None if there was none."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return None
        waited = time.perf_counter()
        ok = flight.done.result()
        if ok and dist.is_initialized() and dist.get_rank() == 0:
            log.info("checkpoint %s (step %s) complete after %.2fs (waited %.3fs for it)", flight.path, flight.step,
                     time.perf_counter() - flight.started, time.perf_counter() - waited)
        return ok

    def close(self, *, wait: bool = True) -> None:
        """End of the fit: wait for the save in flight (or, with ``wait=False``, abandon it) and drop the group."""
        self.closed = True
        if not wait and self._in_flight is not None and not self._in_flight.done.done():
            flight, self._in_flight = self._in_flight, None
            log.error("checkpoint %s (step %s) abandoned while being written: it counts as incomplete unless every "
                      "rank's write still finishes", flight.path, flight.step)
            return  # its thread may still use the group: leave the group to the default group's teardown
        self.wait()
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None

    def open(self) -> None:
        """Create the checkpoint group now, with every rank alive at the start of the fit (a collective): not at the
        first save, where a peer dying during the group's creation would hold the others in its connect and store
        waits, one after the other, far past the collective timeout."""
        self._checkpoint_group()

    def _checkpoint_group(self) -> dist.ProcessGroup:
        if self._group is None:
            with recording_group_sockets():  # gloo's, over the default group: a way out when a peer is gone
                self._group = dist.new_group(backend="gloo", timeout=self.timeout, group_desc="async_checkpoint")
        return self._group


def _prepare_directory(path: Path, rank: int, group: dist.ProcessGroup) -> None:
    """Lightning's directory handling, plus: rank 0 deletes a previous save's markers before anyone writes."""
    if rank == 0:
        if path.is_file() or path.is_symlink():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        (path / _METADATA_FILENAME).unlink(missing_ok=True)
        (path / DCP_METADATA).unlink(missing_ok=True)
    dist.barrier(group=group)
    path.mkdir(parents=True, exist_ok=True)


def _serialize(checkpoint: dict[str, Any]) -> bytes:
    """A snapshot of the metadata now (training goes on changing the objects it came from)."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    return buffer.getvalue()


def _finish(flight: _InFlight, upload: Future[Any], meta: bytes | None, group: dist.ProcessGroup) -> None:
    """Runs when DCP's write ends (in its thread): rank 0 writes the completion marker, then every rank learns
    whether the whole checkpoint is complete (one ``all_reduce(MIN)``, run even after a failure so that every rank
    runs the same collectives). Failures are logged, never raised: nobody would catch them."""
    error: BaseException | None = None
    try:
        upload.result()
        if meta is not None:
            _write_atomically(flight.path / _METADATA_FILENAME, meta)
    except BaseException as failure:  # noqa: BLE001 - a background failure must be reported, never lost
        error = failure
    complete = False
    try:
        flag = torch.tensor([0 if error is not None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        complete = bool(flag.item())
    except BaseException as failure:  # noqa: BLE001 - the group broke (a peer died): the save is abandoned
        if error is None:  # this rank wrote its part; a failure of the job (a peer died), not of the checkpoint
            log.warning("checkpoint %s (step %s): the process group broke before every rank confirmed it (%s); it is "
                        "resumed from only if its files are complete", flight.path, flight.step,
                        str(failure).splitlines()[0][:200])
            flight.done.set_result(False)
            return
        error = error or failure
    if not complete:
        log.error("CHECKPOINT FAILED: writing %s (step %s) in the background failed%s; it stays incomplete and is "
                  "never resumed from", flight.path, flight.step, "" if error is not None else " on another rank",
                  exc_info=error)
    flight.done.set_result(complete)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
