"""Migration planner: who sends which box of which tensor to whom, computed by each process for itself.

Pure: inputs are the tensors' old and new :class:`~lightning_emig.migration.geometry.TensorSharding` and an
:class:`IdentityMap`; nothing touches ``torch.distributed``.

Identity. The unit is a *process* (:mod:`~lightning_emig.migration.identity`): what only a dead old rank held is
lost.

Invariants (the tests hold them):

* minimal bytes: every element a process needs under the new layout arrives exactly once; an element it already
  holds is copied locally and never sent, so bytes received = the intersection minimum for this identity map;
* every transfer is a box inside one piece of the sender's old holding and one piece of the receiver's new holding;
* consistency without communication: the sends that process A plans to B equal, in order, the receives that B plans
  from A; both sides evaluate the same deterministic choice on the same fragment (no hashing of strings, no sets in
  the output order);
* order: transfers between a pair are sorted by ``(tensor name, box)``, the same on both sides, so point-to-point
  operations posted in list order match;
* cost per process grows with its own pieces and the peers overlapping them, never with world², and with the
  kinds of tensor (old sharding, new sharding, element size), not their number.

Replica choice: among the live holders of a fragment, holders on the receiver's node are preferred; a fragment of
at least ``PlanOptions.split_min_bytes`` is split evenly over those holders, a smaller one goes to the holder picked
by rotating on ``new_rank + tensor index``, so receivers of the same shard spread over its replicas.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from lightning_emig.migration.geometry import LocalPiece, ShardBox, Source, TensorSharding
from lightning_emig.migration.identity import IdentityMap, PlanError, ProcessInfo


class StateLostError(RuntimeError):
    """Some state was held only by dead processes; it must come from a checkpoint."""


# ------------------------------------------------------------------------------------------------ inputs
@dataclass(frozen=True, slots=True)
class TensorMigration:
    """One state tensor (a parameter or an optimizer-state tensor) under the old and the new layout."""

    name: str
    itemsize: int
    """Bytes per element."""
    old: TensorSharding
    new: TensorSharding

    def __post_init__(self) -> None:
        if self.old.global_shape != self.new.global_shape:
            raise PlanError(
                f"{self.name}: global shape changes from {self.old.global_shape} to {self.new.global_shape}; "
                "migration moves state, it cannot reshape it"
            )
        if self.itemsize < 1:
            raise PlanError(f"{self.name}: element size must be positive, got {self.itemsize}")


@dataclass(frozen=True, slots=True)
class PlanOptions:
    split_min_bytes: int = 1 << 20
    """A fragment at least this large is split evenly over its eligible replicas."""
    prefer_same_node: bool = True
    """Take a fragment from a holder on the receiver's node when there is one."""
    allow_lost: bool = False
    """Report fragments no live process holds in ``RankPlan.lost`` instead of raising :class:`StateLostError`."""


# ----------------------------------------------------------------------------------------------- outputs
@dataclass(frozen=True, slots=True)
class Transfer:
    """One box of one tensor from ``src`` to ``dst`` (process ids; equal for a local copy).

    ``src_start`` / ``dst_start`` locate the box's first element in the sender's old and the receiver's new local
    tensor: the data is ``old_local[box placed at src_start]`` and goes to ``new_local[box placed at dst_start]``.
    """

    tensor: str
    box: ShardBox
    src: int
    dst: int
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    nbytes: int

    @property
    def sort_key(self) -> tuple[str, tuple[tuple[int, int], ...]]:
        return (self.tensor, self.box.bounds)

    def src_slices(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + n) for s, n in zip(self.src_start, self.box.shape, strict=True))

    def dst_slices(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + n) for s, n in zip(self.dst_start, self.box.shape, strict=True))


@dataclass(frozen=True, slots=True)
class LostFragment:
    tensor: str
    box: ShardBox
    nbytes: int


