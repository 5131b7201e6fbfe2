"""One ``Trainer.fit`` call for the whole elastic job: the strategy's launcher runs it as a sequence of fits.

Lightning hands every ``trainer.fit`` to ``strategy.launcher.launch(trainer._fit_impl, ...)`` when the strategy has
a launcher. Under ``lightning-emig-run`` :class:`ElasticFitLauncher` is that launcher: it runs the fit, and when the
fit stopped for a membership change it carries the live state into the next generation and runs the fit again in
the same process, with the same Trainer, module, callbacks, loggers and DataLoader. The user's ``trainer.fit(...)``
returns only when training is done. Each pass of the loop is one of:

* **handoff** (a node joined; a node left with notice): the fit stopped at an optimizer-step boundary with
  ``strategy.pending_handoff`` set; this process switches to the new generation's process group, drops the model
  (its ``configure_model`` rebuilds it for the new world) and fits again with ``ckpt_path="live"``;
* **failure** (a peer died): the fit raised a collective error; the survivors agree on the dead, rebuild lost
  shards from replicas (then fit again with ``"live"``) or roll back to the newest complete checkpoint;
* **below MIN**: after either, fewer nodes than ``--nnodes`` MIN are left: the survivors wait, with their state,
  for a generation that brings enough nodes;
* **leave**: this process's node was preempted and its state has been handed over: the process leaves the job by
  raising ``SystemExit(0)`` out of ``fit`` (nothing after ``fit`` in the user's script runs in a process that is no
  longer part of the job; its agent leaves the rendezvous without closing it).

A worker started into a live generation (a joiner) runs its first fit with ``ckpt_path="live"`` whatever the
script passed. Outside ``lightning-emig-run`` the strategy has no launcher and ``fit`` is Lightning's own.

Private Lightning 2.6 names used here, and only here (pinned by ``tests/test_elastic_fit.py``): ``Trainer._fit_impl``
(to tell ``fit`` from ``validate``/``test``/``predict``, which run once) and its ``ckpt_path`` parameter; and, when a
fit fails because a peer died, ``lightning.pytorch.trainer.call._interrupt`` and ``Trainer._teardown``, exactly what
Lightning's own handler calls before the survivors recover in the same Trainer; ``ModelCheckpoint._last_global_step_saved``
(every rank skips the step a live fit resumed at).
"""

from __future__ import annotations

import copy
import gc
import inspect
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelSummary
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from typing_extensions import override

from lightning_emig.change.boundary import treat_step_as_saved
from lightning_emig.change.rebuild import drop_model
from lightning_emig.collector import release_frozen
from lightning_emig.consistency import InconsistentStateError
from lightning_emig.launcher.generation import (
    ENV_NODE_ID,
    GenerationError,
    allowed_worlds_from_env,
    control_client_from_env,
    read_generation,
)
from lightning_emig.launcher.leaving import yield_cpu_to_the_job
from lightning_emig.membership.admission import LeftOutError, announce_training_done
from lightning_emig.membership.below_min import below_min, wait_for_enough_nodes
from lightning_emig.membership.failure import (
    RECOVERY_ATTEMPTS,
    Rollback,
    is_peer_failure,
    recover_from_failure,
)
from lightning_emig.membership.group import enter_generation, joining_live, under_launcher
from lightning_emig.membership.handoff import LIVE_CHECKPOINT, LiveHandoff
from lightning_emig.strategy.resume import newest_checkpoint

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import timedelta

    import lightning.pytorch as pl

    from lightning_emig.change.host import FitHost

log = logging.getLogger(__name__)


class _Done:
    """The whole ``Trainer.fit`` call is done (distinct from a next fit that starts from no checkpoint)."""


DONE = _Done()


def is_fit(function: Callable[..., Any]) -> bool:
    """Is ``function`` the Trainer's fit implementation (the one entry point that follows membership changes)?"""
    import lightning.pytorch as pl

    return getattr(function, "__func__", None) is pl.Trainer._fit_impl  # noqa: SLF001 - pinned by a test


