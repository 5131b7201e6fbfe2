"""The training data of one fit, kept at the job's position whatever the layout.

:class:`TrainingData` makes the fit's training loaders elastic (a :class:`MicroBatchLoader` as it is, a user's
``DataLoader`` read through the global-offset sampler, anything else refused), tells their streams this rank's
data-parallel coordinate, commits one global batch per optimizer step, and writes the batch plan's gradient
accumulation into the Trainer (users never set it by hand). After a layout change it moves all of that to the new
layout and restarts Lightning's data iterator at the committed offset.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_emig.change.boundary import reload_validation_loaders, restart_training_iterator
from lightning_emig.data.adopt import USE_INSTEAD, DataLoaderNotElasticError, adopt_dataloader
from lightning_emig.data.loader import MicroBatchLoader

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_emig.data.batching import BatchPlan
    from lightning_emig.data.stream import MicroBatchStream


class TrainingData:
    """The training loaders of a fit, for a fixed global batch of ``global_batch_size`` samples read in micro-batches
    of ``micro_batch_size`` (``seed``: the order a user's ``DataLoader`` is shuffled in)."""

    def __init__(self, *, global_batch_size: int, micro_batch_size: int, seed: int) -> None:
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self._loaders: list[MicroBatchLoader] = []
        self._accumulation_written: int | None = None

    @property
    def streams(self) -> list[MicroBatchStream]:
        """The streams of the training loaders this fit reads (their position is the job's data position)."""
        return [loader.stream for loader in self._loaders]

    def adopt(self, dataloader: object, *, dp: int, dp_rank: int, start_over: bool) -> MicroBatchLoader:
        """``dataloader`` made elastic and attached at data-parallel coordinate ``dp_rank`` of ``dp``; ``start_over``:
        its stream goes back to the first sample (a rollback with no checkpoint)."""
        if not isinstance(dataloader, MicroBatchLoader):
            from torch.utils.data import DataLoader

            if not isinstance(dataloader, DataLoader):
                raise DataLoaderNotElasticError(
                    f"the training data is a {type(dataloader).__name__}, not a DataLoader; {USE_INSTEAD}"
                )
            dataloader = adopt_dataloader(dataloader, global_batch_size=self.global_batch_size,
                                          micro_batch_size=self.micro_batch_size, seed=self.seed)
        self._check_batch_sizes(dataloader)
        if start_over:
            dataloader.stream.seek(0)
        dataloader.stream.set_topology(dp, dp_rank)
        if dataloader not in self._loaders:
            self._loaders.append(dataloader)
        return dataloader

    def _check_batch_sizes(self, loader: MicroBatchLoader) -> None:
        stream = loader.stream
        if stream.sampler.global_batch_size != self.global_batch_size:
            raise ValueError(
                f"the data stream uses global_batch_size={stream.sampler.global_batch_size} but the strategy "
                f"uses {self.global_batch_size}; build both from the same value"
            )
        if stream.micro_batch_size != self.micro_batch_size:
            raise ValueError(
                f"the data stream uses micro_batch_size={stream.micro_batch_size} but the strategy "
                f"uses {self.micro_batch_size}; build both from the same value"
            )

    def apply_accumulation(self, trainer: pl.Trainer, plan: BatchPlan) -> None:
        """Write the plan's gradient accumulation into ``trainer``, refusing a different one the user set."""
        requested = trainer.accumulate_grad_batches
        derived = plan.grad_accumulation
        # The value an earlier fit of the same Trainer.fit call (another world) wrote is ours, not the user's.
        if requested not in (1, derived, self._accumulation_written):
            raise ValueError(
                f"Trainer(accumulate_grad_batches={requested}) conflicts with the strategy's batch plan "
                f"({plan.describe()}); leave accumulate_grad_batches unset, the strategy derives it"
            )
        trainer.accumulate_grad_batches = self._accumulation_written = derived

    def restart(self, trainer: pl.Trainer, plan: BatchPlan, *, dp: int, dp_rank: int) -> None:
        """After a layout change: new accumulation, new data-parallel coordinate, fresh data iterator."""
        old_accumulation = trainer.accumulate_grad_batches
        trainer.accumulate_grad_batches = self._accumulation_written = plan.grad_accumulation
        for loader in self._loaders:
            loader.stream.set_topology(dp, dp_rank)
        restart_training_iterator(trainer, old_accumulation)
        reload_validation_loaders(trainer)

    def commit_step(self) -> None:
        """One optimizer step consumed one global batch, whatever the layout."""
        for loader in self._loaders:
            loader.stream.commit_step()

    def clear(self) -> None:
        """The fit ended: the next one attaches its loaders again."""
        self._loaders.clear()
