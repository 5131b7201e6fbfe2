"""``ElasticMigrationStrategy``: Lightning's model-parallel machinery driven by a :class:`HybridLayout`.

What the strategy owns, and nothing more (elasticity stays inside this boundary, never in the loops):

* the layout, resolved against the world size, and its 4-axis DeviceMesh (available to
  ``LightningModule.configure_model`` as ``self.device_mesh`` and, with the flattened data-parallel axis,
  as ``self.trainer.strategy.layout_mesh``);
* the batch arithmetic (one :class:`BatchPlan`): gradient accumulation is derived from the global batch, the
  micro batch and the data-parallel degree, and written into the Trainer so users never set it by hand;
* the data position: a :class:`MicroBatchLoader` is told this rank's data-parallel coordinate, and its committed
  global offset advances by one global batch after every optimizer step;
* sharded PyTorch Distributed Checkpoints (model, optimizer, scheduler, data offset, loop counters, RNG) that
  load under any other layout (resharding on load);
* under ``pp > 1``, the pipeline schedule: a step's micro-batches run through it at the last one, the user's
  ``training_step`` taking part unchanged (:mod:`lightning_emig.strategy.pipeline`), and gradient clipping by the
  norm over every stage (:mod:`lightning_emig.strategy.clipping`);
* the live join (``fit(ckpt_path="live")``): under ``lightning-emig-run`` it forms the generation's process group
  itself, lays the model out for the new world by ``elastic_settings.layout_for_world`` (one rule for every change),
  and in ``load_checkpoint`` receives the state from the processes that kept running
  (:func:`~lightning_emig.strategy.live_join.join_live`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_emig.collector import freeze_what_exists, release_frozen
from lightning_emig.consistency import check_same_state
from lightning_emig.data.adopt import USE_INSTEAD, DataLoaderNotElasticError, adopt_dataloader
from lightning_emig.data.batching import BatchPlan
from lightning_emig.data.loader import MicroBatchLoader
from lightning_emig.data.stream import MicroBatchStream
from lightning_emig.host_memory import keep_freed_host_memory, warm_host_memory
from lightning_emig.launcher.generation import (
    ENV_AGENT_PID,
    ENV_GENERATION,
    ENV_NODE_ID,
    GenerationError,
    control_client_from_env,
    read_generation,
)
from lightning_emig.launcher.heartbeat import HeartbeatWatch, mark_holding, start_heartbeat
from lightning_emig.launcher.orphans import die_with_parent
from lightning_emig.layout import HybridLayout, LayoutMesh, MeshAxis, build_mesh
from lightning_emig.membership.admission import LeftOutError, await_admission, memory_to_warm
from lightning_emig.membership.group import (
    enter_generation,
    joining_live,
    under_launcher,
)
from lightning_emig.membership.handoff import LIVE_CHECKPOINT, LiveHandoff
from lightning_emig.membership.settings import (
    ElasticSettings,
    FailureSettings,
    LayoutChoice,
    validate_layout_for_module,
)
from lightning_emig.migration.change import ChangeRecord
from lightning_emig.migration.identity import IdentityMap
from lightning_emig.migration.state import storages_of, training_state
from lightning_emig.migration.transfer import DEFAULT_BUCKET_BYTES, TransferOptions
from lightning_emig.strategy.async_checkpoint import AsyncCheckpointWriter
from lightning_emig.strategy.boundary import (
    StepBoundaryHook,
    at_step_boundary,
    reload_validation_loaders,
    rescale_batch_progress,
    restart_training_iterator,
)
from lightning_emig.strategy.clipping import route_norm_clipping
from lightning_emig.strategy.consistency import ConsistencyGuard, prove
from lightning_emig.strategy.elastic_fit import ElasticFitLauncher, treat_step_as_saved
from lightning_emig.strategy.events import ReconfigureEvent, publish_event
from lightning_emig.strategy.fit_start import check_callbacks, check_can_be_staged, check_fit_start
from lightning_emig.strategy.grad_sync import DeferGradSync, accumulating, check_defer_choice
from lightning_emig.strategy.live_join import join_live
from lightning_emig.strategy.pipeline import (
    PipelineDriver,
    PipelineError,
    check_schedule,
    param_groups_of_every_stage,
)
from lightning_emig.strategy.prepare import LayoutPreparation, ShadowView
from lightning_emig.strategy.rebuild import check_rebuilt, children_with_state, node_of_every_rank
from lightning_emig.strategy.reconfigure import reconfigure_live
from lightning_emig.strategy.rendezvous import RendezvousCallback
from lightning_emig.strategy.resume import check_checkpoint_matches, restart_reason
from lightning_emig.strategy.rng import gather_rng_states, restore_rng_for_rank
from lightning_emig.strategy.schedule import LayoutSchedule
from lightning_emig.strategy.sharded_load import holds_dtensors, load_sharded_into_plain_model

if TYPE_CHECKING:
    from collections.abc import Iterator

    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH
    from torch.optim import Optimizer

    from lightning_emig.membership.failure import Rollback
    from lightning_emig.picker.policy import LayoutPicker

log = logging.getLogger(__name__)

#: Key of our own section in Lightning's checkpoint dict (saved by rank 0 beside the sharded tensors).
CHECKPOINT_KEY = "lightning_emig"


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
            :mod:`lightning_emig.strategy.consistency`.
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
        self._loaders: list[MicroBatchLoader] = []
        self.bucket_bytes = bucket_bytes
        self.checksum = checksum
        self._migrating = False
        self.shadow_view = ShadowView()
        """What a thread preparing a layout change sees as ``layout_mesh`` and ``migrating`` (see ``prepare``)."""
        self._preparation: LayoutPreparation | None = None
        self.events: list[ReconfigureEvent] = []
        self._pending_layout: HybridLayout | None = None
        self._incoming_handoff: LiveHandoff | None = None
        self.live_transfer_started = False
        """Set by the live join as the first byte of this fit's incoming state is about to move."""
        """Live state carried over from the previous fit of this ``Trainer.fit`` call (see ``prepare_next_fit``)."""
        self.pending_handoff: LiveHandoff | None = None
        """Set by ``RendezvousCallback`` when this fit stops to hand its state to a newer generation."""
        self.failure_settings = failure or FailureSettings()
        self.last_boundary: LiveHandoff | None = None
        """This process's live state and resume metadata at the last optimizer-step boundary (or right after a live
        join): what survives an abrupt failure of a peer (see :mod:`lightning_emig.membership.failure`)."""
        self._rollback: Rollback | None = None
        """Set when the next fit restores a checkpoint after an abrupt failure left state without a surviving copy
        (its process group is already formed); that fit records the ``failure`` event."""
        self.generation = _start_generation()
        """The launcher generation this fit runs in (0 outside ``lightning-emig-run``)."""
        self.left_job = False
        """This process's node was preempted and handed its state over: it is no longer part of the job."""
        self.start_reason = restart_reason()
        """Why this process's first fit is a restart of a running job (None: a first start, a live join); the later
        fits of one ``trainer.fit`` call are live changes, never restarts, whatever torchrun's environment says."""
        self._accumulation_written: int | None = None
        self._dropped_children: list[str] = []
        self.kept_children: frozenset[str] = frozenset()
        """The LightningModule's children with state that existed before ``configure_model`` ran (built in
        ``__init__`` or ``setup``): a change keeps them as they are instead of building them again."""
        self._starting_over = False
        self._join: tuple[ChangeRecord, float, float] | None = None
        """The change this fit started with (its record, when the last old step ended, when the state was in place):
        its event is recorded once the first step on the new world is done."""
        self.live_resume_step: int | None = None
        """The step a live handoff resumed at (its state was never written; no checkpoint is due for it)."""
        self.resumed_from: ResumedCheckpoint | None = None
        """Set when this fit resumed from a checkpoint file, until its first step's time is recorded."""
        self.async_checkpoints = async_checkpoints
        self._checkpoint_writer = AsyncCheckpointWriter(timeout)
        self.picker = picker
        self.layout_choice: LayoutChoice | None = None
        """How this fit's layout was chosen (the picker's explanation goes into the next event's record)."""
        check_schedule(pipeline_schedule, pp=1, micro_batches=1)
        if picker is not None and picker.constraints.pipeline_schedule != pipeline_schedule:
            raise ValueError(f"the layout picker plans for the {picker.constraints.pipeline_schedule!r} schedule but "
                             f"the strategy runs {pipeline_schedule!r}: give both the same pipeline_schedule")
        self.pipeline_schedule = pipeline_schedule
        self._pipeline: PipelineDriver | None = None
        check_defer_choice(defer_grad_sync)
        if picker is not None and picker.constraints.defer_grad_sync != defer_grad_sync:
            raise ValueError(f"the layout picker plans for defer_grad_sync={picker.constraints.defer_grad_sync!r} but "
                             f"the strategy runs {defer_grad_sync!r}: give both the same defer_grad_sync")
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
        if self._rollback is not None:  # restores a checkpoint, even in a process that once joined live
            return False
        return self._incoming_handoff is not None or joining_live()

    @property
    def awaiting_live_state(self) -> bool:
        """This fit takes its state live and none of it has moved yet: a failure now leaves every holder's handoff
        (:attr:`incoming_handoff`) intact, and a joiner holding nothing."""
        return self.live_join and not self.live_transfer_started

    @property
    def incoming_handoff(self) -> LiveHandoff | None:
        """The state this process carries into this fit (None in a joiner and once the join has taken it)."""
        return self._incoming_handoff

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
        self._incoming_handoff = handoff
        self.live_transfer_started = False
        self._rollback = rollback
        self.pending_handoff = None
        self.last_boundary = None
        self._join = None
        self.resumed_from = None
        if handoff is not None:
            self.generation = handoff.generation
        if rollback is not None:
            self.generation = rollback.generation
        self._starting_over = rollback is not None and rollback.checkpoint is None

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
        if self._checkpoint_writer.closed:  # the previous fit of this Trainer.fit call closed it
            self._checkpoint_writer = AsyncCheckpointWriter(self.timeout)
        if under_launcher():
            die_with_parent(expected_parent=int(os.environ.get(ENV_AGENT_PID, os.getppid())))  # no orphan workers
            if self.root_device.type == "cpu":
                keep_freed_host_memory()  # each step reuses the last one's pages (see lightning_emig.host_memory)
            start_heartbeat(self.failure_settings.heartbeat_interval_s, self.failure_settings.heartbeat_timeout_s)
        self._form_generation_group()
        # Skip ModelParallelStrategy's 2-D mesh: ours is built from the layout.
        self._setup_distributed()
        mark_holding()  # in the generation the holders form: a holder from now on (see membership.admission)
        settings = self.elastic_settings
        if settings.picker is not None:
            self.layout_choice = self._agreed_choice(settings)
        elif self.live_join or self.start_reason is not None or self._rollback is not None:
            # A world this job did not start with (joined, restarted, rolled back): the rule of every change decides.
            self.layout_choice = settings.choose(self.world_size)
        else:  # the first start: the layout asked for, or a loud error if it does not fit this world
            layout = self._requested_layout.resolve(self.world_size)
            settings.validate_layout(layout)
            self.layout_choice = LayoutChoice(layout, settings.plan_for(layout))
        self.layout_choice = self._keeping_handed_order(self.layout_choice)
        layout, plan = self.layout_choice.layout, self.layout_choice.plan
        self.migrating = self.live_join  # configure_model must not initialise: the join overwrites every tensor
        self.install_mesh(build_mesh(layout, self.root_device.type, timeout=self.timeout), plan)
        if self.async_checkpoints:
            self._checkpoint_writer.open()
        if self._rollback is not None and self._rollback.checkpoint is None:
            self._note_rollback(step=0, load_seconds=0.0)  # no checkpoint: the fit starts over from step 0

    def _keeping_handed_order(self, choice: LayoutChoice) -> LayoutChoice:
        """State handed over in this layout's degrees on this world (a drain or a rebuild laid it out for them) comes
        in the rank order chosen to keep it in place: the fit keeps that order, so the state need not move again."""
        handed = self._incoming_handoff
        if handed is None or handed.old_world != self.world_size or handed.old_layout.degrees != choice.layout.degrees:
            return choice
        return dataclasses.replace(choice, layout=handed.old_layout)

    def _agreed_choice(self, settings: ElasticSettings) -> LayoutChoice:
        """The picker's layout for this world, decided by rank 0 and sent to every rank: rank 0 of a new generation
        holds the live state (it knows the layout the state is in, the migration cost's origin); a joiner decides
        nothing. Rank 0 logs the candidates table."""
        import torch.distributed as dist

        box: list[object] = [None]
        if self.global_rank == 0:
            current = self._incoming_handoff.old_layout if self._incoming_handoff is not None else None
            try:
                box[0] = settings.choose(self.world_size, current)
            except ValueError as error:  # every rank raises it, not only rank 0
                box[0] = error
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        choice = box[0]
        assert isinstance(choice, LayoutChoice) and choice.pick is not None
        if self.global_rank == 0:
            log.warning("layout picker, world %d:\n%s", self.world_size, choice.pick.table(max_rows=8))
        return choice

    def _form_generation_group(self) -> None:
        """Under lightning-emig-run, after a live change, torchrun's env:// rendezvous no longer applies. A joiner
        forms the generation the state holders commit to (not always the one it was started into: rounds overlap,
        see :mod:`~lightning_emig.membership.admission`)."""
        import torch.distributed as dist

        if dist.is_initialized() or not under_launcher() or not (self.generation > 0 or self.live_join):
            return
        client = control_client_from_env()
        node_id, local_rank = os.environ[ENV_NODE_ID], int(os.environ["LOCAL_RANK"])
        joiner = self.live_join and self._incoming_handoff is None
        if joiner:
            self._warm_before_joining(client)
            patience = self.timeout.total_seconds() + self.failure_settings.failure_timeout_s
            holders = HeartbeatWatch(client, self.failure_settings.heartbeat_timeout_s)
            self.generation = await_admission(client, node_id, local_rank, started_in=self.generation,
                                              timeout_s=patience, holders=holders)
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        try:
            enter_generation(read_generation(client, self.generation), node_id, local_rank, backend, self.timeout)
        except GenerationError:
            if not joiner:
                raise
            # A member died as the group formed; the holders recover among themselves (membership.failure). This
            # process holds nothing: it leaves, and its agent brings a fresh one in through a new round.
            log.exception("generation %d could not be formed: leaving as left out", self.generation)
            raise LeftOutError from None

    def _warm_before_joining(self, client: Any) -> None:
        """A joiner on the CPU faults in the memory it will need while the old world still trains (see
        :mod:`~lightning_emig.membership.admission`), so neither the transfer nor the first step waits for it."""
        if self.root_device.type != "cpu":
            return
        nbytes = memory_to_warm(client, read_generation(client, self.generation).world_size)
        if nbytes:
            seconds = warm_host_memory(nbytes)
            log.info("warmed %.2f GB of host memory in %.2fs before joining (the old world trains meanwhile)",
                     nbytes / 1e9, seconds)

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

    def _stages_later(self, trainer: pl.Trainer) -> bool:
        """A layout this job is told of may have pipeline stages: the requested one, a ``LayoutSchedule``'s or the
        picker's."""
        scheduled = [layout for callback in trainer.callbacks if isinstance(callback, LayoutSchedule)
                     for layout in callback.schedule.values()]
        picked = self.picker is not None and self.picker.constraints.allow_pp
        return picked or any(layout.pp != 1 for layout in (self._requested_layout, *scheduled))

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        check_rebuilt(self.lightning_module, self._dropped_children)
        self._dropped_children = []
        self._apply_gradient_accumulation(trainer)
        _add_callbacks(trainer)
        super().setup(trainer)
        check_fit_start(trainer, self.lightning_module, self.kept_children, stages_later=self._stages_later(trainer))
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
        if isinstance(layout, dict):
            layout = HybridLayout(**layout)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            raise RuntimeError("reconfigure(layout) works during Trainer.fit; change the layout argument instead")
        if layout.pp != 1:  # pp=-1 fills the world with stages
            check_can_be_staged(self.lightning_module)
        self._pending_layout = layout
        if at_step_boundary(trainer):
            self.apply_pending_reconfigure(trainer)

    def prepare_reconfigure(self, layout: HybridLayout | dict[str, int]) -> None:
        """Start building ``layout`` (mesh, model, plan) in a background thread while training goes on; the next
        :meth:`reconfigure` to the same layout then pauses only for the optimizer, the transfer and the restore.

        Every rank must call it with the same layout at the same step boundary, and create no process group until
        that ``reconfigure`` (see :mod:`~lightning_emig.strategy.prepare`). A second call replaces the first (after
        waiting for it). A change to or from pipeline stages is not prepared (it is built at the boundary).
        """
        if isinstance(layout, dict):
            layout = HybridLayout(**layout)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            raise RuntimeError("prepare_reconfigure(layout) works during Trainer.fit")
        resolved = layout.resolve(self.world_size)
        self.elastic_settings.validate_layout(resolved)
        self.discard_preparation()
        if resolved.pp > 1 or self.layout.pp > 1:
            # Where a layout has stages each process knows its own stage's specs only: the rank order and the plan
            # need every process's (a collective on the default group, which the training thread uses).
            log.info("a change to or from pipeline stages is built at the step boundary, not prepared")
            return
        module = self.lightning_module
        old_specs = {k: t.spec for k, t in training_state(module, self.optimizers[0]).items()}
        identity = IdentityMap.same_processes(self.world_size, node_of_every_rank())
        self._preparation = LayoutPreparation(self, layout, old_specs=old_specs, identity=identity)

    def take_preparation(self) -> LayoutPreparation | None:
        """The pending preparation, handed to the change that uses or discards it."""
        preparation, self._preparation = self._preparation, None
        return preparation

    def discard_preparation(self) -> None:
        """Wait for a pending preparation's thread and drop what it built (its groups stay, like any old mesh's)."""
        preparation = self.take_preparation()
        if preparation is not None:
            preparation.wait(self.timeout.total_seconds())

    def apply_pending_reconfigure(self, trainer: pl.Trainer) -> None:
        layout, self._pending_layout = self._pending_layout, None
        if layout is None:
            return
        if self.pending_handoff is not None:  # its state is handed over as it is; the next fit picks the layout
            log.warning("layout change to %s skipped: a membership change is handing the state over", layout.describe())
            return
        self.last_boundary = None  # its tensors are released by the change; the next boundary captures anew
        before = prove(trainer, "before a layout change")
        event = reconfigure_live(self, trainer, layout)
        check_same_state(before, prove(trainer, "after a layout change"), what="the layout change")
        if event is not None:
            self.record_event(trainer, event)

    def record_event(self, trainer: pl.Trainer, event: ReconfigureEvent) -> None:
        """Keep ``event`` in :attr:`events` and, on global rank 0, publish it (``events.jsonl``, the loggers); every
        kind of change comes through here, a restart's from the step-time recorder."""
        choice = self.layout_choice
        if choice is not None and choice.layout.as_dict() == event.new_layout:
            event.layout_choice = choice.record()  # the picker chose this fit's layout: why, in its words
        self.events.append(event)
        if self.global_rank != 0:
            return
        publish_event(trainer, event)

    def restart_data(self, trainer: pl.Trainer) -> None:
        """After a layout change: new accumulation, new data-parallel coordinate, fresh data iterator."""
        old_accumulation = trainer.accumulate_grad_batches
        trainer.accumulate_grad_batches = self._accumulation_written = self.batch_plan.grad_accumulation
        for loader in self._loaders:
            loader.stream.set_topology(self.layout.dp, self.layout_mesh.dp_rank)
        restart_training_iterator(trainer, old_accumulation)
        reload_validation_loaders(trainer)

    def _apply_gradient_accumulation(self, trainer: pl.Trainer) -> None:
        requested = trainer.accumulate_grad_batches
        derived = self.batch_plan.grad_accumulation
        # The value an earlier fit of the same Trainer.fit call (another world) wrote is ours, not the user's.
        if requested not in (1, derived, self._accumulation_written):
            raise ValueError(
                f"Trainer(accumulate_grad_batches={requested}) conflicts with the strategy's batch plan "
                f"({self.batch_plan.describe()}); leave accumulate_grad_batches unset, the strategy derives it"
            )
        trainer.accumulate_grad_batches = self._accumulation_written = derived

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.dp, "rank": self.layout_mesh.dp_rank}

    # -------------------------------------------------------------------- data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader, made elastic: a :class:`MicroBatchLoader` as it is, a user's ``DataLoader`` read
        through the global-offset sampler (:func:`~lightning_emig.data.adopt.adopt_dataloader`); anything else is
        refused. Evaluation loaders pass through."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and not trainer.training:
            return dataloader
        if not isinstance(dataloader, MicroBatchLoader):
            from torch.utils.data import DataLoader

            if not isinstance(dataloader, DataLoader):
                raise DataLoaderNotElasticError(
                    f"the training data is a {type(dataloader).__name__}, not a DataLoader; {USE_INSTEAD}"
                )
            dataloader = adopt_dataloader(dataloader, global_batch_size=self.global_batch_size,
                                          micro_batch_size=self.micro_batch_size, seed=self.seed)
        self._attach_loader(dataloader)
        return dataloader

    @property
    def data_streams(self) -> list[MicroBatchStream]:
        """The streams of the training loaders this fit reads (their position is the job's data position)."""
        return [loader.stream for loader in self._loaders]

    def _attach_loader(self, loader: MicroBatchLoader) -> None:
        stream = loader.stream
        if stream.sampler.global_batch_size != self.global_batch_size:
            raise ValueError(
                f"the data stream uses global_batch_size={stream.sampler.global_batch_size} but the strategy "
                f"uses {self.global_batch_size}; build both from the same value"
            )
        if stream.micro_batch_size != self.micro_batch_size:
            raise ValueError(
                f"the data stream uses micro_batch_size={stream.micro_batch_size} but the strategy "
                f"uses {self.micro_batch_size}; build both from the same value"
            )
        if self._starting_over:  # a rollback with no checkpoint: the data starts over too
            stream.seek(0)
        stream.set_topology(self.layout.dp, self.layout_mesh.dp_rank)
        if loader not in self._loaders:
            self._loaders.append(loader)

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
        layout_mesh = self.layout_mesh
        last_stage = self.layout.pp == 1 or layout_mesh[MeshAxis.PP].get_local_rank() == self.layout.pp - 1
        if last_stage and local_mean is None:
            raise ValueError("step_loss needs this rank's mean loss: it computed the step's losses")
        mean = local_mean.detach().float().clone() if last_stage else torch.zeros((), device=self.root_device)
        if last_stage:
            dist.all_reduce(mean, group=layout_mesh.dp.get_group())
            mean /= self.layout.dp
        if self.layout.pp > 1:
            dist.broadcast(mean, group=layout_mesh[MeshAxis.PP].get_group(), group_src=self.layout.pp - 1)
        return mean

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._pipeline is not None and self._pipeline.pending:
            raise PipelineError(f"the optimizer stepped with {self._pipeline.pending} of the step's micro-batches not "
                                "yet run through the pipeline (Lightning's accumulation and the batch plan disagree)")
        # One optimizer step consumed one global batch, whatever the layout.
        for loader in self._loaders:
            loader.stream.commit_step()
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
        checkpoint[CHECKPOINT_KEY] = {
            "layout": self.layout.as_dict(),
            "world_size": self.world_size,
            "rng_states": gather_rng_states(),
        }
        trainer = getattr(self.lightning_module, "_trainer", None)
        if self.async_checkpoints and trainer is not None and trainer.training and not self._checkpoint_writer.closed:
            if storage_options is not None:
                raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
            # The path from rank 0, as Lightning does, so that every rank writes into the same directory.
            self._checkpoint_writer.save(checkpoint, self.broadcast(filepath))
            return
        self._checkpoint_writer.wait()  # one save at a time: the one in flight finishes first
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def save_checkpoint_and_wait(self, trainer: pl.Trainer, path: Path) -> None:
        """Save a checkpoint now, in the background writer if there is one, and wait until it is complete."""
        trainer.save_checkpoint(path)
        self._checkpoint_writer.wait()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = self._load_live() if checkpoint_path == LIVE_CHECKPOINT else self._load_file(checkpoint_path)
        # Loaded into the module already; the load hooks (WeightAveraging's, a user's) see it as in a checkpoint.
        assert self.lightning_module is not None
        checkpoint.setdefault("state_dict", self.lightning_module.state_dict())
        return checkpoint

    def _load_file(self, checkpoint_path: _PATH) -> dict[str, Any]:
        load_started = time.time()
        checkpoint = self._load_checkpoint_contents(checkpoint_path)
        saved = checkpoint.get(CHECKPOINT_KEY, {})
        old_layout = HybridLayout(**saved["layout"]) if saved else self.layout
        old_world = int(saved.get("world_size", self.world_size))
        reason = None if self._rollback is not None else self.start_reason
        step = int(checkpoint.get("global_step", 0))
        # Saved under the old world's gradient accumulation; Lightning steps on this world's.
        old_plan = BatchPlan(global_batch_size=self.global_batch_size, micro_batch_size=self.micro_batch_size,
                             dp_degree=old_layout.dp)
        if "loops" in checkpoint:
            rescale_batch_progress(checkpoint, old_plan.grad_accumulation, self.batch_plan.grad_accumulation)
        self.resumed_from = ResumedCheckpoint(
            path=str(checkpoint_path), step=step, old_layout=old_layout.as_dict(), old_world=old_world,
            load_started=load_started, load_seconds=time.time() - load_started, restart_reason=reason,
        )
        if self.global_rank == 0:
            log.warning(
                "%sresumed %s at step %d: saved on %d process(es) as %s, now %d process(es) as %s%s (%.2fs)",
                f"RESTART ({reason}): " if reason else "", checkpoint_path, step, old_world, old_layout.describe(),
                self.world_size, self.layout.describe(),
                ", resharded on load" if (old_layout, old_world) != (self.layout, self.world_size) else "",
                self.resumed_from.load_seconds,
            )
        restore_rng_for_rank(
            saved.get("rng_states"), self.global_rank, seed=self.seed, step=checkpoint.get("global_step", 0)
        )
        if self._rollback is not None:
            self._note_rollback(step=step, load_seconds=self.resumed_from.load_seconds)
        return checkpoint

    def _load_checkpoint_contents(self, checkpoint_path: _PATH) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path)).resolve()  # every rank reads the same checkpoint
        assert self.lightning_module is not None
        check_checkpoint_matches(path, self.lightning_module)  # every rank reads the same metadata: all refuse
        if path.is_dir() and not holds_dtensors(self.lightning_module):  # one process: no FSDP2, no TP
            return load_sharded_into_plain_model(path, self.lightning_module, self.optimizers,
                                                 strict=self.lightning_module.strict_loading)
        # RNG states are pickled Python objects (per rank), so the metadata cannot be weights_only.
        return super().load_checkpoint(path, weights_only=False)

    def _note_rollback(self, *, step: int, load_seconds: float) -> None:
        """The ``failure`` event of a rollback, recorded once the first step on the new world is done."""
        rollback = self._rollback
        assert rollback is not None
        lost = max(0, rollback.from_step - step)
        self._join = (ChangeRecord(
            kind="failure", step=step, old_layout=rollback.old_layout, new_layout=self.layout,
            old_world=rollback.old_world, new_world=self.world_size, seconds={**rollback.seconds, "load": load_seconds},
            steps_rolled_back=lost, nodes=tuple(rollback.dead_nodes),
        ), rollback.last_step_wall, time.perf_counter())
        self.live_resume_step = step
        self._rollback = None  # used: a later fit, validate or test of this Trainer is no rollback
        treat_step_as_saved(self.lightning_module.trainer, step)  # restored, not trained: no save due for it
        if self.global_rank == 0:
            cause = f"the failure of node(s) {rollback.dead_nodes}" if rollback.dead_nodes else "a failed proof"
            log.error("ROLLED BACK to step %d after %s: %d step(s) lost (%s); world %d -> %d, %s", step, cause, lost,
                      rollback.reason, rollback.old_world, self.world_size, self.layout.describe())

    def _load_live(self) -> dict[str, Any]:
        if not self.live_join:
            raise RuntimeError(
                "fit(ckpt_path='live') needs live state: a handoff from the previous fit in this process, or a "
                "worker that lightning-emig-run started into a live generation (LIGHTNING_EMIG_JOIN_LIVE=1)"
            )
        handoff = self._incoming_handoff
        if handoff is not None:
            handoff.lap("build")
        module = self.lightning_module
        assert module is not None
        try:
            metadata, result, last_step_wall = join_live(self, module.trainer, handoff,
                                                         os.environ.get("LIGHTNING_EMIG_NODE_ID", ""))
        finally:
            self.migrating = False
        self._incoming_handoff = None  # moved (kept until then: a failure before the transfer goes on with it)
        self._join = (result, last_step_wall, time.perf_counter())
        self.live_resume_step = result.step
        treat_step_as_saved(module.trainer, result.step)
        os.environ.pop("LIGHTNING_EMIG_JOIN_LIVE", None)  # joined: from now on this process holds state
        self._stash_after_join(module, metadata, last_step_wall)
        if self.global_rank == 0:
            log.warning(
                "joined generation %d: world %d -> %d, %s -> %s, %.1f MB moved, resuming at step %d",
                self.generation, result.old_world, self.world_size, result.old_layout.describe(),
                self.layout.describe(), result.bytes_moved / 1e6, result.step,
            )
        return metadata

    def _stash_after_join(self, module: Any, metadata: dict[str, Any], last_step_wall: float) -> None:
        """A peer failing before this fit's first step boundary finds the joined state here."""
        import copy

        self.last_boundary = LiveHandoff(
            generation=-1, holders=(), old_layout=self.layout, old_world=self.world_size,
            old_rank=self.global_rank, state=training_state(module, self.optimizers[0]),
            metadata=copy.deepcopy(metadata), last_step_wall=last_step_wall,
        )

    def record_prior_event(self, trainer: pl.Trainer, handoff: LiveHandoff) -> None:
        """Record the change ``handoff`` carries (one that left the survivors below MIN, or was cut short); what follows
        is another event. Called in the survivors' generation (this process's rank is its rank there)."""
        prior, handoff.prior = handoff.prior, None
        assert prior is not None
        seconds = {**handoff.seconds, **prior.seconds}
        self.record_event(trainer, ReconfigureEvent.of(dataclasses.replace(prior, seconds=seconds),
                                                        generation=handoff.generation))
        handoff.seconds = {}

    def finish_join_event(self, trainer: pl.Trainer, *, interrupted: bool = False) -> None:
        """Record the join once the first step on the new world has finished (or the fit ends without one).
        ``interrupted``: a failure ended the fit before that step (called in the survivors' generation): the join
        happened all the same and is recorded, before the failure, with no first step and no downtime."""
        if self._join is None:
            return
        record, last_step_wall, loaded_at = self._join
        self._join = None
        if not interrupted:
            record = dataclasses.replace(record, seconds={**record.seconds,
                                                          "first_step": time.perf_counter() - loaded_at})
        if record.kind == "join" and (record.old_world, record.old_layout) == (record.new_world, record.new_layout):
            # The holders' own generation after a change that failed before its state moved (membership.failure):
            # no change happened, none to record.
            if self.global_rank == 0:
                log.warning("training again on the same %d process(es) after %.1fs: the change they began failed "
                            "before any state moved", self.world_size, time.time() - last_step_wall)
            return
        downtime = None if interrupted else time.time() - last_step_wall
        self.record_event(trainer, ReconfigureEvent.of(record, generation=self.generation, downtime_seconds=downtime))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._pipeline is not None:
            self._pipeline.reset()  # a step cut short by a peer's failure left part of its micro-batches
        _terminate_on_sigterm_under_torchrun()  # Lightning registered its own handler just before this fit

    @override
    def teardown(self) -> None:
        # Never lose the last periodic checkpoint; after a failure (a peer may be dead) do not wait for it.
        trainer = getattr(self.lightning_module, "_trainer", None)
        interrupted = trainer is not None and trainer.interrupted
        if not interrupted:  # after a failure its thread may wait on a dead peer: left to die with the groups
            self.discard_preparation()
        self._checkpoint_writer.close(wait=not interrupted)
        self._loaders.clear()
        if not isinstance(self._launcher, ElasticFitLauncher):  # its loop runs the next fit, and releases at the end
            release_frozen()
        super().teardown()


