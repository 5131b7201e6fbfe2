"""Corpus, datasets and the micro-batch stream: shapes, determinism, and the committed-offset contract."""

from __future__ import annotations

import pickle
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

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
from lightning_emig.data.corpus import SEPARATOR, SKIPPED_DIRS, stdlib_source_files

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
