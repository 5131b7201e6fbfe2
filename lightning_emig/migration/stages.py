"""Pipeline stages, by name (pure): which blocks each stage holds and which stage owns a tensor.

The one split rule of the project (the model builder, :mod:`lightning_emig.parallelize.pipeline`, the migration
geometry and the picker's cost model all use it): a decoder's blocks go to ``pp`` contiguous runs, each stage
holding at least one block, so that the largest stage's parameter count is as small as it can be; the embedding
counts on the first stage and everything outside the blocks and the embedding (final norm, output head) on the last.
Among equally good splits the earlier stages take fewer blocks (under 1F1B the first stage keeps the most
micro-batches' activations in flight). With a small vocabulary this is the even split; a large one gives the end
stages fewer blocks.

With ``pp_virtual`` stages per process (the interleaved schedule's layout) the model is split the same way into
``pp x pp_virtual`` stages and stage ``s`` goes to the process whose pipeline coordinate is ``s % pp``: each process
holds ``pp_virtual`` runs of blocks, the embedding is on process 0 and the head on process ``pp - 1``.

Names: ``layers.<i>.`` anywhere in a name puts it in block ``i``; a component in ``first_stage`` (the embedding)
puts it on stage 0; a buffer of the model's root module (``StageSplit.shared``: cutting a model to a stage keeps
it, e.g. a step counter) is held by every stage; everything else goes to the last stage.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lightning_emig.migration.boxes import GeometryError

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
FIRST_STAGE_NAMES = ("tok_embeddings", "embed_tokens", "embeddings")


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


def block_of(name: str) -> int | None:
    """The block index a name belongs to (``layers.<i>.``), or None."""
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None


def stage_costs_by_name(named_sizes: Iterable[tuple[str, int]], n_layers: int, *,
                        first_stage: Sequence[str] = FIRST_STAGE_NAMES) -> tuple[list[int], int, int]:
    """(elements per block, on the first stage only, on the last stage only) of named tensors: what
    :func:`split_stages` balances."""
    blocks, first, last = [0] * n_layers, 0, 0
    for name, size in named_sizes:
        block = block_of(name)
        if block is not None:
            if block >= n_layers:
                raise GeometryError(f"{name!r} names layer {block} but the model has {n_layers} layers")
            blocks[block] += size
        elif any(part in first_stage for part in name.split(".")):
            first += size
        else:
            last += size
    return blocks, first, last


def stage_ranges_by_name(named_sizes: Iterable[tuple[str, int]], n_layers: int, pp: int) -> tuple[range, ...]:
    """The blocks of every stage of a model whose tensors are ``named_sizes``."""
    costs, first, last = stage_costs_by_name(named_sizes, n_layers)
    return split_stages(costs, pp, first_extra=first, last_extra=last)


def stage_of(
    name: str,
    ranges: Sequence[range],
    *,
    first_stage: Sequence[str] = FIRST_STAGE_NAMES,
    extra_owner: Mapping[str, int] | None = None,
) -> int:
    """Pipeline stage owning a parameter (or optimizer-state entry) by name, given every stage's blocks.

    ``layers.<i>.`` anywhere in the name puts it on the stage holding block ``i``; a name with a component in
    ``first_stage`` goes to stage 0; ``extra_owner`` maps other component names to a stage; everything else (final
    norm, output head) goes to the last stage.
    """
    block = block_of(name)
    if block is not None:
        for stage, blocks in enumerate(ranges):
            if block in blocks:
                return stage
        raise GeometryError(f"{name!r} names layer {block} but the model has {ranges[-1].stop} layers")
    components = name.split(".")
    if extra_owner:
        for part in components:
            if part in extra_owner:
                return extra_owner[part]
    if any(part in first_stage for part in components):
        return 0
    return len(ranges) - 1


@dataclass(frozen=True, slots=True)
class StageSplit:
    """A whole model's stage costs (see :func:`stage_costs_by_name`): enough to split it for any ``pp``."""

    block_costs: tuple[int, ...]
    first_extra: int
    last_extra: int
    shared: tuple[str, ...] = ()
    """Names of the root module's own buffers, sorted: every stage keeps them, so every stage holds them. (A tuple:
    the specs' ``repr`` must read the same in every process, a frozenset's order varies with the hash seed.)"""

    @classmethod
    def by_name(cls, named_sizes: Iterable[tuple[str, int]], n_layers: int,
                shared: Iterable[str] = ()) -> StageSplit:
        costs, first, last = stage_costs_by_name(named_sizes, n_layers)
        return cls(tuple(costs), first, last, tuple(sorted(shared)))

    def ranges(self, pp: int) -> tuple[range, ...]:
        return _split_of(self, pp)

    def chunks_of(self, pp: int, process: int, pp_virtual: int = 1) -> tuple[range, ...]:
        """The blocks of each stage pipeline process ``process`` (of ``pp``) holds, in schedule order: stages
        ``process, process + pp, ...`` of the ``pp x pp_virtual``."""
        ranges = self.ranges(pp * pp_virtual)
        return tuple(ranges[process + chunk * pp] for chunk in range(pp_virtual))


@functools.lru_cache(maxsize=64)
def _split_of(split: StageSplit, pp: int) -> tuple[range, ...]:
    return split_stages(split.block_costs, pp, first_extra=split.first_extra, last_extra=split.last_extra)


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
    def of(cls, name: str, split: StageSplit, *, first_stage: Sequence[str] = FIRST_STAGE_NAMES) -> StageOwner:
        if name in split.shared:
            return cls(None, False, split, every=True)
        block = block_of(name)
        if block is not None and block >= len(split.block_costs):
            raise GeometryError(f"{name!r} names layer {block} but the model has {len(split.block_costs)} layers")
        return cls(block, block is None and any(part in first_stage for part in name.split(".")), split)

    def stage(self, pp: int, pp_virtual: int = 1) -> int | None:
        """The pipeline process (of ``pp``, each with ``pp_virtual`` stages) holding the tensor (None: every
        process holds a copy)."""
        if self.every:
            return None
        if self.block is not None:
            ranges = self.split.ranges(pp * pp_virtual)
            return next(stage for stage, blocks in enumerate(ranges) if self.block in blocks) % pp
        return 0 if self.first else pp - 1
