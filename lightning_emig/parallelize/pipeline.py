"""A model cut down to one pipeline process's stages.

Which blocks a stage holds is the project's one split rule (:mod:`lightning_emig.migration.stages`, shared with the
migration geometry and the picker): balanced by parameter count. A model takes part through three methods, as
:class:`~lightning_emig.models.llama.Llama` does: ``blocks()`` lists its blocks, ``first_stage_modules()`` what the
first stage holds besides them (the embedding; everything else outside the blocks is the last stage's), and
``keep_stage(blocks: range, first: bool, last: bool)`` drops every block outside ``blocks`` and, unless it is the
first or the last stage, the embedding or the norm and head. The kept modules keep their names, so a parameter's
name is the same in every stage layout (the key the migration moves it by).

Before a model is cut, every stage's cut is tried on a copy of it whose tensors are on the meta device (no memory,
the same on every process): a ``keep_stage`` that keeps or drops other tensors than the declaration says, or tied
weights that stages would hold apart, are refused on every process alike, before any state moves.

With ``pp_virtual > 1`` (the interleaved schedule) a process holds several stages: the model keeps the blocks of all
of them (one ``keep_stage`` call with their union), and each stage gets a *chunk*, a shallow view of the cut model
over that stage's blocks only (``pipeline_chunks``): the view shares every module and parameter with the model but
has its own containers and hooks, so each stage is an FSDP2 root of its own and its forward runs only its blocks.
The model itself, not the chunks, is what the optimizer, the state dict and the migration see.

The strategy trains a stage with torch's schedules (:mod:`lightning_emig.strategy.pipeline`); the state's specs
record each tensor's stage, so the migration moves state between any stage layouts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_emig.migration.state import stage_split_of

if TYPE_CHECKING:
    from torch import nn

    from lightning_emig.migration.stages import StageSplit


def stage_ranges(model: nn.Module, stages: int) -> tuple[range, ...]:
    """The blocks of every stage of ``model`` (the whole model's, also once it is cut to one stage)."""
    return _split(model).ranges(stages)


def _split(model: nn.Module) -> StageSplit:
    split = stage_split_of(model)
    if split is None:
        raise ValueError(f"{type(model).__name__} has no blocks(): it cannot be split into pipeline stages")
    return split


def keep_stage(model: nn.Module, pp: int, stage: int, pp_virtual: int = 1) -> nn.Module:
    """Cut ``model`` down, in place, to the stages of pipeline process ``stage`` of ``pp`` (``pp_virtual`` each);
    return it. The whole model's split stays recorded on it (``pipeline_split``): its state's specs then say which
    stage holds each tensor for any layout. With ``pp_virtual > 1`` its ``pipeline_chunks`` are the stages' views."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is not one of the {pp} stages")
    check_ties_stay_in_a_block(model, pp)
    split = _split(model)
    check_cuts_match_the_declaration(model, split, pp, pp_virtual)
    chunks = _cut(model, split, pp, stage, pp_virtual)
    if pp_virtual > 1:
        model.pipeline_chunks = tuple(
            _chunk_view(model, chunk, first=stage == 0 and index == 0,
                        last=stage == pp - 1 and index == pp_virtual - 1)
            for index, chunk in enumerate(chunks))
    model.pipeline_split = split
    return model


def check_ties_stay_in_a_block(model: nn.Module, pp: int) -> None:
    """Refuse (on every process alike) tied weights that pipeline stages could put on different processes: a
    parameter registered under two names (an embedding tied to the output projection) is one tensor only while both
    names are in one block, which one stage holds whole. Cut apart, each stage would train its own copy."""
    from lightning_emig.layout import LayoutError
    from lightning_emig.models.base import blocks_of, module_paths, tied_parameter_names

    prefixes = [path + "." for path in module_paths(model, blocks_of(model), "blocks")]

    def block_holding(name: str) -> str | None:
        return next((prefix for prefix in prefixes if name.startswith(prefix)), None)

    for tied in tied_parameter_names(model):
        if block_holding(tied[0]) is None or any(block_holding(n) != block_holding(tied[0]) for n in tied[1:]):
            raise LayoutError(
                f"pp={pp}: the tied parameters {tied} are one tensor, which pipeline stages would put on different "
                "processes (each training its own copy); untie them, or use a layout without pipeline stages"
            )


def check_cuts_match_the_declaration(model: nn.Module, split: StageSplit, pp: int, pp_virtual: int) -> None:
    """Cut a meta copy of ``model`` to each process's stages and check that it keeps exactly the tensors ``split``
    (the model's ``blocks()`` and ``first_stage_modules()``) puts there: the migration moves each tensor to the stage
    the declaration names, so a cut that disagrees would train on tensors nobody moved, or drop moved ones."""
    from lightning_emig.layout import LayoutError
    from lightning_emig.migration.stages import StageOwner

    names = list(model.state_dict(keep_vars=True))
    for process in range(pp):
        cut = _meta_copy(model)
        _cut(cut, split, pp, process, pp_virtual)
        kept = set(cut.state_dict(keep_vars=True))
        expected = {name for name in names if StageOwner.of(name, split).stage(pp, pp_virtual) in (process, None)}
        if kept != expected:
            extra, missing = sorted(kept - expected)[:4], sorted(expected - kept)[:4]
            raise LayoutError(
                f"pp={pp}: {type(model).__name__}.keep_stage for stage {process} keeps {extra or 'nothing'} beyond "
                f"and drops {missing or 'nothing'} of what blocks() and first_stage_modules() put on that stage: "
                "first_stage_modules() must list exactly the modules outside the blocks that keep_stage keeps on "
                "the first stage (the embedding), and keep_stage must keep everything else outside the blocks on "
                "the last"
            )


def _cut(model: nn.Module, split: StageSplit, pp: int, process: int, pp_virtual: int) -> tuple[range, ...]:
    """Cut ``model`` in place, by its own ``keep_stage``, to the stages of pipeline process ``process``; return
    their blocks (one range per stage)."""
    chunks = split.chunks_of(pp, process, pp_virtual)
    blocks = chunks[0] if pp_virtual == 1 else frozenset(b for chunk in chunks for b in chunk)
    model.keep_stage(blocks, first=process == 0, last=process == pp - 1)  # type: ignore[operator]
    return chunks


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose tensors are new ones on the meta device (nothing is copied or allocated)."""
    import copy

    import torch

    memo: dict[int, object] = {}
    for param in model.parameters():
        memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def stage_chunks(model: nn.Module) -> tuple[nn.Module, ...]:
    """The modules a pipeline schedule runs for this process's stages, in stage order: the chunks, or the model."""
    return getattr(model, "pipeline_chunks", None) or (model,)


def _chunk_view(model: nn.Module, blocks: range, *, first: bool, last: bool) -> nn.Module:
    """A view of ``model`` holding ``blocks`` (and the embedding if ``first``, the head if ``last``): the model's
    modules, its buffers and (on the last stage, which owns what is outside the blocks) its own parameters, in new
    containers cut by the model's own ``keep_stage``."""
    from lightning_emig.models.base import blocks_of

    view = _shallow(model, parameters=last)
    names = {id(m): name for name, m in model.named_modules()}
    above_blocks = {".".join(names[id(b)].split(".")[:depth]) for b in blocks_of(model)
                    for depth in range(1, names[id(b)].count(".") + 1)}
    for path in sorted(above_blocks, key=lambda p: p.count(".")):  # outermost first: each lands in a copied parent
        parent_path, _, attribute = path.rpartition(".")
        parent = view.get_submodule(parent_path) if parent_path else view
        parent._modules[attribute] = _shallow(model.get_submodule(path), parameters=True)  # noqa: SLF001
    view.keep_stage(blocks, first=first, last=last)  # type: ignore[operator]
    return view


def _shallow(module: nn.Module, *, parameters: bool) -> nn.Module:
    """A new module of ``module``'s class sharing its attributes, buffers and children but with containers and
    hooks of its own (cutting or wrapping it leaves ``module`` as it was)."""
    from torch import nn

    view = type(module).__new__(type(module))
    nn.Module.__init__(view)
    internals = set(view.__dict__)
    view.__dict__.update({k: v for k, v in module.__dict__.items() if k not in internals})
    view._buffers = module._buffers  # noqa: SLF001 - shared: every stage reads the root's buffers
    view._non_persistent_buffers_set = module._non_persistent_buffers_set  # noqa: SLF001
    view._parameters = module._parameters if parameters else {}  # noqa: SLF001
    view._modules = dict(module._modules)  # noqa: SLF001
    view.training = module.training
    return view


__all__ = ["keep_stage", "stage_chunks", "stage_ranges"]
