"""The training state as migratable tensors: each one's name, sharding under a layout, and local storage.

Keys are stable across layouts: ``param/<fqn>`` for parameters, ``buffer/<fqn>`` for persistent buffers and
``optim/<fqn>/<state>`` for per-parameter optimizer state (TP and FSDP2 never rename parameters). What moves is what
the module's and the optimizer's state dicts hold. Invariants:

* a parameter-shaped optimizer state (AdamW's ``exp_avg``, ``exp_avg_sq``) has its parameter's sharding;
* a scalar optimizer state (AdamW's ``step``) is held whole by every rank;
* anything else (a state of another shape) is refused with :class:`UnsupportedStateError`, never guessed;
* a DTensor's local shard has the shape our geometry computes from its placements (checked at capture);
* ``local`` is the tensor this rank actually trains with (``DTensor._local_tensor`` or the plain tensor), so
  writing into it changes the live state without a copy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from lightning_emig.layout import HybridLayout
from lightning_emig.migration.geometry import GeometryError, TensorSharding
from lightning_emig.migration.stages import StageOwner, StageSplit
from lightning_emig.models.base import blocks_of, declares_blocks, first_stage_modules_of, module_paths


class UnsupportedStateError(TypeError):
    """Optimizer state that is neither parameter-shaped nor scalar: we cannot know how it is sharded."""


@dataclass(frozen=True, slots=True)
class ShardingSpec:
    """What it takes to place a tensor on any rank of a layout: picklable, so it can be broadcast."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    mesh_dim_names: tuple[str, ...]
    placements: tuple[object, ...]
    owner: StageOwner | None = None
    """Which pipeline stage holds the tensor under any ``pp`` (None: a model without blocks, never pipelined)."""

    def on(self, layout: HybridLayout) -> TensorSharding:
        return _sharding_on(self, layout)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@functools.lru_cache(maxsize=4096)
def _sharding_on(spec: ShardingSpec, layout: HybridLayout) -> TensorSharding:
    """Geometry depends on (shape, placements, layout) only: a model has a handful of distinct ones, and a change
    asks for every state tensor's on both layouts, so it is computed once per distinct pair (the planner's inputs
    are immutable, sharing is safe)."""
    stage = None
    if layout.pp > 1:
        if spec.owner is None:
            raise GeometryError(f"a tensor of shape {spec.global_shape} has no pipeline stage owner, so it cannot be "
                                f"placed on {layout.describe()}: pipelining needs a model with blocks()")
        stage = spec.owner.stage(layout.pp, layout.pp_virtual)
    return TensorSharding.for_layout(spec.global_shape, layout, spec.mesh_dim_names, spec.placements, stage=stage)


@dataclass(frozen=True, slots=True)
class StateTensor:
    key: str
    spec: ShardingSpec
    local: torch.Tensor


def release_storage(state: dict[str, StateTensor], keep: frozenset[int] = frozenset()) -> None:
    """Free the storage of every tensor of ``state`` now (nothing may read it afterwards) but those in ``keep``
    (:func:`storages_of` what stays live). A dropped model's old modules sit in reference cycles (FSDP's hooks) that
    only a full ``gc.collect()`` would free, at 0.3-0.4 s on a trained process; freeing the storage itself costs
    nothing and is the same on GPUs (no cached block lingers)."""
    for tensor in state.values():
        if storage_key(tensor.local) not in keep:
            free_storage(tensor.local)


