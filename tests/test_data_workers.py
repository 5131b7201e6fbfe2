"""A user's DataLoader with worker processes, adopted: the same micro-batches in the same order as without workers,
the user's worker settings kept, and workers seeded as Lightning seeds them."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, get_worker_info

from lightning_emig.data import (
    GlobalOffsetSampler,
    MicroBatchStream,
    StaleIteratorError,
)
from lightning_emig.data.adopt import DataLoaderNotElasticError, adopt_dataloader
from lightning_emig.data.loader import MicroBatchLoader
from lightning_emig.data.workers import MicroBatchReader, WorkerSettings

# ---------------------------------------------------------------------------------------------- worker processes
# A user's DataLoader(num_workers=...) is read through worker processes with its own settings; the position stays in
# the training process. Workers start with "fork" (Linux's default): the probe below is not pickled.

_WORKER_MARK = -1  # what _mark_worker sets, in a worker process


def _mark_worker(worker_id: int) -> None:
    global _WORKER_MARK
    _WORKER_MARK = 100 + worker_id


class _Probe(torch.utils.data.Dataset):
    """Sample ``i`` says which process read it: its worker id (-1: the training process), that process's pid and torch
    seed, the seed torch gave the worker, a draw from its ``random``, and the mark a ``worker_init_fn`` left there."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        info = get_worker_info()
        return {"x": torch.full((3,), i), "worker": -1 if info is None else info.id, "pid": os.getpid(),
                "seed": str(torch.initial_seed() if info is not None else -1), "mark": _WORKER_MARK,  # up to 2**64
                "worker_seed": -1 if info is None else info.seed, "draw": -1.0 if info is None else random.random()}


PROBE_SIZE, PROBE_BATCH, PROBE_MICRO, PROBE_SEED = 36, 8, 2, 3  # 4 steps per epoch, 4 samples dropped (drop_last)


def adopted(num_workers: int = 0, **settings: Any) -> MicroBatchLoader:
    user = DataLoader(_Probe(PROBE_SIZE), batch_size=PROBE_MICRO, shuffle=True, drop_last=True, num_workers=num_workers,
                      **settings)
    return adopt_dataloader(user, global_batch_size=PROBE_BATCH, micro_batch_size=PROBE_MICRO, seed=PROBE_SEED)


def probe_step(offset: int, dp: int, rank: int) -> list[list[int]]:
    return GlobalOffsetSampler(PROBE_SIZE, PROBE_BATCH, seed=PROBE_SEED).indices_for_step(offset, dp, rank, PROBE_MICRO)


def read(loader: MicroBatchLoader, iterator: Iterator[Any], n: int) -> list[list[int]]:
    """``n`` micro-batches' sample ids, checked against the record of what the stream produced."""
    out = []
    for _ in range(n):
        batch = next(iterator)
        produced = loader.stream.take_produced()
        assert produced is not None and batch["x"][:, 0].tolist() == list(produced.sample_ids)
        out.append(list(produced.sample_ids))
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_workers_read_the_same_micro_batches_in_the_same_order(num_workers: int) -> None:
    loader = adopted(num_workers)
    loader.stream.set_topology(dp_degree=2, dp_rank=1)
    batches = list(loader)  # one epoch: the tail that fills no global batch is dropped (drop_last=True)
    assert len(batches) == len(loader) == 4 * 2
    assert [b["x"][:, 0].tolist() for b in batches] == [ids for step in range(4) for ids in probe_step(8 * step, 2, 1)]
    readers = {w for b in batches for w in b["worker"].tolist()}
    assert readers == ({-1} if num_workers == 0 else {0, 1})


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)],
                         ids=["in_process", "workers", "persistent_workers"])
