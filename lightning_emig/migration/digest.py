"""A digest of the training state that no layout changes, and the sums that show every replica agrees.

The *state digest* of a training state is, per tensor, the sum over its elements of the element's bits times a weight
drawn from the tensor's key and the element's **global** position, added over tensors, modulo 2**64. It is a function
of the full tensors only: the same state laid out on 1 process or 64, sharded, tensor-parallel or in pipeline stages
has the same digest, so it proves a migration bit-exact (the digest before a change equals the digest after it) and a
checkpoint intact (the digest saved with it equals the digest of what was loaded, whatever the new world).

Each rank adds what it holds; an element held by several ranks (replicas: HSDP's ``dp_replicate``, a tensor-parallel
replicated norm, a scalar held by every rank) must be counted once. A tensor with ``R`` replicas has them at replica
index ``0 .. R-1`` (the rank's position among the ranks holding the same piece); a rank adds its sum into every slot
``j`` of a vector of ``L = world / pp`` slots with ``j = index mod R`` (``R`` divides ``L``: it is a product of mesh
degrees). After a SUM over all ranks, every slot holds the full digest, once per tensor, *read from a different
replica*: slots that differ mean replicas that differ. One all-reduce of ``L`` integers checks both. A plain (not
DTensor) buffer may differ between ranks by design (BatchNorm's running statistics without SyncBatchNorm): its first
replica's value is added to every slot, counted and never compared.

Not a cryptographic hash: a guard against state that silently went wrong (a replica that missed an update, a shard
restored from another step, a transfer that wrote the wrong place), cheap enough to run every few hundred steps.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping

import torch

from lightning_emig.layout import HybridLayout
from lightning_emig.migration.boxes import LocalPiece
from lightning_emig.migration.state import StateTensor

_CHUNK_ELEMENTS = 1 << 18
"""Elements reduced at once: a chunk's widened (int64) partial sums stay in cache. Reducing a 25M-element embedding
in one call ran 10x slower per element, most of it faulting in the int64 copy the reduction widens into."""

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def replica_slots(state: Mapping[str, StateTensor], layout: HybridLayout, rank: int,
                  device: torch.device | str) -> torch.Tensor:
    """This rank's contribution: ``world / pp`` int64 slots (module docstring). SUM them over all ranks; every slot
    is then the state digest, each slot read from other replicas."""
    return digest_sums(state, layout, rank, device)[0]


def digest_sums(state: Mapping[str, StateTensor], layout: HybridLayout, rank: int, device: torch.device | str,
                only: Callable[[str], bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contributions, in one pass: the replica slots (:func:`replica_slots`) and, per tensor in sorted
    key order, its first replica's sum. SUM both over all ranks: the second then holds every tensor's own digest
    (layout-independent too), which names the tensors that differ where two states' digests do.

    ``only`` (a test of the key) sums some tensors and leaves the others' positions zero: the sums of two calls whose
    ``only`` split the keys add up to one call's."""
    slots = torch.zeros(layout.world_size // layout.pp, dtype=torch.int64, device=device)
    per_tensor = torch.zeros(len(state), dtype=torch.int64, device=device)
    for position, key in enumerate(sorted(state)):
        if only is not None and not only(key):
            continue
        tensor = state[key]
        sharding = tensor.spec.on(layout)
        holding = sharding.holding_of_rank(rank)
        if holding is None or holding.is_empty:
            continue
        replicas = sharding.replica_ranks(rank)
        index = replicas.index(rank)
        per_rank = _per_rank(key, tensor)
        if per_rank and index > 0:
            continue
        local_sum = torch.zeros((), dtype=torch.int64, device=device)
        for piece in holding.pieces:
            local_sum += _piece_sum(tensor.local, piece, tensor.spec.global_shape, _salt(key)).to(device)
        if per_rank:  # the first replica's value in every slot: in the digest, never compared
            slots += local_sum
        else:
            slots[index::len(replicas)] += local_sum
        if index == 0:
            per_tensor[position] += local_sum
    return slots, per_tensor


def _per_rank(key: str, tensor: StateTensor) -> bool:
    """A buffer that is not a DTensor may legitimately differ between ranks (BatchNorm's running statistics without
    SyncBatchNorm, a per-rank counter): the digest counts its first replica's value and does not compare the others
    (a buffer sharded under one layout and plain under another counts the same under both)."""
    return key.startswith("buffer/") and not tensor.spec.placements


def _salt(key: str) -> int:
    # Two tensors swapped (or one restored under another's name) weigh their elements differently.
    return zlib.crc32(key.encode()) << 24


def _piece_sum(local: torch.Tensor, piece: LocalPiece, global_shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """Sum of bits x odd weight ``2 * (g + salt) + 1`` over one piece, ``g`` the element's global flat index, modulo
    2**64. Computed without a per-element weight: the sum is ``2 * sum_d stride_d * sum_p p * S_d[p] + (2 * salt + 1)
    * sum(bits)``, where ``S_d[p]`` is the bits summed over the piece's elements at global position ``p`` of dim
    ``d``: one integer reduction per dim, in cache-sized chunks of rows (10x faster than weighting every element,
    the same number: integer arithmetic modulo 2**64 is a ring)."""
    region = local[piece.local_slices(piece.global_box)] if local.dim() else local.reshape(())
    total = torch.zeros((), dtype=torch.int64, device=local.device)
    if region.numel() == 0:
        return total
    bits = _bits(region)
    if bits.dim() == 0:
        return total + bits.to(torch.int64) * (2 * salt + 1)
    along = [torch.zeros(length, dtype=torch.int64, device=local.device) for length in bits.shape]
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(1, bits[0].numel()))
    widened = torch.empty(min(bits.numel(), rows_per_chunk * bits[0].numel()), dtype=torch.int64,
                          device=local.device)
    for first in range(0, bits.shape[0], rows_per_chunk):
        # Widened once into one reused buffer, then reduced in int64: reducing the narrow bits with dtype=int64
        # widens every element again in every reduction (1.5x slower per element).
        narrow = bits[first:first + rows_per_chunk]
        chunk = widened[:narrow.numel()].view(narrow.shape).copy_(narrow)
        along[0][first:first + chunk.shape[0]] = _sums_along(chunk, 0)
        for dim in range(1, chunk.dim()):
            along[dim] += _sums_along(chunk, dim)
    strides = _row_major_strides(global_shape)
    for dim, ((begin, _), sums) in enumerate(zip(piece.global_box.bounds, along, strict=True)):
        positions = torch.arange(begin, begin + sums.numel(), dtype=torch.int64, device=local.device)
        total += (sums * positions).sum() * strides[dim]
    return total * 2 + along[0].sum() * (2 * salt + 1)


def _sums_along(bits: torch.Tensor, dim: int) -> torch.Tensor:
    """``bits`` (int64) summed over every dim but ``dim``: one sum per position along ``dim``."""
    others = [d for d in range(bits.dim()) if d != dim]
    return bits.sum(dim=others) if others else bits


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The elements' bit patterns as integers, in ``values``' shape (equal values with different bits, e.g. -0.0,
    differ): a view of the same memory, except for complex128, whose two 64-bit halves are mixed into one int64."""
    values = values.detach()
    if values.dtype == torch.bool:
        return values.view(torch.uint8)
    if values.element_size() == 16:
        halves = torch.view_as_real(values).view(torch.int64)
        return halves[..., 0] * 3 + halves[..., 1]
    return values.view(_BITS_DTYPE[values.element_size()])


def _row_major_strides(shape: tuple[int, ...]) -> list[int]:
    strides, running = [], 1
    for length in reversed(shape):
        strides.append(running)
        running *= max(1, length)
    return strides[::-1]