def storages_of(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """The storages ``tensors`` use (:func:`storage_key`): what a release must keep.

    Old state is not always gone state: the LightningModule's own parameters and buffers (a temperature, a running
    statistic registered on its root) are never dropped and rebuilt, so the same tensor is old and new state at once,
    and freeing it would free storage a live module reads (a segfault at its next use)."""
    return frozenset(storage_key(t) for t in tensors if t.numel() > 0)


def storage_key(tensor: torch.Tensor) -> int:
    return local_of(tensor).untyped_storage().data_ptr()


def free_storage(tensor: torch.Tensor) -> None:
    """Free ``tensor``'s storage now; its views read nothing afterwards (an empty tensor is left alone: its storage
    may be shared and is no memory)."""
    if tensor.numel() > 0:
        tensor.untyped_storage().resize_(0)


def spec_of(tensor: torch.Tensor) -> ShardingSpec:
    if isinstance(tensor, DTensor):
        names = tensor.device_mesh.mesh_dim_names
        if names is None:
            raise ValueError("a DTensor's mesh must have named axes to be migrated")
        spec = ShardingSpec(tuple(tensor.shape), tensor.dtype, tuple(names), tuple(tensor.placements))
        _check_local_geometry(spec, tensor)
        return spec
    # A plain tensor is whole on every rank (no TP, no FSDP: e.g. one process, or a scalar state).
    return ShardingSpec(tuple(tensor.shape), tensor.dtype, (), ())


class GeometryMismatchError(RuntimeError):
    """The shard this rank really holds differs from the one our geometry computes from its placements."""


def _check_local_geometry(spec: ShardingSpec, tensor: DTensor) -> None:
    """Fail loudly if the local shard's shape is not what the geometry planning relies on says (a change in how
    torch lays out ``_StridedShard`` or uneven shards would otherwise plan wrong boxes and move wrong bytes)."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        return
    expected = _expected_local_shape(spec.global_shape, tuple(tensor.device_mesh.shape), spec.placements,
                                     tuple(coordinate))
    actual = tuple(tensor._local_tensor.shape)  # noqa: SLF001 - the real local storage
    if expected != actual:
        raise GeometryMismatchError(
            f"a DTensor of global shape {spec.global_shape} with placements {spec.placements} holds a local shard "
            f"of shape {actual} at mesh coordinate {tuple(coordinate)}, but lightning_emig's geometry computes "
            f"{expected}: this torch version lays shards out differently; migration would move wrong bytes"
        )


@functools.lru_cache(maxsize=4096)
def _expected_local_shape(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[object, ...],
                          coordinate: tuple[int, ...]) -> tuple[int, ...] | None:
    holding = TensorSharding.create(global_shape, mesh_shape, placements).holding(coordinate)
    return tuple(holding.local_shape) if holding is not None else None


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # noqa: SLF001 - in-place access


def stage_split_of(model: torch.nn.Module) -> StageSplit | None:
    """The stage split of the model ``model`` is or holds (a LightningModule holds one), named as in ``model``:
    recorded on a model cut to one stage (``pipeline_split``), else computed from a model with ``blocks()``; None
    where there is no model with blocks (it cannot be pipelined)."""
    found = _splittable(model)
    if found is None:
        return None
    prefix, inner = found
    split = getattr(inner, "pipeline_split", None) or whole_model_split(inner)
    return split.with_prefix(prefix) if prefix else split


def whole_model_split(model: torch.nn.Module) -> StageSplit:
    """The split of a whole (uncut) model with ``blocks()``: its parameter counts, its blocks and first-stage modules
    as it declares them, its root buffers shared."""
    own_parameters = {name for name, _ in model.named_parameters(recurse=False)}
    root_buffers = [name for name in model.state_dict(keep_vars=True) if "." not in name and name not in own_parameters]
    return StageSplit.of_tensors(((name, p.numel()) for name, p in model.named_parameters()),
                                 blocks=module_paths(model, blocks_of(model), "blocks"),
                                 first=module_paths(model, first_stage_modules_of(model), "first_stage_modules"),
                                 shared=root_buffers)


def stage_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every module in ``model`` (itself included) cut to one pipeline stage."""
    return [(name, m) for name, m in model.named_modules() if getattr(m, "pipeline_split", None) is not None]


def holds_stage(model: torch.nn.Module) -> bool:
    """``model`` is, or holds, a model cut to one pipeline stage."""
    return bool(stage_modules(model))


def _splittable(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """The outermost module (and its name prefix) that is cut into a stage or declares a ``blocks()`` method."""
    for name, module in model.named_modules():
        if getattr(module, "pipeline_split", None) is not None or declares_blocks(module):
            return (name + "." if name else ""), module
    return None


def _owned(spec: ShardingSpec, name: str, split: StageSplit | None) -> ShardingSpec:
    return spec if split is None else dataclasses.replace(spec, owner=StageOwner.of(name, split))


def model_state(model: torch.nn.Module, split: StageSplit | None) -> Iterator[StateTensor]:
    """Everything ``model.state_dict()`` holds: parameters (``param/<fqn>``) and persistent buffers
    (``buffer/<fqn>``), sharded or not. A tensor registered under two names (tied weights) is moved once, under its
    first name. Non-tensor entries (``get_extra_state``) cannot be migrated and are refused by name."""
    parameters = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            raise UnsupportedStateError(
                f"module state {name!r} is a {type(value).__name__}, not a tensor (get_extra_state?): only tensor "
                "state can be migrated; keep it in a buffer or rebuild it in configure_model"
            )
        if id(value) in seen:
            continue
        seen.add(id(value))
        kind = "param" if id(value) in parameters else "buffer"
        yield StateTensor(f"{kind}/{name}", _owned(spec_of(value), name, split), local_of(value.data))


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    split: StageSplit | None) -> Iterator[StateTensor]:
    for name, param in model.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            check_optimizer_state(f"{name}/{key}", value, param)
            yield StateTensor(f"optim/{name}/{key}", _owned(spec_of(value), name, split), local_of(value))


def check_optimizer_state(name: str, value: object, param: torch.Tensor) -> None:
    """What can be migrated of an optimizer: per-parameter tensors, each shaped like its parameter or a scalar.

    Raises:
        UnsupportedStateError: for any other state (a Python number, a factored moment, a flat buffer).
    """
    if not isinstance(value, torch.Tensor):
        raise UnsupportedStateError(
            f"optimizer state {name} is a {type(value).__name__}, not a tensor; only tensor state "
            "(parameter-shaped or scalar) can be migrated"
        )
    if value.dim() != 0 and tuple(value.shape) != tuple(param.shape):
        raise UnsupportedStateError(
            f"optimizer state {name} has shape {tuple(value.shape)}, neither the parameter's "
            f"{tuple(param.shape)} nor a scalar; this optimizer cannot be migrated"
        )


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, StateTensor]:
    split = stage_split_of(model)  # each tensor's spec says which stage holds it under any pp
    tensors = list(model_state(model, split))
    if optimizer is not None:
        tensors += list(optimizer_state(model, optimizer, split))
    return {t.key: t for t in tensors}


