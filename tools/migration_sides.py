"""The state a migration benchmark moves: transitions between layouts, and a model's state filled with a pattern.

Every local shard is filled with an exact function of (state key, global element index) over the box the geometry
says it holds (``step`` is 1.0), so bit-exactness is checked on every new rank against the same function, with
nothing gathered (:func:`check_pattern`); :func:`check_full` cross-checks the geometry against DTensor's own rules.
Used by ``tools/bench_migration.py``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_emig.layout import (
    DEFAULT_RANK_ORDER,
    SHORT_LETTERS,
    HybridLayout,
    LayoutError,
    LayoutMesh,
    build_mesh,
    degrees_from_short,
)
from lightning_emig.migration.state import (
    ShardingSpec,
    allocate_optimizer_state,
    free_storage,
    local_of,
    spec_of,
    training_state,
)
from lightning_emig.models.llama import get_model_config
from lightning_emig.testing.llama import laid_out_llama

_RANK_AXES = {letter: name for letter, name in SHORT_LETTERS.items() if name in DEFAULT_RANK_ORDER}
_MASK = (1 << 24) - 1  # pattern values are multiples of 2**-24 in [-0.5, 0.5): exact in float32
_MULT = 2654435761  # odd, so index -> index * _MULT is a bijection modulo 2**24


# ------------------------------------------------------------------------------------------- transitions
@dataclass(frozen=True, slots=True)
class Transition:
    """``old:new`` in short form: ``r`` dp_replicate, ``s`` dp_shard, ``t`` tp, ``p`` pp; e.g. ``s4:t2s2``."""

    name: str
    old: dict[str, int]
    new: dict[str, int]

    @property
    def old_world(self) -> int:
        return HybridLayout(**self.old).world_size

    @property
    def new_world(self) -> int:
        return HybridLayout(**self.new).world_size


def _parse_side(text: str) -> dict[str, Any]:
    text, _, order = text.partition("@")
    degrees: dict[str, Any] = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, **degrees_from_short(text)}
    if order:
        if sorted(order) != sorted(_RANK_AXES):
            raise ValueError(f"bad rank order {order!r}: the four letters r/s/t/p, slowest first, e.g. rspt")
        degrees["rank_order"] = tuple(_RANK_AXES[a] for a in order)
    return degrees


def parse_transitions(text: str, world: int) -> list[Transition]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        old, sep, new = item.partition(":")
        if not sep:
            raise ValueError(f"bad transition {item!r}: write OLD:NEW, e.g. s4:t2s2")
        t = Transition(item, _parse_side(old), _parse_side(new))
        if max(t.old_world, t.new_world) != world:
            raise ValueError(
                f"transition {item} spans {max(t.old_world, t.new_world)} processes but --world is {world}: every "
                "process takes part (the larger of the two worlds must be --world)"
            )
        out.append(t)
    return out


# ------------------------------------------------------------------------------------- deterministic state
def pattern(key: str, shape: tuple[int, ...], bounds: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Exact float32 value of every element of ``bounds`` of state tensor ``key`` (a function of its global index)."""
    if key.endswith("/step"):
        return torch.ones((), dtype=torch.float32)
    index = torch.zeros([1] * len(shape), dtype=torch.int64)
    stride = 1
    for dim in reversed(range(len(shape))):
        lo, hi = bounds[dim]
        view = [1] * len(shape)
        view[dim] = hi - lo
        index = index + torch.arange(lo, hi, dtype=torch.int64).mul_(stride).view(view)
        stride *= shape[dim]
    values = index.mul_(_MULT).add_(zlib.crc32(key.encode())).bitwise_and_(_MASK).to(torch.float32)
    return values.mul_(2.0**-24).sub_(0.5)


@dataclass(slots=True)
class Side:
    """One layout's model and optimizer on this process (absent where the process is not in that world)."""

    layout: HybridLayout
    mesh: LayoutMesh
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every state tensor (DTensor or plain) by migration key, detached, sharing the live storage."""
    specs: dict[str, ShardingSpec] = field(default_factory=dict)
    """Each tensor's spec as the migration sees it (with its pipeline stage owner)."""


def _state_tensors(model: Any, optimizer: Any) -> dict[str, Any]:
    out = {}
    for name, param in model.named_parameters():
        out[f"param/{name}"] = param.detach()
        for state_name, value in optimizer.state[param].items():
            out[f"optim/{name}/{state_name}"] = value
    return out


