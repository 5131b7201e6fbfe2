"""One state per generation, proven: every rank at the same step, data offset, layout and generation, every replica
holding the same values, and the state equal to the one it came from.

A :class:`StateProof` is what the ranks of a world agree they hold: their step, data offset, generation and layout,
and the layout-independent digest of the training state (:mod:`lightning_emig.migration.digest`). :func:`prove_state`
takes it with two all-reduces (integers only) after checking

* that every rank has the same step, data offset, generation and layout (a worker restored from another step, or
  started from a checkpoint while its peers joined live, differs here);
* that every replica of every piece has the same values (HSDP replicas, tensor-parallel replicated tensors, scalars:
  a replica that missed an update, or restored another step's shard, differs here).

:func:`check_same_state` compares a proof with the one taken before a change (a live change, a join, a checkpoint's
save): the digest does not depend on the layout, so a migration or a restore that changed any value shows.

Either failure raises :class:`InconsistentStateError` on every rank alike (the outcome of a collective), so no rank
trains on while the others stop.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_emig.layout import HybridLayout
from lightning_emig.migration.digest import DIGEST_VERSION, combined, digest_sums
from lightning_emig.migration.state import StateTensor

log = logging.getLogger(__name__)

PROOF_KEY = "lightning_emig_state_proof"
"""Where a checkpoint (or a handoff's metadata) keeps the proof of the state it holds."""


class InconsistentStateError(RuntimeError):
    """The ranks of a world do not hold one state: never trained on."""

    checkpoint: str | None = None
    """The checkpoint whose restore gave that state (never to be resumed from again), where one did."""


@dataclass(frozen=True)
class StateProof:
    """What every rank of a world agreed it holds (picklable; travels in checkpoints and handoffs)."""

    step: int
    data_offset: int
    """The global sample offset of the training data (``-1``: no data stream attached)."""
    generation: int
    layout: str
    digest: int
    """The state digest as an unsigned 64-bit number (see :mod:`lightning_emig.migration.digest`)."""
    tensors: dict[str, int] | None = None
    """Each tensor's own digest (unsigned), by state key: where two proofs' digests differ, the tensors that do
    (None in proofs saved before they were recorded)."""
    digest_version: int = 1
    """The digest's definition (:data:`~lightning_emig.migration.digest.DIGEST_VERSION`; 1 in proofs saved before
    it was recorded): digests of different versions do not compare."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StateProof:
        return cls(**values)


def prove_state(state: dict[str, StateTensor], layout: HybridLayout, *, rank: int, step: int, data_offset: int,
                generation: int, device: torch.device, when: str) -> StateProof:
    """Check that the world's ranks hold one state (module docstring) and return it; ``when`` names the moment in
    the error. Every rank of the default process group calls it at the same point."""
    return begin_proof(state, layout, rank=rank, step=step, data_offset=data_offset, generation=generation,
                       device=device, when=when).result()


def begin_proof(state: dict[str, StateTensor], layout: HybridLayout, *, rank: int, step: int, data_offset: int,
                generation: int, device: torch.device, when: str,
                read_only: Callable[[str], bool] | None = None, timeout_s: float = 1800.0) -> ProofInFlight:
    """:func:`prove_state` in two halves, for a caller with other work to do meanwhile: the ranks agree on step, data
    offset, generation and layout now (one all-reduce of integers), and the tensors whose keys ``read_only`` accepts
    (nobody writes them before :meth:`ProofInFlight.result`) are summed on a thread; the others now. Every rank of
    the default process group calls both halves at the same points. ``timeout_s`` bounds the wait for the thread (the
    process group's own timeout, from the strategy)."""
    keys = sorted(state)
    facts = torch.tensor([step, data_offset, generation, _layout_code(layout), _keys_code(keys)], dtype=torch.int64,
                         device=device)
    extremes = torch.cat([facts, -facts])  # one MAX gives every fact's highest and lowest value
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    highest, lowest = extremes[:4].tolist(), [-v for v in extremes[5:9].tolist()]
    disagree = [f"{name} {low}..{high}" for name, low, high in
                zip(("step", "data offset", "generation", "layout"), lowest, highest, strict=True) if low != high]
    if disagree:
        raise InconsistentStateError(
            f"INCONSISTENT STATE {when}: the ranks disagree on {', '.join(disagree)} (this rank: step {step}, "
            f"data offset {data_offset}, generation {generation}, {layout.describe()}): they do not hold one state"
        )
    later = shares = None
    if read_only is not None:
        shares = _SharedKeys(read_only)
        # Not at a lower priority (SCHED_IDLE was tried: a first step 0.4-0.6 s faster after a preemption, but a
        # thread starved by a busy host stalls whoever waits for the tensor it is summing, or for the GIL it holds;
        # see docs/results/change_cost.md, "The proof's thread on idle CPU").
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-emig-proof")
        later = pool.submit(digest_sums, state, layout, rank, device, shares.claim)
        pool.shutdown(wait=False)  # the thread ends with its one task
    now = digest_sums(state, layout, rank, device, None if read_only is None else lambda key: not read_only(key))
    return ProofInFlight(
        # Every rank holds the same keys (no pipeline stages): the per-tensor sums line up and are reduced too.
        keys=keys, same_keys=int(extremes[4]) == -int(extremes[9]), sums_now=now, sums_later=later, world=world,
        step=step, data_offset=data_offset, generation=generation, layout=layout, when=when, timeout_s=timeout_s,
        rest=None if shares is None else lambda: digest_sums(state, layout, rank, device, shares.claim),
        shares=shares,
    )


class _SharedKeys:
    """The tensors a proof's thread sums, shared with the thread that comes to wait for it: each key is summed by
    whichever claims it first (both go through the keys in the same order), so the waiting thread sums what the
    digest thread has not reached and waits for one tensor at most."""

    def __init__(self, accept: Callable[[str], bool]) -> None:
        self._accept = accept
        self._claimed: set[str] = set()
        self._closed = False
        self._lock = threading.Lock()

    def claim(self, key: str) -> bool:
        if not self._accept(key):
            return False
        with self._lock:
            if self._closed or key in self._claimed:
                return False
            self._claimed.add(key)
            return True

    def close(self) -> None:
        """No key is claimed any more: the digest thread stops after the tensor it is summing."""
        with self._lock:
            self._closed = True


@dataclass
class ProofInFlight:
    """A proof begun by :func:`begin_proof`: the ranks agreed on the facts, some sums are still being taken."""

    keys: list[str]
    same_keys: bool
    sums_now: tuple[torch.Tensor, torch.Tensor]
    sums_later: Future[tuple[torch.Tensor, torch.Tensor]] | None
    world: int
    """The size of the default process group it began in: it is completed in the same one (a world of one: no
    collective, anywhere)."""
    step: int
    data_offset: int
    generation: int
    layout: HybridLayout
    when: str
    timeout_s: float = 1800.0
    """The longest :meth:`result` and :meth:`abandon` wait for the thread."""
    rest: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    """Sums the tensors the thread has not claimed yet, in the calling thread."""
    shares: _SharedKeys | None = None

    def result(self) -> StateProof:
        """Wait for the sums, reduce them over the world (one all-reduce) and check that every replica agrees: the
        proof, or :class:`InconsistentStateError` on every rank."""
        slots, per_tensor = self.sums_now
        if self.sums_later is not None:
            rest, self.rest = self.rest, None  # it holds the state: not kept past the proof
            if rest is not None and not self.sums_later.done():
                rest_slots, rest_per_tensor = rest()
                slots, per_tensor = slots + rest_slots, per_tensor + rest_per_tensor
            try:
                later_slots, later_per_tensor = self.sums_later.result(timeout=self.timeout_s)
            except FutureTimeout:
                raise TimeoutError(f"the state digest taken {self.when} (step {self.step}) did not finish within "
                                   f"{self.timeout_s:.0f}s on its thread") from None
            slots, per_tensor = slots + later_slots, per_tensor + later_per_tensor
        sums = torch.cat([slots, per_tensor]) if self.same_keys else slots
        if self.world > 1:
            if dist.get_world_size() != self.world:
                raise RuntimeError(f"a proof begun in a world of {self.world} cannot be completed in a world of "
                                   f"{dist.get_world_size()}")
            dist.all_reduce(sums)
        slots, per_tensor = sums[:len(slots)], sums[len(slots):]
        digests = sorted(set(combined(slots)))
        if len(digests) > 1:
            raise InconsistentStateError(
                f"INCONSISTENT STATE {self.when} at step {self.step}: replicas of the training state differ "
                f"({len(digests)} different digests over the {len(slots)} replica slots of {self.layout.describe()})"
            )
        tensors = (dict(zip(self.keys, combined(per_tensor), strict=True))
                   if self.same_keys else None)  # pipeline stages: each holds its own tensors, the whole digest only
        return StateProof(step=self.step, data_offset=self.data_offset, generation=self.generation,
                          layout=self.layout.describe(), digest=digests[0], tensors=tensors,
                          digest_version=DIGEST_VERSION)

    def abandon(self) -> None:
        """Never to be completed (the fit failed, the world broke): wait until the thread reads the state no more,
        so that it may be released."""
        self.rest = None
        if self.shares is not None:
            self.shares.close()
        if self.sums_later is not None and wait([self.sums_later], timeout=self.timeout_s).not_done:
            log.warning("the state digest taken %s (step %d) was still running after %.0fs; going on without it",
                        self.when, self.step, self.timeout_s)


def settle_handoff_proof(metadata: dict[str, Any]) -> float:
    """Complete the proof a live handoff's save hooks began (a collective of the old world, still whole; before the
    old state is released). Returns the seconds it waited."""
    started = time.perf_counter()
    in_flight = metadata.get(PROOF_KEY)
    if isinstance(in_flight, ProofInFlight):
        metadata[PROOF_KEY] = in_flight.result().as_dict()
    return time.perf_counter() - started


def check_same_state(before: StateProof, after: StateProof, *, what: str) -> None:
    """``what`` (a change, a restore) kept the state: same step, same digest, and the same data offset where both
    know one (a checkpoint saved after ``fit`` returned has no data stream attached: ``-1``). A proof whose digest an
    earlier release took (another definition) is compared on its step and data offset only, with a warning."""
    comparable = before.digest_version == after.digest_version
    if not comparable:
        log.warning("the proof of the state before %s was taken by another release's digest (version %d, now %d): "
                    "its step and data offset are checked, its values are not", what, before.digest_version,
                    after.digest_version)
    offsets_known = before.data_offset >= 0 and after.data_offset >= 0
    if before.step != after.step or (comparable and before.digest != after.digest) or (
            offsets_known and before.data_offset != after.data_offset):
        differ = _tensors_that_differ(before, after) if comparable else ""
        raise InconsistentStateError(
            f"INCONSISTENT STATE after {what}: before it step {before.step}, data offset {before.data_offset}, digest "
            f"{before.digest:#018x} ({before.layout}); after it step {after.step}, data offset {after.data_offset}, "
            f"digest {after.digest:#018x} ({after.layout}){differ}"
        )


def _tensors_that_differ(before: StateProof, after: StateProof, most: int = 8) -> str:
    if before.tensors is None or after.tensors is None:
        return ""
    keys = sorted(set(before.tensors) | set(after.tensors))
    differ = [key for key in keys if before.tensors.get(key) != after.tensors.get(key)]
    if not differ:
        return ""
    more = f" and {len(differ) - most} more" if len(differ) > most else ""
    return f"; tensors that differ: {', '.join(differ[:most])}{more}"


def _keys_code(keys: list[str]) -> int:
    return zlib.crc32("\n".join(keys).encode())


def _layout_code(layout: HybridLayout) -> int:
    return zlib.crc32(layout.describe().encode())