def allocate_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, template: dict[str, ShardingSpec]
) -> dict[str, StateTensor]:
    """Create empty optimizer state for ``model``'s new parameters, with the keys (and dtypes) of ``template`` (a
    model cut to one pipeline stage: the keys of its own parameters).

    Parameter-shaped states take the new parameter's sharding (``empty_like`` of a DTensor keeps its mesh and
    placements); scalars are plain tensors, on the device torch's optimizers keep them on (the CPU, or the
    parameter's device for ``fused`` / ``capturable`` groups: a CUDA ``step`` on a plain group would cost a device
    sync per parameter per step). The tensors are installed in ``optimizer.state`` so the optimizer adopts them
    as they are once the transfer has filled them.
    """
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    out: dict[str, StateTensor] = {}
    for key, spec, state_name, param in _states_of_held_parameters(model, template):
        if _counter_like(spec, state_name, param):
            device = _scalar_state_device(groups.get(id(param), {}), param)
            value = torch.zeros((), dtype=spec.dtype, device=device)
        else:
            value = torch.empty_like(param.data, dtype=spec.dtype)
        optimizer.state[param][state_name] = value
        out[key] = StateTensor(key, dataclasses.replace(spec_of(value), owner=spec.owner), local_of(value))
    return out


def planned_optimizer_specs(model: torch.nn.Module, template: dict[str, ShardingSpec]) -> dict[str, ShardingSpec]:
    """The specs :func:`allocate_optimizer_state` gives ``model``'s optimizer state, without allocating it (a plan
    made before the state exists)."""
    out: dict[str, ShardingSpec] = {}
    for key, spec, state_name, param in _states_of_held_parameters(model, template):
        if _counter_like(spec, state_name, param):
            out[key] = ShardingSpec((), spec.dtype, (), (), owner=spec.owner)
        else:
            out[key] = dataclasses.replace(spec_of(param), dtype=spec.dtype, owner=spec.owner)
    return out