@dataclass(frozen=True, slots=True)
class RankPlan:
    """Everything one process does: local copies, then sends and receives grouped by peer in canonical order."""

    pid: int
    old_rank: int | None
    new_rank: int | None
    copies: tuple[Transfer, ...]
    sends: tuple[Transfer, ...]
    """Sorted by (dst, tensor, box)."""
    recvs: tuple[Transfer, ...]
    """Sorted by (src, tensor, box)."""
    lost: tuple[LostFragment, ...] = ()

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted({t.dst for t in self.sends} | {t.src for t in self.recvs}))

    def sends_to(self, pid: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.sends if t.dst == pid)

    def recvs_from(self, pid: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.recvs if t.src == pid)

    @property
    def bytes_sent(self) -> int:
        return sum(t.nbytes for t in self.sends)

    @property
    def bytes_received(self) -> int:
        return sum(t.nbytes for t in self.recvs)

    @property
    def bytes_copied(self) -> int:
        return sum(t.nbytes for t in self.copies)


# ---------------------------------------------------------------------------------------------- planning
def plan_for_rank(
    tensors: Sequence[TensorMigration],
    identity: IdentityMap,
    pid: int,
    options: PlanOptions = PlanOptions(),
) -> RankPlan:
    """The plan of process ``pid`` alone, derived without communication (every process gets the same answers).

    A model has hundreds of state tensors but a handful of distinct (old sharding, new sharding, element size):
    the fragments of one such kind are worked out once (:class:`_KindPlan`) and named for each tensor of it."""
    me = identity.process(pid)
    copies: list[Transfer] = []
    recvs: list[Transfer] = []
    sends: list[Transfer] = []
    lost: list[LostFragment] = []
    kinds: dict[tuple[TensorSharding, TensorSharding, int], _KindPlan] = {}
    for index, tensor in enumerate(_ordered(tensors, identity)):
        kind = (tensor.old, tensor.new, tensor.itemsize)
        if kind not in kinds:
            kinds[kind] = _KindPlan(tensor, me, identity, options)
        for item in kinds[kind].items(tensor.name, index):
            if isinstance(item, LostFragment):
                lost.append(item)
            elif item.src == item.dst:
                copies.append(item)
            elif item.dst == me.pid:
                recvs.append(item)
            else:
                sends.append(item)
    return _finish(me, copies, sends, recvs, lost, options)


class _KindPlan:
    """What ``me`` copies, receives and sends of every tensor of one kind (old sharding, new sharding, element
    size). The boxes and peers depend on the tensor only through its index, and on that only modulo the number
    of candidates of each fragment (the replica rotation): each fragment's choices are worked out per residue,
    on first use, and named for each tensor."""

    __slots__ = ("_choices", "_first")

    def __init__(self, first: TensorMigration, me: ProcessInfo, identity: IdentityMap, options: PlanOptions) -> None:
        self._first = first
        self._choices: list[_Choice] = []
        if me.new_rank is not None:
            self._choices.extend(_receiver_choices(first, me, identity, options))
        if me.old_rank is not None:
            self._choices.extend(_sender_choices(first, me, identity, options))

    def items(self, name: str, index: int) -> Iterator[Transfer | LostFragment]:
        for choice in self._choices:
            for item in choice.at(index):
                yield item if name == self._first.name else _named(item, name)


def _named(item: Transfer | LostFragment, name: str) -> Transfer | LostFragment:
    """``item`` for the tensor ``name`` (built directly: ``dataclasses.replace`` costs several times more)."""
    if isinstance(item, LostFragment):
        return LostFragment(name, item.box, item.nbytes)
    return Transfer(name, item.box, item.src, item.dst, item.src_start, item.dst_start, item.nbytes)


class _Choice:
    """One fragment's transfers as a function of the tensor's index, which matters modulo ``period`` only."""

    __slots__ = ("_made", "_make", "_period")

    def __init__(self, period: int, make: Callable[[int], Iterable[Transfer | LostFragment]]) -> None:
        self._period, self._make = period, make
        self._made: dict[int, tuple[Transfer | LostFragment, ...]] = {}

    def at(self, index: int) -> tuple[Transfer | LostFragment, ...]:
        residue = index % self._period
        if residue not in self._made:
            self._made[residue] = tuple(self._make(residue))
        return self._made[residue]


