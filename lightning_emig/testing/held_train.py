"""``python -m lightning_emig.testing.held_train [key=value ...]``: ``lightning_emig.train`` with holds that pin a
race of two membership events in end-to-end tests, so a test hits it on any machine instead of aiming at a window.

* ``LIGHTNING_EMIG_TEST_HOLD_UNTIL_GENERATION=N``: every live join of this worker (the transfer inside
  ``fit(ckpt_path="live")``, on the processes that kept running and on the joiners alike) waits, right before it
  moves any state, until generation ``N`` is published in the control store and its joining workers are ready;
  afterwards joins run at once. A migration into generation ``N - 1`` is thereby running when generation ``N``
  appears, and generation ``N``'s join comes at the next step boundary, however slowly its workers started.
* ``LIGHTNING_EMIG_TEST_HOLD_LEAVING_EXIT=1``: a worker whose node announced its preemption, once it has handed
  its state over and its training returned, exits only when a generation newer than the one it handed its state
  to appears (a preempted worker whose teardown is slow: its agent still runs while others change the world).
* ``LIGHTNING_EMIG_TEST_HOLD_STEPS_FOR_JOINERS=1``: when rank 0 sees a new generation whose joining workers are not
  ready yet, training waits for them instead of going on (the join lands at the step it was seen, on any machine;
  without it a slow joiner may miss a short run). Only for worlds of one process: the others would wait inside a
  collective meanwhile.

* ``LIGHTNING_EMIG_TEST_HOLD_ADMISSION_UNTIL_GENERATION=N``: a worker started into a live generation announces itself
  ready (and waits for admission) only once generation ``N`` or a newer one is published: a joiner still starting
  up while the next round or a drain happens, on any machine.
* ``LIGHTNING_EMIG_TEST_HOLD_BEFORE_DONE=D``: once training is over, the holders' rank 0 announces it only when the
  test creates ``D/release-done`` (logging ``test hold: training over``): a node joins after the holders' last
  membership check and before their workers exit, on any machine.
* ``LIGHTNING_EMIG_TEST_HOLD_TRAINING_UNTIL_GENERATION=N``: while the world is one process and runs in a generation
  before ``N``, rank 0's membership check waits until generation ``N`` is published and its joining workers are ready
  (a short run cannot end before a sequence of rounds has played out); with
  ``LIGHTNING_EMIG_TEST_HOLD_TRAINING_FROM_STEP=S``, only from step ``S`` on (a joiner arrives mid-run, on any machine;
  the wait is part of the membership check, inside the change's downtime, not the step before it).
* ``LIGHTNING_EMIG_TEST_HOLD_AT_STEPS=20,60`` with ``LIGHTNING_EMIG_TEST_HOLD_DIR=D``: global rank 0 stops at each of
  these optimizer steps (at the step boundary, before the membership check) and logs ``test hold: step N``, until
  the test creates ``D/release-N``: the test acts (starts a node, sends a notice, kills a worker) while training is
  known to be at that step, on any machine.
* ``LIGHTNING_EMIG_TEST_HOLD_IN_STEP_AFTER=N`` with ``LIGHTNING_EMIG_TEST_HOLD_DIR=D``: the same hold (same log line,
  same release file), inside the step after step ``N``: once the boundary's work (capture, membership check, proof)
  is done, before the first micro-batch's forward: the test acts while rank 0 is computing, not at a collective.
* ``LIGHTNING_EMIG_TEST_HOLD_RESTARTED_FIT=1`` with ``LIGHTNING_EMIG_TEST_HOLD_DIR=D``: global rank 0 of a fit that
  torchrun's restart path started waits before its first batch, logging ``test hold: restarted fit waits``, until the
  test creates ``D/release-restart``: a failure before the restart's first step, on any machine.
* ``LIGHTNING_EMIG_TEST_DIE_BEFORE_JOIN=F``: a joiner's worker dies (exit 1) as its live join begins — after its
  generation's group formed and the fit set up, before any state moved — if file ``F`` does not exist yet; it creates
  ``F`` first, so the worker its agent restarts joins normally.
* ``LIGHTNING_EMIG_TEST_DIE_AFTER_JOIN=F``: the same, right after its live join is done (before its first step).
* ``LIGHTNING_EMIG_TEST_DIE_BEFORE_MESH=F``: a worker dies (exit 1) right before its layout's mesh is built — after
  its generation's default group formed, while the others build theirs — if file ``F`` does not exist yet; it
  creates ``F`` first, so the worker its agent restarts goes on normally.
* ``LIGHTNING_EMIG_TEST_CORRUPT_REPLICA_AT_STEP=N``: at step ``N`` (once per process) global rank 1 adds 1 to one
  element of its first trainable parameter, right before the consistency guard's periodic check: a replica that
  silently went wrong.
* ``LIGHTNING_EMIG_TEST_CORRUPT_RESTORE_AT_STEP=N``: when a fit starts training at step ``N`` (a restore of that
  step's checkpoint, or a live change at that step), global rank 1 does the same before the guard proves the state
  the fit starts from: a restore, or a transfer, that went wrong.
* ``LIGHTNING_EMIG_TEST_RUN_MODULE=M``: run module ``M`` (e.g. ``lightning_emig.examples.gpt``) instead of
  ``lightning_emig.train``, with the same holds.

Each hold gives up after :data:`HOLD_TIMEOUT_S` (the exit hold after 60 s: within a test's grace period) and logs
when it starts and ends. Without the variables this is ``lightning_emig.train`` unchanged.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

ENV_HOLD_UNTIL_GENERATION = "LIGHTNING_EMIG_TEST_HOLD_UNTIL_GENERATION"
ENV_HOLD_LEAVING_EXIT = "LIGHTNING_EMIG_TEST_HOLD_LEAVING_EXIT"
ENV_HOLD_STEPS_FOR_JOINERS = "LIGHTNING_EMIG_TEST_HOLD_STEPS_FOR_JOINERS"
ENV_HOLD_ADMISSION_UNTIL_GENERATION = "LIGHTNING_EMIG_TEST_HOLD_ADMISSION_UNTIL_GENERATION"
ENV_HOLD_BEFORE_DONE = "LIGHTNING_EMIG_TEST_HOLD_BEFORE_DONE"
ENV_HOLD_TRAINING_UNTIL_GENERATION = "LIGHTNING_EMIG_TEST_HOLD_TRAINING_UNTIL_GENERATION"
ENV_HOLD_TRAINING_FROM_STEP = "LIGHTNING_EMIG_TEST_HOLD_TRAINING_FROM_STEP"
HOLD_TIMEOUT_S = 120.0

log = logging.getLogger(__name__)


def _wait_for_generation(what: str, newer_than: int, timeout_s: float, *, joiners_of: int | None = None) -> bool:
    """Block until the control store's latest generation exceeds ``newer_than`` (with ``joiners_of``: and its
    workers that are not in that generation, the holders', are ready). False after the timeout."""
    from lightning_emig.launcher.generation import control_client_from_env, latest_generation, read_generation
    from lightning_emig.membership.admission import joiners_ready

    client = control_client_from_env()

    def reached() -> bool:
        latest = latest_generation(client)
        return latest > newer_than and (joiners_of is None or joiners_ready(
            client, read_generation(client, latest), read_generation(client, joiners_of)))

    started = time.monotonic()
    if reached():
        return True
    log.warning("test hold: %s waits until generation %d is published%s", what, newer_than + 1,
                " and its joiners are ready" if joiners_of is not None else "")
    while not reached():
        if time.monotonic() - started > timeout_s:
            log.warning("test hold: no generation after %d within %.0fs (%s); going on", newer_than, timeout_s, what)
            return False
        time.sleep(0.1)
    log.warning("test hold: generation %d published; %s resumes after %.2fs", latest_generation(client), what,
                time.monotonic() - started)
    return True


