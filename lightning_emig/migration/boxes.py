"""Boxes of global tensors and what a rank holds of them (pure data, no torch).

* A :class:`ShardBox` is a half-open ``[start, stop)`` range per dim; a 0-dim box is one scalar.
* A :class:`Holding` is a tuple of disjoint :class:`LocalPiece` s: a global box plus where it starts in the
  holder's local tensor. The pieces' local boxes tile the local tensor exactly; an empty shard has no pieces.
* Splits follow ``torch.chunk``: chunk size ``ceil(L / n)``, so trailing chunks may be short or empty.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Interval = tuple[int, int]
Coordinate = tuple[int, ...]


class GeometryError(ValueError):
    """A shape, placement or coordinate that geometry cannot describe."""


# ---------------------------------------------------------------------------------------------------- boxes
@dataclass(frozen=True, slots=True)
class ShardBox:
    """A box of a global tensor: per dim a half-open ``[start, stop)`` range. A 0-dim box is one scalar."""

    bounds: tuple[Interval, ...]

    def __post_init__(self) -> None:
        for start, stop in self.bounds:
            if not 0 <= start <= stop:
                raise GeometryError(f"invalid box bounds {self.bounds}: need 0 <= start <= stop in every dim")

    @classmethod
    def full(cls, shape: Sequence[int]) -> ShardBox:
        return cls(tuple((0, int(n)) for n in shape))

    @classmethod
    def from_offset(cls, start: Sequence[int], shape: Sequence[int]) -> ShardBox:
        return cls(tuple((int(s), int(s) + int(n)) for s, n in zip(start, shape, strict=True)))

    @property
    def ndim(self) -> int:
        return len(self.bounds)

    @property
    def start(self) -> tuple[int, ...]:
        return tuple(a for a, _ in self.bounds)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.bounds)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_empty(self) -> bool:
        return self.numel == 0

    def intersect(self, other: ShardBox) -> ShardBox | None:
        """The common box, or ``None`` when the two share no element."""
        if self.ndim != other.ndim:
            raise GeometryError(f"cannot intersect a {self.ndim}-d box with a {other.ndim}-d box")
        bounds = tuple(
            (max(a, c), min(b, d)) for (a, b), (c, d) in zip(self.bounds, other.bounds, strict=True)
        )
        if any(a >= b for a, b in bounds):
            return None
        return ShardBox(bounds)

    def contains(self, other: ShardBox) -> bool:
        return all(a <= c and d <= b for (a, b), (c, d) in zip(self.bounds, other.bounds, strict=True))

    def slices_within(self, outer: ShardBox) -> tuple[slice, ...]:
        """Index of this box inside a tensor that holds exactly ``outer`` (``outer`` must contain it)."""
        if not outer.contains(self):
            raise GeometryError(f"{self} is not inside {outer}")
        return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(self.bounds, outer.bounds, strict=True))

    def split(self, parts: int) -> tuple[ShardBox, ...]:
        """Split into at most ``parts`` non-empty boxes along one dim, ``torch.chunk`` style.

        The first dim with at least ``parts`` indices is cut, so that sub-boxes of row-major data stay as contiguous as
        they can; failing that, the longest dim.
        """
        if parts < 1:
            raise GeometryError(f"cannot split a box into {parts} parts")
        if parts == 1 or self.ndim == 0 or self.is_empty:
            return (self,)
        shape = self.shape
        dim = next(
            (d for d, n in enumerate(shape) if n >= parts), max(range(self.ndim), key=lambda d: shape[d])
        )
        start, stop = self.bounds[dim]
        out = []
        for lo, hi in chunk_spans(stop - start, parts):
            if lo < hi:
                bounds = list(self.bounds)
                bounds[dim] = (start + lo, start + hi)
                out.append(ShardBox(tuple(bounds)))
        return tuple(out)

    def __repr__(self) -> str:
        return "ShardBox[" + ", ".join(f"{a}:{b}" for a, b in self.bounds) + "]"


@dataclass(frozen=True, slots=True)
class LocalPiece:
    """A global box held by a rank, and where its first element sits in that rank's local tensor."""

    global_box: ShardBox
    local_start: tuple[int, ...]

    @property
    def local_box(self) -> ShardBox:
        return ShardBox.from_offset(self.local_start, self.global_box.shape)

    def local_slices(self, sub: ShardBox) -> tuple[slice, ...]:
        """Index into the local tensor of the part ``sub`` (which must lie inside this piece)."""
        rel = sub.slices_within(self.global_box)
        return tuple(slice(s.start + o, s.stop + o) for s, o in zip(rel, self.local_start, strict=True))

    def local_offset(self, sub: ShardBox) -> tuple[int, ...]:
        """Local position of ``sub``'s first element (``sub`` inside this piece)."""
        return tuple(s.start for s in self.local_slices(sub))


@dataclass(frozen=True, slots=True)
class Holding:
    """Everything one coordinate holds of one tensor.

    ``global_offset`` follows DTensor's convention (the first global index per dim, the dim's global size where the
    shard is empty), so it compares directly with ``compute_local_shape_and_global_offset``.
    """

    local_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    pieces: tuple[LocalPiece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def is_empty(self) -> bool:
        return self.numel == 0

    @property
    def box(self) -> ShardBox:
        """The single box this holding is (an empty box for an empty shard); raises when it is several pieces."""
        if len(self.pieces) > 1:
            raise GeometryError(f"holding is {len(self.pieces)} separate pieces, not one box: {self.pieces}")
        if self.pieces:
            return self.pieces[0].global_box
        return ShardBox(
            tuple(
                (o, o) if n == 0 else (o, o + n)
                for o, n in zip(self.global_offset, self.local_shape, strict=True)
            )
        )

    def piece_containing(self, sub: ShardBox) -> LocalPiece:
        for piece in self.pieces:
            if piece.global_box.contains(sub):
                return piece
        raise GeometryError(f"{sub} is not inside one piece of this holding {self.pieces}")


def chunk_span(length: int, parts: int, index: int) -> Interval:
    """Chunk ``index`` of ``torch.chunk`` of ``length`` indices into ``parts`` (trailing ones may be short or empty)."""
    size = -(-length // parts)
    lo = min(index * size, length)
    return lo, min(lo + size, length)


def chunk_spans(length: int, parts: int) -> list[Interval]:
    """All ``parts`` chunks of ``torch.chunk`` of ``length`` indices."""
    return [chunk_span(length, parts, i) for i in range(parts)]