def _receiver_choices(
    tensor: TensorMigration, me: ProcessInfo, identity: IdentityMap, options: PlanOptions
) -> Iterator[_Choice]:
    """Everything ``me`` needs of a tensor of ``tensor``'s kind: one choice per (old distinct piece x new piece)
    fragment (a copy, transfers from its holders, or lost)."""
    assert me.new_rank is not None
    holding = tensor.new.holding_of_rank(me.new_rank)
    if holding is None:
        return
    for new_piece in holding.pieces:
        for source in tensor.old.sources(new_piece.global_box):
            holders = _Holders(source, identity)
            fixed = holders.holds(me.old_rank) or not holders.live
            period = 1 if fixed else len(_candidates(holders, me, options))
            yield _Choice(period, functools.partial(_fragment_transfers, tensor, holders=holders, new_piece=new_piece,
                                                    receiver=me, options=options))


def _sender_choices(
    tensor: TensorMigration, me: ProcessInfo, identity: IdentityMap, options: PlanOptions
) -> Iterator[_Choice]:
    """What ``me`` sends of a tensor of ``tensor``'s kind: one choice per (fragment, receiver lacking it), which
    replays the receiver's choice and keeps ``me``'s part."""
    assert me.old_rank is not None
    holding = tensor.old.holding_of_rank(me.old_rank)
    if holding is None:
        return
    replicas = tensor.old.replica_ranks(me.old_rank)
    for old_piece in holding.pieces:
        holders = _Holders(Source(old_piece, replicas), identity)
        for target in tensor.new.sources(old_piece.global_box):
            for new_rank in _receivers_lacking(target, holders, identity):
                receiver = identity.by_new_rank(new_rank)
                period = len(_candidates(holders, receiver, options)) if holders.live else 1
                yield _Choice(period, functools.partial(_share, me, tensor, holders=holders, new_piece=target.piece,
                                                        receiver=receiver, options=options))


def _share(sender: ProcessInfo, tensor: TensorMigration, index: int, *, holders: _Holders, new_piece: LocalPiece,
           receiver: ProcessInfo, options: PlanOptions) -> Iterator[Transfer]:
    part = _share_of(sender, tensor, index, holders, new_piece, receiver, options)
    if part is not None:
        yield _transfer(tensor, part, sender, receiver, holders.piece, new_piece)


def plan_all(
    tensors: Sequence[TensorMigration],
    identity: IdentityMap,
    options: PlanOptions = PlanOptions(),
) -> dict[int, RankPlan]:
    """Every process's plan at once (tests, simulators). Sends are derived from the receivers' side only, so
    comparing with :func:`plan_for_rank` checks that the two sides agree."""
    ordered = _ordered(tensors, identity)
    copies: dict[int, list[Transfer]] = {p: [] for p in identity.pids}
    sends: dict[int, list[Transfer]] = {p: [] for p in identity.pids}
    recvs: dict[int, list[Transfer]] = {p: [] for p in identity.pids}
    lost: dict[int, list[LostFragment]] = {p: [] for p in identity.pids}
    for me in identity.processes:
        if me.new_rank is None:
            continue
        for index, tensor in enumerate(ordered):
            for item in _receiver_fragments(tensor, index, me, identity, options):
                if isinstance(item, LostFragment):
                    lost[me.pid].append(item)
                elif item.src == me.pid:
                    copies[me.pid].append(item)
                else:
                    recvs[me.pid].append(item)
                    sends[item.src].append(item)
    return {
        p.pid: _finish(p, copies[p.pid], sends[p.pid], recvs[p.pid], lost[p.pid], options)
        for p in identity.processes
    }


def _ordered(tensors: Sequence[TensorMigration], identity: IdentityMap) -> list[TensorMigration]:
    # Sorting by name makes the canonical order independent of how each process happened to list its state.
    ordered = sorted(tensors, key=lambda t: t.name)
    for a, b in itertools.pairwise(ordered):
        if a.name == b.name:
            raise PlanError(f"tensor {a.name!r} is listed twice")
    for t in ordered:
        if (t.old.world_size, t.new.world_size) != (identity.old_world, identity.new_world):
            raise PlanError(
                f"{t.name}: its meshes span {t.old.world_size} -> {t.new.world_size} ranks but the identity map "
                f"is for {identity.old_world} -> {identity.new_world}"
            )
    return ordered