@dataclass(frozen=True, slots=True)
class ResumedCheckpoint:
    """A fit's start from a checkpoint file (what the restart event reports)."""

    path: str
    step: int
    old_layout: dict[str, int]
    old_world: int
    load_started: float
    """``time.time()`` when loading began."""
    load_seconds: float
    restart_reason: str | None
    """Why this start was a restart (see :func:`lightning_emig.strategy.resume.restart_reason`), else None."""


def _add_callbacks(trainer: pl.Trainer) -> None:
    """The strategy's own callbacks, added once: the step-boundary hook always, the rendezvous callback under
    ``lightning-emig-run``. Both run before any checkpoint callback, so a step that hands the state over is known
    to be one before a periodic save would fall on it."""
    from lightning.pytorch.callbacks import Checkpoint

    wanted: list[Any] = [StepBoundaryHook()]
    if under_launcher():
        wanted.append(RendezvousCallback())
    # After the rendezvous callback: it captures the boundary state before the step's first collective (a periodic
    # proof is one), so a peer dying in the proof leaves the survivors that step's state.
    wanted.append(ConsistencyGuard())
    for callback in wanted:
        if any(isinstance(cb, type(callback)) for cb in trainer.callbacks):
            continue
        first_checkpoint = next((i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)),
                                len(trainer.callbacks))
        trainer.callbacks.insert(first_checkpoint, callback)


def _start_generation() -> int:
    return int(os.environ.get(ENV_GENERATION, "0"))


def _terminate_on_sigterm_under_torchrun() -> None:
    """Let torchrun's agent stop a worker with SIGTERM, as it expects.

    Lightning 2.6 installs a SIGTERM handler (at every fit, after the strategy's setup) that runs a
    ``dist.broadcast`` inside the handler and then ignores the signal: a worker told to stop mid-collective hangs
    with its peers until the agent's SIGKILL 30 s later — the restart path's stop would cost half a minute. Under
    torchrun the agent owns the workers' lifecycle, so the default action (terminate) is restored.
    """
    import signal
    import threading

    if "TORCHELASTIC_RUN_ID" in os.environ and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
