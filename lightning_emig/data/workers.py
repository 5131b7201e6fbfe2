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
  offset (after a change or a restart) get the same seeds; unless Lightning's worker seeding (below) reseeds them, the
  seeds do not depend on the rank, so tensor-parallel peers, which read the same micro-batches, augment them alike;
* Lightning's worker seeding: after ``seed_everything(seed, workers=True)`` (which sets ``PL_SEED_WORKERS=1``)
  Lightning gives a ``DataLoader`` without a ``worker_init_fn`` its ``pl_worker_init_function``, bound to the global
  rank; each worker then reseeds ``torch``, ``random`` and ``numpy`` from (its torch seed less its id, its id, that
  rank). Lightning adds it to the loader the strategy hands back, the adopted one, which has no workers; so the reader
  does it for its own: with no ``worker_init_fn`` and ``PL_SEED_WORKERS`` set, its workers run Lightning's function
  with the process's global rank *when they start* (persistent workers started for another rank, before a change of
  world, are replaced). As under Lightning, the rank then enters the seeds: tensor-parallel peers' workers draw
  differently.

Why torch's ``DataLoader`` and not torchdata's ``StatefulDataLoader``: the latter's state is the number of batches an
iterator yielded (prefetched ones included) plus the state of stateful samplers and iterable datasets in the workers.
Here the position is the committed global offset, from which the index lists are a pure function for any data-parallel
degree; the dataset is map-style and its items depend on the index only. A ``StatefulDataLoader`` state would have to
be discarded at every change and replaced at every restart, so it would add a dependency and nothing to restore.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
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
    """Called in each worker with its id, after torch seeded it (``None``: Lightning's, under ``seed_everything(...,
    workers=True)``; see the module docstring)."""
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
        self._dataset = dataset
        self._collate_fn = collate_fn
        self._feed = _Feed()
        self._generator = torch.Generator()
        self._seeded_for: int | None = None
        """The global rank Lightning's seeding of :attr:`loader`'s workers uses (``None``: not Lightning's)."""
        self.loader = self._new_loader(settings.worker_init_fn)

    def read(self, index_lists: Iterable[list[int]], seed: int) -> Iterator[Any]:
        """A new iterator of ``collate_fn([dataset[i] for i in ids])`` for each ``ids`` of ``index_lists``, in order.

        The previous iterator must not be used again: with persistent workers it is this same object, reset.
        ``index_lists`` is iterated lazily, in this process, as far ahead as the workers prefetch.
        """
        self._follow_lightnings_worker_seeding()
        self._feed.index_lists = index_lists
        self._generator.manual_seed(seed)
        return iter(self.loader)

    def _follow_lightnings_worker_seeding(self) -> None:
        """Seed the workers about to start as Lightning would, for the rank this process has now; a loader whose
        (persistent) workers were seeded for another rank is replaced, and they stop with it."""
        rank = lightning_seeding_rank(self.settings)
        if rank == self._seeded_for:
            return
        self._seeded_for = rank
        self.loader = self._new_loader(self.settings.worker_init_fn if rank is None else _lightnings_seeding(rank))

    def _new_loader(self, worker_init_fn: Callable[[int], None] | None) -> DataLoader:
        return DataLoader(
            self._dataset,
            batch_sampler=self._feed,
            collate_fn=self._collate_fn,
            **(self.settings.loader_arguments() | {"worker_init_fn": worker_init_fn}),
            generator=self._generator,
            in_order=True,
        )


def lightning_seeding_rank(settings: WorkerSettings) -> int | None:
    """The global rank Lightning would seed these workers with now, or ``None`` where it would not seed them (or
    there are none).

    Lightning adds its ``pl_worker_init_function`` to a loader that has no ``worker_init_fn`` when ``PL_SEED_WORKERS``
    is set (by ``seed_everything(workers=True)``), bound to ``trainer.global_rank``: the default group's rank, which
    after a change of world is the new one. Without a group, the rank Lightning's ``rank_zero_only`` holds."""
    seeds = int(os.environ.get("PL_SEED_WORKERS", 0))  # read as Lightning reads it
    if not seeds or settings.num_workers == 0 or settings.worker_init_fn is not None:
        return None
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    # Lightning is imported already where PL_SEED_WORKERS is set; the data package does not import it otherwise.
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return int(rank_zero_only.rank)  # type: ignore[attr-defined]


def _lightnings_seeding(rank: int) -> Callable[[int], None]:
    """Lightning's ``worker_init_fn`` for ``rank``, bound as Lightning binds it (it pickles, for spawned workers)."""
    from lightning.fabric.utilities.seed import pl_worker_init_function

    return partial(pl_worker_init_function, rank=rank)