def _finish(
    me: ProcessInfo,
    copies: list[Transfer],
    sends: list[Transfer],
    recvs: list[Transfer],
    lost: list[LostFragment],
    options: PlanOptions,
) -> RankPlan:
    if lost and not options.allow_lost:
        total = sum(f.nbytes for f in lost)
        names = sorted({f.tensor for f in lost})
        raise StateLostError(
            f"process {me.pid} (new rank {me.new_rank}) needs {total} bytes of {len(names)} tensors "
            f"(e.g. {names[:3]}) that no live process holds; restore them from a checkpoint "
            "(plan with PlanOptions(allow_lost=True) to get the list)"
        )
    return RankPlan(
        pid=me.pid,
        old_rank=me.old_rank,
        new_rank=me.new_rank,
        copies=tuple(sorted(copies, key=lambda t: t.sort_key)),
        sends=tuple(sorted(sends, key=lambda t: (t.dst, *t.sort_key))),
        recvs=tuple(sorted(recvs, key=lambda t: (t.src, *t.sort_key))),
        lost=tuple(sorted(lost, key=lambda f: (f.tensor, f.box.bounds))),
    )


def _receiver_fragments(
    tensor: TensorMigration, index: int, me: ProcessInfo, identity: IdentityMap, options: PlanOptions
) -> Iterator[Transfer | LostFragment]:
    """Everything ``me`` needs of ``tensor``, the tensor worked out on its own (:func:`plan_all`)."""
    for choice in _receiver_choices(tensor, me, identity, options):
        yield from choice.at(index)


def _receivers_lacking(target: Source, holders: _Holders, identity: IdentityMap) -> list[int]:
    """New ranks of ``target`` whose process does not hold ``holders.piece`` (those copy it locally, ``me`` among
    them), ascending. Set operations: with HSDP both lists are as long as the world is wide."""
    holding = map(identity.new_rank_of_old, holders.ranks)
    return sorted(set(target.ranks).difference(holding))


class _Holders:
    """A distinct old piece with its holders: their old ranks (ascending), and the live processes among them (all,
    by node), worked out on first use: a receiver holding the piece copies it and needs no list of the others, which
    with HSDP replicas is as long as the world is wide."""

    __slots__ = ("_by_node", "_identity", "_live", "piece", "ranks")

    def __init__(self, source: Source, identity: IdentityMap) -> None:
        self.piece: LocalPiece = source.piece
        self.ranks: tuple[int, ...] = source.ranks
        self._identity = identity
        self._live: tuple[ProcessInfo, ...] | None = None
        self._by_node: dict[Hashable, tuple[ProcessInfo, ...]] = {}

    def holds(self, old_rank: int | None) -> bool:
        if old_rank is None:
            return False
        at = bisect.bisect_left(self.ranks, old_rank)
        return at < len(self.ranks) and self.ranks[at] == old_rank

    @property
    def live(self) -> tuple[ProcessInfo, ...]:
        if self._live is None:
            # ordered by old rank (source.ranks is sorted): the same list on every process
            self._live = tuple(p for p in (self._identity.by_old_rank(r) for r in self.ranks) if p is not None)
            by_node: dict[Hashable, list[ProcessInfo]] = {}
            for p in self._live:
                by_node.setdefault(p.node, []).append(p)
            self._by_node = {n: tuple(ps) for n, ps in by_node.items()}
        return self._live

    @property
    def by_node(self) -> dict[Hashable, tuple[ProcessInfo, ...]]:
        self.live  # noqa: B018 - fills the index
        return self._by_node


