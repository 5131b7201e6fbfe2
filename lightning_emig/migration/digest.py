"""A digest of the training state that no layout changes, and the sums that show every replica agrees.

The state is read as 32-bit *words*: an element of 4 bytes is one word (its bit pattern), a narrower one is widened
to one (bool and uint8 zero-extended, 2-byte types sign-extended), a wider one is its 2 (8 bytes) or 4 (complex128)
words in memory order, as if its tensor's last dim were that many times longer. A 0-d tensor counts as a 1-d tensor of
one element. ``g`` is a word's **global** flat index and ``p_d`` its global position along dim ``d``.

The *state digest* is two 32-bit halves, each a sum over every tensor's words modulo 2**32, with weights drawn from the
tensor's key and the word's global position:

* low half: ``word x (2 * (g + salt) + 1)`` (``salt``: the key's CRC-32);
* high half: ``word x (sum_d (2 * p_d + 1) * m_d + c)``, with odd ``m_d`` and ``c`` from another hash of the key.

Both depend on the full tensors only: the same state laid out on 1 process or 64, sharded, tensor-parallel or in
pipeline stages has the same digest, so it proves a migration bit-exact (the digest before a change equals the
digest after it) and a checkpoint intact (the digest saved with it equals the digest of what was loaded, whatever the
new world). Each half is computed from the words summed per position along each dim, modulo 2**32 (a ring, so a sum
split across processes and added later gives the same number): integer reductions that need no widening of 32-bit
state, at several GB/s on one core. (Proofs before ``DIGEST_VERSION`` 2 summed in 64 bits, widening every element: half
the speed. The two do not compare.)

Each rank adds what it holds; an element held by several ranks (replicas: HSDP's ``dp_replicate``, a tensor-parallel
replicated norm, a scalar held by every rank) must be counted once. A tensor with ``R`` replicas has them at replica
index ``0 .. R-1`` (the rank's position among the ranks holding the same piece); a rank adds its sums into every slot
``j`` of ``L = world / pp`` slots with ``j = index mod R`` (``R`` divides ``L``: it is a product of mesh degrees).
After a SUM over all ranks, every slot holds the full digest, once per tensor, *read from a different replica*: slots
that differ mean replicas that differ. One all-reduce of ``2 L`` integers checks both. A plain (not DTensor) buffer may
differ between ranks by design (BatchNorm's running statistics without SyncBatchNorm): its first replica's value is
added to every slot, counted and never compared.

Not a cryptographic hash: a guard against state that silently went wrong (a replica that missed an update, a shard
restored from another step, a transfer that wrote the wrong place), cheap enough to run at every change.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping

import torch

from lightning_emig.layout import HybridLayout
from lightning_emig.migration.boxes import LocalPiece
from lightning_emig.migration.state import StateTensor

DIGEST_VERSION = 2
"""Which digest a :class:`~lightning_emig.consistency.StateProof` holds (1: the 64-bit one before this module's two
halves, in proofs saved by earlier releases)."""

_CHUNK_ELEMENTS = 1 << 18
"""Elements reduced at once: a chunk and its partial sums stay in cache (a 25M-element embedding reduced in one call
ran several times slower per element)."""

_HALF = 0xFFFF_FFFF

_NARROW_BITS = {1: torch.uint8, 2: torch.int16}


def replica_slots(state: Mapping[str, StateTensor], layout: HybridLayout, rank: int,
                  device: torch.device | str) -> torch.Tensor:
    """This rank's contribution: ``world / pp`` slots of two int64 halves (module docstring). SUM them over all ranks;
    every slot then holds the state digest (:func:`combined`), each slot read from other replicas."""
    return digest_sums(state, layout, rank, device)[0]


def combined(sums: torch.Tensor) -> list[int]:
    """The digests, as unsigned 64-bit numbers, of rows of halves summed over ranks (low half in the low 32 bits)."""
    return [((high & _HALF) << 32) | (low & _HALF) for low, high in sums.tolist()]


def digest_sums(state: Mapping[str, StateTensor], layout: HybridLayout, rank: int, device: torch.device | str,
                only: Callable[[str], bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contributions, in one pass: the replica slots (:func:`replica_slots`) and, per tensor in sorted
    key order, its first replica's halves. SUM both over all ranks: the second then holds every tensor's own digest
    (layout-independent too), which names the tensors that differ where two states' digests do. Every half is below
    2**32, so the SUM over any world fits in int64.

    ``only`` (a test of the key) sums some tensors and leaves the others' positions zero: the sums of two calls whose
    ``only`` split the keys add up to one call's."""
    slots = [[0, 0] for _ in range(layout.world_size // layout.pp)]
    per_tensor = [[0, 0] for _ in state]
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
        low = high = 0
        for piece in holding.pieces:
            piece_low, piece_high = _piece_sum(tensor.local, piece, tensor.spec.global_shape, key)
            low, high = low + piece_low, high + piece_high
        low, high = low & _HALF, high & _HALF
        # per_rank: the first replica's value in every slot (in the digest, never compared)
        for slot in (slots if per_rank else slots[index::len(replicas)]):
            slot[0], slot[1] = (slot[0] + low) & _HALF, (slot[1] + high) & _HALF
        if index == 0:  # each key comes once: its position is written once
            per_tensor[position] = [low, high]
    return (torch.tensor(slots, dtype=torch.int64, device=device).reshape(-1, 2),
            torch.tensor(per_tensor, dtype=torch.int64, device=device).reshape(-1, 2))


def _per_rank(key: str, tensor: StateTensor) -> bool:
    """A buffer that is not a DTensor may legitimately differ between ranks (BatchNorm's running statistics without
    SyncBatchNorm, a per-rank counter): the digest counts its first replica's value and does not compare the others
    (a buffer sharded under one layout and plain under another counts the same under both)."""
    return key.startswith("buffer/") and not tensor.spec.placements


def _salts(key: str) -> tuple[int, int]:
    """The low half's ``salt`` and the high half's seed (module docstring): two tensors swapped (or one restored under
    another's name) weigh their words differently."""
    return zlib.crc32(key.encode()), zlib.crc32(key.encode(), 0x5BD1E995)


def _high_multiplier(seed: int, dim: int) -> int:
    """The high half's odd ``m_d`` (``dim`` >= 0) and ``c`` (``dim`` = -1)."""
    return ((seed ^ (0x9E3779B9 * (dim + 2))) | 1) & _HALF


def _piece_sum(local: torch.Tensor, piece: LocalPiece, global_shape: tuple[int, ...], key: str) -> tuple[int, int]:
    """The two halves of one piece, modulo 2**32. Computed from the words summed along each dim: with ``S_d[p]`` the
    words at global position ``p`` of dim ``d`` summed, ``A_d = sum_p p * S_d[p]`` and ``T`` all words summed, the low
    half is ``sum_d 2 * stride_d * A_d + (2 * salt + 1) * T`` and the high half ``sum_d m_d * (2 * A_d + T) + c * T``:
    one 32-bit reduction per dim, in cache-sized chunks of rows, and a dot product per dim."""
    if local.dim():
        region, bounds, shape = local[piece.local_slices(piece.global_box)], piece.global_box.bounds, global_shape
    else:
        region, bounds, shape = local.reshape(1), ((0, 1),), (1,)
    if region.numel() == 0:
        return 0, 0
    per_element = max(1, region.element_size() // 4)  # words per element
    last = region.dim() - 1
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(1, region[0].numel()))
    widened = (torch.empty(min(region.numel(), rows_per_chunk * max(1, region[0].numel())), dtype=torch.int32,
                           device=local.device) if region.element_size() < 4 else None)
    first_dim: list[torch.Tensor] = []  # S_0, chunk by chunk
    other_dims: list[torch.Tensor] = []  # S_1 .. S_(n-1), added over chunks
    for first in range(0, region.shape[0], rows_per_chunk):
        words = _words(region[first:first + rows_per_chunk], widened)
        first_dim.append(_sums_along(words, 0).to(torch.int64))
        sums = [_sums_along(words, dim).to(torch.int64) for dim in range(1, words.dim())]
        other_dims = sums if not other_dims else [kept + more for kept, more in zip(other_dims, sums, strict=True)]
    along = [first_dim[0] if len(first_dim) == 1 else torch.cat(first_dim), *other_dims]
    strides = _row_major_strides((*shape[:-1], shape[-1] * per_element))
    salt, seed = _salts(key)
    total = int(along[0].sum())
    low, high = (2 * salt + 1) * total, _high_multiplier(seed, -1) * total
    for dim, ((begin, _), sums) in enumerate(zip(bounds, along, strict=True)):
        begin *= per_element if dim == last else 1
        weighted = int((sums * torch.arange(begin, begin + sums.numel(), dtype=torch.int64,
                                            device=local.device)).sum())
        low += 2 * strides[dim] * weighted
        high += _high_multiplier(seed, dim) * (2 * weighted + total)
    return low & _HALF, high & _HALF


def _words(values: torch.Tensor, widened: torch.Tensor | None) -> torch.Tensor:
    """``values``' 32-bit words (module docstring) as int32, in ``values``' shape but for a last dim as many times
    longer as an element has words: a view of the same memory where it can be, else a copy (into ``widened`` for
    narrow types)."""
    values = values.detach()
    size = values.element_size()
    if size == 4:
        return values.view(torch.int32)
    if size < 4:
        bits = values.view(torch.uint8) if values.dtype == torch.bool else values.view(_NARROW_BITS[size])
        assert widened is not None
        return widened[:bits.numel()].view(bits.shape).copy_(bits)
    as_words = values.unsqueeze(-1)
    if as_words.stride(-2) != 1:  # the elements of the last dim are not adjacent: their words are not either
        as_words = as_words.contiguous()
    return as_words.view(torch.int32).flatten(-2)


def _sums_along(words: torch.Tensor, dim: int) -> torch.Tensor:
    """``words`` (int32) summed over every dim but ``dim``, modulo 2**32: one sum per position along ``dim``."""
    others = [d for d in range(words.dim()) if d != dim]
    return words.sum(dim=others, dtype=torch.int32) if others else words


def _row_major_strides(shape: tuple[int, ...]) -> list[int]:
    strides, running = [], 1
    for length in reversed(shape):
        strides.append(running)
        running *= max(1, length)
    return strides[::-1]
