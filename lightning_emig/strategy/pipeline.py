"""Training with pipeline stages from Lightning's loop: the strategy drives the schedule, ``training_step`` stays.

Under ``pp > 1`` each process holds one stage of the model (``parallelize_model`` cut it; the stage records the
whole model's split as ``pipeline_split``). Lightning calls the strategy's ``training_step`` once per micro-batch;
:class:`PipelineDriver` keeps the step's micro-batches and, at the last one, runs the whole step through a
``torch.distributed.pipelining`` schedule (GPipe, 1F1B, or interleaved 1F1B over the process's ``pp_virtual``
stages): forward and backward of every micro-batch at once.

How a user's own ``training_step`` takes part, unchanged (it calls its model once, e.g. ``self.model(inputs)``):

* on the first stage it runs up to that call; the call's arguments are the stage's input for the micro-batch
  and the rest of ``training_step`` is skipped;
* on the last stage the schedule's loss function runs it with that call answered by the stage's output for the
  micro-batch: its returned loss is what the schedule back-propagates, and what it logs or accumulates, it does
  there, once per micro-batch, exactly as without stages;
* on the stages in between it does not run.

For the model call the stage's place in the module (its attribute) is taken for a moment by a stand-in; the stage
itself runs only under the schedule. The schedule averages gradients over the micro-batches (as Lightning's
accumulation divides each loss by their number) and FSDP2 over the data-parallel ranks, so the gradients are those
of the global batch's mean loss, as without stages; Lightning's own backward has nothing left to do.

What the strategy's ``training_step`` returns on every stage: 0 for a step's micro-batches before its last, and at
the last the mean of the step's micro-batch losses on this data-parallel rank (sent from the last stage).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_emig.layout import (
    MULTI_STAGE_SCHEDULES,
    PIPELINE_SCHEDULES,
    LayoutMesh,
    MeshAxis,
    micro_batches_problem,
)
from lightning_emig.migration.state import stage_modules
from lightning_emig.parallelize.pipeline import stage_chunks


class PipelineError(RuntimeError):
    """The module, its ``training_step`` or the batch plan cannot be run as a pipeline."""


def check_schedule(name: str, pp: int, micro_batches: int, pp_virtual: int = 1) -> None:
    """Refuse a schedule that cannot run ``micro_batches`` per step over ``pp`` processes holding ``pp_virtual``
    stages each (before anything is built)."""
    if name not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {list(PIPELINE_SCHEDULES)}, got {name!r}")
    if pp_virtual > 1 and name not in MULTI_STAGE_SCHEDULES:
        raise PipelineError(f"pp_virtual={pp_virtual} puts several stages on each process: the {name} schedule runs "
                            f"one; use pipeline_schedule={MULTI_STAGE_SCHEDULES[0]!r} or pp_virtual=1")
    problem = micro_batches_problem(name, pp, micro_batches)
    if problem is not None:
        raise PipelineError(f"{problem}; change global_batch_size or micro_batch_size, or use "
                            "pipeline_schedule='gpipe'")


def find_stage(module: nn.Module) -> tuple[nn.Module, str, nn.Module]:
    """``(parent, attribute, stage)``: where in ``module`` the pipeline stage ``parallelize_model`` built sits."""
    found = stage_modules(module)
    if len(found) != 1:
        where = ", ".join(name for name, _ in found) or "none"
        raise PipelineError(
            f"{type(module).__name__} must hold exactly one pipeline stage under pp > 1 (a model that "
            f"parallelize_model cut into stages); found {len(found)}: {where}"
        )
    name, stage = found[0]
    parent_name, _, attribute = name.rpartition(".")
    return module.get_submodule(parent_name), attribute, stage


class _Called(Exception):  # noqa: N818 - control flow, not an error: the first stage has what it needs
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("the model was called")
        self.args, self.kwargs = args, kwargs


class _StandIn(nn.Module):
    """Takes the stage's place during ``training_step``: stops at the model call and hands over its arguments (the
    first stage), or answers the call with the stage's output (the last stage)."""

    def __init__(self, answer: Any = None) -> None:
        super().__init__()
        self.answer = answer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.answer is None:
            raise _Called(args, kwargs)
        return self.answer


