"""``RendezvousCallback``: at every optimizer-step boundary, agree whether a newer generation is published.

The protocol, per step (only under ``lightning-emig-run``; elsewhere the callback does nothing):

0. every rank captures references to its live model and optimizer tensors and its resume metadata (the same
   consistent mid-epoch state a ``ModelCheckpoint`` saved in ``on_train_batch_end`` would hold) as
   ``strategy.last_boundary``, *before* the step's collective: should a peer die, this is what the survivors hold
   (see :mod:`~lightning_emig.membership.failure`);
1. global rank 0 reads ``latest_generation`` from the control store, at most every ``poll_interval_s``, and
   reports a newer generation only once every worker started into it has announced itself ready (or
   ``joiner_wait_s`` passed): until then training goes on, so the joiners' start-up costs no downtime;
2. one ``all_reduce(MAX)`` of that number over the world: every rank decides the same thing at the same step
   (its cost is kept in :attr:`RendezvousCallback.agree_seconds`);
3. when it is newer than the generation this Trainer runs in, every rank leaves that capture on the strategy as a
   :class:`~lightning_emig.membership.handoff.LiveHandoff` to hand over, and stops the fit. The caller then starts a new
   ``Trainer.fit(ckpt_path="live")`` in the same process, in the new generation.

When rank 0 also finds a ``leaving/<node_id>`` notice of a node of the current generation (announced preemption),
the same all-reduce carries a flag and every rank runs :func:`~lightning_emig.membership.preempt.drain_leavers`
on the old group before stopping the fit: the leavers' state moves to the survivors first.

No checkpoint is written because of that stop: :class:`HandoffAwareCheckpoint` skips saving while a handoff is
pending (this also skips a periodic checkpoint that would have fallen on exactly that step).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from lightning_emig.change.boundary import at_step_boundary
from lightning_emig.change.consistency import HANDOFF_SAVE_KEY
from lightning_emig.change.progress import show_migration
from lightning_emig.consistency import settle_handoff_proof
from lightning_emig.launcher.generation import (
    ENV_NODE_ID,
    control_client_from_env,
    latest_generation,
    node_host,
    read_generation,
)
from lightning_emig.launcher.heartbeat import HeartbeatWatch
from lightning_emig.membership.admission import (
    commit_generation,
    generation_to_join,
    joiners_ready,
    publish_working_set,
)
from lightning_emig.membership.group import open_generation_store, under_launcher
from lightning_emig.membership.handoff import LiveHandoff
from lightning_emig.membership.preempt import NobodyToHandOffToError, drain_leavers, leaving_nodes
from lightning_emig.migration.state import training_state
from lightning_emig.migration.transfer import local_bytes
from lightning_emig.strategy.resume import is_complete

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


class RendezvousCallback(Callback):
    """Stops ``Trainer.fit`` at the first optimizer-step boundary after a new generation is published.

    Args:
        poll_interval_s: Rank 0 reads the control store at most this often (the all-reduce runs every step).
        joiner_wait_s: How long training goes on after a generation appears while its joiners start up; then
            the holders go on with the joiners that are ready (the others are left out and rejoin).
        store_timeout_s: Timeout of the control-store client (rank 0 only).
    """

    def __init__(self, poll_interval_s: float = 0.25, joiner_wait_s: float = 120.0, store_timeout_s: float = 60.0
                 ) -> None:
        self.poll_interval_s = poll_interval_s
        self.joiner_wait_s = joiner_wait_s
        self.store_timeout_s = store_timeout_s
        self.agree_seconds: list[float] = []
        """Seconds of each step's check (capturing the live state's references and resume metadata, the store read
        on rank 0, the all-reduce): the steady-state cost."""
        self._client: Any = None
        self._last_poll = float("-inf")
        self._seen: dict[int, float] = {}  # generation -> monotonic time rank 0 first saw it
        self._watch: HeartbeatWatch | None = None  # rank 0: joining agents' heartbeats
        self._strategy: Any = None

    @property
    def enabled(self) -> bool:
        return under_launcher()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.enabled or not at_step_boundary(trainer):
            return
        strategy: Any = trainer.strategy
        self._strategy = strategy
        last_step_wall = time.time()
        # Captured before the step's only collective: a peer dying now leaves the survivors this consistent state.
        boundary_start = time.perf_counter()
        strategy.last_boundary = stash = capture_handoff(trainer, new_generation=-1, last_step_wall=last_step_wall)
        stash.seconds["capture"] = time.perf_counter() - boundary_start
        start = time.perf_counter()
        latest, leave = self._poll(strategy.generation) if trainer.global_rank == 0 else (-1, 0)
        detect = time.perf_counter() - start
        agreed = torch.tensor([latest, leave], dtype=torch.int64, device=strategy.root_device)
        if dist.is_initialized():
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        latest, leave = (int(v) for v in agreed.tolist())
        agree = time.perf_counter() - start - detect
        self.agree_seconds.append(time.perf_counter() - boundary_start)
        if leave and dist.is_initialized():
            # A node announced its preemption: drain it over the old group, then stop like a handoff.
            handoff = stash
            handoff.phase_started = time.perf_counter()
            handoff.seconds.update(detect=detect, agree=agree)
            run_save_hooks(trainer, handoff, prove_while_moving=True)  # the drain completes the proof
            show_migration(trainer, "migrating (node leaving)")
            try:
                strategy.pending_handoff = drain_leavers(trainer, self._client, handoff)
            except NobodyToHandOffToError as nobody:
                settle_handoff_proof(handoff.metadata)
                strategy.pending_handoff = _checkpoint_before_leaving(trainer, handoff, nobody)
            strategy.last_boundary = None  # the drain re-laid the captured state out: it is no boundary state now
            trainer.should_stop = True
            return
        if latest <= strategy.generation:
            return
        handoff = stash
        handoff.generation, handoff.phase_started = latest, time.perf_counter()
        handoff.seconds.update(detect=detect, agree=agree)
        # Before the commit: the save hooks prove the state (a collective that may refuse it), and joiners admitted by
        # the commit must not wait for holders that roll back instead. A world of one has no replica to disagree and
        # needs no collective: its digest is summed while the new world forms, the proof completed before the state
        # is announced to it (join_live).
        run_save_hooks(trainer, handoff, prove_while_moving=strategy.world_size == 1)
        if trainer.global_rank == 0:  # the agreed number is rank 0's: joiners waiting for admission read it
            open_generation_store(read_generation(self._client, latest), os.environ[ENV_NODE_ID],
                                  int(os.environ["LOCAL_RANK"]), strategy.timeout)
            commit_generation(self._client, latest)
        show_migration(trainer, f"migrating (generation {latest})")
        strategy.pending_handoff = handoff
        trainer.should_stop = True
        if trainer.global_rank == 0:
            log.warning(
                "generation %d published: handing over live state after step %d (world %d, %s)",
                latest, trainer.global_step, strategy.world_size, strategy.layout.describe(),
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.enabled and dist.is_initialized() and trainer.strategy.pending_handoff is None:
            self._hand_over_to_late_joiners(trainer)

    def _hand_over_to_late_joiners(self, trainer: pl.Trainer) -> None:
        """Training is done, but a generation with joiners was published: hand them the final state rather than
        leave them waiting for a group nobody forms (they receive it, find ``max_steps`` reached, and exit 0)."""
        strategy: Any = trainer.strategy
        latest = self._late_generation(strategy.generation) if trainer.global_rank == 0 else -1
        agreed = torch.tensor([latest], dtype=torch.int64, device=strategy.root_device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        latest = int(agreed.item())
        if latest <= strategy.generation or strategy.last_boundary is None:
            return
        handoff = strategy.last_boundary
        handoff.generation, handoff.phase_started = latest, time.perf_counter()
        run_save_hooks(trainer, handoff)  # before the commit, as at a step boundary
        if trainer.global_rank == 0:
            commit_generation(self._client, latest)
        strategy.pending_handoff = handoff
        if trainer.global_rank == 0:
            log.warning("generation %d joined as training ended: handing it the final state", latest)

    def _late_generation(self, current: int) -> int:
        """Rank 0 at the end of training: a newer generation whose joiners become ready in time, else -1."""
        if self._client is None:
            self._client = control_client_from_env(timeout_s=self.store_timeout_s)
        deadline = time.monotonic() + self.joiner_wait_s
        holders = read_generation(self._client, current)
        while (latest := latest_generation(self._client)) > current:
            if joiners_ready(self._client, read_generation(self._client, latest), holders):
                return latest
            if time.monotonic() > deadline:
                log.warning("generation %d: joiners not ready %.0fs after training ended; finishing without them",
                            latest, self.joiner_wait_s)
                break
            time.sleep(0.1)
        return -1

    def _poll(self, current: int) -> tuple[int, int]:
        """Rank 0: (the newest generation whose joiners are all ready, else ``current``; 1 if a node is leaving)."""
        now = time.monotonic()
        if now - self._last_poll < self.poll_interval_s:
            return current, 0
        self._last_poll = now
        if self._client is None:
            self._client = control_client_from_env(timeout_s=self.store_timeout_s)
        self._publish_working_set()
        leaving = set(leaving_nodes(self._client, current))
        newest = self._newest_ready(current, now)
        if leaving and newest > current and leaving & {n.node_id for n in read_generation(self._client, newest).nodes}:
            # A round kept the leaver (its notice came later) and its joiners are ready: join that generation first,
            # drain the leaver there. (A round whose joiners are not ready yet waits: the drain goes first, they
            # rejoin.)
            leaving = set()
        return newest, 1 if leaving else 0

    def _publish_working_set(self) -> None:
        """Rank 0 on the CPU: what a joiner should warm before it says ready (see membership.admission)."""
        strategy: Any = self._strategy
        if strategy.root_device.type == "cpu" and strategy.last_boundary is not None:
            state = {key: tensor.local for key, tensor in strategy.last_boundary.state.items()}
            publish_working_set(self._client, state_bytes=local_bytes(state), world=strategy.world_size)

    def _newest_ready(self, current: int, now: float) -> int:
        """Rank 0: the generation to go into (see :func:`~lightning_emig.membership.admission.generation_to_join`;
        joiners still starting after ``joiner_wait_s`` are given up on), else ``current``."""
        latest = latest_generation(self._client)
        if latest <= current:
            return current
        first_seen = self._seen.setdefault(latest, now)
        strategy: Any = self._strategy
        if self._watch is None:
            self._watch = HeartbeatWatch(self._client, strategy.failure_settings.heartbeat_timeout_s)
        found = generation_to_join(self._client, current, self._watch, host=node_host(os.environ[ENV_NODE_ID]),
                                   timeout=strategy.timeout, give_up_on_starting=now - first_seen > self.joiner_wait_s)
        if found is None:
            return current
        log.info("generation %d: joiners ready %.2fs after generation %d was seen; training went on meanwhile",
                 found, now - first_seen, latest)
        return found


def _checkpoint_before_leaving(trainer: pl.Trainer, handoff: LiveHandoff, nobody: NobodyToHandOffToError
                               ) -> LiveHandoff:
    """Every node of the generation is preempted: nobody can receive the live state, so every rank saves it at this
    step boundary (``step<N>.ckpt`` in the checkpoint directory, where a restart looks), waits for the write, and
    leaves (exit 0). The generation that forms next, with nodes that join later, resumes from it: no step is lost.
    Without a checkpoint directory (no ``ModelCheckpoint``) there is nowhere to put it: the error stands."""
    strategy: Any = trainer.strategy
    directory = strategy.checkpoint_dir(trainer)
    if directory is None:
        raise RuntimeError(f"{nobody}: nobody to hand the state to, and no checkpoint directory to save it in") from None
    path = directory / f"step{trainer.global_step:06d}.ckpt"
    if trainer.global_rank == 0:
        log.error("%s: nobody to hand the live state to; saving it to %s before leaving (the next generation resumes "
                  "from it)", nobody, path)
    if not strategy.broadcast(is_complete(path)):  # a periodic save may have written this step; rank 0 says
        strategy.save_checkpoint_and_wait(trainer, path)
    handoff.leaving, handoff.state = True, None
    return handoff


def capture_handoff(trainer: pl.Trainer, *, new_generation: int, last_step_wall: float) -> LiveHandoff:
    """The live state and resume metadata of this process, at an optimizer-step boundary."""
    strategy: Any = trainer.strategy
    module = trainer.lightning_module
    optimizer = trainer.optimizers[0]
    metadata = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": lightning.__version__,
        # What a Lightning checkpoint saves of loops and callbacks, through their public state_dict()s.
        "loops": {name: getattr(trainer, name).state_dict()
                  for name in ("fit_loop", "validate_loop", "test_loop", "predict_loop")},
        "callbacks": {cb.state_key: state for cb in trainer.callbacks if (state := cb.state_dict())},
        "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        "optimizer_hyper": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "lightning_emig": {"layout": strategy.layout.as_dict(), "world_size": strategy.world_size},
    }
    datamodule = trainer.datamodule
    if datamodule is not None and (datamodule_state := datamodule.state_dict()):
        metadata[type(datamodule).__qualname__] = datamodule_state
    holders = (read_generation(control_client_from_env(), strategy.generation).members if under_launcher()
               else ())
    return LiveHandoff(
        generation=new_generation, holders=holders, old_layout=strategy.layout,
        old_world=strategy.world_size, old_rank=strategy.global_rank, state=training_state(module, optimizer),
        metadata=metadata, last_step_wall=last_step_wall,
    )


def run_save_hooks(trainer: pl.Trainer, handoff: LiveHandoff, *, prove_while_moving: bool = False) -> None:
    """Once a captured boundary is handed over: the callbacks' and the module's ``on_save_checkpoint`` see its resume
    metadata as they see a checkpoint Lightning saves, with the module's ``state_dict`` (the live tensors, not
    copied; taken out again, as the state moves by itself), and what they add travels with it. Not at every
    boundary's capture: Lightning calls these hooks when it saves, not at every step. Their time is the change's
    ``save_hooks`` phase.

    The proof of the state handed over is begun there; with ``prove_while_moving`` the caller completes it
    (:func:`~lightning_emig.consistency.settle_handoff_proof`) once the state has moved, before the old state
    is released (a drain: its digest is summed during the transfer), else it is completed here."""
    module = trainer.lightning_module
    checkpoint = handoff.metadata
    checkpoint["state_dict"] = module.state_dict()
    checkpoint[HANDOFF_SAVE_KEY] = True
    try:
        for callback in trainer.callbacks:
            callback.on_save_checkpoint(trainer, module, checkpoint)
        module.on_save_checkpoint(checkpoint)
    finally:
        checkpoint.pop("state_dict", None)
        checkpoint.pop(HANDOFF_SAVE_KEY, None)
    if not prove_while_moving:
        settle_handoff_proof(checkpoint)
    handoff.lap("save_hooks")


class HandoffAwareCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that saves nothing while live state is being handed to a new generation, nor at the
    step a live handoff resumed from: Lightning restores that state as "at the end of that batch" and would
    otherwise save it again before the first new step, on the downtime's critical path. Nor does it write
    ``last.ckpt`` at the end of a fit stopped for a handoff.

    With ``save_last="link"`` ``last.ckpt`` is a link to the newest step checkpoint (no second copy of the state);
    a real save to ``last.ckpt`` (a fit that saved no step checkpoint) replaces the link instead of writing through
    it into the step checkpoint it points to."""

    @override
    def _should_skip_saving_checkpoint(self, trainer: pl.Trainer) -> bool:
        strategy = trainer.strategy
        if getattr(strategy, "pending_handoff", None) is not None:
            return True
        if getattr(strategy, "live_resume_step", None) == trainer.global_step:
            return True
        return super()._should_skip_saving_checkpoint(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if getattr(trainer.strategy, "pending_handoff", None) is not None:
            return  # the state moves live; a last.ckpt would be a full save on every membership change's critical path
        super().on_train_end(trainer, pl_module)

    @override
    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        import os

        # Rank 0 only; the save's first collectives order every other rank's writes after it.
        if trainer.is_global_zero and os.path.islink(filepath):
            os.remove(filepath)
        super()._save_checkpoint(trainer, filepath)
