"""Pipeline stages: which blocks each stage holds, and a model cut down to one stage.

One split rule (:func:`split_stages`) for everything that needs to know where a block lives — the model builder
now, the migration geometry when stages change (issue #12). A decoder's blocks are split into ``pp`` contiguous
runs, each stage holding at least one block, so that the largest stage's parameter count is as small as it can be;
the embedding counts on the first stage and the final norm and output head on the last (with a large vocabulary
the end stages get fewer blocks; ``llama_125m``'s 256-token vocabulary weighs little: 16 blocks split 8/8, 5/6/5).

A model takes part by exposing two hooks (as :class:`~lightning_emig.models.llama.Llama` does):

* ``stage_costs() -> (per-block parameter counts, first-stage extra, last-stage extra)``;
* ``keep_stage(blocks: range, first: bool, last: bool)``: drop every block outside ``blocks`` and, unless it is the
  first or the last stage, the embedding or the norm and head; the kept modules keep their names, so a parameter's
  name is the same in every stage layout (the key the migration moves it by).

Scope today: the split and a stage module that ``torch.distributed.pipelining`` runs (loss and gradients equal
the unpipelined model's, ``tests/test_pipeline.py``). Not yet: ``pp > 1`` in the strategy, schedules from config,
TP/FSDP inside a stage, migration between stage layouts (issue #12).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def split_stages(block_costs: Sequence[int], pp: int, *, first_extra: int = 0, last_extra: int = 0) -> tuple[range, ...]:
    """``pp`` contiguous runs of block indices, each non-empty, covering every block, minimizing the largest stage's
    cost (its blocks' costs, plus ``first_extra`` on the first stage and ``last_extra`` on the last). Among equally
    good splits the earliest stages take the fewest blocks (a deterministic choice every process makes alike).

    Raises:
        ValueError: ``pp`` is not in ``1..len(block_costs)``.
    """
    n = len(block_costs)
    if not 1 <= pp <= n:
        raise ValueError(f"cannot split {n} blocks into {pp} pipeline stages: each stage needs at least one block")
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
        # Leave at least one block for each later stage.
        for stop in range(start + 1, n - (pp - 1 - stage) + 1):
            rest, stops = best(stage + 1, stop)
            options.append((max(stage_cost(stage, start, stop), rest), (stop, *stops)))
        return min(options)  # ties: the smallest stop first (tuples compare element by element)

    _, stops = best(0, 0)
    starts = (0, *stops[:-1])
    return tuple(range(a, b) for a, b in zip(starts, stops, strict=True))


def stage_ranges(model: nn.Module, pp: int) -> tuple[range, ...]:
    """The blocks of every stage of ``model`` (see the module docstring for its ``stage_costs`` hook)."""
    costs, first_extra, last_extra = model.stage_costs()  # type: ignore[operator]
    return split_stages(costs, pp, first_extra=first_extra, last_extra=last_extra)


def keep_stage(model: nn.Module, pp: int, stage: int) -> nn.Module:
    """Cut ``model`` down, in place, to pipeline stage ``stage`` of ``pp``; return it."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not one of the {pp} stages")
    blocks = stage_ranges(model, pp)[stage]
    model.keep_stage(blocks, first=stage == 0, last=stage == pp - 1)  # type: ignore[operator]
    return model


__all__ = ["keep_stage", "split_stages", "stage_ranges"]
