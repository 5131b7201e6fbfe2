"""What a model must offer to be parallelized and initialized by :mod:`lightning_emig.parallelize`.

Invariants:

* parameter names (``named_parameters``) never change under tensor parallelism or FSDP2, so a name identifies
  the same logical tensor in every layout — geometry, planner and initialization all key on it;
* pipeline stages (``pp > 1``) are declared, never guessed from names: ``blocks()`` lists the blocks, the optional
  ``first_stage_modules()`` the modules outside them that the first stage holds (the embedding; all others go to
  the last stage), and ``keep_stage(blocks, first=, last=)`` cuts the model to one stage's share (see
  :mod:`lightning_emig.parallelize.pipeline`, which checks every stage's cut against the declaration);
* a :class:`TensorParallelPlan` is a pair of ``parallelize_module`` plans: one applied to the root module, one
  applied to each block returned by ``blocks()``, so a pipeline stage that dropped some blocks still works;
* ``init_full_parameter`` fills the *full* (unsharded) value of a parameter from a generator, so the same seed
  gives the same full weights whatever the layout and world.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ParallelStyle


class TensorParallelPlan(NamedTuple):
    """Tensor-parallel plans keyed by submodule path (``parallelize_module`` format)."""

    root: dict[str, ParallelStyle]
    """Applied to the whole model: embedding, final norm, output projection."""
    block: dict[str, ParallelStyle]
    """Applied to each block in ``model.blocks()``; paths are relative to the block."""
    sequence_dim: int | None = None
    """Dim of the model's input that sequence parallelism shards (its size must divide by the TP degree)."""


@runtime_checkable
class ParallelizableModel(Protocol):
    """The hooks :func:`lightning_emig.parallelize.parallelize_model` and ``materialize_and_init`` use."""

    def tensor_parallel_plan(self) -> TensorParallelPlan: ...

    def blocks(self) -> list[nn.Module]: ...

    def init_full_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None: ...

    def init_buffers(self) -> None: ...


def declares_blocks(model: nn.Module) -> bool:
    """``model``'s class defines a ``blocks()`` method (the :class:`ParallelizableModel` protocol).

    Only a method counts: an attribute that happens to be named ``blocks`` (timm's and many GPT codes'
    ``self.blocks = nn.ModuleList(...)``) is the user's own container, not a declaration; nothing is guessed from it.
    """
    return inspect.isfunction(getattr(type(model), "blocks", None))


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The blocks ``model`` declares with its ``blocks()`` method; none if it declares none (then the whole model is
    one FSDP2 unit, and it cannot be cut into pipeline stages)."""
    return list(model.blocks()) if declares_blocks(model) else []  # type: ignore[operator]


def first_stage_modules_of(model: nn.Module) -> list[nn.Module]:
    """The modules outside the blocks that a pipeline's first stage holds (the embedding), as ``model`` declares
    them with its ``first_stage_modules()`` method; none if it declares none (all of them go to the last stage)."""
    declared = getattr(type(model), "first_stage_modules", None)
    return list(model.first_stage_modules()) if inspect.isfunction(declared) else []  # type: ignore[operator]


def module_paths(model: nn.Module, modules: list[nn.Module], what: str) -> tuple[str, ...]:
    """The paths of ``modules`` inside ``model`` (``what`` names them in the error when one is not in it)."""
    paths = {id(module): name for name, module in model.named_modules()}
    missing = [type(module).__name__ for module in modules if id(module) not in paths]
    if missing:
        raise ValueError(f"{type(model).__name__}.{what}() returned modules that are not submodules of it: {missing}")
    return tuple(paths[id(module)] for module in modules)


def tied_parameter_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter registered under more than one name in ``model`` (tied weights), in registration
    order."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]