def hold_live_migrations(until_generation: int, timeout_s: float = HOLD_TIMEOUT_S) -> None:
    """Make every live join of this process wait for generation ``until_generation`` (see the module docstring)."""
    from lightning_emig.change import live_join

    execute_change = live_join.execute_change

    def held_execute_change(*args: Any, **kwargs: Any) -> Any:
        if not _wait_for_generation("live migration", until_generation - 1, timeout_s,
                                    joiners_of=until_generation - 1):
            raise RuntimeError(f"test hold: generation {until_generation} never came")
        return execute_change(*args, **kwargs)

    live_join.execute_change = held_execute_change


def hold_admission(until_generation: int, timeout_s: float = HOLD_TIMEOUT_S) -> None:
    """A joiner's start-up ends only once generation ``until_generation`` is published (see the module docstring)."""
    from lightning_emig.change import enter

    await_admission = enter.await_admission

    def held_await_admission(*args: Any, **kwargs: Any) -> int:
        _wait_for_generation("joiner start-up", until_generation - 1, timeout_s)
        return await_admission(*args, **kwargs)

    enter.await_admission = held_await_admission


def _wait_for_file(path: Path, timeout_s: float, what: str) -> None:
    """Until the test creates ``path`` (a release), or ``timeout_s`` passed; logs which, naming ``what`` waited."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if path.exists():
        log.warning("test hold: %s released", what)
    else:
        log.warning("test hold: no %s within %.0fs (%s); going on", path, timeout_s, what)


def hold_before_done(release_dir: str, timeout_s: float = HOLD_TIMEOUT_S) -> None:
    """The end of training is announced only once ``release_dir/release-done`` exists (see the module docstring)."""
    from lightning_emig.strategy.elastic_fit import ElasticFitLauncher

    announce = ElasticFitLauncher._announce_done  # noqa: SLF001 - the seam this hold pins

    def held_announce(self: Any) -> None:
        if self._strategy.global_rank == 0:
            release = Path(release_dir) / "release-done"
            log.warning("test hold: training over, the end is announced once %s exists", release)
            _wait_for_file(release, timeout_s, "the end of training")
        announce(self)

    ElasticFitLauncher._announce_done = held_announce  # type: ignore[method-assign]  # noqa: SLF001


_handed_to: list[int] = []
"""The generation this worker's drain handed its state to (set once its node was preempted)."""


