"""Map-style datasets of next-token samples: ``{"inputs": LongTensor[T], "targets": LongTensor[T]}``.

Invariants shared by every dataset here:

* ``sample["targets"][t] == tokens[t + 1]`` where ``sample["inputs"][t] == tokens[t]`` (shift by one);
* ``dataset[i]`` depends only on the index (and the construction arguments): no hidden RNG state, so any rank
  can produce any sample, which is what lets the data-parallel degree change without moving data.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_emig.data.corpus import load_byte_corpus
from lightning_emig.data.sampler import mix_seed

Sample = dict[str, torch.Tensor]


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _shifted(tokens: torch.Tensor) -> Sample:
    return {"inputs": tokens[:-1], "targets": tokens[1:]}


class ByteCorpusDataset(Dataset[Sample]):
    """Non-overlapping windows of a byte corpus: sample ``i`` is bytes ``[i*T, i*T + T + 1)``.

    The last byte of a window is the first input of the next one, so every byte except the first is a target
    exactly once per epoch. ``len = (n_bytes - 1) // seq_len``; the corpus is memory-mapped lazily in each
    process (the mapping is not pickled).
    """

    vocab_size = 256

    def __init__(self, path: str | os.PathLike[str], seq_len: int) -> None:
        self.path = Path(path)
        self.seq_len = _positive_int("seq_len", seq_len)
        self.n_bytes = self.path.stat().st_size
        self._length = (self.n_bytes - 1) // self.seq_len
        if self._length < 1:
            raise ValueError(
                f"corpus {self.path} has {self.n_bytes} bytes, fewer than one sample of seq_len {seq_len} + 1:"
                " use a larger corpus (max_bytes) or a smaller seq_len"
            )
        self._data: torch.Tensor | None = None

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Sample:
        index = _check_index(index, self._length)
        if self._data is None:
            self._data = load_byte_corpus(self.path)
        start = index * self.seq_len
        # .long() copies out of the mapping, so samples never alias the file.
        return _shifted(self._data[start : start + self.seq_len + 1].long())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_data"] = None  # re-mapped on first use in the receiving process instead of copied
        return state


class SyntheticDataset(Dataset[Sample]):
    """Deterministic, learnable token sequences for tests and smoke runs.

    Sample ``i`` is an arithmetic progression modulo ``vocab_size``: ``(start + stride * t) % vocab_size``, with
    ``start`` and ``stride`` (1 to 4) derived from a hash of ``(seed, i)``. A model that sees two tokens can
    predict the rest exactly (loss -> 0) and even a bigram model gets to ``ln 4``, so tiny models' loss falls
    quickly from ``ln vocab_size``.
    """

    max_stride = 4

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int = 256, seed: int = 0) -> None:
        self.num_samples = _positive_int("num_samples", num_samples)
        self.seq_len = _positive_int("seq_len", seq_len)
        self.vocab_size = _positive_int("vocab_size", vocab_size, minimum=2)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Sample:
        index = _check_index(index, self.num_samples)
        key = mix_seed(self.seed, index)
        start = key % self.vocab_size
        stride = 1 + (key >> 32) % self.max_stride
        positions = torch.arange(self.seq_len + 1, dtype=torch.long)
        return _shifted((start + stride * positions) % self.vocab_size)


def _check_index(index: int, length: int) -> int:
    index = int(index)  # sampler indices may arrive as 0-d tensors or numpy ints
    if not 0 <= index < length:
        raise IndexError(f"sample index {index} out of range for a dataset of {length} samples")
    return index
