"""Optimizer-step boundaries inside Lightning's fit loop, and restarting the data iterator at one.

Lightning offers no "between two optimizer steps" hook, so the strategy installs :class:`StepBoundaryHook`:
its ``on_train_batch_end`` runs after the optimizer step and the LR-scheduler step of the batch that closed an
accumulation window, which is where a pending layout change is applied.

Two pieces of Lightning's loop state must follow a layout change, and are touched only here (private
attributes of Lightning 2.6, pinned by the reconfigure tests):

* the training data fetcher has already prefetched the next micro-batch for the *old* data-parallel
  coordinate: its iterator is rebuilt so the stream restarts at the committed global offset;
* Lightning steps when ``batch_progress.current.ready % accumulate_grad_batches == 0``: when the accumulation
  changes, the micro-batch counters are re-expressed as "steps done x new accumulation" so the next step
  still closes after exactly the new number of micro-batches;
* a loader with epochs has as many micro-batches per epoch as the new accumulation makes: the epoch's length
  (``fit_loop.max_batches``, the loader's limit, the fetcher's length) and the validation interval taken from it
  are measured again, so the epoch still ends after the same number of optimizer steps;
* the validation loop's loaders were given a ``DistributedSampler`` for the old data-parallel coordinate (tensor-
  parallel peers would read different batches): they are dropped, and Lightning prepares them again for the current
  layout when it next validates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl


def at_step_boundary(trainer: pl.Trainer) -> bool:
    """True inside ``on_train_batch_end`` of a batch whose optimizer step has run (or before the first batch)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    batch_done = progress.processed == progress.ready
    return batch_done and progress.ready % trainer.accumulate_grad_batches == 0


def restart_training_iterator(trainer: pl.Trainer, old_accumulation: int) -> None:
    epoch_loop = trainer.fit_loop.epoch_loop
    progress = epoch_loop.batch_progress.current
    steps_done = progress.ready // old_accumulation
    micro_batches = steps_done * trainer.accumulate_grad_batches
    in_batch_end = progress.completed < progress.processed  # Lightning completes the batch after the hooks
    progress.ready = progress.started = progress.processed = micro_batches
    progress.completed = micro_batches - 1 if in_batch_end else micro_batches

    fetcher: Any = trainer.fit_loop._data_fetcher  # noqa: SLF001 - no public handle; pinned by test_reconfigure
    if fetcher is None or fetcher.iterator is None:
        return  # not iterating yet: the first iter() will read the new topology
    if hasattr(fetcher, "batches"):
        fetcher.batches.clear()  # prefetched for the old data-parallel coordinate
    _measure_epoch_again(trainer, fetcher.combined_loader)
    iter(fetcher)  # takes its length from the loader's new limits
    fetcher.fetched += micro_batches


def reload_validation_loaders(trainer: pl.Trainer) -> None:
    """Make Lightning prepare the validation loaders again, under the strategy's current sampler arguments."""
    val_loop: Any = trainer.fit_loop.epoch_loop.val_loop
    val_loop._combined_loader = None  # noqa: SLF001 - no public reset; pinned by test_lightning_parity


def _measure_epoch_again(trainer: pl.Trainer, combined_loader: Any) -> None:
    """The epoch's length in micro-batches under the new accumulation, where the loaders have one (as Lightning's
    ``fit_loop.setup_data`` measures it at the start; ``limit_train_batches`` is refused when fit starts, see
    :mod:`lightning_emig.change.fit_start`)."""
    from lightning.fabric.utilities.data import sized_len

    lengths = [sized_len(loader) for loader in combined_loader.flattened]
    if None in lengths:
        return  # endless: no epoch to measure
    combined_loader.limits = lengths
    trainer.fit_loop.max_batches = max(lengths)
    if isinstance(trainer.val_check_interval, float) and trainer.check_val_every_n_epoch is not None:
        trainer.val_check_batch = max(1, int(trainer.fit_loop.max_batches * trainer.val_check_interval))


class StepBoundaryHook(Callback):
    """At the end of every optimizer step: records the change the fit began with once its first step is done (a
    live change, a rollback, a restart), then applies a layout change requested through ``strategy.reconfigure``.
    Runs before the strategy's other callbacks, so the change is recorded before another can begin."""

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not at_step_boundary(trainer):
            return
        strategy: Any = trainer.strategy
        _finish_change_event(trainer)
        if getattr(strategy, "reconfigure_pending", False):
            strategy.apply_pending_reconfigure(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A change at the last step: the new fit restores max_steps and runs no step; its event is still due.
        _finish_change_event(trainer)


def _finish_change_event(trainer: pl.Trainer) -> None:
    finish = getattr(trainer.strategy, "finish_change_event", None)
    if finish is not None:
        finish(trainer)


def rescale_batch_progress(metadata: dict[str, Any], old_accumulation: int, new_accumulation: int) -> None:
    """Re-express the saved micro-batch counters as "steps done x new accumulation".

    Lightning steps when ``batch_progress.current.ready % accumulate_grad_batches == 0``; the counters were captured
    under the old world's accumulation (the same rule as :func:`restart_training_iterator` applies to a live layout
    change in one fit). Every handoff into a world with another data-parallel degree needs it: joins, preemptions,
    failures.
    """
    if old_accumulation == new_accumulation:
        return
    progress = metadata["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for scope in ("current", "total"):
        counters = progress[scope]
        micro_batches = counters["ready"] // old_accumulation * new_accumulation
        in_batch_end = counters["completed"] < counters["processed"]
        counters.update(ready=micro_batches, started=micro_batches, processed=micro_batches,
                        completed=micro_batches - 1 if in_batch_end else micro_batches)


def treat_step_as_saved(trainer: pl.Trainer, step: int) -> None:
    """Every rank's ``ModelCheckpoint`` skips ``step``: a live fit resumes "at the end of" that step, and a callback
    that has not saved it (a joiner's is new, a survivor's skipped it during the handoff) would save it again before
    the first new step — on some ranks only, and a save is collective. The live state was never written; the next
    periodic checkpoint comes at its usual step."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            callback._last_global_step_saved = step  # noqa: SLF001 - pinned by a test