class ElasticFitLauncher(_Launcher):
    """Runs ``Trainer.fit`` once per generation until training is done (see the module docstring)."""

    def __init__(self, strategy: FitHost) -> None:
        self._strategy = strategy
        self._inconsistent_rollbacks = 0  # in a row: training past the step of the last one resets the count
        self._inconsistent_at = -1
        self._refused_checkpoints: frozenset[Path] = frozenset()

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True  # it starts no processes: torchrun's agent did

    @override
    def kill(self, signum: Any) -> None:
        """Nothing to kill: the agent owns the worker processes."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any
               ) -> Any:
        if trainer is None or not is_fit(function):
            return function(*args, **kwargs)
        _check_allowed_worlds(self._strategy, trainer)
        call = inspect.signature(function).bind(*args, **kwargs)
        if joining_live():
            call.arguments["ckpt_path"] = LIVE_CHECKPOINT
        elif call.arguments.get("ckpt_path") is None and self._strategy.start_reason is not None:
            call.arguments["ckpt_path"] = _checkpoint_to_restart_from(self._strategy, trainer)
        self._fresh_loops = copy.deepcopy(trainer.fit_loop.state_dict())  # a rollback with no checkpoint restores it
        summaries: list[tuple[int, Callback]] = []
        try:
            while True:
                next_checkpoint = self._fit_once(function, call, trainer)
                if next_checkpoint is DONE:
                    self._announce_done()
                    return None
                call.arguments["ckpt_path"] = next_checkpoint
                _prepare_trainer_for_next_fit(trainer)
                summaries += _take_model_summaries(trainer)
        finally:
            for index, callback in summaries:  # ascending: each goes back where it was
                trainer.callbacks.insert(index, callback)
            # Frozen as each fit started (lightning_emig.collector). A process leaving the job keeps them frozen:
            # its interpreter's exit would otherwise walk every object in several full collections (~1 s of a core
            # at 125M, measured with perf), taken from the survivors' first step where they share a host.
            if not self._strategy.left_job:
                release_frozen()

    def _announce_done(self) -> None:
        """Training ended: a node that joined in its last steps and still waits for admission leaves (exit 0), so
        its agent reaches the exit barrier instead of making every other agent wait there for it."""
        if self._strategy.global_rank != 0 or not under_launcher():
            return
        try:
            announce_training_done(control_client_from_env(timeout_s=10.0), self._strategy.generation)
        except Exception:  # noqa: BLE001 - training is done: a store gone at the very end must not fail the worker
            log.warning("could not announce the end of training in the control store", exc_info=True)

    def _fit_once(self, function: Callable[..., Any], call: inspect.BoundArguments, trainer: pl.Trainer
                  ) -> str | None | _Done:
        """Run one fit; returns what the next one starts from (``"live"``, a checkpoint path, or None: from step 0),
        or :data:`DONE`."""
        strategy = self._strategy
        try:
            function(*call.args, **call.kwargs)
        except InconsistentStateError as exc:  # raised on every rank alike, in a healthy world
            _end_interrupted_fit(trainer, exc)
            return self._roll_back_inconsistent(trainer, exc)
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            if strategy.awaiting_live_state:  # a member died before any state moved into this fit
                held = strategy.incoming_handoff
                if held is None:  # a joiner holds nothing: it leaves, its agent brings a fresh worker back in
                    log.exception("generation %d failed before the state moved in: leaving as left out",
                                  strategy.generation)
                    raise LeftOutError from None
                _end_interrupted_fit(trainer, exc)
                return self._recover(trainer, exc, held=held)
            # A process that failed before it had a layout holds no state: it exits, and its agent treats the
            # node as failed (spending a restart: an error that repeats must end the job). One whose generation
            # started fresh and lost a peer is ended by its death watch instead, which spends none.
            if not strategy.has_layout:
                raise
            _end_interrupted_fit(trainer, exc)
            return self._recover(trainer, exc)
        # A join at max_steps: that fit ran no step, its event is still due.
        strategy.finish_change_event(trainer)
        handoff = strategy.pending_handoff
        if handoff is None:
            return DONE
        if handoff.leaving:
            dist.destroy_process_group()
            strategy.left_job = True
            niceness = yield_cpu_to_the_job()  # nobody waits for this process any more (launcher.leaving)
            log.warning("this process's node was preempted and its state handed over: leaving the job (exit 0, "
                        "niceness %d)", niceness)
            raise SystemExit(0)
        handoff.lap("teardown")
        dropped = drop_model(trainer.lightning_module, self._strategy.kept_children)
        return self._go_on(trainer, self._switch(trainer, handoff), dropped)

    def _recover(self, trainer: pl.Trainer, failure: BaseException, *, held: LiveHandoff | None = None
                 ) -> str | None:
        """The survivors' side of an abrupt failure (of the generation, or of the change to ``held.generation``
        before its state moved): a live handoff into their generation, or a rollback."""
        # Its FSDP state references the broken groups; the state is stashed.
        dropped = drop_model(trainer.lightning_module, self._strategy.kept_children, cut_short_by=failure)
        outcome = recover_from_failure(self._strategy, failure, os.environ[ENV_NODE_ID],
                                       int(os.environ["LOCAL_RANK"]), held=held)
        self._record_unfinished_change(trainer, held, outcome)
        # A join whose first step the failure interrupted happened all the same: its event comes before the failure's.
        self._strategy.finish_change_event(trainer, interrupted=True)
        return self._go_on(trainer, outcome, dropped)

    def _roll_back_inconsistent(self, trainer: pl.Trainer, error: InconsistentStateError) -> str | None:
        """The ranks found they do not hold one state: never train on it. The same world restores the newest complete
        checkpoint that has not failed its proof (a checkpoint whose restore failed it is never taken again), and
        the restore is proven in turn; after :data:`RECOVERY_ATTEMPTS` such rollbacks in a row the fit gives up."""
        strategy = self._strategy
        if trainer.global_step > self._inconsistent_at:  # trained past the last one: not the same loop
            self._inconsistent_rollbacks = 0
        self._inconsistent_at = trainer.global_step
        self._inconsistent_rollbacks += 1
        if error.checkpoint is not None:
            self._refused_checkpoints |= {Path(error.checkpoint).resolve()}
        if self._inconsistent_rollbacks > RECOVERY_ATTEMPTS:
            raise InconsistentStateError(
                f"{RECOVERY_ATTEMPTS} rollbacks in a row found no state the ranks hold alike; giving up") from error
        log.error("%s; ROLLING BACK to the newest complete checkpoint whose state proves (rollback %d of at most %d)",
                  error, self._inconsistent_rollbacks, RECOVERY_ATTEMPTS)
        # The change the fit began with (a live change, a restart) happened, though its state is refused: its event
        # comes before the rollback's, whose old world it left.
        strategy.finish_change_event(trainer, interrupted=True)
        dropped = drop_model(trainer.lightning_module, strategy.kept_children, cut_short_by=error)
        rollback = Rollback(generation=strategy.generation, from_step=trainer.global_step,
                            reason=f"inconsistent state ({str(error).split(':', 1)[0]})", dead_nodes=[],
                            old_layout=strategy.layout, old_world=strategy.world_size, last_step_wall=time.time())
        return self._go_on(trainer, rollback, dropped)

    def _record_unfinished_change(self, trainer: pl.Trainer, held: LiveHandoff | None,
                                  outcome: LiveHandoff | Rollback) -> None:
        """A drain or a rebuild had already moved ``held``'s state when a holder died: that change happened and
        is an event of its own, before the failure's."""
        if held is None or outcome is held or held.prior is None:
            return
        held.generation = outcome.generation
        self._strategy.record_prior_event(trainer, held)

    def _go_on(self, trainer: pl.Trainer, outcome: LiveHandoff | Rollback, dropped: list[str]) -> str | None:
        """After a change or a failure: the next fit takes ``outcome`` live, or restores a checkpoint."""
        strategy = self._strategy
        if isinstance(outcome, Rollback):
            # The dropped model's storage was not handed over and freed by a transfer: its modules' reference cycles
            # hold it until collected, and the restore is about to allocate the model again (on a GPU, twice the
            # state). The restart path reads a checkpoint anyway; the collection is small beside it.
            gc.collect()
            outcome.checkpoint = _agree_on_newest_checkpoint(strategy.checkpoint_dir(trainer),
                                                             self._refused_checkpoints)
            if outcome.checkpoint is None:  # nothing complete was saved: training starts over from step 0
                trainer.fit_loop.load_state_dict(copy.deepcopy(self._fresh_loops))
            strategy.prepare_next_fit(rollback=outcome, dropped=dropped)
            return outcome.checkpoint
        return self._continue_live(trainer, outcome, dropped)

    def _switch(self, trainer: pl.Trainer, handoff: LiveHandoff) -> LiveHandoff | Rollback:
        """Into ``handoff.generation`` with the live state; if its group cannot be formed (a member died meanwhile),
        the holders recover among themselves (see :mod:`~lightning_emig.membership.failure`)."""
        try:
            switch_to_generation(handoff.generation, timeout=self._strategy.timeout)
        except GenerationError as exc:
            outcome = recover_from_failure(self._strategy, exc, os.environ[ENV_NODE_ID],
                                           int(os.environ["LOCAL_RANK"]), held=handoff)
            self._record_unfinished_change(trainer, handoff, outcome)
            return outcome
        handoff.lap("group")
        return handoff

    def _continue_live(self, trainer: pl.Trainer, handoff: LiveHandoff, dropped: list[str]) -> str | None:
        """Below MIN, wait for joiners with the state in memory; then the next fit takes the handoff live."""
        strategy = self._strategy
        settings = strategy.failure_settings
        if handoff.prior is not None and below_min(handoff.generation):
            # The change that left too few nodes is an event of its own, recorded before the wait: the survivors may
            # die waiting, and the next event (a join, or a restart from a checkpoint) must start from its world.
            strategy.record_prior_event(trainer, handoff)
        waiting_since = time.perf_counter()
        newer = wait_for_enough_nodes(handoff.generation, settings.below_min_timeout_s,
                                      heartbeat_timeout_s=settings.heartbeat_timeout_s, group_timeout=strategy.timeout)
        if newer is not None:  # fewer nodes than MIN were left: join the generation that brought more
            handoff.seconds = {**handoff.seconds, "below_min_wait": time.perf_counter() - waiting_since}
            handoff.generation = newer
            outcome = self._switch(trainer, handoff)
            if outcome is not handoff:  # the switch failed and a holder died meanwhile
                return self._go_on(trainer, outcome, dropped)
            handoff.phase_started = time.perf_counter()
        strategy.prepare_next_fit(handoff=handoff, dropped=dropped)
        return LIVE_CHECKPOINT


