"""Corpus, datasets and the micro-batch stream: shapes, determinism, and the committed-offset contract."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import random
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, get_worker_info

from lightning_emig.data import (
    ByteCorpusDataset,
    CorpusError,
    GlobalOffsetSampler,
    MicroBatchStream,
    StaleIteratorError,
    SyntheticDataset,
    default_cache_dir,
    ensure_stdlib_corpus,
    load_byte_corpus,
)
from lightning_emig.data import stream as stream_module
from lightning_emig.data.adopt import DataLoaderNotElasticError, adopt_dataloader
from lightning_emig.data.corpus import SEPARATOR, SKIPPED_DIRS, stdlib_source_files
from lightning_emig.data.loader import MicroBatchLoader
from lightning_emig.data.workers import MicroBatchReader, WorkerSettings

SMALL = 4096

# ---------------------------------------------------------------------------------------------- corpus


def test_corpus_is_the_sorted_stdlib_sources(tmp_path: Path) -> None:
    files = stdlib_source_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = [f.relative_to(root).as_posix() for f in files]
    assert relative == sorted(relative)
    assert not any(part in SKIPPED_DIRS for name in relative for part in name.split("/")[:-1])
    path = ensure_stdlib_corpus(tmp_path, max_bytes=SMALL)
    expected = SEPARATOR.join(f.read_bytes() for f in files[:50])[:SMALL]
    assert len(expected) == SMALL  # 50 stdlib files are more than 4 KiB
    assert path.read_bytes() == expected


def test_corpus_is_deterministic_and_cached(tmp_path: Path) -> None:
    first = ensure_stdlib_corpus(tmp_path / "a", max_bytes=SMALL)
    other = ensure_stdlib_corpus(tmp_path / "b", max_bytes=SMALL)
    assert first.name == other.name and first.read_bytes() == other.read_bytes()
    before = first.stat()
    again = ensure_stdlib_corpus(tmp_path / "a", max_bytes=SMALL)
    assert (
        again == first
        and again.stat().st_ino == before.st_ino
        and again.stat().st_mtime_ns == before.st_mtime_ns
    )
    # Another cap is another file, never a truncated or extended reuse.
    assert ensure_stdlib_corpus(tmp_path / "a", max_bytes=SMALL + 1).name != first.name


def test_corpus_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_EMIG_CACHE", str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env"
    assert ensure_stdlib_corpus(max_bytes=SMALL).parent == tmp_path / "env"
    monkeypatch.delenv("LIGHTNING_EMIG_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "lightning_emig"


def test_concurrent_builders_publish_one_complete_file(tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_stdlib_corpus(tmp_path, max_bytes=SMALL)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 4 and len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no temporary file left behind
    assert results[0].stat().st_size == SMALL


def test_load_byte_corpus_maps_the_file(tmp_path: Path) -> None:
    path = ensure_stdlib_corpus(tmp_path, max_bytes=SMALL)
    data = load_byte_corpus(path)
    assert data.dtype == torch.uint8 and data.shape == (SMALL,)
    assert bytes(data[:100].tolist()) == path.read_bytes()[:100]
    original = path.read_bytes()[0]
    data[0] = (original + 1) % 256  # the mapping is private (copy-on-write): the file must not change
    assert path.read_bytes()[0] == original


def test_corpus_rejects_bad_cap(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="max_bytes must be an int >= 2"):
        ensure_stdlib_corpus(tmp_path, max_bytes=1)


# ---------------------------------------------------------------------------------------------- datasets


@pytest.fixture
def byte_file(tmp_path: Path) -> Path:
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(i % 256 for i in range(1000)))
    return path


def test_byte_dataset_windows_and_shift(byte_file: Path) -> None:
    dataset = ByteCorpusDataset(byte_file, seq_len=16)
    assert len(dataset) == (1000 - 1) // 16
    sample = dataset[3]
    assert sample["inputs"].dtype == torch.long and sample["inputs"].shape == (16,)
    assert sample["inputs"].tolist() == list(range(48, 64))
    assert sample["targets"].tolist() == list(range(49, 65))
    last = dataset[len(dataset) - 1]
    assert int(last["targets"][-1]) == (len(dataset) * 16) % 256  # the final window stays inside the file
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_byte_dataset_pickles_without_the_mapping(byte_file: Path) -> None:
    dataset = ByteCorpusDataset(byte_file, seq_len=16)
    dataset[0]  # maps the file
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone._data is None
    assert torch.equal(clone[5]["inputs"], dataset[5]["inputs"])


def test_byte_dataset_rejects_a_too_small_corpus(tmp_path: Path) -> None:
    path = tmp_path / "tiny.bin"
    path.write_bytes(b"abcd")
    with pytest.raises(ValueError, match="fewer than one sample of seq_len 4"):
        ByteCorpusDataset(path, seq_len=4)


def test_byte_dataset_on_the_stdlib_corpus(tmp_path: Path) -> None:
    dataset = ByteCorpusDataset(ensure_stdlib_corpus(tmp_path, max_bytes=SMALL), seq_len=64)
    assert len(dataset) == (SMALL - 1) // 64
    assert bytes(dataset[0]["inputs"].tolist()) == (tmp_path / dataset.path.name).read_bytes()[:64]


def test_synthetic_dataset_is_deterministic_per_index() -> None:
    a, b = SyntheticDataset(100, 12, seed=7), SyntheticDataset(100, 12, seed=7)
    for i in (0, 5, 99):
        assert torch.equal(a[i]["inputs"], b[i]["inputs"])
    assert torch.equal(a[5]["inputs"], a[5]["inputs"])
    assert not all(
        torch.equal(a[i]["inputs"], SyntheticDataset(100, 12, seed=8)[i]["inputs"]) for i in range(5)
    )
    assert len({tuple(a[i]["inputs"].tolist()) for i in range(100)}) > 90


def test_synthetic_dataset_is_learnable_and_shifted() -> None:
    dataset = SyntheticDataset(50, 10, vocab_size=32)
    for i in range(50):
        inputs, targets = dataset[i]["inputs"], dataset[i]["targets"]
        assert inputs.shape == targets.shape == (10,) and inputs.dtype == torch.long
        assert torch.equal(inputs[1:], targets[:-1])
        assert int(inputs.min()) >= 0 and int(targets.max()) < 32
        stride = (targets - inputs) % 32
        assert len(set(stride.tolist())) == 1 and 1 <= int(stride[0]) <= SyntheticDataset.max_stride


# ---------------------------------------------------------------------------------------------- stream


def make_stream(
    num_samples: int = 40, global_batch: int = 8, micro: int = 2, dp: int = 2, rank: int = 0
) -> MicroBatchStream:
    sampler = GlobalOffsetSampler(num_samples, global_batch, seed=5)
    return MicroBatchStream(SyntheticDataset(num_samples, 6), sampler, micro, dp_degree=dp, dp_rank=rank)


def ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["sample_ids"].tolist()


def take(iterator: Iterator[dict[str, torch.Tensor]], n: int) -> list[dict[str, torch.Tensor]]:
    return [next(iterator) for _ in range(n)]


def test_stream_yields_this_ranks_micro_batches() -> None:
    stream = make_stream(dp=2, rank=1)
    batches = take(iter(stream), 4)
    sampler = GlobalOffsetSampler(40, 8, seed=5)
    expected = sampler.indices_for_step(0, 2, 1, 2) + sampler.indices_for_step(8, 2, 1, 2)
    assert [ids(b) for b in batches] == expected
    first = batches[0]
    assert set(first) == {"inputs", "targets", "sample_ids", "step_offset", "micro_step"}
    assert first["inputs"].shape == first["targets"].shape == (2, 6)
    assert torch.equal(first["inputs"][1], SyntheticDataset(40, 6)[expected[0][1]]["inputs"])
    assert [b["step_offset"].tolist() for b in batches] == [[0, 0], [0, 0], [8, 8], [8, 8]]
    assert [b["micro_step"].tolist() for b in batches] == [[0, 0], [1, 1], [0, 0], [1, 1]]


def test_stream_runs_across_epochs() -> None:
    stream = make_stream(num_samples=20, global_batch=8, micro=4, dp=1)  # 2 steps/epoch, 4 samples dropped
    batches = take(iter(stream), 12)
    sampler = GlobalOffsetSampler(20, 8, seed=5)
    for epoch in range(3):
        seen = [i for b in batches[4 * epoch : 4 * epoch + 4] for i in ids(b)]
        assert seen == sampler.permutation(epoch)[:16].tolist()


def test_producing_does_not_commit() -> None:
    stream = make_stream()
    iterator = iter(stream)
    take(iterator, 3)  # a whole step plus one prefetched micro-batch
    assert stream.offset == 0 and stream.state_dict()["sampler"]["offset"] == 0
    assert stream.commit_step() == 8
    assert stream.state_dict() == {"sampler": stream.sampler.state_dict()}
    assert stream.state_dict()["sampler"]["offset"] == 8


def test_commit_refuses_a_step_not_fully_produced() -> None:
    stream = make_stream()
    iterator = iter(stream)
    next(iterator)  # first of the two micro-batches of step 0
    with pytest.raises(RuntimeError, match="commit once per optimizer step"):
        stream.commit_step()
    next(iterator)
    stream.commit_step()
    # Without a live iterator (e.g. a rank that reads no data) committing is allowed.
    idle = make_stream()
    assert idle.commit_step() == 8


def test_new_iterator_after_load_state_dict_resumes_at_committed_offset() -> None:
    stream = make_stream(dp=2, rank=1)
    iterator = iter(stream)
    for _ in range(3):  # three optimizer steps, with one micro-batch prefetched beyond each
        take(iterator, 2)
        stream.commit_step()
    prefetched_not_committed = next(iterator)
    state = stream.state_dict()

    resumed = make_stream(dp=2, rank=1)
    resumed.load_state_dict(state)
    assert resumed.offset == 24
    assert ids(next(iter(resumed))) == ids(prefetched_not_committed)  # the prefetched batch is read again


def test_set_topology_restarts_at_committed_offset_and_stales_old_iterators() -> None:
    stream = make_stream(dp=2, rank=0)
    old = iter(stream)
    take(old, 2)
    stream.commit_step()
    take(old, 1)  # prefetched under the old layout
    stream.set_topology(4, 3, micro_batch_size=1)
    with pytest.raises(StaleIteratorError, match="call\\s+iter\\(stream\\)|iter\\(stream\\)"):
        next(old)
    new = take(iter(stream), 2)
    expected = GlobalOffsetSampler(40, 8, seed=5).indices_for_step(8, 4, 3, 1)
    assert [ids(b) for b in new] == expected
    assert stream.plan.describe() == "global batch 8 = micro 1 x accum 2 x dp 4"


def test_unchanged_topology_keeps_iterators_live() -> None:
    stream = make_stream(dp=2, rank=0)
    iterator = iter(stream)
    next(iterator)
    stream.set_topology(2, 0)
    next(iterator)


def test_only_the_newest_iterator_is_live() -> None:
    stream = make_stream()
    first = iter(stream)
    next(first)
    second = iter(stream)
    assert ids(next(second)) == GlobalOffsetSampler(40, 8, seed=5).indices_for_step(0, 2, 0, 2)[0]
    with pytest.raises(StaleIteratorError):
        next(first)


def test_stream_through_a_dataloader() -> None:
    stream = make_stream(dp=2, rank=1)
    loader = DataLoader(stream, batch_size=None, num_workers=0)
    from_loader = take(iter(loader), 4)
    assert [ids(b) for b in from_loader] == [ids(b) for b in take(iter(make_stream(dp=2, rank=1)), 4)]


def test_stream_refuses_worker_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_module, "get_worker_info", lambda: object())
    with pytest.raises(RuntimeError, match="num_workers=0"):
        iter(make_stream())


def test_stream_configuration_errors() -> None:
    sampler = GlobalOffsetSampler(40, 8)
    with pytest.raises(
        ValueError, match="dataset has 30 samples but the sampler was built for num_samples=40"
    ):
        MicroBatchStream(SyntheticDataset(30, 4), sampler, 2)
    with pytest.raises(ValueError, match="choose a micro_batch_size that divides 8"):
        MicroBatchStream(SyntheticDataset(40, 4), sampler, 3)
    unplaced = MicroBatchStream(SyntheticDataset(40, 4), sampler, 2)
    with pytest.raises(RuntimeError, match="call set_topology"):
        iter(unplaced)
    with pytest.raises(ValueError, match="with micro batch 2 choose dp_degree in"):
        unplaced.set_topology(3, 0)
    with pytest.raises(ValueError, match=r"dp_rank must be an int in \[0, 2\)"):
        unplaced.set_topology(2, 2)
    with pytest.raises(ValueError, match="exactly the key 'sampler'"):
        unplaced.load_state_dict(sampler.state_dict())  # a sampler's state is not a stream's
    with pytest.raises(ValueError, match=r"missing keys \['seed', 'num_samples', 'global_batch_size'\]"):
        unplaced.load_state_dict({"sampler": {"offset": 8}})


def test_stream_accepts_tuple_samples() -> None:
    class Pairs(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.full((3,), i), torch.full((3,), i + 1)

    stream = MicroBatchStream(Pairs(), GlobalOffsetSampler(16, 4), 2, dp_degree=1, dp_rank=0)
    batch = next(iter(stream))
    assert torch.equal(batch["inputs"][:, 0], batch["sample_ids"])
    assert torch.equal(batch["targets"][:, 0], batch["sample_ids"] + 1)


def test_elastic_run_ledger_sees_every_sample_once_per_epoch() -> None:
    """Ranks read through prefetching iterators; dp changes 2 -> 3 -> 1 -> 6 -> 2 at step boundaries, the new
    ranks restoring the stream state of an old one (the data part of a migration). The ledger of sample ids
    that reached a training step must hold every consumed sample of each epoch exactly once."""
    num_samples, global_batch, micro = 50, 12, 2  # 4 steps per epoch, 2 samples dropped per epoch
    schedule = {0: 2, 3: 3, 5: 1, 6: 6, 9: 2}  # step -> new dp degree
    sampler = GlobalOffsetSampler(num_samples, global_batch, seed=9)
    dataset = SyntheticDataset(num_samples, 4)
    ledger: dict[int, list[int]] = {}
    streams: list[MicroBatchStream] = []
    iterators: list[Iterator[dict[str, torch.Tensor]]] = []
    pending: list[dict[str, torch.Tensor] | None] = []  # one prefetched micro-batch per rank, like Lightning
    state = {"sampler": sampler.state_dict()}
    for step in range(12):
        if step in schedule:
            dp = schedule[step]
            streams = [
                MicroBatchStream(dataset, GlobalOffsetSampler(num_samples, global_batch, seed=9), micro)
                for _ in range(dp)
            ]
            iterators = []
            for rank, stream in enumerate(streams):
                stream.load_state_dict(state)
                stream.set_topology(dp, rank)
                iterators.append(iter(stream))
            pending = [next(it) for it in iterators]
        for rank, stream in enumerate(streams):
            for _ in range(stream.plan.grad_accumulation):
                batch, pending[rank] = pending[rank], next(iterators[rank])
                assert batch is not None and int(batch["step_offset"][0]) == stream.offset
                ledger.setdefault(sampler.epoch_of(stream.offset), []).extend(ids(batch))
            stream.commit_step()
        state = streams[0].state_dict()
        assert all(s.state_dict() == state for s in streams)

    assert state["sampler"]["offset"] == 12 * global_batch
    assert sorted(ledger) == [0, 1, 2]
    for epoch, seen in ledger.items():
        assert sorted(seen) == sorted(sampler.permutation(epoch)[: sampler.samples_per_epoch].tolist())


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
        seeds = {s for batch in take(iter(stream), 4) for s in batch["seed"]}
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
    for batch in take(iter(stream), 4):
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
