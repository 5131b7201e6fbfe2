"""A model cut down to one pipeline stage.

Which blocks a stage holds is the project's one split rule (:mod:`lightning_emig.migration.stages`, shared with the
migration geometry and the picker): balanced by parameter count, counted by name. A model takes part through one
hook, as :class:`~lightning_emig.models.llama.Llama` does: ``keep_stage(blocks: range, first: bool, last: bool)``
drops every block outside ``blocks`` and, unless it is the first or the last stage, the embedding or the norm and
head. The kept modules keep their names, so a parameter's name is the same in every stage layout (the key the
migration moves it by).

The strategy trains a stage with torch's schedules (:mod:`lightning_emig.strategy.pipeline`); the state's specs
record each tensor's stage, so the migration moves state between any stage layouts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_emig.migration.state import stage_split_of

if TYPE_CHECKING:
    from torch import nn

    from lightning_emig.migration.stages import StageSplit


def stage_ranges(model: nn.Module, pp: int) -> tuple[range, ...]:
    """The blocks of every stage of ``model`` (the whole model's, also once it is cut to one stage)."""
    return _split(model).ranges(pp)


def _split(model: nn.Module) -> StageSplit:
    split = stage_split_of(model)
    if split is None:
        raise ValueError(f"{type(model).__name__} has no blocks(): it cannot be split into pipeline stages")
    return split


def keep_stage(model: nn.Module, pp: int, stage: int) -> nn.Module:
    """Cut ``model`` down, in place, to pipeline stage ``stage`` of ``pp``; return it. The whole model's split stays
    recorded on it (``pipeline_split``): its state's specs then say which stage holds each tensor for any ``pp``."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not one of the {pp} stages")
    split = _split(model)
    blocks = split.ranges(pp)[stage]
    model.keep_stage(blocks, first=stage == 0, last=stage == pp - 1)  # type: ignore[operator]
    model.pipeline_split = split
    return model


__all__ = ["keep_stage", "stage_ranges"]