def _check_allowed_worlds(strategy: FitHost, trainer: pl.Trainer) -> None:
    """Once per ``Trainer.fit`` call: refuse a job none of whose worlds (``--nnodes`` MIN to MAX) can be laid out;
    warn about the worlds a change into would stop the job."""
    failing = strategy.elastic_settings.unworkable_worlds(allowed_worlds_from_env())
    if failing and trainer.global_rank == 0:
        log.warning("a change into these worlds would stop the job: %s",
                    "; ".join(f"{w} processes: {why}" for w, why in failing.items()))


def _end_interrupted_fit(trainer: pl.Trainer, exc: BaseException) -> None:
    """What Lightning does when a fit raises (``_call_and_handle_interrupt``), before the survivors recover: status
    INTERRUPTED, ``on_exception`` hooks, the Trainer's teardown (which releases the strategy's resources in the
    broken world, e.g. the background checkpoint group)."""
    from lightning.pytorch.trainer.call import _interrupt

    # A checkpoint callback that saves on exception would start a collective save in the broken world.
    treat_step_as_saved(trainer, trainer.global_step)
    _interrupt(trainer, exc)
    trainer._teardown()  # noqa: SLF001 - pinned by a test, as Lightning's own handler calls it
    trainer.state.stage = None


def _take_model_summaries(trainer: pl.Trainer) -> list[tuple[int, Callback]]:
    """Lightning's model summary, out of the next fits of this call: the model is the one it summarised already, and
    rank 0 worked the summary out again in every change's pause (0.03 s at 125M) while the others waited for it.
    Returns each with its index, to be put back when the call returns."""
    taken = [(index, callback) for index, callback in enumerate(trainer.callbacks) if isinstance(callback, ModelSummary)]
    for index, _ in reversed(taken):
        del trainer.callbacks[index]
    return taken


