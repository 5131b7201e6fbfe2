"""Pipeline-stage ownership of whole parameters, by name (pure).

Blocks are split into contiguous runs per stage (the first ``n_layers % pp`` stages take one more); a name
containing ``layers.<i>.`` belongs to block ``i``'s stage, embeddings to stage 0, everything else to the last.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from lightning_emig.migration.boxes import GeometryError

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def stage_layer_ranges(n_layers: int, pp: int) -> tuple[range, ...]:
    """Contiguous blocks of layers per pipeline stage; the first ``n_layers % pp`` stages get one extra."""
    if pp < 1 or n_layers < pp:
        raise GeometryError(f"cannot split {n_layers} layers into {pp} pipeline stages")
    base, extra = divmod(n_layers, pp)
    ranges, start = [], 0
    for stage in range(pp):
        stop = start + base + (1 if stage < extra else 0)
        ranges.append(range(start, stop))
        start = stop
    return tuple(ranges)


def stage_of(
    name: str,
    pp: int,
    n_layers: int,
    *,
    first_stage: Sequence[str] = ("tok_embeddings", "embed_tokens", "embeddings"),
    extra_owner: Mapping[str, int] | None = None,
) -> int:
    """Pipeline stage owning a parameter (or optimizer-state entry) by name.

    ``layers.<i>.`` anywhere in the name puts it on the stage of block ``i`` (see :func:`stage_layer_ranges`); a
    name with a component in ``first_stage`` goes to stage 0; ``extra_owner`` maps other component names to a
    stage; everything else (final norm, output head) goes to the last stage.
    """
    match = _LAYER_INDEX.search(name)
    if match:
        layer = int(match.group(1))
        for stage, layers in enumerate(stage_layer_ranges(n_layers, pp)):
            if layer in layers:
                return stage
        raise GeometryError(f"{name!r} names layer {layer} but the model has {n_layers} layers")
    components = name.split(".")
    if extra_owner:
        for part in components:
            if part in extra_owner:
                return extra_owner[part]
    if any(part in first_stage for part in components):
        return 0
    return pp - 1