def _fragment_transfers(
    tensor: TensorMigration,
    index: int,
    holders: _Holders,
    new_piece: LocalPiece,
    receiver: ProcessInfo,
    options: PlanOptions,
) -> Iterator[Transfer | LostFragment]:
    """How ``receiver`` gets the part of ``new_piece`` inside ``holders.piece``: a copy, transfers, or lost."""
    fragment = holders.piece.global_box.intersect(new_piece.global_box)
    if fragment is None:
        return
    if holders.holds(receiver.old_rank):
        yield _transfer(tensor, fragment, receiver, receiver, holders.piece, new_piece)
        return
    if not holders.live:
        yield LostFragment(tensor.name, fragment, fragment.numel * tensor.itemsize)
        return
    candidates = _candidates(holders, receiver, options)
    for part, sender in _choose_senders(fragment, tensor.itemsize, candidates, receiver, index, options):
        yield _transfer(tensor, part, sender, receiver, holders.piece, new_piece)


def _candidates(holders: _Holders, receiver: ProcessInfo, options: PlanOptions) -> tuple[ProcessInfo, ...]:
    """The live holders ``receiver`` may take a fragment from, ascending by old rank."""
    return (holders.by_node.get(receiver.node) if options.prefer_same_node else None) or holders.live


def _choose_senders(
    fragment: ShardBox,
    itemsize: int,
    candidates: tuple[ProcessInfo, ...],
    receiver: ProcessInfo,
    index: int,
    options: PlanOptions,
) -> list[tuple[ShardBox, ProcessInfo]]:
    """Deterministic replica choice: big fragments split over the candidates, small ones rotated over them.

    Rotating on the receiver's new rank spreads the receivers of one shard over its replicas; adding the tensor's
    index spreads the tensors one receiver needs.
    """
    rotation = _rotation(receiver, index)
    n = len(candidates)
    if _is_split(fragment, itemsize, n, options):
        return [(part, candidates[(k + rotation) % n]) for k, part in enumerate(_split(fragment, n))]
    return [(fragment, candidates[rotation % n])]


def _rotation(receiver: ProcessInfo, index: int) -> int:
    return (receiver.new_rank or 0) + index


def _is_split(fragment: ShardBox, itemsize: int, candidates: int, options: PlanOptions) -> bool:
    """Whether a fragment is split over its candidates (else one of them sends it whole)."""
    return candidates > 1 and fragment.numel * itemsize >= options.split_min_bytes


def _share_of(
    sender: ProcessInfo,
    tensor: TensorMigration,
    index: int,
    holders: _Holders,
    new_piece: LocalPiece,
    receiver: ProcessInfo,
    options: PlanOptions,
) -> ShardBox | None:
    """The part of ``receiver``'s fragment that :func:`_choose_senders` gives ``sender`` (``None``: nothing), found
    from the sender's position among the candidates: with HSDP a fragment is split over as many replicas as the
    world is wide, and a sender replays the choice of every receiver it may serve."""
    fragment = holders.piece.global_box.intersect(new_piece.global_box)
    if fragment is None or not holders.live:
        return None
    candidates = _candidates(holders, receiver, options)
    position = bisect.bisect_left(candidates, sender.old_rank, key=lambda p: p.old_rank)
    if position == len(candidates) or candidates[position].pid != sender.pid:
        return None
    rotation = _rotation(receiver, index)
    n = len(candidates)
    if _is_split(fragment, tensor.itemsize, n, options):
        parts = _split(fragment, n)
        k = (position - rotation) % n  # part k goes to candidate (k + rotation) % n
        return parts[k] if k < len(parts) else None
    return fragment if rotation % n == position else None


@functools.lru_cache(maxsize=4096)
def _split(fragment: ShardBox, parts: int) -> tuple[ShardBox, ...]:
    # the receivers of one replicated shard (and their senders' replays) split the same fragment
    return fragment.split(parts)


def _transfer(
    tensor: TensorMigration,
    box: ShardBox,
    sender: ProcessInfo,
    receiver: ProcessInfo,
    old_piece: LocalPiece,
    new_piece: LocalPiece,
) -> Transfer:
    return Transfer(
        tensor=tensor.name,
        box=box,
        src=sender.pid,
        dst=receiver.pid,
        src_start=old_piece.local_offset(box),
        dst_start=new_piece.local_offset(box),
        nbytes=box.numel * tensor.itemsize,
    )