def _prepare_trainer_for_next_fit(trainer: pl.Trainer) -> None:
    """What ``Trainer.fit`` sets before it calls the launcher, again for the next fit of the same call."""
    trainer.state.fn = TrainerFn.FITTING
    trainer.state.status = TrainerStatus.RUNNING
    trainer.training = True
    trainer.should_stop = False


def _checkpoint_to_restart_from(strategy: FitHost, trainer: pl.Trainer) -> str | None:
    """The launcher restarted this job's workers (every rank of the generation alike: nobody held the live state any
    more), and the script passed no ``ckpt_path``: the job goes on from the newest complete checkpoint in its
    ``ModelCheckpoint``'s directory, not silently from step 0. Every rank looks alike: no process of the job is
    writing one (the processes that did are gone)."""
    directory = strategy.checkpoint_dir(trainer)
    found = newest_checkpoint(directory) if directory is not None else None
    if strategy.global_rank == 0:
        if found is None:
            log.warning("RESTART (%s): no complete checkpoint in %s; training starts again from step 0",
                        strategy.start_reason, directory)
        else:
            log.warning("RESTART (%s): resuming from the newest complete checkpoint %s (step %d)",
                        strategy.start_reason, found.path, found.step)
    return str(found.path) if found is not None else None


def _agree_on_newest_checkpoint(checkpoint_dir: Path | None, refused: frozenset[Path]) -> str | None:
    """Rank 0 picks the newest complete checkpoint (none of ``refused``) and tells the others (a background save might
    complete while the ranks look, so one rank decides)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0 and checkpoint_dir is not None:
        found = newest_checkpoint(checkpoint_dir, refused)
        box[0] = str(found.path) if found is not None else None
    dist.broadcast_object_list(box, src=0)
    return box[0]


def switch_to_generation(generation: int, *, timeout: timedelta) -> None:
    """Leave the current process group and form ``generation``'s, same backend (this process keeps running)."""
    info = read_generation(control_client_from_env(), generation)
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    if dist.is_initialized():
        dist.destroy_process_group()
    enter_generation(info, os.environ[ENV_NODE_ID], int(os.environ["LOCAL_RANK"]), backend, timeout)
