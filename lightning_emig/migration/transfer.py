"""Run one process's :class:`RankPlan`: local copies, then bucketed point-to-point rounds.

Invariants:

* matching without negotiation: the transfers between two processes are cut into buckets by the same rule on
  both sides (the pair's transfer list, in plan order, greedily packed up to the pair's bucket size, a transfer
  larger than a bucket cut into runs of whole rows, and a row larger than a bucket cut the same way along the
  next dim), and bucket ``k`` of every pair travels in round ``k`` as the same messages (a transfer of at least
  ``IN_PLACE_MIN_BYTES`` alone, runs of smaller ones packed), so every ``isend`` has its ``irecv`` in the same
  ``batch_isend_irecv`` call on the other side, in the same order;
* no needless copies: a one-box message whose box is contiguous in the live tensor (FSDP's row shards are)
  is sent from, or received into, that tensor directly when no checksum or fault injection is asked for;
  everything else is staged in two arenas allocated once per transfer (pages touched once, not per round);
* bounded memory: a pair's bucket is ``bucket_bytes / (2 x the larger peer count of the two)`` and no bucket is
  larger than that (the indivisible unit is one element), so the send and receive buffers of one round never
  exceed ``bucket_bytes`` on any process (unless the budget is below ``2 x peers x itemsize``);
* ranks are ranks *in* ``group`` (``group_peer``), so the union group may be any group, not only the default one;
* a bucket may mix dtypes: boxes sit at arbitrary byte offsets of the flat buffer, never reinterpreted in place
  at an offset their dtype cannot be aligned to;
* bounded memory of the state itself: local copies run in the round that last reads their source, within what
  the round's messages leave of ``bucket_bytes`` (:mod:`lightning_emig.migration.local_side`); old state is
  released (``on_release(key)``) right after the round that last reads it, and on the CPU released pages go back to
  the OS when the next write into new pages would otherwise take the process above what it held at the start plus
  the bound; new storage that is allocated but not yet written costs no memory (untouched pages), so a process
  holds at most max(old, new) + ``bucket_bytes`` + one tensor's shard at any time;
* with ``checksum=True`` each message carries a CRC32 of its bytes; a mismatch raises
  :class:`ChecksumMismatchError` once every round has run (so no peer is left waiting in a later round), and the
  received state must not be used.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_emig.host_memory import resident_bytes
from lightning_emig.migration.geometry import ShardBox
from lightning_emig.migration.local_side import FirstError, LocalWork, Releases, Round
from lightning_emig.migration.planner import RankPlan, Transfer

DEFAULT_BUCKET_BYTES = 256 << 20
#: A transfer at least this large travels as its own message, so it can leave from / land in the live tensor.
IN_PLACE_MIN_BYTES = 256 << 10


class ChecksumMismatchError(RuntimeError):
    """Bytes received differ from bytes sent: the migrated state is corrupt and must not be used."""


@dataclass(frozen=True, slots=True)
class TransferOptions:
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Budget for the send + receive buffers of one round on one process."""
    checksum: bool = False
    """Send a CRC32 with every bucket and verify it on receipt."""
    in_place_min_bytes: int = IN_PLACE_MIN_BYTES
    """A transfer of at least this many bytes travels as its own message (in place when contiguous)."""
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
    bytes_in_place: int = 0
    """Bytes sent from or received into the live tensors without staging."""
    peak_buffer_bytes: int = 0
    """Largest send + receive buffer space allocated in one round (the extra memory of the transfer)."""
    seconds_copy: float = 0.0
    seconds_transfer: float = 0.0
    per_peer_bytes: dict[int, int] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- bucketing
def _split_rows(transfer: Transfer, max_bytes: int) -> list[Transfer]:
    """Cut a transfer larger than ``max_bytes`` into pieces of at most ``max_bytes`` (same cut on both sides).

    Runs of whole rows along dim 0 first; a single row larger than ``max_bytes`` is cut the same way along dim 1,
    and so on, so only a single element can exceed ``max_bytes``. Pieces are in row-major order of the box.
    """
    return _split_from(transfer, max_bytes, 0)


