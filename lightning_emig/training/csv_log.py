"""``metrics.csv`` for a whole elastic job: every generation's Trainer appends to the one file.

A live membership change builds a new Trainer (and its loggers) in the same run directory; so does a rollback and
a torchrun restart. Lightning's CSV writer deletes an existing ``metrics.csv`` when it is created, so each
generation would erase the steps logged before it. :class:`ContinuedCSVLogger` keeps the file: its writer starts from
the existing header (new columns still rewrite the header, as Lightning's does) and appends. Steps recomputed after a
rollback appear twice; ``events.jsonl`` says which.
"""

from __future__ import annotations

import csv

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class ContinuedExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, appending to an existing ``metrics.csv`` instead of deleting it."""

    def _check_log_dir_exists(self) -> None:
        self._read_header()

    def save(self) -> None:
        # Another process's writer (the previous rank 0, finishing as this one starts) may have added columns.
        self._read_header()
        super().save()

    def _read_header(self) -> None:
        """The writer compares new keys against ``metrics_keys``: take them from the file as it is now."""
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            header = next(csv.reader(file), [])
        self.metrics_keys = sorted(header)


class ContinuedCSVLogger(CSVLogger):
    """:class:`~lightning.pytorch.loggers.CSVLogger` whose ``metrics.csv`` survives a new Trainer in the same run."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ContinuedExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuedExperimentWriter(log_dir=self.log_dir)
        return self._experiment
