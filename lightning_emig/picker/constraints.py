"""What the user allows the layout picker to choose: the ``elastic.picker`` settings, validated once.

Invariants of a :class:`PickerConstraints` (checked in ``__post_init__``, every error a :class:`PickerError` that
names the key to change):

* allowed degrees per axis are ``None`` (any) or a sorted tuple of distinct positive ints;
* ``pp > 1`` is allowed (in the degree lists or the table) only with ``allow_pp=True``: only a model that can be cut
  into stages trains with them;
* ``table`` maps a world size to a :class:`~lightning_emig.layout.HybridLayout` that fits in that world;
* an unknown key in :meth:`PickerConstraints.from_mapping` is an error listing the valid ones, never dropped.

Checks that need the model (heads, sequence length) are :meth:`PickerConstraints.check_model`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from lightning_emig.layout import GRAD_SYNC_DEFERRALS, PIPELINE_SCHEDULES, HybridLayout, LayoutError

if TYPE_CHECKING:
    from lightning_emig.models.llama import LlamaConfig

AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp", "pp")
PP_OPT_IN = "pipeline stages are opt-in (the model must be one that can be cut into stages, see keep_stage)"


class PickerError(ValueError):
    """Picker settings that cannot be used, or a world for which no layout is feasible."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PickerConstraints:
    """Limits on the layouts the picker may choose, and the facts about the hardware it needs."""

    dp_replicate: tuple[int, ...] | None = None
    """Allowed HSDP replica degrees; ``None``: any."""
    dp_shard: tuple[int, ...] | None = None
    """Allowed FSDP2 shard degrees; ``None``: any."""
    tp: tuple[int, ...] | None = None
    """Allowed tensor-parallel degrees; ``None``: any the model's heads, kv heads and FFN width divide."""
    pp: tuple[int, ...] | None = None
    """Allowed pipeline degrees; ``None``: only 1 unless ``allow_pp``."""
    tp_within_node: bool = True
    """Keep every TP group inside one node (``tp`` divides ``devices_per_node``): TP talks every layer."""
    devices_per_node: int = 8
    """Accelerators per node; ranks fill nodes in order, so rank ``r`` is on node ``r // devices_per_node``."""
    device_memory_gb: float | None = None
    """Memory of one device in GB (1e9 bytes); ``None``: unbounded (CPU runs)."""
    usable_memory_fraction: float = 0.9
    """Share of ``device_memory_gb`` the estimate may fill; the rest covers the CUDA context, NCCL buffers and the
    caching allocator's fragmentation, which the memory model does not count."""
    micro_batch_sizes: tuple[int, ...] | int = (1, 2, 4, 8)
    """Candidate micro batch sizes, or an int ``m`` meaning any of ``1..m``."""
    allow_pp: bool = False
    """Let the search use ``pp > 1``; off by default: only a model that can be cut into stages (``keep_stage``)
    trains with them."""
    pipeline_schedule: str = "gpipe"
    """The schedule training runs stages with (the strategy's ``pipeline_schedule``): ``gpipe`` keeps every
    micro-batch's activations until its backward, ``1f1b`` at most ``pp`` and needs at least ``pp`` micro-batches."""
    defer_grad_sync: str = "replicas"
    """Which gradient reductions training leaves to a step's last micro-batch (the strategy's ``defer_grad_sync``):
    ``replicas`` (HSDP's all-reduce), ``all`` (the reduce-scatter too: unsharded gradients held) or ``none``."""
    mixed_precision: Literal["bf16", "fp32"] = "bf16"
    """``bf16``: bf16 compute with fp32 master weights, gradients and optimizer state; ``fp32``: all fp32."""
    activation_checkpointing: Literal["auto"] | bool = "auto"
    """Recompute each block in backward: ``True``, ``False`` or ``"auto"`` (only where it is needed to fit)."""
    table: Mapping[int, HybridLayout] = field(default_factory=dict)
    """Explicit ``world size -> layout`` entries that override the search (``-1`` fills the world)."""
    idle_devices_allowed: bool = True
    """Let the picker leave devices idle when that is faster or when no layout uses them all."""
    tie_tolerance: float = 0.02
    """Step times within this fraction of the fastest are a near-tie, broken by idle devices, then migration bytes."""

    def __post_init__(self) -> None:
        for axis in AXES:
            object.__setattr__(self, axis, _degrees(axis, getattr(self, axis)))
        _require_bool("tp_within_node", self.tp_within_node)
        _require_bool("allow_pp", self.allow_pp)
        _require_bool("idle_devices_allowed", self.idle_devices_allowed)
        _require_positive_int("devices_per_node", self.devices_per_node)
        object.__setattr__(self, "micro_batch_sizes", _micro_sizes(self.micro_batch_sizes))
        self._check_numbers()
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise PickerError(f"pipeline_schedule must be one of {list(PIPELINE_SCHEDULES)}, "
                              f"got {self.pipeline_schedule!r}")
        if self.defer_grad_sync not in GRAD_SYNC_DEFERRALS:
            raise PickerError(f"defer_grad_sync must be one of {list(GRAD_SYNC_DEFERRALS)}, "
                              f"got {self.defer_grad_sync!r}")
        if self.mixed_precision not in ("bf16", "fp32"):
            raise PickerError(f"mixed_precision must be 'bf16' or 'fp32', got {self.mixed_precision!r}")
        if self.activation_checkpointing not in ("auto", True, False):
            raise PickerError(
                f"activation_checkpointing must be 'auto', true or false, got {self.activation_checkpointing!r}"
            )
        if not self.allow_pp and self.pp is not None and max(self.pp) > 1:
            raise PickerError(
                f"pp={list(self.pp)} allows pipeline stages but allow_pp is false: {PP_OPT_IN}; "
                "set pp=[1] (or leave it unset), or allow_pp=true to plan for it anyway"
            )
        if self.tp is not None and self.tp_within_node and not any(self.devices_per_node % t == 0 for t in self.tp):
            raise PickerError(
                f"no allowed tp={list(self.tp)} keeps tensor parallelism within a node of {self.devices_per_node}"
                f" devices; allow a tp dividing {self.devices_per_node} or set tp_within_node=false"
            )
        object.__setattr__(self, "table", self._checked_table(self.table))

    def _check_numbers(self) -> None:
        memory = self.device_memory_gb
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float)) or memory <= 0):
            raise PickerError(f"device_memory_gb must be a positive number or null (unbounded), got {memory!r}")
        if not 0 < self.usable_memory_fraction <= 1:
            raise PickerError(f"usable_memory_fraction must be in (0, 1], got {self.usable_memory_fraction!r}")
        if not 0 <= self.tie_tolerance < 0.5:
            raise PickerError(f"tie_tolerance must be in [0, 0.5), got {self.tie_tolerance!r}")

    def _checked_table(self, table: Mapping[Any, Any]) -> dict[int, HybridLayout]:
        if not isinstance(table, Mapping):
            raise PickerError(f"table must map world sizes to layouts, got {table!r}")
        out: dict[int, HybridLayout] = {}
        for key, value in sorted(table.items(), key=lambda kv: int(kv[0])):
            world = _table_world(key)
            layout = _table_layout(world, value)
            if layout.pp > 1 and not self.allow_pp:
                raise PickerError(f"table[{world}]: pp={layout.pp} but allow_pp is false: {PP_OPT_IN}")
            out[world] = layout
        return out

    # --------------------------------------------------------------------------- queries
    @property
    def device_memory_bytes(self) -> float | None:
        """Bytes an estimate may fill on one device, ``None`` when unbounded."""
        if self.device_memory_gb is None:
            return None
        return self.device_memory_gb * 1e9 * self.usable_memory_fraction

    def micro_batch_options(self) -> tuple[int, ...]:
        sizes = self.micro_batch_sizes
        return tuple(range(1, sizes + 1)) if isinstance(sizes, int) else sizes

    def checkpointing_options(self) -> tuple[bool, ...]:
        """Activation checkpointing settings to try, cheapest (no recomputation) first."""
        if self.activation_checkpointing == "auto":
            return (False, True)
        return (bool(self.activation_checkpointing),)

    def allowed(self, axis: str, degree: int) -> bool:
        values = getattr(self, axis)
        if axis == "pp" and values is None:
            return degree == 1 or self.allow_pp
        return values is None or degree in values

    def check_model(self, model: LlamaConfig, *, seq_len: int) -> None:
        """Raise :class:`PickerError` for settings no layout of this model can meet."""
        if seq_len > model.max_seq_len:
            raise PickerError(f"seq_len {seq_len} exceeds the model's max_seq_len {model.max_seq_len}")
        if self.tp is not None and not any(_tp_fits(model, t) for t in self.tp):
            raise PickerError(
                f"no allowed tp={list(self.tp)} divides the model's heads ({model.n_heads}), kv heads "
                f"({model.n_kv_heads}) and FFN width ({model.ffn_hidden}); valid tp for this model: "
                f"{[t for t in range(1, model.n_kv_heads + 1) if _tp_fits(model, t)]}"
            )
        for world, layout in self.table.items():
            try:
                model.validate_layout(layout)
            except LayoutError as error:
                raise PickerError(f"table[{world}]: {error}") from None

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> PickerConstraints:
        """Build from a plain mapping (a Hydra section); unknown keys are an error naming the valid ones."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in mapping if k not in valid)
        if unknown:
            raise PickerError(f"unknown picker key(s) {unknown}; valid keys: {', '.join(valid)}")
        return cls(**dict(mapping))


def _tp_fits(model: LlamaConfig, tp: int) -> bool:
    return all(n % tp == 0 for n in (model.n_heads, model.n_kv_heads, model.ffn_hidden))


def _degrees(axis: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    values = [value] if isinstance(value, int) else value
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise PickerError(f"{axis} must be null (any), an int or a non-empty list of ints, got {value!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PickerError(f"{axis} degrees must be positive ints, got {v!r} in {value!r}")
    return tuple(sorted(set(values)))


def _micro_sizes(value: Any) -> tuple[int, ...] | int:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise PickerError(f"micro_batch_sizes as a maximum must be >= 1, got {value}")
        return value
    sizes = _degrees("micro_batch_sizes", value)
    if sizes is None:
        raise PickerError("micro_batch_sizes must be a list of sizes or a maximum, not null")
    return sizes


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise PickerError(f"{name} must be true or false, got {value!r}")


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PickerError(f"{name} must be a positive int, got {value!r}")


def _table_world(key: Any) -> int:
    try:
        world = int(key)
    except (TypeError, ValueError):
        raise PickerError(f"table keys are world sizes (positive ints), got {key!r}") from None
    if world < 1:
        raise PickerError(f"table keys are world sizes (positive ints), got {key!r}")
    return world


def _table_layout(world: int, value: Any) -> HybridLayout:
    if isinstance(value, HybridLayout):
        layout = value
    elif isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in AXES)
        if unknown:
            raise PickerError(f"table[{world}]: unknown layout key(s) {unknown}; valid keys: {', '.join(AXES)}")
        try:
            layout = HybridLayout(**{k: value[k] for k in AXES if k in value})
        except LayoutError as error:
            raise PickerError(f"table[{world}]: {error}") from None
    else:
        raise PickerError(f"table[{world}] must be a layout mapping such as {{dp_shard: -1, tp: 2}}, got {value!r}")
    return _fit_in_world(world, layout)


def _fit_in_world(world: int, layout: HybridLayout) -> HybridLayout:
    if not layout.is_resolved:
        try:
            return layout.resolve(world)
        except LayoutError as error:
            raise PickerError(f"table[{world}]: {error}") from None
    if layout.world_size > world:
        raise PickerError(
            f"table[{world}]: {layout.describe()} needs {layout.world_size} devices but the world has {world}"
        )
    return layout
