"""Checkpoint files: what one holds of ours, how the strategy writes and reads them, and what a fit that resumes
from one does with it.

Lightning's checkpoint dict gets one section of ours, :data:`CHECKPOINT_KEY` (saved by rank 0 beside the sharded
tensors): the layout and world it was saved under, and every rank's RNG states. A fit that resumes from it
(:func:`resume_from`) re-expresses the loop counters for this world's gradient accumulation, restores this rank's RNG
state (or derives one where the saved world had no such rank) and says what it resumed, resharded or not.

:class:`CheckpointFiles` writes the periodic saves in the background while training runs (``async_checkpoints``),
the others through Lightning's own synchronous path, one save at a time; :func:`read_checkpoint` refuses a checkpoint
the module cannot take before anything is loaded, and loads one into a plain model (one process: no FSDP2, no TP).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning_emig.change.boundary import rescale_batch_progress
from lightning_emig.change.rng import gather_rng_states, restore_rng_for_rank
from lightning_emig.data.batching import BatchPlan
from lightning_emig.layout import HybridLayout
from lightning_emig.strategy.async_checkpoint import AsyncCheckpointWriter
from lightning_emig.strategy.resume import check_checkpoint_matches
from lightning_emig.strategy.sharded_load import holds_dtensors, load_sharded_into_plain_model

log = logging.getLogger(__name__)

#: Key of our own section in Lightning's checkpoint dict (saved by rank 0 beside the sharded tensors).
CHECKPOINT_KEY = "lightning_emig"


def our_section(layout: HybridLayout, world_size: int) -> dict[str, Any]:
    """What a checkpoint saved now records of ours (every rank's RNG states: a collective)."""
    return {"layout": layout.as_dict(), "world_size": world_size, "rng_states": gather_rng_states()}


@dataclass(frozen=True, slots=True)
class ResumedCheckpoint:
    """A fit's start from a checkpoint file (what the restart event reports)."""

    path: str
    step: int
    old_layout: dict[str, int]
    old_world: int
    load_started: float
    """``time.time()`` when loading began."""
    load_seconds: float
    restart_reason: str | None
    """Why this start was a restart (see :func:`lightning_emig.strategy.resume.restart_reason`), else None."""


def resume_from(checkpoint: dict[str, Any], path: object, *, load_started: float, layout: HybridLayout,
                world_size: int, plan: BatchPlan, rank: int, seed: int, reason: str | None) -> ResumedCheckpoint:
    """This fit resumes from ``checkpoint`` (loaded from ``path`` since ``load_started``) on ``world_size`` processes
    in ``layout`` under ``plan``: counters rescaled, RNG restored, the resume logged on rank 0. ``reason``: why this
    start is a restart (None: it is not)."""
    saved = checkpoint.get(CHECKPOINT_KEY, {})
    old_layout = HybridLayout(**saved["layout"]) if saved else layout
    old_world = int(saved.get("world_size", world_size))
    step = int(checkpoint.get("global_step", 0))
    # Saved under the old world's gradient accumulation; Lightning steps on this world's.
    old_plan = BatchPlan(global_batch_size=plan.global_batch_size, micro_batch_size=plan.micro_batch_size,
                         dp_degree=old_layout.dp)
    if "loops" in checkpoint:
        rescale_batch_progress(checkpoint, old_plan.grad_accumulation, plan.grad_accumulation)
    resumed = ResumedCheckpoint(
        path=str(path), step=step, old_layout=old_layout.as_dict(), old_world=old_world,
        load_started=load_started, load_seconds=time.time() - load_started, restart_reason=reason,
    )
    if rank == 0:
        log.warning(
            "%sresumed %s at step %d: saved on %d process(es) as %s, now %d process(es) as %s%s (%.2fs)",
            f"RESTART ({reason}): " if reason else "", path, step, old_world, old_layout.describe(),
            world_size, layout.describe(),
            ", resharded on load" if (old_layout, old_world) != (layout, world_size) else "", resumed.load_seconds,
        )
    restore_rng_for_rank(saved.get("rng_states"), rank, seed=seed, step=step)
    return resumed


def read_checkpoint(path: Path, module: Any, optimizers: list[Any], load: Callable[[Path], dict[str, Any]]
                    ) -> dict[str, Any]:
    """The checkpoint at ``path`` loaded into ``module`` and ``optimizers`` (by ``load``, Lightning's distributed
    load, where the module holds DTensors), after checking the module can take it (every rank reads the same
    metadata: all refuse alike)."""
    check_checkpoint_matches(path, module)
    if path.is_dir() and not holds_dtensors(module):  # one process: no FSDP2, no TP
        return load_sharded_into_plain_model(path, module, optimizers, strict=module.strict_loading)
    return load(path)


class CheckpointFiles:
    """The strategy's checkpoint writes; ``async_saves``: the ones made while training runs go to a background
    writer (:class:`~lightning_emig.strategy.async_checkpoint.AsyncCheckpointWriter`)."""

    def __init__(self, *, async_saves: bool, timeout: timedelta) -> None:
        self.async_saves = async_saves
        self._timeout = timeout
        self._writer = AsyncCheckpointWriter(timeout)

    def start_fit(self) -> None:
        """A fit starts, its process group formed: a writer of its own (the last fit's was closed), whose group is
        created now, with every rank alive."""
        if self._writer.closed:
            self._writer = AsyncCheckpointWriter(self._timeout)
        if self.async_saves:
            self._writer.open()

    def in_background(self, trainer: Any) -> bool:
        """A save now goes to the background writer (a periodic one, while ``trainer`` trains)."""
        return self.async_saves and trainer is not None and trainer.training and not self._writer.closed

    def save_in_background(self, checkpoint: dict[str, Any], path: object) -> None:
        self._writer.save(checkpoint, path)

    def wait(self) -> None:
        """Until the save in flight, if any, is complete."""
        self._writer.wait()

    def close(self, *, wait: bool) -> None:
        """The fit ends; ``wait``: for the save in flight (not after a failure: its thread may wait on a dead peer)."""
        self._writer.close(wait=wait)
