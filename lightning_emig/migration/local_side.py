"""The local side of one process's transfer (:mod:`lightning_emig.migration.transfer`), round by round: copies of
what stays on this process, and the release of old shards once nothing reads them.

Why it is bound to the rounds: a local copy runs in the round that last reads its source, while that round's
messages are on the wire as far as the round's memory budget allows (its messages' bytes, the copies and the
released bytes not yet returned to the OS stay within ``bucket_bytes``), the rest once the messages landed, each
source freed right after its copy. On the CPU, released pages go back to the OS in lots: model shards are mostly a
few MiB, below glibc's mmap threshold, so a freed one would otherwise stay resident in the heap while the new
state's pages pile up on top of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_emig.host_memory import return_freed_host_memory
from lightning_emig.migration.planner import RankPlan, Transfer

Round = tuple[dict[int, list[Transfer]], dict[int, list[Transfer]]]
"""One round's buckets: what this process sends to and receives from each peer."""


class FirstError:
    """Runs local steps of a transfer, keeping the first exception instead of raising it: a local error must not
    abandon the rounds, which every peer posts regardless (it would wait for this process until the group's
    timeout). The transfer raises it after the last round."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def run(self, step: Callable[..., Any], *args: Any) -> Any:
        try:
            return step(*args)
        except Exception as exc:
            self.error = self.error or exc
            return None


class Releases:
    """Old shards leave as soon as nothing reads them, and on the CPU their pages go back to the OS before the new
    state's pages pile up on top of them (``reclaim``): the bound on a change's peak memory.

    A trim costs a few ms, so released bytes are trimmed in lots of ``lot_bytes``; the lot is taken out of what a
    round's local copies may write while its messages are on the wire (:meth:`copy_slack`).
    """

    def __init__(self, old: dict[str, torch.Tensor], on_release: Callable[[str], None] | None, local: FirstError,
                 *, reclaim: bool, bucket_bytes: int) -> None:
        self.old = old
        self.on_release = on_release or (lambda key: None)
        self.local = local
        self.reclaim = reclaim
        self.bucket_bytes = bucket_bytes
        self.lot_bytes = min(bucket_bytes // 8, 64 << 20)
        self.pending = 0

    def copy_slack(self, on_wire: Round) -> int | None:
        """Bytes of local copies a round may write while its sources are still held (None: no limit, where old
        state is not released or memory is not returned): the budget left by its messages and one lot."""
        if not self.reclaim:
            return None
        wire_bytes = sum(t.nbytes for buckets in on_wire for bucket in buckets.values() for t in bucket)
        return max(0, self.bucket_bytes - wire_bytes - self.lot_bytes)

    def free(self, key: str, *, in_lots: bool = True) -> None:
        """Release ``old[key]``; return the released pages once a lot has gathered (unless ``in_lots`` is false)."""
        tensor = self.old[key]
        self.local.run(self.on_release, key)
        self.pending += tensor.numel() * tensor.element_size()
        if in_lots and self.pending >= self.lot_bytes:
            self.flush()

    def flush(self) -> None:
        if self.reclaim and self.pending:
            return_freed_host_memory()
        self.pending = 0


class LocalWork:
    """The copies and releases of one transfer, called by its rounds: :meth:`on_wire` while a round's messages
    travel, :meth:`after_wait` once they landed."""

    def __init__(self, plan: RankPlan, last_read: dict[int, list[str]], old: dict[str, torch.Tensor],
                 new: dict[str, torch.Tensor], releases: Releases, local: FirstError) -> None:
        self.last_read = last_read
        self.copies = _copies_by_round(plan, last_read)
        self.old, self.new = old, new
        self.releases = releases
        self.local = local
        self.bytes_copied = 0
        self.seconds_copy = 0.0
        self.deferred: list[str] = []
        """Keys of the current round whose copies wait until its messages landed."""

    def _run_copies(self, transfers: Iterable[Transfer]) -> None:
        started = time.perf_counter()
        self.bytes_copied += self.local.run(_copy, transfers, self.old, self.new) or 0
        self.seconds_copy += time.perf_counter() - started

    def on_wire(self, round_index: int, on_wire: Round | None) -> None:
        """Copies while round ``round_index``'s messages (``on_wire``) travel, within what they leave of the budget;
        the rest are deferred to :meth:`after_wait`. ``None``: a transfer with no rounds, where every copy runs."""
        if round_index == 0:  # sources no round reads (copied locally, or not needed): copy, then free at once
            for key in self.last_read.get(-1, ()):
                self._run_copies(self.copies.get(-1, {}).get(key, ()))
                self.releases.free(key)
        slack = None if on_wire is None else self.releases.copy_slack(on_wire)
        written = 0
        for key, transfers in self.copies.get(round_index, {}).items():
            size = sum(t.nbytes for t in transfers)
            if slack is not None and written + size > slack:
                self.deferred.append(key)
                continue
            self._run_copies(transfers)
            written += size

    def after_wait(self, round_index: int, *, last: bool) -> None:
        """Free what the round read last, then run its deferred copies, each source freed after its copy.

        After the last round nothing new comes in, so its releases stay in the heap for the next step (a trim
        cannot lower a peak already reached, and the step would fault the pages in again)."""
        deferred, self.deferred = self.deferred, []
        waiting = set(deferred)
        for key in self.last_read.get(round_index, ()):
            if key not in waiting:
                self.releases.free(key, in_lots=not last)
        if deferred:
            self.releases.flush()
        for key in deferred:
            self._run_copies(self.copies[round_index][key])
            self.releases.free(key)
        if not last:
            self.releases.flush()


def _copy(transfers: Iterable[Transfer], old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    copied = 0
    for t in transfers:
        new[t.tensor][t.dst_slices()].copy_(old[t.tensor][t.src_slices()])
        copied += t.nbytes
    return copied


def _copies_by_round(plan: RankPlan, last_read: dict[int, list[str]]) -> dict[int, dict[str, list[Transfer]]]:
    """Local copies by the round that last reads their source tensor (-1: no round reads it), then by tensor."""
    round_of = {key: index for index, keys in last_read.items() for key in keys}
    out: dict[int, dict[str, list[Transfer]]] = {}
    for t in plan.copies:
        out.setdefault(round_of.get(t.tensor, -1), {}).setdefault(t.tensor, []).append(t)
    return out
