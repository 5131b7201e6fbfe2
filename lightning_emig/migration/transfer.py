"""Run one process's :class:`RankPlan`: local copies, then bucketed point-to-point rounds.

Invariants:

* matching without negotiation: the transfers between two processes are cut into buckets by the same rule on
  both sides (the pair's transfer list, in plan order, greedily packed up to the pair's bucket size, a transfer
  larger than a bucket split along its first dimension), and bucket ``k`` of every pair travels in round ``k``,
  so every ``isend`` has its ``irecv`` in the same ``batch_isend_irecv`` call on the other side;
* bounded memory: a pair's bucket is ``bucket_bytes / (2 x the larger peer count of the two)``, so the send and
  receive buffers of one round never exceed ``bucket_bytes`` on any process (plus the largest single row of a
  tensor, the indivisible unit);
* old state is released (``on_release(key)``) right after the round that last reads it;
* with ``checksum=True`` each bucket carries a CRC32 of its bytes; a mismatch raises
  :class:`ChecksumMismatchError` and the received state must not be used.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_emig.migration.geometry import ShardBox
from lightning_emig.migration.planner import RankPlan, Transfer

DEFAULT_BUCKET_BYTES = 256 << 20


class ChecksumMismatchError(RuntimeError):
    """Bytes received differ from bytes sent: the migrated state is corrupt and must not be used."""


@dataclass(frozen=True, slots=True)
class TransferOptions:
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Budget for the send + receive buffers of one round on one process."""
    checksum: bool = False
    """Send a CRC32 with every bucket and verify it on receipt."""
    corrupt_in_transit: Callable[[int, int, torch.Tensor], None] | None = None
    """Fault injection for tests: called as ``(round, peer_pid, packed_send_buffer)`` after the checksum is taken."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")


@dataclass(slots=True)
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    rounds: int = 0
    peak_buffer_bytes: int = 0
    """Largest send + receive buffer space allocated in one round (the extra memory of the transfer)."""
    seconds_copy: float = 0.0
    seconds_transfer: float = 0.0
    per_peer_bytes: dict[int, int] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- bucketing
def _split_rows(transfer: Transfer, max_bytes: int) -> list[Transfer]:
    """Cut a transfer larger than ``max_bytes`` into runs of whole rows along dim 0 (same cut on both sides)."""
    box = transfer.box
    if transfer.nbytes <= max_bytes or box.ndim == 0 or box.shape[0] <= 1:
        return [transfer]
    rows = box.shape[0]
    row_bytes = transfer.nbytes // rows
    per = max(1, max_bytes // max(row_bytes, 1))
    pieces = []
    for lo in range(0, rows, per):
        hi = min(rows, lo + per)
        (start, _), *rest = box.bounds
        sub = ShardBox(((start + lo, start + hi), *rest))
        pieces.append(
            Transfer(
                transfer.tensor, sub, transfer.src, transfer.dst,
                (transfer.src_start[0] + lo, *transfer.src_start[1:]),
                (transfer.dst_start[0] + lo, *transfer.dst_start[1:]),
                row_bytes * (hi - lo),
            )
        )
    return pieces


def buckets_for_pair(transfers: tuple[Transfer, ...], bucket_bytes: int) -> list[list[Transfer]]:
    """Greedy packing in plan order; both ends of a pair compute the same buckets from the same list."""
    buckets: list[list[Transfer]] = []
    current: list[Transfer] = []
    size = 0
    for transfer in transfers:
        for piece in _split_rows(transfer, bucket_bytes):
            if current and size + piece.nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(piece)
            size += piece.nbytes
    if current:
        buckets.append(current)
    return buckets


# ------------------------------------------------------------------------------------------ pack / unpack
def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _pack(bucket: list[Transfer], old: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    parts = [_as_bytes(old[t.tensor][t.src_slices()]) for t in bucket]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def _unpack(bucket: list[Transfer], buffer: torch.Tensor, new: dict[str, torch.Tensor]) -> None:
    offset = 0
    for t in bucket:
        target = new[t.tensor]
        chunk = buffer[offset : offset + t.nbytes].view(target.dtype).reshape(t.box.shape)
        target[t.dst_slices()].copy_(chunk)
        offset += t.nbytes


def _crc(buffer: torch.Tensor) -> int:
    return zlib.crc32(buffer.detach().cpu().numpy().tobytes())


# ------------------------------------------------------------------------------------------------ running
def copy_local(plan: RankPlan, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    for t in plan.copies:
        new[t.tensor][t.dst_slices()].copy_(old[t.tensor][t.src_slices()])
    return plan.bytes_copied


def pair_bucket_bytes(bucket_bytes: int, my_peers: int, their_peers: int) -> int:
    return max(1, bucket_bytes // (2 * max(my_peers, their_peers, 1)))


def run_transfer(
    plan: RankPlan,
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    *,
    union_rank: Callable[[int], int],
    peer_counts: dict[int, int],
    group: dist.ProcessGroup | None = None,
    options: TransferOptions = TransferOptions(),
    on_release: Callable[[str], None] | None = None,
) -> TransferStats:
    """Execute ``plan`` on this process.

    Args:
        old / new: This process's local tensors by state key (old holdings it sends from, new ones it fills).
        union_rank: Maps a process id to its rank in ``group``.
        peer_counts: Number of peers of every process this one exchanges with (for the pair bucket size).
        on_release: Called with a key once no later round reads ``old[key]``.
    """
    stats = TransferStats()
    start = time.perf_counter()
    stats.bytes_copied = copy_local(plan, old, new)
    stats.seconds_copy = time.perf_counter() - start

    me = len(plan.peers)
    schedule = _schedule(plan, me, peer_counts, options.bucket_bytes)
    last_read = _last_round_reading(schedule, old, plan)
    device = _device_of(new, old)
    start = time.perf_counter()
    for round_index, (sends, recvs) in enumerate(schedule):
        _run_round(round_index, sends, recvs, old, new, union_rank, group, options, device, stats)
        if on_release is not None:
            for key in last_read.get(round_index, ()):
                on_release(key)
    if on_release is not None:
        for key in last_read.get(-1, ()):
            on_release(key)
    stats.rounds = len(schedule)
    stats.seconds_transfer = time.perf_counter() - start
    return stats


Round = tuple[dict[int, list[Transfer]], dict[int, list[Transfer]]]


def _schedule(plan: RankPlan, me: int, peer_counts: dict[int, int], bucket_bytes: int) -> list[Round]:
    rounds: list[Round] = []
    for peer in plan.peers:
        size = pair_bucket_bytes(bucket_bytes, me, peer_counts.get(peer, 1))
        for direction, transfers in ((0, plan.sends_to(peer)), (1, plan.recvs_from(peer))):
            for k, bucket in enumerate(buckets_for_pair(transfers, size)):
                while len(rounds) <= k:
                    rounds.append(({}, {}))
                rounds[k][direction][peer] = bucket
    return rounds


def _last_round_reading(schedule: list[Round], old: dict[str, torch.Tensor], plan: RankPlan) -> dict[int, list[str]]:
    """Round after which each old tensor is no longer read (-1: only local copies read it)."""
    last: dict[str, int] = {key: -1 for key in old}
    for index, (sends, _) in enumerate(schedule):
        for bucket in sends.values():
            for t in bucket:
                last[t.tensor] = index
    by_round: dict[int, list[str]] = {}
    for key, index in last.items():
        by_round.setdefault(index, []).append(key)
    return by_round


def _run_round(
    round_index: int,
    sends: dict[int, list[Transfer]],
    recvs: dict[int, list[Transfer]],
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    union_rank: Callable[[int], int],
    group: dist.ProcessGroup | None,
    options: TransferOptions,
    device: torch.device,
    stats: TransferStats,
) -> None:
    ops: list[dist.P2POp] = []
    recv_buffers: dict[int, torch.Tensor] = {}
    recv_sums: dict[int, torch.Tensor] = {}
    buffer_bytes = 0
    for peer, bucket in sorted(sends.items()):
        packed = _pack(bucket, old, device)
        buffer_bytes += packed.numel()
        if options.checksum:
            checksum = torch.tensor([_crc(packed)], dtype=torch.int64, device=device)
        if options.corrupt_in_transit is not None:
            options.corrupt_in_transit(round_index, peer, packed)
        ops.append(dist.P2POp(dist.isend, packed, union_rank(peer), group))
        if options.checksum:
            ops.append(dist.P2POp(dist.isend, checksum, union_rank(peer), group))
        stats.bytes_sent += packed.numel()
        stats.per_peer_bytes[peer] = stats.per_peer_bytes.get(peer, 0) + packed.numel()
    for peer, bucket in sorted(recvs.items()):
        nbytes = sum(t.nbytes for t in bucket)
        recv_buffers[peer] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        buffer_bytes += nbytes
        ops.append(dist.P2POp(dist.irecv, recv_buffers[peer], union_rank(peer), group))
        if options.checksum:
            recv_sums[peer] = torch.empty(1, dtype=torch.int64, device=device)
            ops.append(dist.P2POp(dist.irecv, recv_sums[peer], union_rank(peer), group))
    stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, buffer_bytes)
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for peer, bucket in sorted(recvs.items()):
        buffer = recv_buffers[peer]
        if options.checksum and _crc(buffer) != int(recv_sums[peer].item()):
            names = sorted({t.tensor for t in bucket})
            raise ChecksumMismatchError(
                f"checksum mismatch in round {round_index} from process {peer}: {len(bucket)} boxes of "
                f"{names[:3]}{'...' if len(names) > 3 else ''}; the migrated state is corrupt and was not accepted"
            )
        _unpack(bucket, buffer, new)
        stats.bytes_received += buffer.numel()


def _device_of(*tensor_maps: dict[str, torch.Tensor]) -> torch.device:
    for tensors in tensor_maps:
        for tensor in tensors.values():
            return tensor.device
    return torch.device("cpu")


def max_single_row_bytes(plan: RankPlan) -> int:
    """The indivisible unit of a bucket: one row of the widest transfer (for the peak-memory bound)."""
    rows = [t.nbytes // max(1, t.box.shape[0]) if t.box.ndim else t.nbytes for t in (*plan.sends, *plan.recvs)]
    return max(rows, default=0)


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "ChecksumMismatchError",
    "TransferOptions",
    "TransferStats",
    "buckets_for_pair",
    "copy_local",
    "max_single_row_bytes",
    "pair_bucket_bytes",
    "run_transfer",
]