def test_a_restart_with_prefetching_in_flight_skips_and_repeats_nothing(num_workers: int, persistent: bool) -> None:
    """The strategy's sequence: commit per optimizer step, restart the iterator at a change (the same world, then
    dp 1 -> 2 with a new rank restored from the state, as after a checkpoint restart). Batches read beyond the committed
    step (Lightning's one ahead, the workers' prefetch) are read again, never counted."""
    settings: dict[str, Any] = {"persistent_workers": persistent, "prefetch_factor": 2} if num_workers else {}
    first = adopted(num_workers, **settings)
    stream = first.stream
    stream.set_topology(1, 0)
    trained: list[list[int]] = []
    old = iter(first)
    trained += read(first, old, 4)
    stream.commit_step()
    read(first, old, 2)  # of step 1, read ahead; the workers hold more
    pids = {int(p) for p in next(old)["pid"]}  # (one more)

    new = iter(first)  # the restart: from the committed offset, the reader fed anew
    with pytest.raises(StaleIteratorError):
        next(old)
    trained += read(first, new, 4)
    stream.commit_step()
    if num_workers and persistent:
        assert {int(p) for p in next(new)["pid"]} == pids  # the same workers, reset
    elif num_workers:
        assert len(multiprocessing.active_children()) == num_workers  # the stale iterator's workers stopped
    state = stream.state_dict()

    second = adopted(num_workers, **settings)  # a process that joins: a fresh loader at the committed offset
    second.load_state_dict(state)
    for rank, loader in enumerate((first, second)):
        loader.stream.set_topology(2, rank)
    iterators = [iter(first), iter(second)]
    for _ in range(2):
        for loader, iterator in zip((first, second), iterators, strict=True):
            trained += read(loader, iterator, 2)
            loader.stream.commit_step()
    assert first.stream.offset == second.stream.offset == 4 * PROBE_BATCH
    expected = [ids for step in range(2) for ids in probe_step(8 * step, 1, 0)]
    expected += [ids for step in range(2, 4) for rank in range(2) for ids in probe_step(8 * step, 2, rank)]
    assert trained == expected
    assert sorted(i for ids in trained for i in ids) == sorted(
        GlobalOffsetSampler(PROBE_SIZE, PROBE_BATCH, seed=PROBE_SEED).permutation(0)[:32].tolist()
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_worker_init_fn_runs_in_the_workers(num_workers: int) -> None:
    loader = adopted(num_workers, worker_init_fn=_mark_worker)
    loader.stream.set_topology(1, 0)
    marks = {m for batch in loader for m in batch["mark"].tolist()}
    assert marks == ({-1} if num_workers == 0 else {100, 101})  # in this process nothing called it


def test_pin_memory_is_kept() -> None:
    loader = adopted(2, pin_memory=True)
    loader.stream.set_topology(1, 0)
    assert loader.stream.workers.pin_memory
    if torch.accelerator.is_available():
        assert next(iter(loader))["x"].is_pinned()
    else:  # torch pins nothing without an accelerator, and says so: the setting reached it
        with pytest.warns(UserWarning, match="'pin_memory' argument is set as true but no accelerator"):
            next(iter(loader))


def test_the_loaders_worker_settings_are_kept() -> None:
    settings: dict[str, Any] = dict(num_workers=2, prefetch_factor=3, persistent_workers=True, pin_memory=True,
                                    worker_init_fn=_mark_worker, timeout=30.0,
                                    multiprocessing_context=multiprocessing.get_context("fork"))
    loader = adopted(generator=torch.Generator().manual_seed(11), **settings)
    assert loader.stream.workers == WorkerSettings(generator_seed=11, **settings)
    reader = MicroBatchReader(_Probe(4), lambda samples: samples, loader.stream.workers)
    for name, value in settings.items():
        assert getattr(reader.loader, name) == value
    assert reader.loader.in_order


def test_out_of_order_workers_are_refused() -> None:
    with pytest.raises(DataLoaderNotElasticError, match="in_order=False"):
        adopted(2, in_order=False)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_reading_leaves_the_training_rng_alone_and_seeds_workers_from_the_position(num_workers: int) -> None:
    """Reading draws nothing from the training process's global RNG (dropout and the like stay as without workers);
    the workers of an iterator restarted at the same offset get the same seeds, at another offset other ones."""
    stream = adopted(num_workers).stream
    stream.set_topology(1, 0)

    def worker_seeds() -> set[int]:
        rng = torch.get_rng_state()
        seeds = {s for batch in itertools.islice(iter(stream), 4) for s in batch["seed"]}
        assert torch.equal(torch.get_rng_state(), rng)
        return seeds

    at_start = worker_seeds()
    assert worker_seeds() == at_start
    if num_workers:
        assert len(at_start) == 2
        stream.commit_step()
        assert worker_seeds().isdisjoint(at_start)


# ---------------------------------------------------------------------------------------------- Lightning's seeding
# seed_everything(seed, workers=True) makes Lightning give a loader without a worker_init_fn its
# pl_worker_init_function, bound to the global rank. Lightning adds it to the loader the strategy returns (the adopted
# one, without workers); the reader gives it to its own workers, with the rank the process has when they start.


def seed_workers_as_seed_everything_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PL_SEED_WORKERS`` as Lightning's ``seed_everything(workers=True)`` sets it; the environment is restored after
    the test, the global RNGs it seeded at once."""
    from lightning.fabric.utilities.seed import seed_everything

    for name in ("PL_SEED_WORKERS", "PL_GLOBAL_SEED"):
        monkeypatch.delenv(name, raising=False)  # restored (or removed) after the test
    with _rngs_kept():
        seed_everything(0, workers=True)
    assert os.environ["PL_SEED_WORKERS"] == "1"


@contextlib.contextmanager
def _rngs_kept() -> Iterator[None]:
    """The global ``torch``, ``random`` and ``numpy`` RNGs, after the block, as they were before it."""
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


def lightnings_worker_seeding(worker_seed: int, worker_id: int, rank: int) -> tuple[int, float]:
    """What a worker that torch seeded with ``worker_seed`` holds after Lightning's ``worker_init_fn`` for ``rank``:
    its torch seed and its first ``random`` draw."""
    from lightning.fabric.utilities.seed import pl_worker_init_function

    with _rngs_kept():
        torch.manual_seed(worker_seed)  # as torch seeds a worker
        pl_worker_init_function(worker_id, rank=rank)
        return torch.initial_seed(), random.random()


def first_draws(stream: MicroBatchStream) -> dict[int, tuple[int, int, float]]:
    """Each worker's seed from torch, its torch seed after its ``worker_init_fn`` and its first ``random`` draw (from
    the first batch it read, one step)."""
    draws: dict[int, tuple[int, int, float]] = {}
    for batch in itertools.islice(iter(stream), 4):
        draws.setdefault(int(batch["worker"][0]), (int(batch["worker_seed"][0]), int(batch["seed"][0]),
                                                   float(batch["draw"][0])))
    return draws


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent_workers"])
def test_under_seed_everything_workers_are_seeded_as_lightning_seeds_them(monkeypatch: pytest.MonkeyPatch,
                                                                        persistent: bool) -> None:
    """The adopted loader's workers run Lightning's own ``pl_worker_init_function``, for the process's global rank when
    they start: after a change of world that made this process rank 1, its workers (persistent ones too) are new and
    seeded for rank 1. Without a process group the rank is Lightning's ``rank_zero_only.rank``."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    assert not dist.is_initialized()
    seed_workers_as_seed_everything_does(monkeypatch)
    stream = adopted(2, persistent_workers=persistent).stream  # the user's loader has no worker_init_fn
    stream.set_topology(1, 0)
    for rank in (3, 1):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        draws = first_draws(stream)
        assert sorted(draws) == [0, 1]
        for worker, (worker_seed, seed, draw) in draws.items():
            assert (seed, draw) == lightnings_worker_seeding(worker_seed, worker, rank), (rank, worker)
        assert len(multiprocessing.active_children()) == (2 if persistent else 0)  # those of another rank stopped


def test_under_seed_everything_a_users_worker_init_fn_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """As Lightning does: only a loader without one gets Lightning's."""
    seed_workers_as_seed_everything_does(monkeypatch)
    stream = adopted(2, worker_init_fn=_mark_worker).stream
    stream.set_topology(1, 0)
    batch = next(iter(stream))
    assert batch["mark"].tolist() == [100, 100] and batch["seed"] == [str(s) for s in batch["worker_seed"].tolist()]
