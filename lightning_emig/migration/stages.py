"""Pipeline stages (pure): which blocks each stage holds and which stage owns a tensor.

The one split rule of the project (the model builder, :mod:`lightning_emig.parallelize.pipeline`, the migration
geometry and the picker's cost model all use it): a decoder's blocks go to ``pp`` contiguous runs, each stage
holding at least one block, so that the largest stage's parameter count is as small as it can be; the first stage
also holds the embedding and the last everything else outside the blocks (final norm, output head).
Among equally good splits the earlier stages take fewer blocks (under 1F1B the first stage keeps the most
micro-batches' activations in flight). With a small vocabulary this is the even split; a large one gives the end
stages fewer blocks.

With ``pp_virtual`` stages per process (the interleaved schedule's layout) the model is split the same way into
``pp x pp_virtual`` stages and stage ``s`` goes to the process whose pipeline coordinate is ``s % pp``: each process
holds ``pp_virtual`` runs of blocks, the embedding is on process 0 and the head on process ``pp - 1``.

Which tensor is where is declared by the model, never guessed from names: the modules its ``blocks()`` returns
are the blocks, in that order (a tensor under block ``i``'s module path is in block ``i``); the modules its
``first_stage_modules()`` returns (the embedding) are on stage 0; a buffer of the model's root module
(``StageSplit.shared``: cutting a model to a stage keeps it, e.g. a step counter) is held by every stage; everything
else (final norm, output head) goes to the last stage. A split records these module paths, so a tensor's stage is
known by its name alone, also on a model already cut to one stage (its modules keep their names).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_emig.migration.boxes import GeometryError


def split_stages(block_costs: Sequence[int], pp: int, *, first_extra: int = 0,
                 last_extra: int = 0) -> tuple[range, ...]:
    """``pp`` contiguous, non-empty runs of block indices covering every block, minimizing the largest stage's cost
    (its blocks' costs, plus ``first_extra`` on the first stage and ``last_extra`` on the last); ties: the earlier
    stages take fewer blocks."""
    return _split_stages(tuple(int(c) for c in block_costs), pp, int(first_extra), int(last_extra))


@functools.lru_cache(maxsize=1024)
def _split_stages(block_costs: tuple[int, ...], pp: int, first_extra: int, last_extra: int) -> tuple[range, ...]:
    # Cached: the picker asks for the same model's split once per candidate layout (O(pp x blocks^2) each).
    n = len(block_costs)
    if not 1 <= pp <= n:
        raise GeometryError(f"cannot split {n} layers into {pp} pipeline stages (each stage needs at least one)")
    prefix = [0]
    for cost in block_costs:
        prefix.append(prefix[-1] + int(cost))

    def stage_cost(stage: int, start: int, stop: int) -> int:
        return (prefix[stop] - prefix[start] + (first_extra if stage == 0 else 0)
                + (last_extra if stage == pp - 1 else 0))

    @functools.cache
    def best(stage: int, start: int) -> tuple[int, tuple[int, ...]]:
        """(largest cost, stop of every stage) for stages ``stage..pp-1`` over blocks ``start..n-1``."""
        if stage == pp - 1:
            return stage_cost(stage, start, n), (n,)
        options = []
        for stop in range(start + 1, n - (pp - 1 - stage) + 1):  # at least one block for each later stage
            rest, stops = best(stage + 1, stop)
            options.append((max(stage_cost(stage, start, stop), rest), (stop, *stops)))
        return min(options)  # ties: the smallest stops first

    _, stops = best(0, 0)
    return tuple(range(a, b) for a, b in zip((0, *stops[:-1]), stops, strict=True))


def stage_holding(block: int | None, first: bool, ranges: Sequence[range], pp: int) -> int:
    """The pipeline process (of ``pp``) holding a tensor of ``block`` (None: outside the blocks; then ``first``:
    on the first stage, else on the last), given the blocks of every one of the ``len(ranges)`` stages (stage ``s``
    is on process ``s % pp``)."""
    if block is None:
        return 0 if first else pp - 1
    return next(stage for stage, blocks in enumerate(ranges) if block in blocks) % pp


@dataclass(frozen=True, slots=True)
class StageSplit:
    """A whole model's stage costs and where its tensors are, by module path: enough to split it for any ``pp`` and
    to tell which stage holds a tensor by its name. (Tuples throughout: the specs' ``repr`` must read the same in
    every process; a frozenset's order varies with the hash seed.)"""

    block_costs: tuple[int, ...]
    """Elements of each block."""
    first_extra: int
    """Elements outside the blocks on the first stage (the embedding)."""
    last_extra: int
    """Elements outside the blocks on the last stage (norm, head)."""
    blocks: tuple[str, ...] = ()
    """Module path of each block, in ``blocks()`` order."""
    first: tuple[str, ...] = ()
    """Module paths of the modules outside the blocks that the first stage holds (``first_stage_modules()``)."""
    shared: tuple[str, ...] = ()
    """Names of the root module's own buffers, sorted: every stage keeps them, so every stage holds them."""

    @classmethod
    def of_tensors(cls, named_sizes: Iterable[tuple[str, int]], *, blocks: Sequence[str], first: Sequence[str] = (),
                   shared: Iterable[str] = ()) -> StageSplit:
        """The split of a model whose tensors are ``named_sizes``, with blocks and first-stage modules at these
        module paths."""
        split = cls((0,) * len(blocks), 0, 0, tuple(blocks), tuple(first), tuple(sorted(shared)))
        costs, first_extra, last_extra = [0] * len(blocks), 0, 0
        for name, size in named_sizes:
            block = split.block_of(name)
            if block is not None:
                costs[block] += size
            elif split.on_first_stage(name):
                first_extra += size
            else:
                last_extra += size
        return cls(tuple(costs), first_extra, last_extra, split.blocks, split.first, split.shared)

    def with_prefix(self, prefix: str) -> StageSplit:
        """The same split named from a module that holds this model at ``prefix`` (``"model."``)."""
        def named(paths: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(prefix + path for path in paths)

        return StageSplit(self.block_costs, self.first_extra, self.last_extra, named(self.blocks), named(self.first),
                          named(self.shared))

    def block_of(self, name: str) -> int | None:
        """The block a tensor of this name belongs to, None outside the blocks."""
        return next((index for index, path in enumerate(self.blocks) if _under(name, path)), None)

    def on_first_stage(self, name: str) -> bool:
        """A tensor of this name is outside the blocks, on the first stage."""
        return any(_under(name, path) for path in self.first)

    def ranges(self, pp: int) -> tuple[range, ...]:
        return _split_of(self.block_costs, self.first_extra, self.last_extra, pp)

    def chunks_of(self, pp: int, process: int, pp_virtual: int = 1) -> tuple[range, ...]:
        """The blocks of each stage pipeline process ``process`` (of ``pp``) holds, in schedule order: stages
        ``process, process + pp, ...`` of the ``pp x pp_virtual``."""
        ranges = self.ranges(pp * pp_virtual)
        return tuple(ranges[process + chunk * pp] for chunk in range(pp_virtual))


def _under(name: str, path: str) -> bool:
    return name.startswith(path + ".") or name == path


@functools.lru_cache(maxsize=64)
def _split_of(block_costs: tuple[int, ...], first_extra: int, last_extra: int, pp: int) -> tuple[range, ...]:
    return split_stages(block_costs, pp, first_extra=first_extra, last_extra=last_extra)


@dataclass(frozen=True, slots=True)
class StageOwner:
    """Which stage holds a tensor under any ``pp``: its block (``None`` outside the blocks), whether it belongs to
    the first stage (the embedding) or to every stage (a root buffer), and the whole model's split. Tensors of one
    block share one owner."""

    block: int | None
    first: bool
    split: StageSplit
    every: bool = False

    @classmethod
    def of(cls, name: str, split: StageSplit) -> StageOwner:
        if name in split.shared:
            return cls(None, False, split, every=True)
        block = split.block_of(name)
        return cls(block, block is None and split.on_first_stage(name), split)

    def stage(self, pp: int, pp_virtual: int = 1) -> int | None:
        """The pipeline process (of ``pp``, each with ``pp_virtual`` stages) holding the tensor (None: every
        process holds a copy)."""
        if self.every:
            return None
        return stage_holding(self.block, self.first, self.split.ranges(pp * pp_virtual), pp)