@contextlib.contextmanager
def _standing_in(parent: nn.Module, attribute: str, stand_in: _StandIn) -> Iterator[None]:
    stage = getattr(parent, attribute)
    setattr(parent, attribute, stand_in)
    try:
        yield
    finally:
        setattr(parent, attribute, stage)


class PipelineDriver:
    """Runs one layout's pipeline stage: built when the stage is (every layout change builds a new one).

    Args:
        module: The LightningModule; it holds the stage.
        layout_mesh: The layout's mesh (its ``pp`` axis: the stages of this process's data-parallel coordinate).
        micro_batches: Micro-batches per optimizer step on one data-parallel rank (the batch plan's accumulation).
        schedule: ``"gpipe"`` or ``"1f1b"``.
        training_step: Calls the user's ``training_step`` with Lightning's arguments for one micro-batch.
        device: The stage's device.
    """

    def __init__(self, module: nn.Module, layout_mesh: LayoutMesh, *, micro_batches: int, schedule: str,
                 training_step: Callable[..., Any], device: torch.device) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        pp, pp_virtual = layout_mesh.layout.pp, layout_mesh.layout.pp_virtual
        check_schedule(schedule, pp, micro_batches, pp_virtual)
        self._parent, self._attribute, self.stage_module = find_stage(module)
        pp_mesh = layout_mesh[MeshAxis.PP]
        self._group = pp_mesh.get_group()
        self.stage_index = pp_mesh.get_local_rank()  # this process's place on the pp axis
        self.num_stages = pp
        self.micro_batches = micro_batches
        self._device = device  # where collectives' tensors live (NCCL: the GPU)
        self._training_step = training_step
        chunks = stage_chunks(self.stage_module)
        if len(chunks) != pp_virtual:
            raise PipelineError(f"the model holds {len(chunks)} pipeline stages, the layout {pp_virtual} a process")
        # Stage s of the pp x pp_virtual runs on process s % pp (the stage split's rule, shared with the geometry).
        stages = [PipelineStage(chunk, self.stage_index + index * pp, pp * pp_virtual, device, group=self._group)
                  for index, chunk in enumerate(chunks)]
        # scale_grads (default): gradients are divided by the number of micro-batches, as Lightning's accumulation
        # divides each micro-batch's loss.
        if schedule in MULTI_STAGE_SCHEDULES:
            self._schedule = ScheduleInterleaved1F1B(stages, n_microbatches=micro_batches, loss_fn=self._loss)
        else:
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
            self._schedule = kind(stages[0], n_microbatches=micro_batches, loss_fn=self._loss)
        self._window: list[tuple[Any, ...]] = []
        self._inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._losses_computed = 0

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def pending(self) -> int:
        """Micro-batches of the current step kept until its last arrives (the schedule then runs them all)."""
        return len(self._window)

    def reset(self) -> None:
        """Forget micro-batches of a step that will not finish (a fit cut short, a restart of the data)."""
        self._window.clear()
        self._inputs.clear()

    def training_step(self, *args: Any) -> torch.Tensor:
        """One micro-batch (Lightning's ``training_step`` arguments); at the step's last, the whole step runs."""
        self._window.append(args)
        if self.is_first:
            self._inputs.append(self._model_call_of(args))
        if self.pending < self.micro_batches:
            return torch.zeros((), device=self._device)
        try:
            return self._run_step()
        finally:
            self.reset()

    def _model_call_of(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        try:
            with _standing_in(self._parent, self._attribute, _StandIn()):
                self._training_step(*args)
        except _Called as call:
            return call.args, call.kwargs
        raise PipelineError(
            f"training_step never called the pipelined model ({self._attribute!r}): under pp > 1 it must call "
            "it once per micro-batch"
        )

    def _run_step(self) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        self._losses_computed = 0
        if self.is_first:
            args, kwargs = _concatenated(self._inputs)
            self._schedule.step(*args, **kwargs)
        elif self.is_last:
            # The target names each micro-batch by its index; it requires grad so that the schedule's own chunks
            # of it (views with a grad_fn) tell a real loss call from torch's shape-inference call (a detached
            # copy) on a schedule's first step.
            index = torch.arange(self.micro_batches, dtype=torch.float64).requires_grad_(True)
            self._schedule.step(target=index, losses=losses)
            if self._losses_computed != self.micro_batches:
                raise PipelineError(f"the schedule computed {self._losses_computed} losses for "
                                    f"{self.micro_batches} micro-batches")
        else:
            self._schedule.step()
        return self._mean_loss(losses)

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        if target.grad_fn is None:  # torch's shape inference (fake output): no user code may see it
            return _plain_loss(output)
        self._losses_computed += 1
        args = self._window[int(target.detach()[0])]
        with _standing_in(self._parent, self._attribute, _StandIn(answer=output)):
            result = self._training_step(*args)
        loss = result.get("loss") if isinstance(result, dict) else result
        if not isinstance(loss, torch.Tensor):
            raise PipelineError(f"training_step returned {type(result).__name__}: under pp > 1 it must return the "
                                "micro-batch's loss (a tensor, or a dict with 'loss')")
        return loss

    def _mean_loss(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The mean of this step's micro-batch losses, on every stage (the last stage sends it)."""
        if self.is_last:
            mean = torch.stack([loss.detach().float() for loss in losses]).mean()
        else:
            mean = torch.zeros((), device=self._device)
        dist.broadcast(mean, group=self._group, group_src=self.num_stages - 1)
        return mean


def global_batch_loss(layout_mesh: LayoutMesh, local_mean: torch.Tensor | None, device: torch.device
                      ) -> torch.Tensor:
    """The global batch's mean loss, the same on every rank, from this rank's mean over its micro-batches (``None``
    where it computed none: a stage before the last). Averaged over the data-parallel ranks (tensor-parallel peers
    hold equal losses); under ``pp > 1`` sent from the last stage."""
    pp = layout_mesh.layout.pp
    last_stage = pp == 1 or layout_mesh[MeshAxis.PP].get_local_rank() == pp - 1
    if last_stage and local_mean is None:
        raise ValueError("step_loss needs this rank's mean loss: it computed the step's losses")
    mean = local_mean.detach().float().clone() if last_stage else torch.zeros((), device=device)
    if last_stage:
        dist.all_reduce(mean, group=layout_mesh.dp.get_group())
        mean /= layout_mesh.layout.dp
    if pp > 1:
        dist.broadcast(mean, group=layout_mesh[MeshAxis.PP].get_group(), group_src=pp - 1)
    return mean


def param_groups_of_every_stage(optimizer_state: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """``optimizer_state`` (``get_optimizer_state_dict``'s, keyed by name) with each parameter group listing the
    parameters of every stage. A checkpoint keeps one copy of the ``param_groups`` object, whichever process wrote
    it; with each stage's own list, a resume would find its parameters in no group (missing hyper-parameters, or
    a model without stages taking one stage's list). Every stage's names are gathered over the pipeline group
    ``group`` (a collective); loading picks its own parameters out of the groups by name."""
    groups = optimizer_state["param_groups"]
    gathered: list[list[list[str]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, [list(g["params"]) for g in groups], group=group)
    merged = []
    for index, g in enumerate(groups):
        names = [name for stage in gathered for name in (stage or [[]] * len(groups))[index]]
        merged.append({**g, "params": list(dict.fromkeys(names))})
    return {**optimizer_state, "param_groups": merged}


def _concatenated(calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The step's model calls joined along the batch dimension (the schedule splits them back, one per micro-batch)."""
    first_args, first_kwargs = calls[0]
    values = [*first_args, *first_kwargs.values()]
    if not all(isinstance(v, torch.Tensor) for v in values):
        kinds = sorted({type(v).__name__ for v in values if not isinstance(v, torch.Tensor)})
        raise PipelineError(f"under pp > 1 the model must be called with tensors only, got {kinds}")
    args = tuple(torch.cat([c[0][i] for c in calls]) for i in range(len(first_args)))
    kwargs = {key: torch.cat([c[1][key] for c in calls]) for key in first_kwargs}
    return args, kwargs


def _plain_loss(output: Any) -> torch.Tensor:
    """A loss that depends on every output (shape inference only needs gradients of the right shapes)."""
    outputs = output if isinstance(output, tuple | list) else (output,)
    return sum(o.float().sum() * 0 for o in outputs if isinstance(o, torch.Tensor))  # type: ignore[return-value]


__all__ = ["PipelineDriver", "PipelineError", "check_schedule", "find_stage",
           "param_groups_of_every_stage"]
