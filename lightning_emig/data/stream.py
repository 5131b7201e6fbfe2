"""This rank's micro-batches, step after step, from the *committed* global offset.

:class:`MicroBatchStream` is the ``IterableDataset`` a training loop reads (``DataLoader(stream, batch_size=None,
num_workers=0)``; Lightning never injects a ``DistributedSampler`` into an iterable dataset). Invariants:

* *committed* vs *produced*: producing a micro-batch never moves the position. Loaders prefetch (Lightning reads
  one batch ahead), so the position is the sampler's offset, advanced only by :meth:`MicroBatchStream.commit_step`
  after an optimizer step. ``state_dict`` saves that committed offset, never the prefetch position.
* a NEW iterator starts exactly at the committed offset with the current topology. :meth:`set_topology`,
  :meth:`load_state_dict`, :meth:`seek` and ``iter()`` itself make every older iterator stale: using one raises
  :class:`StaleIteratorError` instead of silently feeding samples of the old layout.
* ``commit_step`` refuses to commit a step whose micro-batches the live iterator has not all produced yet (the
  usual bug: committing per micro-batch instead of per optimizer step).
* with ``epochs=True`` (a user's map-style ``DataLoader`` adopted by the strategy) an iterator ends with the epoch
  its committed offset lies in, and ``len()`` is this rank's micro-batches per epoch (``steps_per_epoch x
  accumulation``): Lightning sees a finite loader and keeps its epochs (epoch ends, epoch-interval schedulers,
  validation at the epoch's end). An epoch is counted in global batches, so its number of optimizer steps does not
  change when the world does; its number of micro-batches per rank does (and so does ``len()``). Without it the
  stream is endless and has no length;
* the stream runs in the process that commits (the outer loader's ``num_workers`` must be 0, which ``__iter__``
  checks: a worker process would hold a copy whose offset never sees the commits). Worker processes read *for* it:
  given :class:`~lightning_emig.data.workers.WorkerSettings` (a user's loader's ``num_workers``, ``prefetch_factor``,
  ``pin_memory``, ``persistent_workers``, ``worker_init_fn``, ...), a
  :class:`~lightning_emig.data.workers.MicroBatchReader` reads and collates the index lists the stream plans, in
  order; without workers the same reader reads in this process. A micro-batch counts as produced when it leaves the
  reader, never when a worker prefetches it. A stale iterator lets go of its reader iterator (its workers stop, or,
  persistent, are reset by the next iterator, their prefetched batches dropped), and so does an iterator nobody holds
  any more; the next iterator plans again from the committed offset.

With ``collate_fn`` (a user's ``DataLoader``'s) an item is ``collate_fn([dataset[i] for i in ids])`` (or of
``dataset.__getitems__(ids)``, as torch reads it), whatever that returns; :meth:`MicroBatchStream.take_produced` names
its samples. Without it, each item is a dict of tensors with batch dimension ``m = micro_batch_size``: ``inputs``
[m, T], ``targets`` [m, T], ``sample_ids`` [m] (dataset indices: the data ledger), ``step_offset`` [m] (the offset of
the optimizer step the micro-batch belongs to) and ``micro_step`` [m] (its index within the accumulation window,
0-based).
The last two are per-sample columns, not Python ints, so Lightning's batch-size inference sees one batch
size; compare ``batch["step_offset"][0]`` with ``stream.offset`` to detect a stale prefetched batch.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from lightning_emig.data.batching import BatchPlan
from lightning_emig.data.sampler import GlobalOffsetSampler, mix_seed
from lightning_emig.data.workers import MicroBatchReader, WorkerSettings

MicroBatch = dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class ProducedBatch:
    """The samples of one produced micro-batch (the data ledger's record)."""

    step_offset: int
    micro_step: int
    sample_ids: tuple[int, ...]


class StaleIteratorError(RuntimeError):
    """An iterator created before the stream's topology or position last changed was used."""


class MicroBatchStream(IterableDataset[MicroBatch]):
    """Elastic stream of one data-parallel rank's micro-batches: endless (across epochs), or one epoch per iterator
    with ``epochs=True``."""

    def __init__(
        self,
        dataset: Dataset[Any],
        sampler: GlobalOffsetSampler,
        micro_batch_size: int,
        *,
        dp_degree: int | None = None,
        dp_rank: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        epochs: bool = False,
        workers: WorkerSettings | None = None,
    ) -> None:
        size = len(dataset) if hasattr(dataset, "__len__") else None  # type: ignore[arg-type]
        if size is not None and size != sampler.num_samples:
            raise ValueError(
                f"dataset has {size} samples but the sampler was built for num_samples={sampler.num_samples}:"
                " build GlobalOffsetSampler(len(dataset), ...) (wrap the dataset in a Subset to use part of it)"
            )
        BatchPlan(sampler.global_batch_size, micro_batch_size)  # validates micro batch against the global one
        self.dataset = dataset
        self.sampler = sampler
        self.micro_batch_size = micro_batch_size
        self.collate_fn = collate_fn
        self.epochs = epochs
        self.workers = WorkerSettings() if workers is None else workers
        self._reader = MicroBatchReader(dataset, _stack_samples if collate_fn is None else collate_fn, self.workers)
        # The live iterator's hold on its reader iterator, weakly: an iterator nobody holds stops its workers.
        self._live: weakref.ref[_ReaderHold] | None = None
        self._produced: deque[ProducedBatch] = deque()
        self._topology: tuple[int, int] | None = None
        # Bumped whenever a live iterator would start reading wrong samples; iterators remember theirs.
        self._generation = 0
        # End (exclusive offset) of the steps the live iterator has produced completely; None: no live iterator.
        self._produced_end: int | None = None
        if dp_degree is not None or dp_rank is not None:
            if dp_degree is None or dp_rank is None:
                raise ValueError("give both dp_degree and dp_rank, or neither (then call set_topology)")
            self.set_topology(dp_degree, dp_rank)

    # ------------------------------------------------------------------ topology and position
    @property
    def offset(self) -> int:
        """The committed global sample offset (samples of completed optimizer steps)."""
        return self.sampler.offset

    @property
    def topology(self) -> tuple[int, int] | None:
        """``(dp_degree, dp_rank)``, or ``None`` before :meth:`set_topology`."""
        return self._topology

    @property
    def plan(self) -> BatchPlan:
        """Batch arithmetic for the current topology."""
        dp_degree, _ = self._require_topology()
        return BatchPlan(self.sampler.global_batch_size, self.micro_batch_size, dp_degree)

    def set_topology(self, dp_degree: int, dp_rank: int, micro_batch_size: int | None = None) -> None:
        """Place this stream at data-parallel rank ``dp_rank`` of ``dp_degree`` (and optionally a new micro
        batch). Takes effect for iterators created afterwards; existing ones become stale if anything changed.
        """
        micro = self.micro_batch_size if micro_batch_size is None else micro_batch_size
        BatchPlan(self.sampler.global_batch_size, micro, dp_degree)
        if not isinstance(dp_rank, int) or isinstance(dp_rank, bool) or not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be an int in [0, {dp_degree}), got {dp_rank!r}")
        if (dp_degree, dp_rank) == self._topology and micro == self.micro_batch_size:
            return
        self._topology = (dp_degree, dp_rank)
        self.micro_batch_size = micro
        self._invalidate_iterators()

    def commit_step(self) -> int:
        """Record one completed optimizer step (one global batch); returns the new committed offset."""
        step_end = self.sampler.offset + self.sampler.global_batch_size
        if self._produced_end is not None and self._produced_end < step_end:
            raise RuntimeError(
                f"commit_step at offset {self.sampler.offset}, but this rank has not yet produced all"
                f" {self.plan.grad_accumulation} micro-batches of that step: commit once per optimizer step,"
                " after the last accumulation micro-batch, never per micro-batch"
            )
        offset = self.sampler.advance(1)
        while self._produced and self._produced[0].step_offset < offset:  # committed: nobody will ask any more
            self._produced.popleft()
        return offset

    def seek(self, offset: int) -> None:
        """Move the committed offset (e.g. from a restored step counter); older iterators become stale."""
        self.sampler.seek(offset)
        self._invalidate_iterators()

    def state_dict(self) -> dict[str, Any]:
        """``{"sampler": GlobalOffsetSampler.state_dict()}``: the committed offset and what defines the data
        order (so a mismatched resume is refused). Never the prefetch position."""
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the committed offset; older iterators become stale."""
        if set(state) != {"sampler"}:
            raise ValueError(
                f"stream state must have exactly the key 'sampler' (from MicroBatchStream.state_dict()),"
                f" got keys {sorted(state)}"
            )
        self.sampler.load_state_dict(state["sampler"])
        self._invalidate_iterators()

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        """This rank's micro-batches per epoch (``epochs=True`` only: an endless stream has no length, which
        ``len()`` callers such as Lightning's ``has_len`` read from the ``TypeError``)."""
        if not self.epochs:
            raise TypeError("an endless MicroBatchStream (epochs=False) has no length")
        return self.sampler.steps_per_epoch * self.plan.grad_accumulation

    def __iter__(self) -> Iterator[MicroBatch]:
        if get_worker_info() is not None:
            raise RuntimeError(
                "MicroBatchStream must be read in the training process: use DataLoader(stream, batch_size=None,"
                " num_workers=0), and give the stream its workers (MicroBatchStream(..., workers=WorkerSettings("
                "num_workers=...))). A worker process holds a copy of the stream that never sees commit_step."
            )
        dp_degree, dp_rank = self._require_topology()
        self._invalidate_iterators()  # one live iterator per stream: two would read the same steps
        self._produced_end = self.sampler.offset
        return self._produce(self._generation, self.sampler.offset, dp_degree, dp_rank, self.micro_batch_size)

    def _produce(
        self, generation: int, offset: int, dp_degree: int, dp_rank: int, micro_batch_size: int
    ) -> Iterator[MicroBatch]:
        last_micro_step = BatchPlan(self.sampler.global_batch_size, micro_batch_size, dp_degree).grad_accumulation - 1
        planned = self._plan(offset, dp_degree, dp_rank, micro_batch_size)
        in_reader: deque[ProducedBatch] = deque()  # handed to the reader, not yet out of it (prefetched)

        def index_lists() -> Iterator[list[int]]:
            for record in planned:
                in_reader.append(record)
                yield list(record.sample_ids)

        self._check_live(generation)
        hold = _ReaderHold(self._reader.read(index_lists(), seed=mix_seed(self.sampler.seed, offset,
                                                                           self.workers.generator_seed)))
        self._live = weakref.ref(hold)
        while True:
            self._check_live(generation)  # before the reader: a persistent one may serve a newer iterator now
            assert hold.batches is not None
            try:
                batch = next(hold.batches)
            except StopIteration:
                hold.batches = None
                return
            record = in_reader.popleft()  # the reader returns batches in the order it took their index lists
            self._produced.append(record)
            if record.micro_step == last_micro_step:
                self._produced_end = record.step_offset + self.sampler.global_batch_size
            yield batch if self.collate_fn is not None else self._with_columns(batch, record)

    def _plan(self, offset: int, dp_degree: int, dp_rank: int, micro_batch_size: int) -> Iterator[ProducedBatch]:
        """This rank's micro-batches from the step at ``offset`` to the end of its epoch (``epochs=True``) or
        forever; a global batch never spans two epochs."""
        global_batch_size = self.sampler.global_batch_size
        end = (self.sampler.epoch_of(offset) + 1) * self.sampler.samples_per_epoch if self.epochs else None
        while end is None or offset < end:
            micro_batches = self.sampler.indices_for_step(offset, dp_degree, dp_rank, micro_batch_size)
            for micro_step, ids in enumerate(micro_batches):
                yield ProducedBatch(offset, micro_step, tuple(ids))
            offset += global_batch_size

    def take_produced(self) -> ProducedBatch | None:
        """Which samples form the oldest micro-batch produced and not taken yet (None: none).

        Loaders hand micro-batches to the training step in the order this stream produced them (a prefetch only
        runs ahead), so taking one record per micro-batch that reaches ``training_step`` names its samples whatever
        the batch looks like (a user's ``collate_fn`` keeps no ids). Records of an iterator that became stale are
        dropped with it."""
        return self._produced.popleft() if self._produced else None

    @staticmethod
    def _with_columns(batch: dict[str, torch.Tensor], record: ProducedBatch) -> MicroBatch:
        """The default item: the stacked samples plus the columns that name them (see the module docstring)."""
        m = len(record.sample_ids)
        return {
            **batch,
            "sample_ids": torch.tensor(record.sample_ids, dtype=torch.long),
            "step_offset": torch.full((m,), record.step_offset, dtype=torch.long),
            "micro_step": torch.full((m,), record.micro_step, dtype=torch.long),
        }

    def _check_live(self, generation: int) -> None:
        if generation != self._generation:
            raise StaleIteratorError(
                "this MicroBatchStream iterator is stale: the stream's topology or position changed"
                " (set_topology / load_state_dict / seek / a newer iter()) after it was created. Call"
                " iter(stream) (or rebuild the DataLoader iterator) to restart at the committed offset"
                f" {self.sampler.offset}"
            )

    def _invalidate_iterators(self) -> None:
        self._generation += 1
        self._produced_end = None
        self._produced.clear()
        hold = self._live() if self._live is not None else None
        if hold is not None:
            hold.batches = None  # its workers stop (persistent ones wait for the next iterator to reset them)
        self._live = None

    def _require_topology(self) -> tuple[int, int]:
        if self._topology is None:
            raise RuntimeError(
                "MicroBatchStream has no data-parallel position: call set_topology(dp_degree, dp_rank) first"
                " (dp_degree=1, dp_rank=0 on a single device)"
            )
        return self._topology


class _ReaderHold:
    """A stream iterator's reader iterator, held by that iterator alone (the stream keeps a weak reference)."""

    __slots__ = ("__weakref__", "batches")

    def __init__(self, batches: Iterator[Any]) -> None:
        self.batches: Iterator[Any] | None = batches


def _stack_samples(samples: list[Any]) -> dict[str, torch.Tensor]:
    """The default collation (run where the reader reads: a worker, or this process)."""
    inputs, targets = zip(*(_split_sample(sample) for sample in samples), strict=True)
    return {"inputs": torch.stack(inputs), "targets": torch.stack(targets)}


def _split_sample(sample: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept ``{"inputs", "targets"}`` dicts and ``(inputs, targets)`` pairs."""
    if isinstance(sample, Mapping):
        return sample["inputs"], sample["targets"]
    inputs, targets = sample
    return inputs, targets