def _states_of_held_parameters(model: torch.nn.Module, template: dict[str, ShardingSpec]
                               ) -> Iterator[tuple[str, ShardingSpec, str, torch.nn.Parameter]]:
    """(key, spec, state name, parameter) for every optimizer state of ``template`` whose parameter ``model`` holds
    (a pipeline stage holds the state of its own parameters only)."""
    params = dict(model.named_parameters())
    stage = holds_stage(model)
    for key, spec in template.items():
        parts = _optimizer_key(key)
        if parts is None or (parts[0] not in params and stage):
            continue
        yield key, spec, parts[1], params[parts[0]]


def adopt_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, held: dict[str, StateTensor]
) -> set[str]:
    """Install the parameter-shaped optimizer state of ``held`` in ``optimizer.state`` as it is, without a copy: for
    a process that already holds it under the new model's layout, world and rank (what a drain or a rebuild from
    replicas left in plain buffers for the next fit). Each tensor becomes the local shard of a state shaped like its
    new parameter (same mesh and placements).

    Returns the keys settled, for the caller to leave out of the migration: every parameter-shaped optimizer state
    of ``held``, adopted where this model has the parameter, and under pipeline stages another stage's (held empty
    here: that stage adopts it). Scalars are left to the migration. Processes holding the same keys settle the same.

    Raises:
        ValueError: where a held tensor is not shaped as the new parameter's local shard: the layouts differ.
    """
    params = dict(model.named_parameters())
    settled: set[str] = set()
    for key, held_tensor in held.items():
        parts = _optimizer_key(key)
        if parts is None or held_tensor.spec.global_shape == ():
            continue
        settled.add(key)
        name, state_name = parts
        param = params.get(name)
        shape = tuple(held_tensor.local.shape)
        if param is None:  # another pipeline stage's parameter: held empty here, that stage adopts it
            if held_tensor.local.numel():
                raise ValueError(f"{key}: a shard {shape} is held for a parameter this model does not have: it "
                                 "cannot be adopted as it is")
            continue
        if shape != tuple(local_of(param).shape):
            raise ValueError(f"{key}: the held shard {shape} is not the new parameter's "
                             f"{tuple(local_of(param).shape)}: it cannot be adopted as it is")
        value = held_tensor.local
        if isinstance(param, DTensor):
            value = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                       shape=param.shape, stride=param.stride())
        optimizer.state[param][state_name] = value
    return settled


def _optimizer_key(key: str) -> tuple[str, str] | None:
    """(parameter name, state name) of an ``optim/<parameter>/<state>`` key; None for any other key."""
    kind, rest = key.split("/", 1)
    if kind != "optim":
        return None
    name, state_name = rest.rsplit("/", 1)
    return name, state_name


def _counter_like(spec: ShardingSpec, state_name: str, param: torch.Tensor) -> bool:
    """Whether an optimizer state is a per-parameter counter (torch's ``step``: a plain scalar, kept where torch's
    optimizers keep it) rather than shaped like its parameter. A 0-dim parameter's moments are scalars too, yet live
    with the parameter (its device, its mesh): only there does the name decide."""
    if spec.global_shape != ():
        return False
    return param.dim() != 0 or state_name == "step"


def _scalar_state_device(group: dict[str, object], param: torch.Tensor) -> torch.device:
    if group.get("fused") or group.get("capturable"):
        return local_of(param).device
    return torch.device("cpu")
