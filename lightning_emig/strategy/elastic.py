"""``ElasticMigrationStrategy``: Lightning's adapter. It translates Lightning's hooks into calls on the objects that do
the work, none of which imports it (they see it through the views of :mod:`lightning_emig.change.host`):

* the generation's process group and the layout, its DeviceMesh (``self.device_mesh`` in ``configure_model``) and
  batch plan: :mod:`~lightning_emig.change.enter`, at ``setup_environment``;
* the training data at the job's position, gradient accumulation derived from the plan:
  :class:`~lightning_emig.strategy.loaders.TrainingData`;
* the change a fit starts with (live, or a rollback): :class:`~lightning_emig.change.incoming.IncomingChange`, in
  ``load_checkpoint``; the layout changes asked for during a fit: :class:`~lightning_emig.change.requests.LayoutRequests`;
  every change's event: :class:`~lightning_emig.change.record.ChangeLog`;
* checkpoint files that load under any layout: :mod:`~lightning_emig.strategy.checkpoint_file`; pipeline stages
  (:mod:`~lightning_emig.strategy.pipeline`), gradient sync (:mod:`~lightning_emig.strategy.grad_sync`), clipping by
  the norm over every stage (:mod:`~lightning_emig.strategy.clipping`);
* under ``lightning-emig-run``, one ``Trainer.fit`` call as a sequence of fits, one per membership change:
  :mod:`~lightning_emig.strategy.elastic_fit`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_emig.change.enter import Arrival, choose_layout, form_generation_group
from lightning_emig.change.events import ReconfigureEvent
from lightning_emig.change.fit_start import check_callbacks, check_fit_start
from lightning_emig.change.incoming import IncomingChange
from lightning_emig.change.prepare import LayoutPreparation, ShadowView
from lightning_emig.change.rebuild import check_rebuilt, children_with_state
from lightning_emig.change.record import ChangeLog
from lightning_emig.change.requests import LayoutRequests
from lightning_emig.collector import freeze_what_exists, release_frozen
from lightning_emig.data.batching import BatchPlan
from lightning_emig.data.stream import MicroBatchStream
from lightning_emig.host_memory import keep_freed_host_memory
from lightning_emig.launcher.generation import ENV_AGENT_PID, ENV_GENERATION
from lightning_emig.launcher.heartbeat import mark_holding, start_heartbeat
from lightning_emig.launcher.orphans import die_with_parent
from lightning_emig.layout import HybridLayout, LayoutMesh, MeshAxis, build_mesh
from lightning_emig.membership.group import under_launcher
from lightning_emig.membership.handoff import LIVE_CHECKPOINT, LiveHandoff
from lightning_emig.membership.settings import (
    ElasticSettings,
    FailureSettings,
    LayoutChoice,
    validate_layout_for_module,
)
from lightning_emig.migration.state import storages_of
from lightning_emig.migration.transfer import DEFAULT_BUCKET_BYTES, TransferOptions
from lightning_emig.strategy.checkpoint_file import (
    CHECKPOINT_KEY,
    CheckpointFiles,
    ResumedCheckpoint,
    our_section,
    read_checkpoint,
    resume_from,
)
from lightning_emig.strategy.clipping import route_norm_clipping
from lightning_emig.strategy.elastic_fit import ElasticFitLauncher
from lightning_emig.strategy.grad_sync import DeferGradSync, accumulating, check_defer_choice
from lightning_emig.strategy.hooks import add_callbacks, terminate_on_sigterm_under_torchrun
from lightning_emig.strategy.loaders import TrainingData
from lightning_emig.strategy.pipeline import (
    PipelineDriver,
    PipelineError,
    check_schedule,
    global_batch_loss,
    param_groups_of_every_stage,
)
from lightning_emig.strategy.resume import restart_reason
from lightning_emig.strategy.schedule import stages_later

if TYPE_CHECKING:
    from collections.abc import Iterator

    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH
    from torch.optim import Optimizer

    from lightning_emig.membership.failure import Rollback
    from lightning_emig.picker.policy import LayoutPicker

log = logging.getLogger(__name__)

class ElasticMigrationStrategy(ModelParallelStrategy):
    """Train under any hybrid layout (pipeline stages x HSDP x FSDP2 x TP) with a fixed global batch.

    Args:
        layout: The hybrid layout; ``-1`` in one degree fills the rest of the world. A dict is accepted too.
        global_batch_size: Samples per optimizer step, the same whatever the layout.
        micro_batch_size: Samples per forward/backward on one data-parallel rank.
        process_group_backend: ``gloo`` or ``nccl``; by default nccl on CUDA and gloo on CPU.
        timeout: Timeout of every collective (gloo has no abort; a dead peer must surface as an error).
        seed: Seed used to re-derive RNG states for ranks that have no saved state after a world change.
        bucket_bytes: Memory budget of a migration's transfer buffers per process (default 256 MiB).
        checksum: Verify every migrated bucket with a CRC32 (costs a pass over the bytes on both ends).
        failure: Heartbeat and failure-detection settings (under ``lightning-emig-run``).
        async_checkpoints: Checkpoints saved while training runs (the periodic ones) are written in the background
            (:class:`~lightning_emig.strategy.async_checkpoint.AsyncCheckpointWriter`): training waits only for the
            copy to CPU memory. Saves outside training stay synchronous.
        picker: Choose each world's layout, the first one included, with the layout picker
            (:class:`~lightning_emig.picker.policy.LayoutPicker`); ``layout`` is then ignored. None: each new world
            keeps the requested ``tp``/``pp``/``dp_replicate`` where they divide it, else pure FSDP.
        pipeline_schedule: Under ``pp > 1``: ``"gpipe"``, ``"1f1b"`` (at least ``pp`` micro-batches per step) or
            ``"interleaved_1f1b"`` (the one for ``pp_virtual > 1``: several stages a process; micro-batches per step
            fewer than ``pp`` or a multiple of it); the strategy runs it (:mod:`lightning_emig.strategy.pipeline`).
        defer_grad_sync: Which gradient reductions wait for a step's last micro-batch: ``"replicas"`` (the
            all-reduce across HSDP replicas; no extra memory), ``"all"`` (the reduce-scatter too: unsharded
            gradients held meanwhile) or ``"none"`` (reduce after every micro-batch, as Lightning's
            ``ModelParallelStrategy``); see :mod:`lightning_emig.strategy.grad_sync`.
        consistency_every_n_steps: Every this many optimizer steps the ranks prove they hold one state (same step,
            data offset, layout and generation; replicas equal); they also prove it when every fit starts, around
            every change and at every checkpoint save, whatever this is (0: only then). See
            :mod:`lightning_emig.change.consistency`.
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
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        checksum: bool = False,
        failure: FailureSettings | None = None,
        async_checkpoints: bool = False,
        picker: LayoutPicker | None = None,
        pipeline_schedule: str = "gpipe",
        defer_grad_sync: DeferGradSync = "replicas",
        consistency_every_n_steps: int = 100,
    ) -> None:
        super().__init__(
            data_parallel_size=1,
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if isinstance(layout, dict):
            layout = HybridLayout(**layout)
        self._requested_layout = layout or HybridLayout()
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        if consistency_every_n_steps < 0:
            raise ValueError(f"consistency_every_n_steps must be >= 0, got {consistency_every_n_steps}")
        self.consistency_every_n_steps = consistency_every_n_steps
        self._layout_mesh: LayoutMesh | None = None
        self._batch_plan: BatchPlan | None = None
        self._data = TrainingData(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, seed=seed)
        self.bucket_bytes = bucket_bytes
        self.checksum = checksum
        self._migrating = False
        self.shadow_view = ShadowView()
        """What a thread preparing a layout change sees as ``layout_mesh`` and ``migrating`` (see ``prepare``)."""
        self._requests = LayoutRequests(self)
        self._changes = ChangeLog()
        self._incoming = IncomingChange(self._changes)
        # What the change modules read and set (documented on their views, lightning_emig.change.host):
        self.live_transfer_started = False
        self.pending_handoff: LiveHandoff | None = None
        self.failure_settings = failure or FailureSettings()
        self.last_boundary: LiveHandoff | None = None
        self.generation = int(os.environ.get(ENV_GENERATION, "0"))
        self.left_job = False
        self.start_reason = restart_reason()
        self._dropped_children: list[str] = []
        self.kept_children: frozenset[str] = frozenset()
        self.resumed_from: ResumedCheckpoint | None = None
        """Set when this fit resumed from a checkpoint file, until its first step's time is recorded."""
        self._files = CheckpointFiles(async_saves=async_checkpoints, timeout=timeout)
        self.picker = picker
        self.layout_choice: LayoutChoice | None = None
        """How this fit's layout was chosen (the picker's explanation goes into the next event's record)."""
        check_schedule(pipeline_schedule, pp=1, micro_batches=1)
        check_defer_choice(defer_grad_sync)
        if picker is not None:
            picker.check_runs_as(pipeline_schedule=pipeline_schedule, defer_grad_sync=defer_grad_sync)
        self.pipeline_schedule = pipeline_schedule
        self._pipeline: PipelineDriver | None = None
        self.defer_grad_sync: DeferGradSync = defer_grad_sync

    # ------------------------------------------------------------------ layout
    @property
    def layout(self) -> HybridLayout:
        return self.layout_mesh.layout

    def release_process_groups(self) -> None:
        """After a peer's failure: drop this strategy's references to the broken groups (mesh, optimizers)."""
        self._layout_mesh = None
        self._device_mesh = None
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = None  # noqa: SLF001 - as ModelParallelStrategy sets it
        self.optimizers = []
        self.lr_scheduler_configs = []

    @property
    def reached_step(self) -> int:
        """The optimizer steps this process's trainer has completed (-1 before it has one)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer.global_step if trainer is not None else -1

    def live_storages(self) -> frozenset[int]:
        module = self.lightning_module
        if module is None:
            return frozenset()
        return storages_of(t for t in module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor))

    @property
    def has_layout(self) -> bool:
        return self._layout_mesh is not None

    @property
    def migrating(self) -> bool:
        """True while ``configure_model`` runs for a migration: it may skip initialisation."""
        return self.shadow_view.migrating or self._migrating

    @migrating.setter
    def migrating(self, value: bool) -> None:
        self._migrating = value

    @property
    def layout_mesh(self) -> LayoutMesh:
        if self.shadow_view.layout_mesh is not None:  # seen by a thread preparing a change only
            return self.shadow_view.layout_mesh
        if self._layout_mesh is None:
            raise RuntimeError("the layout mesh exists once processes are initialised (from configure_model on)")
        return self._layout_mesh

    @property
    def batch_plan(self) -> BatchPlan:
        if self._batch_plan is None:
            raise RuntimeError("the batch plan exists once the layout is resolved (from configure_model on)")
        return self._batch_plan

    @property
    def timeout(self) -> timedelta:
        """Timeout of every collective (and of forming a generation's process group)."""
        return self._timeout

    @property
    def live_join(self) -> bool:
        """This fit receives its state from running processes (``fit(ckpt_path="live")``)."""
        return self._incoming.live_join

    @property
    def awaiting_live_state(self) -> bool:
        """This fit takes its state live and none of it has moved yet: a failure now leaves every holder's handoff
        (:attr:`incoming_handoff`) intact, and a joiner holding nothing."""
        return self.live_join and not self.live_transfer_started

    @property
    def incoming_handoff(self) -> LiveHandoff | None:
        """The state this process carries into this fit (None in a joiner and once the join has taken it)."""
        return self._incoming.handoff

    @property
    def live_resume_step(self) -> int | None:
        """The step a live handoff or a rollback resumed at (its state was never written: no checkpoint is due)."""
        return self._incoming.resume_step

    @property
    def elastic_settings(self) -> ElasticSettings:
        """What every change of world or layout asks (the membership layer sees this, not the strategy)."""
        module = self.lightning_module
        return ElasticSettings(
            requested_layout=self._requested_layout, global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            transfer=TransferOptions(bucket_bytes=self.bucket_bytes, checksum=self.checksum),
            validate_layout=lambda layout: self._validate_layout(module, layout), picker=self.picker,
        )

    def _validate_layout(self, module: Any, layout: HybridLayout) -> None:
        validate_layout_for_module(module, layout)
        if layout.pp > 1:
            plan = BatchPlan(self.global_batch_size, self.micro_batch_size, layout.dp)
            check_schedule(self.pipeline_schedule, layout.pp, plan.grad_accumulation, layout.pp_virtual)

    # ------------------------------------------------------------- lifecycle
    @override
    def _configure_launcher(self) -> None:
        if under_launcher():  # one fit call follows every membership change (see elastic_fit)
            self._launcher = ElasticFitLauncher(self)
            return
        super()._configure_launcher()

    def prepare_next_fit(self, *, handoff: LiveHandoff | None = None, rollback: Rollback | None = None,
                         dropped: list[str] | None = None) -> None:
        """Between two fits of one ``Trainer.fit`` call: the next one takes ``handoff`` live, or restores a
        checkpoint after ``rollback`` (its process group is formed either way); ``dropped`` are the module's
        children its ``configure_model`` must build again."""
        self.release_process_groups()  # the old world's mesh and optimizers: the next fit builds its own
        self.start_reason = None
        # A fit that failed before its setup checked the rebuilt children still owes the ones it was given.
        self._dropped_children = sorted({*self._dropped_children, *(dropped or [])})
        self._incoming.next_fit(handoff, rollback)
        self.live_transfer_started = False
        self.pending_handoff = None
        self.last_boundary = None
        self.resumed_from = None
        if handoff is not None:
            self.generation = handoff.generation
        if rollback is not None:
            self.generation = rollback.generation

    def checkpoint_dir(self, trainer: pl.Trainer) -> Path | None:
        """Where the trainer's ``ModelCheckpoint`` writes (a rollback restores the newest complete one there)."""
        callback = trainer.checkpoint_callback
        dirpath = getattr(callback, "dirpath", None)
        return Path(dirpath) if dirpath else None

    @override
    def setup_environment(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:
            check_callbacks(trainer)  # before the callbacks' setup, where a model-copying one makes its copy
        freeze_what_exists()  # later collections, the ones a change sets off among them, walk only the fit's objects
        if under_launcher():
            die_with_parent(expected_parent=int(os.environ.get(ENV_AGENT_PID, os.getppid())))  # no orphan workers
            if self.root_device.type == "cpu":
                keep_freed_host_memory()  # each step reuses the last one's pages (see lightning_emig.host_memory)
            start_heartbeat(self.failure_settings.heartbeat_interval_s, self.failure_settings.heartbeat_timeout_s)
        self.generation = form_generation_group(Arrival(
            generation=self.generation, live_join=self.live_join, handoff=self._incoming.handoff,
            backend=self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo"),
            timeout=self.timeout, failure=self.failure_settings, on_cpu=self.root_device.type == "cpu",
        ))
        # Skip ModelParallelStrategy's 2-D mesh: ours is built from the layout.
        self._setup_distributed()
        mark_holding()  # in the generation the holders form: a holder from now on (see membership.admission)
        self.layout_choice = choose_layout(
            self.elastic_settings, world_size=self.world_size, rank=self.global_rank, requested=self._requested_layout,
            handoff=self._incoming.handoff,
            new_world=self.live_join or self.start_reason is not None or self._incoming.rollback is not None,
        )
        layout, plan = self.layout_choice.layout, self.layout_choice.plan
        self.migrating = self.live_join  # configure_model must not initialise: the join overwrites every tensor
        self.install_mesh(build_mesh(layout, self.root_device.type, timeout=self.timeout), plan)
        self._files.start_fit()
        if self._incoming.starting_over:
            self._note_rollback(step=0, load_seconds=0.0)  # no checkpoint: the fit starts over from step 0

    def install_mesh(self, layout_mesh: LayoutMesh, plan: BatchPlan) -> None:
        self._layout_mesh = layout_mesh
        self._pipeline = None  # the stage is built anew for the new layout
        self._device_mesh = layout_mesh.root
        self._batch_plan = plan
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # noqa: SLF001 - as ModelParallelStrategy sets it
        if self.global_rank == 0:
            log.info("layout %s on %d processes; %s", layout_mesh.layout.describe(), self.world_size, plan.describe())

    @override
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        # Lightning enters it right before configure_model: what holds state now was built elsewhere.
        module = self.lightning_module
        if module is not None and getattr(module, "_trainer", None) is not None:
            self.kept_children = children_with_state(module)
        with super().tensor_init_context(empty_init):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        check_rebuilt(self.lightning_module, self._dropped_children)
        self._dropped_children = []
        self._data.apply_accumulation(trainer, self.batch_plan)
        add_callbacks(trainer)
        super().setup(trainer)
        check_fit_start(trainer, self.lightning_module, self.kept_children, stages_later=stages_later(
            trainer, self._requested_layout, self.picker))
        route_norm_clipping(self.precision_plugin, self._pipeline_group)

    def _pipeline_group(self) -> dist.ProcessGroup | None:
        return self.layout_mesh[MeshAxis.PP].get_group() if self.layout.pp > 1 else None

    # ---------------------------------------------------------- reconfigure
    def reconfigure(self, layout: HybridLayout | dict[str, int]) -> None:
        """Switch to ``layout`` live, on the same processes, at the next optimizer-step boundary.

        Called from a callback's ``on_train_batch_end`` right after a step, it happens at once; called elsewhere
        (mid-accumulation, from another hook), it is deferred to the end of the current step. Every rank must
        call it with the same layout. Parameters and optimizer state move point to point, bit for bit; the
        global batch, the data position, the LR schedule and the step counter carry on. A layout with pipeline
        stages for a model that declares none is refused here, before anything changes.
        """
        self._requests.reconfigure(layout)

    def prepare_reconfigure(self, layout: HybridLayout | dict[str, int]) -> None:
        """Start building ``layout`` (mesh, model, plan) in a background thread while training goes on; the next
        :meth:`reconfigure` to the same layout then pauses only for the optimizer, the transfer and the restore.

        Every rank must call it with the same layout at the same step boundary, and create no process group until
        that ``reconfigure`` (see :mod:`~lightning_emig.change.prepare`). A second call replaces the first (after
        waiting for it). A change to or from pipeline stages is not prepared (it is built at the boundary).
        """
        self._requests.prepare(layout)

    @property
    def reconfigure_pending(self) -> bool:
        """A layout change asked for by :meth:`reconfigure` waits for the end of the current step."""
        return self._requests.pending

    def apply_pending_reconfigure(self, trainer: pl.Trainer) -> None:
        self._requests.apply(trainer)

    def take_preparation(self) -> LayoutPreparation | None:
        return self._requests.take_preparation()

    @property
    def events(self) -> list[ReconfigureEvent]:
        """Every change this process took part in, in order (rank 0 also published each)."""
        return self._changes.events

    def record_event(self, trainer: pl.Trainer, event: ReconfigureEvent) -> None:
        """Keep ``event`` in :attr:`events` and, on global rank 0, publish it (``events.jsonl``, the loggers); every
        kind of change comes through here, a restart's from the step-time recorder."""
        self._changes.record(trainer, event, rank=self.global_rank, choice=self.layout_choice)

    def restart_data(self, trainer: pl.Trainer) -> None:
        """After a layout change: new accumulation, new data-parallel coordinate, fresh data iterator."""
        self._data.restart(trainer, self.batch_plan, dp=self.layout.dp, dp_rank=self.layout_mesh.dp_rank)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.dp, "rank": self.layout_mesh.dp_rank}

    # -------------------------------------------------------------------- data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader, made elastic (see :class:`~lightning_emig.strategy.loaders.TrainingData`); evaluation
        loaders pass through."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and not trainer.training:
            return dataloader
        return self._data.adopt(dataloader, dp=self.layout.dp, dp_rank=self.layout_mesh.dp_rank,
                                start_over=self._incoming.starting_over)

    @property
    def data_streams(self) -> list[MicroBatchStream]:
        """The streams of the training loaders this fit reads (their position is the job's data position)."""
        return self._data.streams

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
        if self.pending_handoff is not None:
            # The state is being handed to a new generation (a drain may already have released it): the live path
            # is the copy; a save now would cost the change's downtime or write released storage.
            log.warning("checkpoint %s skipped: the state is being handed to generation %d", filepath,
                        self.pending_handoff.generation)
            return
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
        assert self.lightning_module is not None
        if checkpoint_path == LIVE_CHECKPOINT:
            checkpoint = self._incoming.take_live(self, self.lightning_module.trainer)
        else:
            checkpoint = self._load_file(checkpoint_path)
        # Loaded into the module already; the load hooks (WeightAveraging's, a user's) see it as in a checkpoint.
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
            plan=self.batch_plan, rank=self.global_rank, seed=self.seed,
            reason=None if self._incoming.rollback is not None else self.start_reason,
        )
        if self._incoming.rollback is not None:
            self._note_rollback(step=self.resumed_from.step, load_seconds=self.resumed_from.load_seconds)
        return checkpoint

    def _note_rollback(self, *, step: int, load_seconds: float) -> None:
        self._incoming.rolled_back(self.lightning_module.trainer, step=step, load_seconds=load_seconds,
                                   layout=self.layout, world_size=self.world_size, rank=self.global_rank)

    def record_prior_event(self, trainer: pl.Trainer, handoff: LiveHandoff) -> None:
        """Record the change ``handoff`` carries (see :meth:`ChangeLog.record_prior`)."""
        self._changes.record_prior(trainer, handoff, rank=self.global_rank, choice=self.layout_choice)

    def finish_join_event(self, trainer: pl.Trainer, *, interrupted: bool = False) -> None:
        """Record the change this fit began with (see :meth:`ChangeLog.finish`)."""
        self._changes.finish(trainer, generation=self.generation, world_size=self.world_size, rank=self.global_rank,
                             choice=self.layout_choice, interrupted=interrupted)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._pipeline is not None:
            self._pipeline.reset()  # a step cut short by a peer's failure left part of its micro-batches
        terminate_on_sigterm_under_torchrun()  # Lightning registered its own handler just before this fit

    @override
    def teardown(self) -> None:
        # Never lose the last periodic checkpoint; after a failure (a peer may be dead) do not wait for it.
        trainer = getattr(self.lightning_module, "_trainer", None)
        interrupted = trainer is not None and trainer.interrupted
        if not interrupted:  # after a failure its thread may wait on a dead peer: left to die with the groups
            self._requests.discard_preparation()
        self._files.close(wait=not interrupted)
        self._data.clear()
        if not isinstance(self._launcher, ElasticFitLauncher):  # its loop runs the next fit, and releases at the end
            release_frozen()
        super().teardown()