def _pieces(side: Side, key: str, rank: int) -> list[tuple[Any, tuple[slice, ...], tuple[int, ...], Any]]:
    """``(local tensor, local slices, global shape, global bounds)`` of every piece ``rank`` holds of ``key``."""
    tensor = side.tensors[key]
    spec = side.specs[key]
    holding = spec.on(side.layout).holding_of_rank(rank)
    local = local_of(tensor)
    return [
        (local, p.local_slices(p.global_box), spec.global_shape, p.global_box.bounds) for p in holding.pieces
    ]


def fill_pattern(side: Side, rank: int) -> None:
    for key in side.tensors:
        for local, slices, shape, bounds in _pieces(side, key, rank):
            local[slices] = pattern(key, shape, bounds).to(local.dtype)


def check_pattern(side: Side, rank: int) -> str | None:
    """The first key whose local data differs from the source pattern, or None when every element is exact."""
    for key in side.tensors:
        for local, slices, shape, bounds in _pieces(side, key, rank):
            if not torch.equal(local[slices], pattern(key, shape, bounds).to(local.dtype)):
                return key
    return None


def check_full(side: Side) -> str | None:
    """Every tensor made full by DTensor's own rules equals the pattern over its whole shape (a collective)."""
    for key, tensor in side.tensors.items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        shape = tuple(full.shape)
        if not torch.equal(full, pattern(key, shape, tuple((0, n) for n in shape)).to(full.dtype)):
            return key
    return None


def reset_nan(side: Side) -> None:
    for tensor in side.tensors.values():
        local_of(tensor).fill_(float("nan"))


# ------------------------------------------------------------------------------------------ meshes, models
def layout_mesh(degrees: dict[str, int], world: int, cache: dict[Any, Any]) -> LayoutMesh | None:
    """The layout's mesh over processes ``0..world-1``, None off it (a collective: every process calls it)."""
    key = (tuple(sorted(degrees.items())), world)
    if key not in cache:
        layout = HybridLayout(**degrees).resolve(world)
        mesh = build_mesh(layout, "cpu", ranks=None if world == dist.get_world_size() else list(range(world)))
        cache[key] = mesh if mesh.root.get_coordinate() is not None else None
    return cache[key]


def build_side(model_name: str, layout_mesh: LayoutMesh) -> Side:
    """Meta model -> parallelize -> allocate, plus an AdamW with allocated state (data filled separately)."""
    model = laid_out_llama(get_model_config(model_name), layout_mesh, seed=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    template = {}
    for name, param in model.named_parameters():
        template[f"optim/{name}/exp_avg"] = template[f"optim/{name}/exp_avg_sq"] = spec_of(param)
        template[f"optim/{name}/step"] = ShardingSpec((), torch.float32, (), ())
    allocate_optimizer_state(model, optimizer, template)
    specs = {key: t.spec for key, t in training_state(model, optimizer).items()}
    return Side(layout_mesh.layout, layout_mesh, model, optimizer, _state_tensors(model, optimizer), specs)


# ------------------------------------------------------------------------------------------------ memory
def release(side: Side) -> None:
    """Free a side's storage now (its tensors must not be read again)."""
    for tensor in side.tensors.values():
        free_storage(local_of(tensor))


def reallocate(side: Side) -> None:
    """Give a released side fresh storage of its old size (allocated, not yet touched)."""
    for tensor in side.tensors.values():
        local = local_of(tensor)
        if local.untyped_storage().nbytes() == 0:
            local.untyped_storage().resize_(local.numel() * local.element_size())


def locals_of(side: Side | None) -> dict[str, torch.Tensor]:
    return {k: local_of(t) for k, t in side.tensors.items()} if side is not None else {}


def transitions_for(model_name: str, transitions: list[Transition]) -> tuple[list[Transition], list[str]]:
    """The transitions ``model_name`` can take (both sides valid for its shape), and why each other one cannot
    (e.g. ``tiny``'s two blocks cannot make four pipeline stages)."""
    config = get_model_config(model_name)
    kept, skipped = [], []
    for t in transitions:
        try:
            for side, world in ((t.old, t.old_world), (t.new, t.new_world)):
                config.validate_layout(HybridLayout(**side).resolve(world))
        except LayoutError as error:
            skipped.append(f"{model_name} {t.name}: {error}")
        else:
            kept.append(t)
    return kept, skipped