def _split_from(transfer: Transfer, max_bytes: int, dim: int) -> list[Transfer]:
    box = transfer.box
    if transfer.nbytes <= max_bytes or dim >= box.ndim:
        return [transfer]
    length = box.shape[dim]
    if length <= 1:
        return _split_from(transfer, max_bytes, dim + 1)
    unit = transfer.nbytes // length  # one index along ``dim`` with everything inside it
    per = max(1, max_bytes // max(unit, 1))
    pieces: list[Transfer] = []
    for lo in range(0, length, per):
        hi = min(length, lo + per)
        piece = _narrow(transfer, dim, lo, hi, unit * (hi - lo))
        pieces.extend(_split_from(piece, max_bytes, dim + 1) if unit > max_bytes else [piece])
    return pieces


def _narrow(transfer: Transfer, dim: int, lo: int, hi: int, nbytes: int) -> Transfer:
    """Indices ``[lo, hi)`` of ``transfer``'s box along ``dim`` (relative to the box)."""
    bounds = list(transfer.box.bounds)
    start = bounds[dim][0]
    bounds[dim] = (start + lo, start + hi)

    def shifted(origin: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(o + lo if d == dim else o for d, o in enumerate(origin))

    return Transfer(
        transfer.tensor, ShardBox(tuple(bounds)), transfer.src, transfer.dst,
        shifted(transfer.src_start), shifted(transfer.dst_start), nbytes,
    )


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


def _typed(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``raw`` (a byte range of a flat buffer) seen as ``dtype`` of ``shape``; None where it is not aligned."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if raw.storage_offset() % itemsize:
        return None
    return raw.view(dtype).view(shape)


def _pack(bucket: list[Transfer], old: dict[str, torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """Write the bucket's boxes into the flat byte ``buffer`` (no per-box temporaries when aligned)."""
    offset = 0
    for t in bucket:
        source = old[t.tensor][t.src_slices()]
        raw = buffer[offset : offset + t.nbytes]
        typed = _typed(raw, source.dtype, t.box.shape)
        if typed is not None:
            typed.copy_(source)
        else:
            raw.copy_(_as_bytes(source))
        offset += t.nbytes
    return buffer


def _unpack(bucket: list[Transfer], buffer: torch.Tensor, new: dict[str, torch.Tensor]) -> None:
    offset = 0
    for t in bucket:
        target = new[t.tensor]
        raw = buffer[offset : offset + t.nbytes]
        chunk = _typed(raw, target.dtype, t.box.shape)
        if chunk is None:  # e.g. a float32 box after an odd number of bfloat16 elements: realign by copying
            chunk = raw.clone().view(target.dtype).view(t.box.shape)
        target[t.dst_slices()].copy_(chunk)
        offset += t.nbytes


def messages_of(bucket: list[Transfer], min_bytes: int = IN_PLACE_MIN_BYTES) -> list[list[Transfer]]:
    """Cut a bucket into messages the same way on both ends: a large transfer alone, runs of small ones packed."""
    messages: list[list[Transfer]] = []
    run: list[Transfer] = []
    for t in bucket:
        if t.nbytes >= min_bytes:
            if run:
                messages.append(run)
                run = []
            messages.append([t])
        else:
            run.append(t)
    if run:
        messages.append(run)
    return messages


def _single_contiguous(bucket: list[Transfer], tensors: dict[str, torch.Tensor], *, source: bool) -> torch.Tensor | None:
    """The one box of a one-transfer message as a contiguous view of the live tensor, to send or receive in place
    (an FSDP shard's rows are contiguous); None when the message must be staged."""
    if len(bucket) != 1:
        return None
    t = bucket[0]
    view = tensors[t.tensor][t.src_slices() if source else t.dst_slices()]
    return view.reshape(-1).view(torch.uint8) if view.is_contiguous() and view.numel() else None


class _Arena:
    """One staging buffer reused by every round: pages are touched once, not once per round."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.offset = 0

    def take(self, nbytes: int) -> torch.Tensor:
        view = self.buffer[self.offset : self.offset + nbytes]
        self.offset += nbytes
        return view

    def reset(self) -> None:
        self.offset = 0


def _crc(buffer: torch.Tensor) -> int:
    return zlib.crc32(buffer.detach().cpu().numpy().tobytes())


# ------------------------------------------------------------------------------------------------ running
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
    local = FirstError()  # a local error (a copy, a release) is raised after the last round, not before
    me = len(plan.peers)
    schedule = _schedule(plan, me, peer_counts, options.bucket_bytes)
    last_read = _last_round_reading(schedule, old, plan)
    device = _device_of(new, old)
    start = time.perf_counter()
    in_place = options.corrupt_in_transit is None and not options.checksum and device.type == "cpu"
    arenas = _arenas(schedule, old, new, device, in_place, options.in_place_min_bytes)
    # The arenas are the transfer's extra memory: at most the largest round's sends plus its receives.
    stats.peak_buffer_bytes = sum(arena.buffer.numel() for arena in arenas)
    reclaim = on_release is not None and device.type == "cpu"
    releases = Releases(on_release, local, reclaim=reclaim,
                        ceiling=_resident_ceiling(old, new, options.bucket_bytes) if reclaim else None)
    work = LocalWork(plan, last_read, old, new, releases, local, budget=options.bucket_bytes)

    mismatch: ChecksumMismatchError | None = None
    if not schedule:
        work.on_wire(0, None)
    for round_index, (sends, recvs) in enumerate(schedule):
        # After a mismatch keep running the remaining rounds: peers post them regardless, and raising now would
        # leave them blocked until the process group times out. Nothing received is trusted after a mismatch.
        work.before_round()
        error = _run_round(
            round_index, sends, recvs, old, new, union_rank, group, options, device, stats, arenas, in_place, local,
            while_on_wire=lambda i=round_index, r=(sends, recvs): work.on_wire(i, r),
        )
        mismatch = mismatch or error
        work.after_wait(round_index)
    stats.rounds = len(schedule)
    stats.bytes_copied, stats.seconds_copy = work.bytes_copied, work.seconds_copy
    stats.seconds_transfer = time.perf_counter() - start
    if local.error is not None:
        raise local.error
    if mismatch is not None:
        raise mismatch
    return stats


def _resident_ceiling(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], bucket_bytes: int) -> int | None:
    """The most resident bytes this process may hold during the transfer: what it holds now plus the change's bound
    (None where ``/proc`` cannot tell)."""
    resident = resident_bytes()
    return None if resident is None else resident + memory_bound_bytes(old, new, bucket_bytes)


def _staged_bytes(buckets: dict[int, list[Transfer]], tensors: dict[str, torch.Tensor], *, source: bool,
                  in_place: bool, min_bytes: int) -> int:
    return sum(
        sum(t.nbytes for t in message)
        for bucket in buckets.values()
        for message in messages_of(bucket, min_bytes)
        if not (in_place and _single_contiguous(message, tensors, source=source) is not None)
    )


def _arenas(
    schedule: list[Round], old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], device: torch.device,
    in_place: bool, min_bytes: int,
) -> tuple[_Arena, _Arena]:
    """Send and receive staging sized for the largest round (within the budget by construction)."""
    send = max((_staged_bytes(s, old, source=True, in_place=in_place, min_bytes=min_bytes) for s, _ in schedule),
               default=0)
    recv = max((_staged_bytes(r, new, source=False, in_place=in_place, min_bytes=min_bytes) for _, r in schedule),
               default=0)
    return _Arena(send, device), _Arena(recv, device)


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
    arenas: tuple[_Arena, _Arena],
    in_place: bool,
    local: FirstError,
    while_on_wire: Callable[[], None],
) -> ChecksumMismatchError | None:
    """Post one round's sends and receives in one ``batch_isend_irecv``, run ``while_on_wire`` (local work) before
    waiting for them; return a checksum mismatch, if any.

    Each pair's bucket travels as messages (:func:`messages_of`). With ``in_place`` (no checksum, no fault
    injection, CPU), a message that is one contiguous box is sent from, or received into, the live tensor
    itself; everything else goes through the reused staging arenas.
    """
    send_arena, recv_arena = arenas
    send_arena.reset()
    recv_arena.reset()
    ops: list[dist.P2POp] = []
    # Per received message: (peer, its transfers, its buffer, its checksum or None, landed in place).
    received: list[tuple[int, list[Transfer], torch.Tensor, torch.Tensor | None, bool]] = []
    buffer_bytes = 0
    for peer, bucket in sorted(sends.items()):
        for message in messages_of(bucket, options.in_place_min_bytes):
            packed = _single_contiguous(message, old, source=True) if in_place else None
            if packed is None:
                staging = send_arena.take(sum(t.nbytes for t in message))
                local.run(_pack, message, old, staging)  # on failure the message still goes (its bytes unused)
                packed = staging
                buffer_bytes += packed.numel()
            else:
                stats.bytes_in_place += packed.numel()
            if options.checksum:
                checksum = torch.tensor([_crc(packed)], dtype=torch.int64, device=device)
            if options.corrupt_in_transit is not None:
                options.corrupt_in_transit(round_index, peer, packed)
            ops.append(dist.P2POp(dist.isend, packed, group=group, group_peer=union_rank(peer)))
            if options.checksum:
                ops.append(dist.P2POp(dist.isend, checksum, group=group, group_peer=union_rank(peer)))
            stats.bytes_sent += packed.numel()
            stats.per_peer_bytes[peer] = stats.per_peer_bytes.get(peer, 0) + packed.numel()
    for peer, bucket in sorted(recvs.items()):
        for message in messages_of(bucket, options.in_place_min_bytes):
            target = _single_contiguous(message, new, source=False) if in_place else None
            landed = target is not None
            if landed:
                stats.bytes_in_place += target.numel()
            else:
                target = recv_arena.take(sum(t.nbytes for t in message))
                buffer_bytes += target.numel()
            ops.append(dist.P2POp(dist.irecv, target, group=group, group_peer=union_rank(peer)))
            checksum = None
            if options.checksum:
                checksum = torch.empty(1, dtype=torch.int64, device=device)
                ops.append(dist.P2POp(dist.irecv, checksum, group=group, group_peer=union_rank(peer)))
            received.append((peer, message, target, checksum, landed))
    assert buffer_bytes <= stats.peak_buffer_bytes, "staging outgrew its arenas"
    works = dist.batch_isend_irecv(ops) if ops else []
    while_on_wire()
    for work in works:
        work.wait()
    mismatch: ChecksumMismatchError | None = None
    for peer, message, buffer, checksum, landed in received:
        stats.bytes_received += buffer.numel()
        if checksum is not None and _crc(buffer) != int(checksum.item()):
            names = sorted({t.tensor for t in message})
            mismatch = mismatch or ChecksumMismatchError(
                f"checksum mismatch in round {round_index} from process {peer}: {len(message)} boxes of "
                f"{names[:3]}{'...' if len(names) > 3 else ''}; the migrated state is corrupt and was not accepted"
            )
            continue  # never write bytes known to be corrupt
        if not landed:
            local.run(_unpack, message, buffer, new)
    return mismatch


def _device_of(*tensor_maps: dict[str, torch.Tensor]) -> torch.device:
    """Where the communication buffers live: the accelerator when any state is on one (NCCL cannot send CPU
    tensors, and scalar optimizer state such as AdamW's ``step`` often stays on the CPU), else the CPU."""
    devices = [tensor.device for tensors in tensor_maps for tensor in tensors.values()]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def local_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of a process's local state tensors."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def largest_shard_bytes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    """Bytes of the largest single local tensor, old or new."""
    return max((t.numel() * t.element_size() for t in (*old.values(), *new.values())), default=0)


def memory_bound_bytes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], bucket_bytes: int) -> int:
    """The most a process's memory may grow during a transfer with ``release_old`` over holding its old state:
    ``max(old, new) + bucket + the largest single shard - old`` (see the module's invariants). ``new`` is allocated
    but untouched when the transfer starts (pages cost nothing until written)."""
    return max(local_bytes(old), local_bytes(new)) + bucket_bytes + largest_shard_bytes(old, new) - local_bytes(old)


def max_single_row_bytes(plan: RankPlan) -> int:
    """Bytes of one row (dim-0 index) of the widest transfer of ``plan``.

    A looser bound than the executor keeps: rows wider than a pair's bucket are cut further, so the buffers of a
    round stay within ``bucket_bytes`` alone; ``bucket_bytes + max_single_row_bytes(plan)`` therefore always holds.
    """
    rows = [t.nbytes // max(1, t.box.shape[0]) if t.box.ndim else t.nbytes for t in (*plan.sends, *plan.recvs)]
    return max(rows, default=0)


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "IN_PLACE_MIN_BYTES",
    "ChecksumMismatchError",
    "TransferOptions",
    "TransferStats",
    "buckets_for_pair",
    "largest_shard_bytes",
    "local_bytes",
    "max_single_row_bytes",
    "memory_bound_bytes",
    "messages_of",
    "pair_bucket_bytes",
    "run_transfer",
]