def record_drained_generation() -> None:
    from lightning_emig.strategy import rendezvous as callback

    drain = callback.drain_leavers

    def recorded_drain(*args: Any, **kwargs: Any) -> Any:
        handoff = drain(*args, **kwargs)
        if handoff.leaving:
            _handed_to.append(handoff.generation)
        return handoff

    callback.drain_leavers = recorded_drain


def hold_exit_if_left(timeout_s: float = 60.0) -> None:
    """After training returned: if this worker was preempted, wait for a generation after the one it handed to."""
    if _handed_to:
        _wait_for_generation("the preempted worker's exit", _handed_to[-1], timeout_s)


def hold_steps_for_joiners(timeout_s: float = HOLD_TIMEOUT_S) -> None:
    """Rank 0's poll waits, once it sees a new generation, until that generation's joiners are ready."""
    from lightning_emig.launcher.generation import latest_generation
    from lightning_emig.strategy.rendezvous import RendezvousCallback

    newest_ready = RendezvousCallback._newest_ready  # noqa: SLF001 - the seam this hold pins

    def held_newest_ready(self: Any, current: int, now: float) -> int:
        newer = newest_ready(self, current, now)
        if newer == current and latest_generation(self._client) > current:  # seen, its joiners not ready yet
            _wait_for_generation("training", current, timeout_s, joiners_of=current)
            return newest_ready(self, current, time.monotonic())
        return newer

    RendezvousCallback._newest_ready = held_newest_ready  # type: ignore[method-assign]  # noqa: SLF001


def hold_training_until(generation: int, from_step: int = 0, timeout_s: float = HOLD_TIMEOUT_S) -> None:
    """In a world of one process, rank 0's poll (from ``from_step`` on) waits until ``generation`` is published and its
    joiners are ready."""
    import torch.distributed as dist

    from lightning_emig.strategy.rendezvous import RendezvousCallback

    newest_ready = RendezvousCallback._newest_ready  # noqa: SLF001 - the seam this hold pins

    def held_newest_ready(self: Any, current: int, now: float) -> int:
        step = self._strategy.lightning_module.trainer.global_step
        if current < generation and dist.get_world_size() == 1 and step >= from_step:
            _wait_for_generation("training", generation - 1, timeout_s, joiners_of=current)
        return newest_ready(self, current, now)

    RendezvousCallback._newest_ready = held_newest_ready  # type: ignore[method-assign]  # noqa: SLF001


ENV_DIE_BEFORE_JOIN = "LIGHTNING_EMIG_TEST_DIE_BEFORE_JOIN"


ENV_DIE_AFTER_JOIN = "LIGHTNING_EMIG_TEST_DIE_AFTER_JOIN"


def die_in_join(marker: str, *, after: bool) -> None:
    """A joiner's first worker dies as its live join begins, or right after it (see the module docstring)."""
    from lightning_emig.change import incoming

    join_live = incoming.join_live

    def die(strategy: Any) -> None:
        Path(marker).touch()
        log.warning("test: this joiner dies %s its live join (generation %d)", "after" if after else "before",
                    strategy.generation)
        logging.shutdown()
        os._exit(1)

    def dying_join_live(strategy: Any, trainer: Any, handoff: Any, node_id: str) -> Any:
        dies = handoff is None and not Path(marker).exists()
        if dies and not after:
            die(strategy)
        joined = join_live(strategy, trainer, handoff, node_id)
        if dies:
            die(strategy)
        return joined

    incoming.join_live = dying_join_live


