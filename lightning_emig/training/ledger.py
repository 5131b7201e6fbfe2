"""The data ledger: which dataset samples each data-parallel rank trained on, at which optimizer step.

With ``data.ledger=true``, :class:`DataLedger` appends one JSON line per micro-batch to
``<run_dir>/ledger/rank<global rank>_pid<pid>.jsonl``::

    {"step": 12, "offset": 96, "micro_step": 1, "dp_rank": 0, "dp_degree": 2, "sample_ids": [..],
     "generation": 1, "restart": 0, "fit_start_step": 10, "rank": 0, "pid": 4242, "time": 1716000000.123}

``step`` is ``trainer.global_step`` before the step's optimizer step, ``offset`` the data stream's global offset
the micro-batch was cut from (always ``step x global_batch_size``), ``generation`` the launcher generation (None
under a strategy that has none), ``restart`` torchrun's restart count and ``fit_start_step`` the step this
``Trainer.fit`` started (or resumed) at. :mod:`lightning_emig.testing.ledger` checks a ledger. Invariants:

* a line is written when its micro-batch is handed to ``training_step`` (``on_train_batch_start``). A micro-batch
  that a loader prefetched and a layout change discarded is never written; a step cut short by a failure (which
  surfaces inside a collective of the forward or backward pass) leaves the lines of the micro-batches it started,
  so the attempt stays visible, and the step's next attempt after the rollback writes them again. Which attempt
  is the last one is told by ``(generation, restart, fit_start_step)`` and ``time``: every re-attempt of a step
  happens in a later ``Trainer.fit`` of the job, which resumed at that step or before;
* one writer per data-parallel rank: the rank at tensor- and pipeline-parallel coordinate 0 (its peers on those
  axes train on the same samples);
* each line is appended with one ``write`` on a freshly opened file, so a process killed at any point leaves
  complete lines and at most a partial last one (readers skip it), and nothing is lost in a buffer;
* ``time`` is ``time.time()``: ordering lines of different hosts relies on their clocks being in sync.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_emig.data.stream import ProducedBatch
from lightning_emig.layout import MeshAxis

if TYPE_CHECKING:
    import lightning.pytorch as pl

LEDGER_DIR = "ledger"
"""Subdirectory of the run directory that holds the ledger files."""


def ledger_file(run_dir: Path, rank: int, pid: int) -> Path:
    return run_dir / LEDGER_DIR / f"rank{rank}_pid{pid}.jsonl"


class DataLedger(Callback):
    """Appends the sample ids of every micro-batch this data-parallel rank trains on to the run's ledger.

    Args:
        run_dir: The run directory (the ledger goes to ``run_dir / "ledger"``).
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._fit_start_step: int | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start_step = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._fit_start_step is None:
            # The first micro-batch of this fit starts the step the fit started or resumed at.
            self._fit_start_step = trainer.global_step
        strategy: Any = trainer.strategy
        produced = _produced_batch(strategy)  # taken on every rank: each stream's queue holds its own batches
        dp_rank, dp_degree, writer = _data_parallel_position(trainer)
        if not writer:
            return
        record = {
            "step": trainer.global_step,
            "offset": produced.step_offset,
            "micro_step": produced.micro_step,
            "dp_rank": dp_rank,
            "dp_degree": dp_degree,
            "sample_ids": list(produced.sample_ids),
            "generation": getattr(strategy, "generation", None),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "fit_start_step": self._fit_start_step,
            "rank": trainer.global_rank,
            "pid": os.getpid(),
            "time": time.time(),
        }
        path = ledger_file(self.run_dir, trainer.global_rank, os.getpid())
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _produced_batch(strategy: Any) -> ProducedBatch:
    """The samples of the micro-batch now handed to ``training_step``, from the stream that produced it."""
    streams = getattr(strategy, "data_streams", [])
    if len(streams) != 1:
        raise RuntimeError(f"the data ledger needs exactly one elastic training stream, found {len(streams)}")
    produced = streams[0].take_produced()
    if produced is None:
        raise RuntimeError("the data ledger found no produced micro-batch for the batch being trained on")
    return produced


def _data_parallel_position(trainer: pl.Trainer) -> tuple[int, int, bool]:
    """``(dp_rank, dp_degree, writes)``: this rank's data-parallel coordinate, and whether it is its writer."""
    strategy: Any = trainer.strategy
    if not hasattr(type(strategy), "layout_mesh"):  # not an ElasticMigrationStrategy: each rank reads its own data
        return trainer.global_rank, trainer.world_size, True
    layout_mesh = strategy.layout_mesh
    coordinate = layout_mesh.root.get_coordinate()
    names = layout_mesh.root.mesh_dim_names
    writes = all(coordinate[names.index(axis.value)] == 0 for axis in (MeshAxis.TP, MeshAxis.PP))
    return layout_mesh.dp_rank, layout_mesh.layout.dp, writes
