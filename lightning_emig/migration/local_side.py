"""The local side of one process's transfer (:mod:`lightning_emig.migration.transfer`), round by round: copies of
what stays on this process, and the release of old shards once nothing reads them.

Why it is bound to the rounds: a local copy runs in the round that last reads its source, while that round's
messages are on the wire as far as the round's memory budget allows (its messages' bytes and the copies stay within
``bucket_bytes``), the rest once the messages landed, each source freed right after its copy.

On the CPU, freed shards stay in the heap (an elastic worker keeps freed pages for the next step), so the process's
resident memory is what bounds a change, and it is checked before every write into new pages: freed pages go back
to the OS only when the write would take the process above its ceiling (what it held when the transfer began plus
the change's bound). Returning them sooner, at every few freed MiB, also returned the pages the training step had
just used: the first step after a join faulted them in again (``llama_125m``, the survivor of a 1 -> 2 join: 3.5
GiB of page faults in the change and its first step; none with the freed pages kept).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_emig.host_memory import resident_bytes, return_freed_host_memory
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
    """Old shards leave as soon as nothing reads them; on the CPU (``reclaim``) their pages go back to the OS only
    when the process needs the room: :meth:`make_room` before every write into new pages keeps its resident memory
    under ``ceiling`` bytes (the bound on a change's peak memory).
    """

    def __init__(self, on_release: Callable[[str], None] | None, local: FirstError, *, reclaim: bool,
                 ceiling: int | None) -> None:
        self.on_release = on_release or (lambda key: None)
        self.local = local
        self.reclaim = reclaim
        self.ceiling = ceiling
        """Resident bytes the transfer stays under; None where the process's memory cannot be read (then freed
        pages go back before every write)."""
        self.freed_since_trim = False

    def free(self, key: str) -> None:
        """Release ``old[key]`` (its pages stay in the heap until :meth:`make_room` needs them)."""
        self.local.run(self.on_release, key)
        self.freed_since_trim = True

    def make_room(self, nbytes: int) -> None:
        """Before up to ``nbytes`` land in new pages: return freed pages if the process would outgrow its ceiling."""
        if not (self.reclaim and self.freed_since_trim):
            return
        resident = resident_bytes() if self.ceiling is not None else None
        if resident is None or resident + nbytes > self.ceiling:
            return_freed_host_memory()
            self.freed_since_trim = False


class LocalWork:
    """The copies and releases of one transfer, called by its rounds: :meth:`on_wire` while a round's messages
    travel, :meth:`after_wait` once they landed."""

    def __init__(self, plan: RankPlan, last_read: dict[int, list[str]], old: dict[str, torch.Tensor],
                 new: dict[str, torch.Tensor], releases: Releases, local: FirstError, *, budget: int) -> None:
        self.last_read = last_read
        self.budget = budget
        """Bytes a round's messages and the copies run while they travel may write together."""
        self.wire = 0
        """Bytes of the round on the wire (they may still land while a copy outside the budget runs)."""
        self.copies = _copies_by_round(plan, last_read)
        self.old, self.new = old, new
        self.releases = releases
        self.local = local
        self.bytes_copied = 0
        self.seconds_copy = 0.0
        self.deferred: list[str] = []
        """Keys of the current round whose copies wait until its messages landed."""

    def _run_copies(self, transfers: Iterable[Transfer], *, make_room: bool = True) -> None:
        """Copy, first making room for the copy's bytes and what is still on the wire (unless the round's budget
        already holds them)."""
        transfers = list(transfers)
        if make_room:
            self.releases.make_room(sum(t.nbytes for t in transfers) + self.wire)
        started = time.perf_counter()
        self.bytes_copied += self.local.run(_copy, transfers, self.old, self.new) or 0
        self.seconds_copy += time.perf_counter() - started

    def on_wire(self, round_index: int, on_wire: Round | None) -> None:
        """Copies while round ``round_index``'s messages (``on_wire``) travel, within what they leave of the budget;
        the rest are deferred to :meth:`after_wait`. ``None``: a transfer with no rounds, where every copy runs."""
        self.wire = 0 if on_wire is None else _wire_bytes(on_wire)
        if round_index == 0:  # sources no round reads (copied locally, or not needed): copy, then free at once
            for key in self.last_read.get(-1, ()):
                self._run_copies(self.copies.get(-1, {}).get(key, ()))
                self.releases.free(key)
        slack = None if on_wire is None or not self.releases.reclaim else self.budget - self.wire
        written = 0
        for key, transfers in self.copies.get(round_index, {}).items():
            size = sum(t.nbytes for t in transfers)
            if slack is not None and written + size > slack:
                self.deferred.append(key)
                continue
            self._run_copies(transfers, make_room=False)  # within the room made for the round
            written += size

    def before_round(self) -> None:
        """Room for what a round writes into new pages: its messages and the copies it runs on the wire (within
        ``budget`` together)."""
        self.releases.make_room(self.budget)

    def after_wait(self, round_index: int) -> None:
        """Free what the round read last, then run its deferred copies, each source freed after its copy."""
        self.wire = 0
        deferred, self.deferred = self.deferred, []
        waiting = set(deferred)
        for key in self.last_read.get(round_index, ()):
            if key not in waiting:
                self.releases.free(key)
        for key in deferred:
            self._run_copies(self.copies[round_index][key])
            self.releases.free(key)


def _wire_bytes(on_wire: Round) -> int:
    return sum(t.nbytes for buckets in on_wire for bucket in buckets.values() for t in bucket)


def _copy(transfers: Iterable[Transfer], old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    """Run the copies; one whose source and destination are the same memory (a shard the caller adopted as its new
    one: :func:`~lightning_emig.migration.change.allocate_shards`) is already done and counts no bytes."""
    copied = 0
    for t in transfers:
        dst, src = new[t.tensor][t.dst_slices()], old[t.tensor][t.src_slices()]
        if _same_memory(dst, src):
            continue
        dst.copy_(src)
        copied += t.nbytes
    return copied


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _copies_by_round(plan: RankPlan, last_read: dict[int, list[str]]) -> dict[int, dict[str, list[Transfer]]]:
    """Local copies by the round that last reads their source tensor (-1: no round reads it), then by tensor."""
    round_of = {key: index for index, keys in last_read.items() for key in keys}
    out: dict[int, dict[str, list[Transfer]]] = {}
    for t in plan.copies:
        out.setdefault(round_of.get(t.tensor, -1), {}).setdefault(t.tensor, []).append(t)
    return out
