"""How a stream's micro-batches are read: torch's ``DataLoader``, with the worker settings of the user's loader.

The :class:`~lightning_emig.data.stream.MicroBatchStream` decides *which* samples form each micro-batch and in which
order (its rank's index lists from the committed offset); a :class:`MicroBatchReader` only reads and collates them,
in the training process (``num_workers=0``) or in worker processes. Invariants:

* in order: the reader's ``DataLoader`` takes the index lists as its ``batch_sampler`` and runs with
  ``in_order=True``, so its i-th batch is the i-th index list it was fed, whatever the workers and their prefetching;
  the stream, not the workers, keeps the position (a prefetched batch is never counted);
* one ``DataLoader`` for the stream's life, fed anew at each :meth:`MicroBatchReader.read`: with
  ``persistent_workers`` torch resets the same workers (dropping what they had prefetched) instead of starting new
  ones; otherwise an iterator's workers stop when it is exhausted or dropped;
* seeds: workers are seeded (``random``, ``torch``, ``numpy``, as torch seeds them) from a base seed drawn from the
  reader's own generator, which the stream seeds from the data order's seed and the offset the iterator starts at.
  Reading never draws on the training process's global RNG, and the workers of an iterator restarted at the same
  offset (after a change or a restart) get the same seeds; the seeds do not depend on the rank, so tensor-parallel
  peers, which read the same micro-batches, augment them alike.

Why torch's ``DataLoader`` and not torchdata's ``StatefulDataLoader``: the latter's state is the number of batches an
iterator yielded (prefetched ones included) plus the state of stateful samplers and iterable datasets in the workers.
Here the position is the committed global offset, from which the index lists are a pure function for any data-parallel
degree; the dataset is map-style and its items depend on the index only. A ``StatefulDataLoader`` state would have to
be discarded at every change and replaced at every restart, so it would add a dependency and nothing to restore.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset


@dataclass(kw_only=True, frozen=True, slots=True)
class WorkerSettings:
    """A ``DataLoader``'s arguments for how batches are read (not which): kept from the user's loader."""

    num_workers: int = 0
    """Worker processes; 0 reads in the training process."""
    prefetch_factor: int | None = None
    """Batches each worker reads ahead (torch's default 2 when ``num_workers > 0``; ``None`` without workers)."""
    pin_memory: bool = False
    """Collated batches are copied into pinned memory (a no-op, with torch's warning, without an accelerator)."""
    pin_memory_device: str = ""
    """Deprecated by torch (the current accelerator is used); passed on so that torch says so."""
    persistent_workers: bool = False
    """Workers outlive an iterator: a new one (the next epoch, a change, a restart) reuses them."""
    worker_init_fn: Callable[[int], None] | None = None
    """Called in each worker with its id, after torch seeded it."""
    multiprocessing_context: Any = None
    """How workers are started (``"fork"``, ``"spawn"``, a context object, or ``None``: the platform's default)."""
    timeout: float = 0
    """Seconds to wait for a batch from the workers (0: forever)."""
    generator_seed: int = 0
    """The initial seed of the user's loader's ``generator``, mixed into the workers' seeds (0 without one)."""

    @classmethod
    def of(cls, loader: DataLoader) -> WorkerSettings:
        """The settings of ``loader``."""
        generator = loader.generator
        return cls(**{name: getattr(loader, name) for name in _LOADER_ARGUMENTS},
                   generator_seed=0 if generator is None else generator.initial_seed())

    def loader_arguments(self) -> dict[str, Any]:
        """The ``DataLoader`` arguments these settings keep, by their ``DataLoader`` names."""
        return {name: getattr(self, name) for name in _LOADER_ARGUMENTS}


_LOADER_ARGUMENTS = ("num_workers", "prefetch_factor", "pin_memory", "pin_memory_device", "persistent_workers",
                     "worker_init_fn", "multiprocessing_context", "timeout")
"""The fields of :class:`WorkerSettings` that are ``DataLoader`` arguments (and attributes) of the same name."""


class _Feed:
    """The reader's ``batch_sampler``: the index lists it was last fed (iterated by torch in this process)."""

    def __init__(self) -> None:
        self.index_lists: Iterable[list[int]] = ()

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.index_lists)


class MicroBatchReader:
    """Index lists in, collated batches out, in order, read as ``settings`` say (see the module docstring)."""

    def __init__(self, dataset: Dataset[Any], collate_fn: Callable[[list[Any]], Any], settings: WorkerSettings) -> None:
        self.settings = settings
        self._feed = _Feed()
        self._generator = torch.Generator()
        self.loader = DataLoader(
            dataset,
            batch_sampler=self._feed,
            collate_fn=collate_fn,
            **settings.loader_arguments(),
            generator=self._generator,
            in_order=True,
        )

    def read(self, index_lists: Iterable[list[int]], seed: int) -> Iterator[Any]:
        """A new iterator of ``collate_fn([dataset[i] for i in ids])`` for each ``ids`` of ``index_lists``, in order.

        The previous iterator must not be used again: with persistent workers it is this same object, reset.
        ``index_lists`` is iterated lazily, in this process, as far ahead as the workers prefetch.
        """
        self._feed.index_lists = index_lists
        self._generator.manual_seed(seed)
        return iter(self.loader)
