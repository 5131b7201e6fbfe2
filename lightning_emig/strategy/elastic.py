"""``ElasticMigrationStrategy``: Lightning's adapter to elastic training. On top of
:class:`~lightning_emig.strategy.hybrid.HybridLayoutStrategy` (what a layout means for Lightning's loop) it translates
Lightning's hooks into calls on the objects that change a running job, none of which imports it (they see it through
the views of :mod:`lightning_emig.change.host`):

* entering the generation's process group and choosing its layout (:mod:`~lightning_emig.change.enter`), at
  ``setup_environment``;
* the change a fit starts with, live or a rollback (:class:`~lightning_emig.change.incoming.IncomingChange`), in
  ``load_checkpoint``; the layout changes asked for during a fit (:class:`~lightning_emig.change.requests.LayoutRequests`);
  every change's event (:class:`~lightning_emig.change.record.ChangeLog`);
* what a change could not carry refused when ``fit`` starts (:mod:`~lightning_emig.change.fit_start`), the state
  proved the same around every change (:mod:`~lightning_emig.change.consistency`);
* under ``lightning-emig-run``, one ``Trainer.fit`` call as a sequence of fits, one per membership change
  (:mod:`~lightning_emig.strategy.elastic_fit`), and the membership layer's view of this worker
  (:class:`~lightning_emig.membership.settings.ElasticWorker`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from lightning_emig.change.enter import Arrival, choose_layout, form_generation_group
from lightning_emig.change.events import ReconfigureEvent
from lightning_emig.change.fit_start import check_callbacks, check_fit_start
from lightning_emig.change.incoming import IncomingChange
from lightning_emig.change.prepare import LayoutPreparation, ShadowView
from lightning_emig.change.rebuild import check_rebuilt, children_with_state
from lightning_emig.change.record import ChangeLog
from lightning_emig.change.requests import LayoutRequests
from lightning_emig.collective_sockets import recording_group_sockets
from lightning_emig.collector import freeze_what_exists, release_frozen
from lightning_emig.host_memory import keep_freed_host_memory
from lightning_emig.launcher.generation import ENV_AGENT_PID, ENV_GENERATION, live_membership_from_env
from lightning_emig.launcher.heartbeat import mark_holding, start_heartbeat
from lightning_emig.launcher.orphans import die_with_parent
from lightning_emig.layout import HybridLayout, LayoutMesh
from lightning_emig.membership.death_watch import start_death_watch
from lightning_emig.membership.group import under_launcher
from lightning_emig.membership.handoff import LIVE_CHECKPOINT, LiveHandoff
from lightning_emig.membership.settings import ElasticSettings, FailureSettings, LayoutChoice
from lightning_emig.migration.state import storages_of
from lightning_emig.migration.transfer import DEFAULT_BUCKET_BYTES, TransferOptions
from lightning_emig.strategy.elastic_fit import ElasticFitLauncher
from lightning_emig.strategy.grad_sync import DeferGradSync
from lightning_emig.strategy.hooks import add_callbacks, terminate_on_sigterm_under_torchrun
from lightning_emig.strategy.hybrid import HybridLayoutStrategy
from lightning_emig.strategy.schedule import stages_later

if TYPE_CHECKING:
    from collections.abc import Iterator

    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH

    from lightning_emig.data.batching import BatchPlan
    from lightning_emig.membership.failure import Rollback
    from lightning_emig.migration.change import ChangeRecord
    from lightning_emig.picker.policy import LayoutPicker

log = logging.getLogger(__name__)


class ElasticMigrationStrategy(HybridLayoutStrategy):
    """Train under any hybrid layout (pipeline stages x HSDP x FSDP2 x TP) with a fixed global batch, through changes
    of layout (:meth:`reconfigure`) and, under ``lightning-emig-run``, of the world.

    Args:
        layout, global_batch_size, micro_batch_size, process_group_backend, timeout, seed, async_checkpoints,
            pipeline_schedule, defer_grad_sync: as :class:`~lightning_emig.strategy.hybrid.HybridLayoutStrategy`
            (``layout`` is the first world's; each new world keeps its ``tp``/``pp``/``dp_replicate`` where they
            divide it, else pure FSDP).
        bucket_bytes: Memory budget of a migration's transfer buffers per process (default 256 MiB).
        checksum: Verify every migrated bucket with a CRC32 (costs a pass over the bytes on both ends).
        failure: Heartbeat and failure-detection settings (under ``lightning-emig-run``).
        picker: Choose each world's layout, the first one included, with the layout picker
            (:class:`~lightning_emig.picker.policy.LayoutPicker`); ``layout`` is then ignored.
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
        super().__init__(layout, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                         process_group_backend=process_group_backend, timeout=timeout, seed=seed,
                         async_checkpoints=async_checkpoints, pipeline_schedule=pipeline_schedule,
                         defer_grad_sync=defer_grad_sync)
        if picker is not None:
            picker.check_runs_as(pipeline_schedule=pipeline_schedule, defer_grad_sync=defer_grad_sync)
        if consistency_every_n_steps < 0:
            raise ValueError(f"consistency_every_n_steps must be >= 0, got {consistency_every_n_steps}")
        self.consistency_every_n_steps = consistency_every_n_steps
        self.bucket_bytes = bucket_bytes
        self.checksum = checksum
        self.picker = picker
        self.layout_choice: LayoutChoice | None = None
        """How this fit's layout was chosen (the picker's explanation goes into the next event's record)."""
        self._migrating = False
        self.shadow_view = ShadowView()
        """What a thread preparing a layout change sees as ``layout_mesh`` and ``migrating`` (see ``prepare``)."""
        self._requests = LayoutRequests(self)
        self._changes = ChangeLog()
        self._incoming = IncomingChange(self._changes)
        # What the change and membership modules read and set (documented on their views, change.host):
        self.live_transfer_started = False
        self.pending_handoff: LiveHandoff | None = None
        self.failure_settings = failure or FailureSettings()
        self.last_boundary: LiveHandoff | None = None
        self.generation = int(os.environ.get(ENV_GENERATION, "0"))
        self.left_job = False
        self._laid_out = False
        """This process has had a layout (see :attr:`starting_fresh`)."""
        self._dropped_children: list[str] = []
        self.kept_children: frozenset[str] = frozenset()

    # ------------------------------------------------------------------ layout
    @property
    @override
    def layout_mesh(self) -> LayoutMesh:
        if self.shadow_view.layout_mesh is not None:  # seen by a thread preparing a change only
            return self.shadow_view.layout_mesh
        return super().layout_mesh

    @override
    def install_mesh(self, layout_mesh: LayoutMesh, plan: BatchPlan) -> None:
        super().install_mesh(layout_mesh, plan)
        self._laid_out = True

    @property
    def migrating(self) -> bool:
        """True while ``configure_model`` runs for a migration: it may skip initialisation."""
        return self.shadow_view.migrating or self._migrating

    @migrating.setter
    def migrating(self, value: bool) -> None:
        self._migrating = value

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

    @override
    def _choose_layout(self) -> tuple[HybridLayout, BatchPlan]:
        mark_holding()  # in the generation the holders form: a holder from now on (see membership.admission)
        self.layout_choice = choose_layout(
            self.elastic_settings, world_size=self.world_size, rank=self.global_rank, requested=self._requested_layout,
            handoff=self._incoming.handoff,
            new_world=self.live_join or self.start_reason is not None or self._incoming.rollback is not None,
        )
        self.migrating = self.live_join  # configure_model must not initialise: the join overwrites every tensor
        return self.layout_choice.layout, self.layout_choice.plan

    # ------------------------------------------------------------- the fit
    @override
    def _configure_launcher(self) -> None:
        if under_launcher():  # one fit call follows every membership change (see elastic_fit)
            self._launcher = ElasticFitLauncher(self)
            return
        super()._configure_launcher()

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
            # A peer's death stops this process's compute at once.
            start_death_watch(lambda: self.generation, self.failure_settings,
                              exits=self.failure_settings.watch_exits and live_membership_from_env(),
                              starting_fresh=lambda: self.starting_fresh)
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        self.generation = form_generation_group(Arrival(
            generation=self.generation, live_join=self.live_join, handoff=self._incoming.handoff, backend=backend,
            timeout=self.timeout, failure=self.failure_settings, on_cpu=self.root_device.type == "cpu",
        ))
        # A first start's group is torchrun's, formed by Lightning below: recorded as a later generation's is (a way
        # out of its collectives when a peer is gone: lightning_emig.collective_sockets).
        first = under_launcher() and not torch.distributed.is_initialized()
        with recording_group_sockets(generation=self.generation, gloo=backend == "gloo") if first else (
                contextlib.nullcontext()):
            super().setup_environment()
        if self._incoming.rollback is not None and self._incoming.starting_over:  # once: a later validate is none
            self._note_rollback(step=0, load_seconds=0.0)  # no checkpoint: the fit starts over from step 0

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
        add_callbacks(trainer)
        super().setup(trainer)
        check_fit_start(trainer, self.lightning_module, self.kept_children,
                        stages_later=stages_later(trainer, self._requested_layout, self.picker))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        terminate_on_sigterm_under_torchrun()  # Lightning registered its own handler just before this fit

    @override
    def teardown(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if not (trainer is not None and trainer.interrupted):  # after a failure its thread may wait on a dead peer
            self._requests.discard_preparation()
        if not isinstance(self._launcher, ElasticFitLauncher):  # its loop runs the next fit, and releases at the end
            release_frozen()
        super().teardown()

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
        """Keep ``event`` in :attr:`events` and, on global rank 0, publish it (``events.jsonl``, the loggers): the
        entry for changes recorded from outside (a layout change, a restart from the step-time recorder); the ones a
        fit starts with go to the same :meth:`ChangeLog.record` from :meth:`finish_change_event`."""
        self._changes.record(trainer, event, rank=self.global_rank, choice=self.layout_choice)

    # -------------------------------------------------------------- checkpoint
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        if self.pending_handoff is not None:
            # The state is being handed to a new generation (a drain may already have released it): the live path
            # is the copy; a save now would cost the change's downtime or write released storage.
            log.warning("checkpoint %s skipped: the state is being handed to generation %d", filepath,
                        self.pending_handoff.generation)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if checkpoint_path != LIVE_CHECKPOINT:
            return super().load_checkpoint(checkpoint_path, weights_only)
        assert self.lightning_module is not None
        checkpoint = self._incoming.take_live(self, self.lightning_module.trainer)
        checkpoint.setdefault("state_dict", self.lightning_module.state_dict())  # for the load hooks, as in a file
        return checkpoint

    @override
    def _load_file(self, checkpoint_path: _PATH) -> dict[str, Any]:
        checkpoint = super()._load_file(checkpoint_path)
        if self._incoming.rollback is not None and self.resumed_from is not None:
            self._note_rollback(step=self.resumed_from.step, load_seconds=self.resumed_from.load_seconds)
        return checkpoint

    @property
    @override
    def _resume_reason(self) -> str | None:
        return None if self._incoming.rollback is not None else self.start_reason  # a rollback is no restart

    @property
    @override
    def _data_starts_over(self) -> bool:
        return self._incoming.starting_over  # a rollback with no checkpoint

    def _note_rollback(self, *, step: int, load_seconds: float) -> None:
        self._incoming.rolled_back(self.lightning_module.trainer, step=step, load_seconds=load_seconds,
                                   layout=self.layout, world_size=self.world_size, rank=self.global_rank)

    # ------------------------------------------------- membership (ElasticWorker, FitHost)
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

    @property
    def live_join(self) -> bool:
        """This fit receives its state from running processes (``fit(ckpt_path="live")``)."""
        return self._incoming.live_join

    @property
    def starting_fresh(self) -> bool:
        """This process started with its generation, as every worker of it did (the job's first start, or a restart
        from a checkpoint: a joiner joins live), and has never had a layout: nobody in the generation holds state
        that the newest checkpoint does not. (Not :attr:`has_layout`: a failure's recovery drops the layout of a
        process that trained.)"""
        return not self._laid_out and not self.live_join

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
    def reached_step(self) -> int:
        """The optimizer steps this process's trainer has completed (-1 before it has one)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer.global_step if trainer is not None else -1

    def live_storages(self) -> frozenset[int]:
        module = self.lightning_module
        if module is None:
            return frozenset()
        return storages_of(t for t in module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor))

    def record_prior_event(self, trainer: pl.Trainer, handoff: LiveHandoff) -> None:
        """Record the change ``handoff`` carries (see :meth:`ChangeLog.record_prior`)."""
        self._changes.record_prior(trainer, handoff, rank=self.global_rank, choice=self.layout_choice)

    def set_apart_from_first_step(self, phase: str, seconds: float) -> None:
        """See :meth:`ChangeLog.set_apart`."""
        self._changes.set_apart(phase, seconds)

    def note_state_proven(self, digest: int) -> None:
        """See :meth:`ChangeLog.note_proven`."""
        self._changes.note_proven(digest)

    def begin_restart_event(self, record: ChangeRecord, *, last_step_wall: float, in_place_wall: float) -> None:
        """This fit restarted from a checkpoint (``record``, alike on every rank): its event waits for the first
        step like a live change's (see :meth:`ChangeLog.begin`)."""
        self._changes.begin(record, last_step_wall, in_place_wall)

    def finish_change_event(self, trainer: pl.Trainer, *, interrupted: bool = False) -> None:
        """Record the change this fit began with (see :meth:`ChangeLog.finish`)."""
        self._changes.finish(trainer, generation=self.generation, world_size=self.world_size, rank=self.global_rank,
                             choice=self.layout_choice, interrupted=interrupted)
