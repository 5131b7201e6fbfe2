"""The change a fit starts with: how the fit comes by its state, until the change is recorded.

One ``Trainer.fit`` call under ``lightning-emig-run`` is a sequence of fits (:mod:`lightning_emig.strategy.elastic_fit`);
each after the first starts from a change, and so may the first (a worker started into a live generation):

* **live**: the state comes from the processes that hold it (a join; the handoff of a preemption, a drain or a
  rebuild from replicas), moved in ``load_checkpoint("live")`` (:meth:`IncomingChange.take_live`);
* **a rollback**: a failure left no copy of some state; the fit restores the newest complete checkpoint
  (:meth:`IncomingChange.rolled_back`), or starts over from step 0 and the first sample where there is none.

:class:`IncomingChange` holds which it is from the fit's start (:meth:`IncomingChange.next_fit`) and begins the
change's event in the :class:`~lightning_emig.change.record.ChangeLog` once the state is in place; the log records it
after the first step on the new world.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from lightning_emig.change.boundary import treat_step_as_saved
from lightning_emig.change.live_join import join_live, state_after_join
from lightning_emig.launcher.generation import ENV_JOIN_LIVE, ENV_NODE_ID
from lightning_emig.membership.group import joining_live

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_emig.change.host import JoinHost
    from lightning_emig.change.record import ChangeLog
    from lightning_emig.layout import HybridLayout
    from lightning_emig.membership.failure import Rollback
    from lightning_emig.membership.handoff import LiveHandoff

log = logging.getLogger(__name__)

class IncomingChange:
    """How the current fit comes by its state; the change's event is begun in ``changes`` once the state is in
    place."""

    def __init__(self, changes: ChangeLog) -> None:
        self._changes = changes
        self.handoff: LiveHandoff | None = None
        """The live state this process carries into the fit (None in a joiner and once the join has taken it;
        kept until then: a failure before the transfer goes on with it)."""
        self.rollback: Rollback | None = None
        """The rollback this fit restores a checkpoint for, until it has (its process group is formed already)."""
        self.starting_over = False
        """A rollback with no checkpoint: the fit starts from step 0, and the data from its first sample."""
        self.resume_step: int | None = None
        """The step a live handoff or a rollback resumed at (its state was never written: no checkpoint is due)."""

    def next_fit(self, handoff: LiveHandoff | None, rollback: Rollback | None) -> None:
        """The next fit takes ``handoff`` live, or restores a checkpoint after ``rollback``."""
        self.handoff = handoff
        self.rollback = rollback
        self.starting_over = rollback is not None and rollback.checkpoint is None
        self._changes.forget()

    @property
    def live_join(self) -> bool:
        """The fit receives its state from running processes (``fit(ckpt_path="live")``)."""
        if self.rollback is not None:  # restores a checkpoint, even in a process that once joined live
            return False
        return self.handoff is not None or joining_live()

    def rolled_back(self, trainer: pl.Trainer, *, step: int, load_seconds: float, layout: HybridLayout,
                    world_size: int, rank: int) -> None:
        """The rollback's checkpoint of ``step`` is restored (``step`` 0, no load: there is none); its ``failure``
        event is recorded once the first step on the new world is done."""
        rollback, self.rollback = self.rollback, None  # used: a later fit, validate or test of it is no rollback
        assert rollback is not None
        lost = self._changes.begin_rollback(rollback, step=step, load_seconds=load_seconds, layout=layout,
                                            world_size=world_size)
        self.resume_step = step
        treat_step_as_saved(trainer, step)  # restored, not trained: no save due for it
        if rank == 0:
            cause = f"the failure of node(s) {rollback.dead_nodes}" if rollback.dead_nodes else "a failed proof"
            log.error("ROLLED BACK to step %d after %s: %d step(s) lost (%s); world %d -> %d, %s", step, cause, lost,
                      rollback.reason, rollback.old_world, world_size, layout.describe())

    def take_live(self, host: JoinHost, trainer: pl.Trainer) -> dict[str, Any]:
        """Move the live state into ``host``'s new world (every process of it calls this from
        ``load_checkpoint("live")``); returns the resume metadata Lightning restores."""
        if not self.live_join:
            raise RuntimeError(
                "fit(ckpt_path='live') needs live state: a handoff from the previous fit in this process, or a "
                f"worker that lightning-emig-run started into a live generation ({ENV_JOIN_LIVE}=1)"
            )
        handoff = self.handoff
        if handoff is not None:
            handoff.lap("build")
        try:
            metadata, result, last_step_wall = join_live(host, trainer, handoff,
                                                         os.environ.get(ENV_NODE_ID, ""))
        finally:
            host.migrating = False
        self.handoff = None  # moved
        self._changes.begin(result, last_step_wall)
        self.resume_step = result.step
        treat_step_as_saved(trainer, result.step)
        os.environ.pop(ENV_JOIN_LIVE, None)  # joined: from now on this process holds state
        host.last_boundary = state_after_join(host, metadata, last_step_wall)
        if host.global_rank == 0:
            log.warning(
                "joined generation %d: world %d -> %d, %s -> %s, %.1f MB moved, resuming at step %d",
                host.generation, result.old_world, host.world_size, result.old_layout.describe(),
                host.layout.describe(), result.bytes_moved / 1e6, result.step,
            )
        return metadata
