"""Who is who across a change: the processes taking part, their old and new ranks.

The unit is a *process*, named by a ``pid`` that persists across the change (any stable integer the membership
layer hands out). Its ``old_rank`` (``None`` for a joiner) and ``new_rank`` (``None`` for a leaver) are attributes;
an old rank held by no process is dead, and what only it held is lost. Pure: nothing touches ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field


class PlanError(ValueError):
    """Inputs the planner cannot plan from (mismatched tensors, a broken identity map)."""


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A process taking part in the change. ``node`` is any hashable id of its host."""

    pid: int
    node: Hashable = 0
    old_rank: int | None = None
    new_rank: int | None = None


@dataclass(frozen=True, slots=True)
class IdentityMap:
    """Which process keeps which old rank and gets which new rank.

    Every new rank ``0..new_world-1`` belongs to exactly one process; old ranks are unique, and an old rank of
    ``0..old_world-1`` that no process claims is dead. Lookups are dicts (linear in the world, never quadratic).
    """

    processes: tuple[ProcessInfo, ...]
    old_world: int
    new_world: int
    _by_pid: dict[int, ProcessInfo] = field(init=False, repr=False, compare=False)
    _by_old: dict[int, ProcessInfo] = field(init=False, repr=False, compare=False)
    _by_new: dict[int, ProcessInfo] = field(init=False, repr=False, compare=False)
    _new_of_old: tuple[int | None, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        procs = tuple(sorted(self.processes, key=lambda p: p.pid))
        object.__setattr__(self, "processes", procs)
        by_pid = {p.pid: p for p in procs}
        if len(by_pid) != len(procs):
            raise PlanError("process ids must be unique")
        by_old = _unique_index(procs, "old_rank", self.old_world)
        by_new = _unique_index(procs, "new_rank", self.new_world)
        if len(by_new) != self.new_world:
            missing = sorted(set(range(self.new_world)) - set(by_new))
            raise PlanError(f"new ranks {missing} have no process; every new rank needs one")
        object.__setattr__(self, "_by_pid", by_pid)
        object.__setattr__(self, "_by_old", by_old)
        object.__setattr__(self, "_by_new", by_new)
        new_of_old = tuple(by_old[r].new_rank if r in by_old else None for r in range(self.old_world))
        object.__setattr__(self, "_new_of_old", new_of_old)

    @classmethod
    def same_processes(cls, world: int, nodes: Sequence[Hashable] | None = None) -> IdentityMap:
        """A layout change on unchanged processes: pid = old rank = new rank."""
        nodes = nodes if nodes is not None else [0] * world
        return cls(tuple(ProcessInfo(r, nodes[r], r, r) for r in range(world)), world, world)

    @classmethod
    def first_ranks(cls, old_world: int, new_world: int) -> IdentityMap:
        """Processes ``0..max-1``, process ``p`` old rank ``p`` below ``old_world`` and new rank ``p`` below
        ``new_world``: a world that grows gains joiners at the top, one that shrinks loses its top processes."""
        return cls(tuple(ProcessInfo(p, 0, p if p < old_world else None, p if p < new_world else None)
                         for p in range(max(old_world, new_world))), old_world, new_world)

    def process(self, pid: int) -> ProcessInfo:
        try:
            return self._by_pid[pid]
        except KeyError:
            raise PlanError(f"process {pid} is not part of this change") from None

    def by_old_rank(self, rank: int) -> ProcessInfo | None:
        """The live process that held old ``rank``, or ``None`` when it is dead."""
        return self._by_old.get(rank)

    def by_new_rank(self, rank: int) -> ProcessInfo:
        return self._by_new[rank]

    def new_rank_of_old(self, rank: int) -> int | None:
        """The new rank of the live process that held old ``rank`` (``None``: dead, or it leaves)."""
        return self._new_of_old[rank]

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.processes)

    def union_rank(self, pid: int) -> int:
        """Rank of ``pid`` in a process group over old and new processes, ordered by pid."""
        self.process(pid)
        return self.pids.index(pid)

    @property
    def dead_old_ranks(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.old_world) if r not in self._by_old)


def _unique_index(procs: Iterable[ProcessInfo], attr: str, world: int) -> dict[int, ProcessInfo]:
    index: dict[int, ProcessInfo] = {}
    for p in procs:
        rank = getattr(p, attr)
        if rank is None:
            continue
        if not 0 <= rank < world:
            raise PlanError(f"process {p.pid} has {attr}={rank}, outside a world of {world}")
        if rank in index:
            raise PlanError(f"processes {index[rank].pid} and {p.pid} both claim {attr}={rank}")
        index[rank] = p
    return index
