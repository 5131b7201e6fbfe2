"""``HybridLayoutStrategy``: Lightning's model-parallel machinery driven by a :class:`HybridLayout`, with a fixed
global batch. What a layout means for Lightning's loop, and nothing about changing it (that is
:class:`~lightning_emig.strategy.elastic.ElasticMigrationStrategy`, built on this one):

* the layout, resolved against the world size, and its 4-axis DeviceMesh (``self.device_mesh`` in
  ``LightningModule.configure_model``, and ``self.trainer.strategy.layout_mesh`` with the flattened data-parallel axis);
* the batch arithmetic (one :class:`BatchPlan`): gradient accumulation derived from the global batch, the micro batch
  and the data-parallel degree, written into the Trainer, and the training data at the job's position
  (:class:`~lightning_emig.strategy.loaders.TrainingData`);
* under ``pp > 1`` the pipeline schedule: a step's micro-batches run through it at the last one, the user's
  ``training_step`` taking part unchanged (:mod:`~lightning_emig.strategy.pipeline`), gradient clipping by the norm
  over every stage (:mod:`~lightning_emig.strategy.clipping`); which gradient reductions wait for a step's last
  micro-batch (:mod:`~lightning_emig.strategy.grad_sync`);
* sharded PyTorch Distributed Checkpoints that load under any other layout (resharding on load), written in the
  background while training runs if asked (:mod:`~lightning_emig.strategy.checkpoint_file`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_emig.data.batching import BatchPlan
from lightning_emig.layout import HybridLayout, LayoutMesh, MeshAxis, build_mesh
from lightning_emig.membership.settings import validate_layout_for_module
from lightning_emig.strategy.checkpoint_file import (
    CHECKPOINT_KEY,
    CheckpointFiles,
    ResumedCheckpoint,
    our_section,
    read_checkpoint,
    resume_from,
)
from lightning_emig.strategy.clipping import route_norm_clipping
from lightning_emig.strategy.grad_sync import DeferGradSync, accumulating, check_defer_choice
from lightning_emig.strategy.loaders import TrainingData
from lightning_emig.strategy.pipeline import (
    PipelineDriver,
    PipelineError,
    check_schedule,
    global_batch_loss,
    param_groups_of_every_stage,
)
from lightning_emig.strategy.resume import restart_reason

if TYPE_CHECKING:
    from collections.abc import Iterator

    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH
    from torch.optim import Optimizer

    from lightning_emig.data.stream import MicroBatchStream

log = logging.getLogger(__name__)


class HybridLayoutStrategy(ModelParallelStrategy):
    """Train under one hybrid layout (pipeline stages x HSDP x FSDP2 x TP) with a fixed global batch.

    Args:
        layout: The hybrid layout; ``-1`` in one degree fills the rest of the world. A dict is accepted too.
        global_batch_size: Samples per optimizer step, the same whatever the layout.
        micro_batch_size: Samples per forward/backward on one data-parallel rank.
        process_group_backend: ``gloo`` or ``nccl``; by default nccl on CUDA and gloo on CPU.
        timeout: Timeout of every collective (gloo has no abort; a dead peer must surface as an error).
        seed: Seed of a user's ``DataLoader`` order, and of the RNG states derived for ranks that have no saved state.
        async_checkpoints: Checkpoints saved while training runs (the periodic ones) are written in the background
            (:class:`~lightning_emig.strategy.async_checkpoint.AsyncCheckpointWriter`): training waits only for the
            copy to CPU memory. Saves outside training stay synchronous.
        pipeline_schedule: Under ``pp > 1``: ``"gpipe"``, ``"1f1b"`` (at least ``pp`` micro-batches per step) or
            ``"interleaved_1f1b"`` (the one for ``pp_virtual > 1``: several stages a process; micro-batches per step
            fewer than ``pp`` or a multiple of it); the strategy runs it (:mod:`lightning_emig.strategy.pipeline`).
        defer_grad_sync: Which gradient reductions wait for a step's last micro-batch: ``"replicas"`` (the
            all-reduce across HSDP replicas; no extra memory), ``"all"`` (the reduce-scatter too: unsharded
            gradients held meanwhile) or ``"none"`` (reduce after every micro-batch, as Lightning's
            ``ModelParallelStrategy``); see :mod:`lightning_emig.strategy.grad_sync`.
    """

    def __init__(
        self,
        layout: HybridLayout | dict[str, int] | None = None,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        seed: int = 0,
        async_checkpoints: bool = False,
        pipeline_schedule: str = "gpipe",
        defer_grad_sync: DeferGradSync = "replicas",
    ) -> None:
        super().__init__(data_parallel_size=1, tensor_parallel_size=1, save_distributed_checkpoint=True,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._requested_layout = HybridLayout(**layout) if isinstance(layout, dict) else layout or HybridLayout()
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        check_schedule(pipeline_schedule, pp=1, micro_batches=1)
        check_defer_choice(defer_grad_sync)
        self.pipeline_schedule = pipeline_schedule
        self.defer_grad_sync: DeferGradSync = defer_grad_sync
        self._layout_mesh: LayoutMesh | None = None
        self._batch_plan: BatchPlan | None = None
        self._pipeline: PipelineDriver | None = None
        self._data = TrainingData(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, seed=seed)
        self._files = CheckpointFiles(async_saves=async_checkpoints, timeout=timeout)
        self.start_reason = restart_reason()
        """Why this process's first fit is a restart of a running job (None: a first start)."""
        self.resumed_from: ResumedCheckpoint | None = None
        """Set when this fit resumed from a checkpoint file, until its first step's time is recorded."""

    # ------------------------------------------------------------------ layout
    @property
    def layout(self) -> HybridLayout:
        return self.layout_mesh.layout

    @property
    def layout_mesh(self) -> LayoutMesh:
        if self._layout_mesh is None:
            raise RuntimeError("the layout mesh exists once processes are initialised (from configure_model on)")
        return self._layout_mesh

    @property
    def has_layout(self) -> bool:
        return self._layout_mesh is not None

    @property
    def batch_plan(self) -> BatchPlan:
        if self._batch_plan is None:
            raise RuntimeError("the batch plan exists once the layout is resolved (from configure_model on)")
        return self._batch_plan

    @property
    def timeout(self) -> timedelta:
        """Timeout of every collective (and of forming a generation's process group)."""
        return self._timeout

    def _validate_layout(self, module: Any, layout: HybridLayout) -> None:
        """Refuse ``layout`` where the module cannot be laid out so, or the schedule cannot run the plan."""
        validate_layout_for_module(module, layout)
        if layout.pp > 1:
            plan = BatchPlan(self.global_batch_size, self.micro_batch_size, layout.dp)
            check_schedule(self.pipeline_schedule, layout.pp, plan.grad_accumulation, layout.pp_virtual)

    def _choose_layout(self) -> tuple[HybridLayout, BatchPlan]:
        """The layout of this fit and its plan, once the process group is formed: the one asked for (or a loud error
        if it does not fit this world)."""
        layout = self._requested_layout.resolve(self.world_size)
        self._validate_layout(self.lightning_module, layout)
        return layout, BatchPlan(self.global_batch_size, self.micro_batch_size, layout.dp)

    def install_mesh(self, layout_mesh: LayoutMesh, plan: BatchPlan) -> None:
        self._layout_mesh = layout_mesh
        self._pipeline = None  # the stage is built anew for the new layout
        self._device_mesh = layout_mesh.root
        self._batch_plan = plan
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # noqa: SLF001 - as ModelParallelStrategy sets it
        if self.global_rank == 0:
            log.info("layout %s on %d processes; %s", layout_mesh.layout.describe(), self.world_size, plan.describe())

    def release_process_groups(self) -> None:
        """After a peer's failure: drop this strategy's references to the broken groups (mesh, optimizers)."""
        self._layout_mesh = None
        self._device_mesh = None
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = None  # noqa: SLF001 - as ModelParallelStrategy sets it
        self.optimizers = []
        self.lr_scheduler_configs = []

    # ------------------------------------------------------------- lifecycle
    @override
    def setup_environment(self) -> None:
        # Skip ModelParallelStrategy's 2-D mesh: ours is built from the layout.
        self._setup_distributed()
        layout, plan = self._choose_layout()
        self.install_mesh(build_mesh(layout, self.root_device.type, timeout=self.timeout), plan)
        self._files.start_fit()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._data.apply_accumulation(trainer, self.batch_plan)
        super().setup(trainer)
        route_norm_clipping(self.precision_plugin, self._pipeline_group)

    def _pipeline_group(self) -> dist.ProcessGroup | None:
        return self.layout_mesh[MeshAxis.PP].get_group() if self.layout.pp > 1 else None

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._pipeline is not None:
            self._pipeline.reset()  # a step cut short by a peer's failure left part of its micro-batches

    @override
    def teardown(self) -> None:
        # Never lose the last periodic checkpoint; after a failure (a peer may be dead) do not wait for it.
        trainer = getattr(self.lightning_module, "_trainer", None)
        self._files.close(wait=not (trainer is not None and trainer.interrupted))
        self._data.clear()
        super().teardown()

    # -------------------------------------------------------------------- data
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.dp, "rank": self.layout_mesh.dp_rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader, made elastic (see :class:`~lightning_emig.strategy.loaders.TrainingData`); evaluation
        loaders pass through."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and not trainer.training:
            return dataloader
        return self._data.adopt(dataloader, dp=self.layout.dp, dp_rank=self.layout_mesh.dp_rank,
                                start_over=self._data_starts_over)

    @property
    def _data_starts_over(self) -> bool:
        """The fit's data starts from its first sample whatever its stream says (a subclass's rollback)."""
        return False

    @property
    def data_streams(self) -> list[MicroBatchStream]:
        """The streams of the training loaders this fit reads (their position is the job's data position)."""
        return self._data.streams

    def restart_data(self, trainer: pl.Trainer) -> None:
        """After a layout change: new accumulation, new data-parallel coordinate, fresh data iterator."""
        self._data.restart(trainer, self.batch_plan, dp=self.layout.dp, dp_rank=self.layout_mesh.dp_rank)

    # -------------------------------------------------------------- stages
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.layout.pp == 1:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            return self._pipeline_driver().training_step(*args)

    def _pipeline_driver(self) -> PipelineDriver:
        if self._pipeline is None:
            module = self.lightning_module
            assert module is not None
            self._pipeline = PipelineDriver(
                module, self.layout_mesh, micro_batches=self.batch_plan.grad_accumulation,
                schedule=self.pipeline_schedule, training_step=module.training_step, device=self.root_device,
            )
        return self._pipeline

    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        # Lightning enters this around the micro-batches that only accumulate.
        assert self.model is not None
        with accumulating(self.model, self.layout, self.defer_grad_sync):
            yield

    @override
    def backward(self, closure_loss: Any, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        if self.layout.pp > 1:  # the schedule ran backward with the step's last micro-batch
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.layout.pp > 1:
            raise NotImplementedError("validation under pp > 1 is not built: validate with a layout without "
                                      "pipeline stages (or set Trainer(limit_val_batches=0))")
        return super().validation_step(*args, **kwargs)

    def step_loss(self, local_mean: torch.Tensor | None) -> torch.Tensor:
        """The global batch's mean loss, the same on every rank, from this rank's mean over its micro-batches
        (``None`` where it computed none: a pipeline stage before the last). Averaged over the data-parallel
        ranks (tensor-parallel peers hold equal losses); under ``pp > 1`` taken from the last stage."""
        return global_batch_loss(self.layout_mesh, local_mean, self.root_device)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._pipeline is not None and self._pipeline.pending:
            raise PipelineError(f"the optimizer stepped with {self._pipeline.pending} of the step's micro-batches not "
                                "yet run through the pipeline (Lightning's accumulation and the batch plan disagree)")
        self._data.commit_step()
        return output

    # -------------------------------------------------------------- checkpoint
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        group = self._pipeline_group()
        return param_groups_of_every_stage(state, group) if group is not None else state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        checkpoint[CHECKPOINT_KEY] = our_section(self.layout, self.world_size)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if self._files.in_background(trainer):
            if storage_options is not None:
                raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
            # The path from rank 0, as Lightning does, so that every rank writes into the same directory.
            self._files.save_in_background(checkpoint, self.broadcast(filepath))
            return
        self._files.wait()  # one save at a time: the one in flight finishes first
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def save_checkpoint_and_wait(self, trainer: pl.Trainer, path: Path) -> None:
        """Save a checkpoint now, in the background writer if there is one, and wait until it is complete."""
        trainer.save_checkpoint(path)
        self._files.wait()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = self._load_file(checkpoint_path)
        # Loaded into the module already; the load hooks (WeightAveraging's, a user's) see it as in a checkpoint.
        assert self.lightning_module is not None
        checkpoint.setdefault("state_dict", self.lightning_module.state_dict())
        return checkpoint

    def _load_file(self, checkpoint_path: _PATH) -> dict[str, Any]:
        load_started = time.time()
        path = Path(self.broadcast(checkpoint_path)).resolve()  # every rank reads the same checkpoint
        # RNG states are pickled Python objects (per rank), so the metadata cannot be weights_only.
        load = functools.partial(super().load_checkpoint, weights_only=False)
        checkpoint = read_checkpoint(path, self.lightning_module, self.optimizers, load)
        self.resumed_from = resume_from(
            checkpoint, checkpoint_path, load_started=load_started, layout=self.layout, world_size=self.world_size,
            plan=self.batch_plan, rank=self.global_rank, seed=self.seed, reason=self._resume_reason,
        )
        return checkpoint

    @property
    def _resume_reason(self) -> str | None:
        """Why a resume from a checkpoint file is a restart of a running job (None: it is not)."""
        return self.start_reason
