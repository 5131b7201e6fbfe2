"""A user's ``DataLoader`` made elastic: its dataset and collation, read through the global-offset sampler.

Lightning injects a ``DistributedSampler`` into a training ``DataLoader``; a sampler that knows only "rank r of n"
reads wrong samples once the data-parallel degree changes mid-epoch (tensor-parallel peers would read different
samples, and the next step would replay earlier ones). So the strategy replaces the sampler, as Lightning does, but
with the :class:`~lightning_emig.data.sampler.GlobalOffsetSampler`: the same dataset, the same ``collate_fn``, the
same shuffle choice, read from one global sample offset that every checkpoint and every live change carries.

What can be adopted, decided from the loader alone and refused at start with a message otherwise (never trained on
wrong data):

* a map-style dataset (``__getitem__`` and ``__len__``); an ``IterableDataset`` has no index to re-position;
* the default batching (``batch_size=micro_batch_size``, no custom ``batch_sampler``);
* Lightning's epochs: the loader has ``len()`` (this rank's micro-batches per epoch) and each iterator ends with its
  epoch. An optimizer step always takes a whole global batch, so a dataset whose size is not a multiple of it loses
  the tail of each epoch's order: that is refused unless the loader says ``drop_last=True``;
* a ``SequentialSampler`` (``shuffle=False``), a ``RandomSampler`` without replacement (``shuffle=True``), or the
  plain ``DistributedSampler`` Lightning injected for either (its ``shuffle`` is kept); any other sampler decides
  the order itself, so it cannot be re-positioned. Under Lightning's ``DistributedSampler`` the order is its own
  (its seed, torch's permutation of each epoch): every optimizer step takes the samples it takes under Lightning's
  ``ModelParallelStrategy``, whatever the world. Otherwise a shuffled order is seeded by the strategy's ``seed``.

How the samples are read is the loader's own: ``num_workers``, ``prefetch_factor``, ``pin_memory``,
``persistent_workers``, ``worker_init_fn``, ``multiprocessing_context`` and ``timeout`` are kept
(:class:`~lightning_emig.data.workers.WorkerSettings`). Worker processes read and collate this rank's micro-batches, in
order, ahead of training; the position stays in the training process and moves only when an optimizer step commits
it (never for a batch the workers or Lightning read ahead), so a change or a restart continues at the exact global
offset. The workers' seeds come from the data order's seed, the offset an iterator starts at and the initial seed of
the loader's ``generator`` (which orders nothing here). Lightning's ``seed_everything(workers=True)`` reaches them: a
loader without a ``worker_init_fn`` gets Lightning's ``pl_worker_init_function``, as under ``ModelParallelStrategy``,
with the process's global rank when the workers start (Lightning itself adds it only to the adopted loader, which has
no workers). ``in_order=False`` is refused: batches out of order would break the position.
"""

from __future__ import annotations

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from lightning_emig.data.loader import MicroBatchLoader
from lightning_emig.data.sampler import GlobalOffsetSampler
from lightning_emig.data.stream import MicroBatchStream
from lightning_emig.data.workers import WorkerSettings

USE_INSTEAD = (
    "use a map-style Dataset in a DataLoader(dataset, batch_size=micro_batch_size, shuffle=True|False), or feed "
    "a lightning_emig.data.MicroBatchLoader"
)


class DataLoaderNotElasticError(ValueError):
    """A training ``DataLoader`` whose position cannot follow a change of world or layout."""


def adopt_dataloader(loader: DataLoader, *, global_batch_size: int, micro_batch_size: int, seed: int
                     ) -> MicroBatchLoader:
    """The elastic loader over ``loader``'s dataset and collation (see the module docstring)."""
    shuffle = _shuffles(loader)
    if loader.batch_size != micro_batch_size:
        raise DataLoaderNotElasticError(
            f"the training DataLoader has batch_size={loader.batch_size} but the strategy's micro_batch_size is "
            f"{micro_batch_size}: a DataLoader batch is one micro-batch; build both from the same value"
        )
    tail = len(loader.dataset) % global_batch_size  # type: ignore[arg-type]
    if tail and not loader.drop_last:
        raise DataLoaderNotElasticError(
            f"the training dataset's {len(loader.dataset)} samples do not fill whole global batches of "  # type: ignore[arg-type]
            f"{global_batch_size}: an optimizer step never takes part of one, so the last {tail} samples of each "
            "epoch's order would not be trained on; pass DataLoader(..., drop_last=True) to agree to that, or use a "
            "dataset whose size is a multiple of the global batch"
        )
    if not loader.in_order:
        raise DataLoaderNotElasticError(
            "the training DataLoader has in_order=False: its workers would hand over micro-batches out of order, and "
            "the data position counts them in order; leave in_order at its default (True)"
        )
    # Under Lightning's DistributedSampler: its seed and torch's order, as Lightning reads it. Otherwise the strategy's
    # seed, the same on every rank.
    lightnings = isinstance(loader.sampler, DistributedSampler)
    sampler = GlobalOffsetSampler(len(loader.dataset), global_batch_size,  # type: ignore[arg-type]
                                  seed=loader.sampler.seed if lightnings else seed,  # type: ignore[attr-defined]
                                  shuffle=shuffle, torch_order=lightnings)
    return MicroBatchLoader(MicroBatchStream(loader.dataset, sampler, micro_batch_size, collate_fn=loader.collate_fn,
                                            epochs=True, workers=WorkerSettings.of(loader)))


def _shuffles(loader: DataLoader) -> bool:
    """Whether ``loader`` reads its dataset shuffled; refuses a loader whose order we cannot reproduce."""
    if isinstance(loader.dataset, IterableDataset):
        raise DataLoaderNotElasticError(
            f"the training DataLoader reads an IterableDataset ({type(loader.dataset).__name__}): it cannot be "
            f"re-positioned when the world or layout changes; {USE_INSTEAD}"
        )
    if not hasattr(loader.dataset, "__len__"):
        raise DataLoaderNotElasticError(f"the training dataset has no __len__; {USE_INSTEAD}")
    if type(loader.batch_sampler) is not BatchSampler:
        raise DataLoaderNotElasticError(
            f"the training DataLoader uses a custom batch_sampler ({type(loader.batch_sampler).__name__}): it decides "
            f"the order itself and cannot be re-positioned; {USE_INSTEAD}"
        )
    sampler = loader.sampler
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:  # noqa: SLF001 - RandomSampler(num_samples=...)
            raise DataLoaderNotElasticError(
                f"RandomSampler(replacement=True or num_samples=...) draws a different set each epoch; {USE_INSTEAD}"
            )
        return True
    if type(sampler) is DistributedSampler:  # Lightning's injection, for a Sequential or Random one
        return bool(sampler.shuffle)
    raise DataLoaderNotElasticError(
        f"the training DataLoader uses a custom sampler ({type(sampler).__name__}): it decides the order itself and "
        f"cannot be re-positioned when the world or layout changes; {USE_INSTEAD}"
    )

