"""The DataLoader Lightning sees: a stateful wrapper around a :class:`MicroBatchStream`.

Lightning saves and restores the ``state_dict`` of any training dataloader that has one (its fit loop keeps
them under ``loops.fit_loop.state_dict.combined_loader``), so the sampler's global offset travels inside every
Lightning checkpoint with no extra hook. Because the stream is an ``IterableDataset``, Lightning never injects
a ``DistributedSampler``: which micro-batches a rank reads is decided by the stream's topology, set by the
strategy from the current data-parallel degree and rank.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from lightning_emig.data.stream import MicroBatchStream


class MicroBatchLoader(DataLoader):
    """``DataLoader(stream, batch_size=None, num_workers=0)`` whose state is the stream's committed offset."""

    def __init__(self, stream: MicroBatchStream) -> None:
        # num_workers=0: the stream's position lives in this process, where every optimizer step commits it; worker
        # processes, if any, are the stream's own (MicroBatchStream(workers=...)), reading for it in order.
        super().__init__(stream, batch_size=None, num_workers=0)
        self.stream = stream

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stream.load_state_dict(state_dict)