ENV_DIE_BEFORE_MESH = "LIGHTNING_EMIG_TEST_DIE_BEFORE_MESH"


def die_before_mesh(marker: str) -> None:
    """This node's worker dies as its layout's mesh is about to be built, the first time (see the module)."""
    from lightning_emig.strategy import hybrid

    build_mesh = hybrid.build_mesh

    def dying_build_mesh(*args: Any, **kwargs: Any) -> Any:
        if not Path(marker).exists():
            Path(marker).touch()
            log.warning("test: this worker dies before its layout's mesh is built")
            logging.shutdown()
            os._exit(1)
        return build_mesh(*args, **kwargs)

    hybrid.build_mesh = dying_build_mesh


ENV_CORRUPT_REPLICA_AT_STEP = "LIGHTNING_EMIG_TEST_CORRUPT_REPLICA_AT_STEP"


def corrupt_a_replica(step: int) -> None:
    """Once per process, at ``step``'s boundary, global rank 1 adds 1 to one element of its first parameter: a
    replica that silently went wrong (see the module docstring)."""
    from lightning_emig.change.boundary import at_step_boundary
    from lightning_emig.change.consistency import ConsistencyGuard

    on_batch_end = ConsistencyGuard.on_train_batch_end
    done: list[bool] = []

    def corrupting_on_batch_end(self: Any, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step == step and trainer.global_rank == 1 and at_step_boundary(trainer) and not done:
            done.append(True)
            _change_one_element(trainer, f"at step {step}")
        on_batch_end(self, trainer, *args, **kwargs)

    ConsistencyGuard.on_train_batch_end = corrupting_on_batch_end  # type: ignore[method-assign]


ENV_CORRUPT_RESTORE_AT_STEP = "LIGHTNING_EMIG_TEST_CORRUPT_RESTORE_AT_STEP"


def corrupt_a_restore(step: int) -> None:
    """Once per process, when a fit starts training at ``step``, global rank 1 adds 1 to one element of its first
    parameter before the guard's proof of the state the fit starts from (see the module docstring)."""
    from lightning_emig.change.consistency import ConsistencyGuard

    on_train_start = ConsistencyGuard.on_train_start
    done: list[bool] = []

    def corrupting_on_train_start(self: Any, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step == step and trainer.global_rank == 1 and not done:
            done.append(True)
            _change_one_element(trainer, f"as a fit started at step {step}")
        on_train_start(self, trainer, *args, **kwargs)

    ConsistencyGuard.on_train_start = corrupting_on_train_start  # type: ignore[method-assign]


def _change_one_element(trainer: Any, when: str) -> None:
    from torch.distributed.tensor import DTensor

    param = next(p for p in trainer.lightning_module.parameters() if p.requires_grad)
    local = param.to_local() if isinstance(param, DTensor) else param
    with torch.no_grad():
        local.view(-1)[0] += 1.0
    log.warning("test: rank 1 changed one element of its replica %s", when)


ENV_HOLD_AT_STEPS = "LIGHTNING_EMIG_TEST_HOLD_AT_STEPS"
ENV_HOLD_DIR = "LIGHTNING_EMIG_TEST_HOLD_DIR"
ENV_RUN_MODULE = "LIGHTNING_EMIG_TEST_RUN_MODULE"


def hold_at_steps(steps: set[int], release_dir: str, timeout_s: float = HOLD_TIMEOUT_S) -> None:
    """Rank 0 waits at each of ``steps`` until ``release_dir/release-<step>`` exists (see the module docstring)."""
    from lightning_emig.change.boundary import at_step_boundary
    from lightning_emig.strategy.rendezvous import RendezvousCallback

    on_batch_end = RendezvousCallback.on_train_batch_end

    def held_on_batch_end(self: Any, trainer: Any, *args: Any, **kwargs: Any) -> None:
        step = trainer.global_step
        if trainer.global_rank == 0 and step in steps and at_step_boundary(trainer):
            steps.discard(step)
            release = Path(release_dir) / f"release-{step}"
            log.warning("test hold: step %d waits for %s", step, release)
            _wait_for_file(release, timeout_s, f"step {step}")
            self._last_poll = float("-inf")  # the held step always reads the store (whatever the test did meanwhile)
        on_batch_end(self, trainer, *args, **kwargs)

    RendezvousCallback.on_train_batch_end = held_on_batch_end  # type: ignore[method-assign]


ENV_HOLD_IN_STEP_AFTER = "LIGHTNING_EMIG_TEST_HOLD_IN_STEP_AFTER"


def hold_in_step_after(step: int, release_dir: str, timeout_s: float = HOLD_TIMEOUT_S) -> None:
    """Rank 0 waits before the first forward of the step after ``step`` until ``release_dir/release-<step>`` exists."""
    from lightning_emig.strategy.hybrid import HybridLayoutStrategy

    training_step = HybridLayoutStrategy.training_step
    held: list[bool] = []

    def held_training_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer
        if trainer.global_rank == 0 and trainer.global_step == step and not held:
            held.append(True)
            release = Path(release_dir) / f"release-{step}"
            log.warning("test hold: step %d waits for %s (in the next step, before its forward)", step, release)
            _wait_for_file(release, timeout_s, f"step {step}")
        return training_step(self, *args, **kwargs)

    HybridLayoutStrategy.training_step = held_training_step  # type: ignore[method-assign]


ENV_HOLD_RESTARTED_FIT = "LIGHTNING_EMIG_TEST_HOLD_RESTARTED_FIT"


def hold_restarted_fit(release_dir: str, timeout_s: float = HOLD_TIMEOUT_S) -> None:
    """Rank 0 of a restarted fit waits before its first batch until ``release_dir/release-restart`` exists."""
    from lightning_emig.strategy.rendezvous import RendezvousCallback

    held: list[bool] = []

    def held_on_batch_start(self: Any, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if trainer.global_rank == 0 and getattr(trainer.strategy, "start_reason", None) is not None and not held:
            held.append(True)  # the first batch only
            release = Path(release_dir) / "release-restart"
            log.warning("test hold: restarted fit waits for %s", release)
            _wait_for_file(release, timeout_s, "the restarted fit")

    RendezvousCallback.on_train_batch_start = held_on_batch_start  # type: ignore[method-assign]


def main() -> None:
    import runpy

    until = os.environ.get(ENV_HOLD_UNTIL_GENERATION)
    if until:
        hold_live_migrations(int(until))
    admission = os.environ.get(ENV_HOLD_ADMISSION_UNTIL_GENERATION)
    if admission:
        hold_admission(int(admission))
    if os.environ.get(ENV_HOLD_BEFORE_DONE):
        hold_before_done(os.environ[ENV_HOLD_BEFORE_DONE])
    training_until = os.environ.get(ENV_HOLD_TRAINING_UNTIL_GENERATION)
    if training_until:
        hold_training_until(int(training_until), int(os.environ.get(ENV_HOLD_TRAINING_FROM_STEP, "0")))
    if os.environ.get(ENV_HOLD_STEPS_FOR_JOINERS) == "1":
        hold_steps_for_joiners()
    hold_exit = os.environ.get(ENV_HOLD_LEAVING_EXIT) == "1"
    if hold_exit:
        record_drained_generation()
    for variable, after in ((ENV_DIE_BEFORE_JOIN, False), (ENV_DIE_AFTER_JOIN, True)):
        if os.environ.get(variable):
            die_in_join(os.environ[variable], after=after)
    if os.environ.get(ENV_DIE_BEFORE_MESH):
        die_before_mesh(os.environ[ENV_DIE_BEFORE_MESH])
    corrupt_at = os.environ.get(ENV_CORRUPT_REPLICA_AT_STEP)
    if corrupt_at:
        corrupt_a_replica(int(corrupt_at))
    corrupt_restore_at = os.environ.get(ENV_CORRUPT_RESTORE_AT_STEP)
    if corrupt_restore_at:
        corrupt_a_restore(int(corrupt_restore_at))
    if os.environ.get(ENV_HOLD_RESTARTED_FIT) == "1":
        hold_restarted_fit(os.environ[ENV_HOLD_DIR])
    in_step_after = os.environ.get(ENV_HOLD_IN_STEP_AFTER)
    if in_step_after:
        hold_in_step_after(int(in_step_after), os.environ[ENV_HOLD_DIR])
    steps = os.environ.get(ENV_HOLD_AT_STEPS)
    if steps:
        hold_at_steps({int(s) for s in steps.split(",")}, os.environ[ENV_HOLD_DIR])
    # As ``python -m lightning_emig.train``: Hydra finds ``conf/`` relative to the file of a ``__main__`` module.
    runpy.run_module(os.environ.get(ENV_RUN_MODULE, "lightning_emig.train"), run_name="__main__", alter_sys=True)
    if hold_exit:
        hold_exit_if_left()


if __name__ == "__main__":
    main()
