"""The last part of every change: its event, recorded once the first step on the new world is done.

A change that starts a fit (a live join, a preemption's handoff, a rollback to a checkpoint, a restart from one)
has its state in place before the fit's first step, but its downtime ends only when that step does:
:class:`ChangeLog` holds the change's record from the moment the state is in place until then
(:meth:`ChangeLog.begin` … :meth:`ChangeLog.finish`) on every process of the new world, so that whichever is rank 0
when the fit ends records it — also when a failure ends it before that step. A change made inside a fit (a layout
change) is recorded at once. Every event of a process passes through
:meth:`ChangeLog.record`: kept in :attr:`ChangeLog.events`, published on global rank 0 (``events.jsonl``, the
loggers; see :mod:`~lightning_emig.change.events`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_emig.change.events import ReconfigureEvent, publish_event
from lightning_emig.migration.change import ChangeRecord

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_emig.layout import HybridLayout
    from lightning_emig.membership.failure import Rollback
    from lightning_emig.membership.handoff import LiveHandoff
    from lightning_emig.membership.settings import LayoutChoice

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Begun:
    record: ChangeRecord
    last_step_wall: float
    """``time.time()`` when the last step on the old world finished."""
    in_place: float
    """``time.perf_counter()`` when the state was in place on the new world."""
    proven_digest: int | None = None
    """The state's digest once proven equal to the one before the change (:meth:`ChangeLog.note_proven`)."""


class ChangeLog:
    """The events of one process, and the change its current fit started with until that change is recorded."""

    def __init__(self) -> None:
        self.events: list[ReconfigureEvent] = []
        self._begun: _Begun | None = None

    def begin(self, record: ChangeRecord, last_step_wall: float, in_place_wall: float | None = None) -> None:
        """The state of change ``record`` is in place (since ``time.time()`` ``in_place_wall``; default: now); its
        event waits for the first step (:meth:`finish`)."""
        in_place = time.perf_counter() - (0.0 if in_place_wall is None else max(0.0, time.time() - in_place_wall))
        self._begun = _Begun(record, last_step_wall, in_place)

    def set_apart(self, phase: str, seconds: float) -> None:
        """Work of ``seconds`` done since the state was in place, before the first step (the proof of the state that
        arrived), is the change's ``phase``, not part of its ``first_step``: the first step's excess over a steady one
        is then the step's own. Nothing to do without a change begun."""
        begun = self._begun
        if begun is None:
            return
        record = dataclasses.replace(begun.record, seconds={**begun.record.seconds, phase: seconds})
        self._begun = dataclasses.replace(begun, record=record, in_place=begun.in_place + seconds)

    def note_proven(self, digest: int) -> None:
        """The new world's state was proven equal to the state before the change (its ``digest``): the event says so.
        Nothing to do without a change begun."""
        if self._begun is not None:
            self._begun = dataclasses.replace(self._begun, proven_digest=digest)

    def forget(self) -> None:
        """A new fit starts: a change the last one began and never recorded is not this fit's."""
        self._begun = None

    def begin_rollback(self, rollback: Rollback, *, step: int, load_seconds: float, layout: HybridLayout,
                       world_size: int) -> int:
        """A rollback restored ``step`` (0: no checkpoint, the fit starts over): begin its ``failure`` event. Returns
        the steps lost."""
        lost = max(0, rollback.from_step - step)
        self._begun = _Begun(ChangeRecord(
            kind="failure", step=step, old_layout=rollback.old_layout, new_layout=layout,
            old_world=rollback.old_world, new_world=world_size, seconds={**rollback.seconds, "load": load_seconds},
            steps_rolled_back=lost, nodes=tuple(rollback.dead_nodes),
        ), rollback.last_step_wall, time.perf_counter())
        return lost

    def record(self, trainer: pl.Trainer, event: ReconfigureEvent, *, rank: int,
               choice: LayoutChoice | None) -> None:
        """Keep ``event`` and, on global ``rank`` 0, publish it; ``choice``: how the fit's layout was chosen (the
        picker's reasons go into the event of the change that led to it)."""
        if choice is not None and choice.layout.as_dict() == event.new_layout:
            event.layout_choice = choice.record()
        self.events.append(event)
        if rank == 0:
            publish_event(trainer, event)

    def record_prior(self, trainer: pl.Trainer, handoff: LiveHandoff, *, rank: int,
                     choice: LayoutChoice | None) -> None:
        """Record the change ``handoff`` carries (one that left the survivors below MIN, or was cut short); what
        follows is another event. Called in the survivors' generation (``rank`` is this process's rank there)."""
        prior, handoff.prior = handoff.prior, None
        assert prior is not None
        seconds = {**handoff.seconds, **prior.seconds}
        event = ReconfigureEvent.of(dataclasses.replace(prior, seconds=seconds), generation=handoff.generation)
        self.record(trainer, event, rank=rank, choice=choice)
        handoff.seconds = {}

    def finish(self, trainer: pl.Trainer, *, generation: int, world_size: int, rank: int,
               choice: LayoutChoice | None, interrupted: bool = False) -> None:
        """Record the change this fit began with, now that its first step on the new world has finished (or the fit
        ends without one). ``interrupted``: a failure ended the fit before that step (called in the survivors'
        generation): the change happened all the same and is recorded, before the failure, with no first step and
        no downtime."""
        begun, self._begun = self._begun, None
        if begun is None:
            return
        record = begun.record
        if not interrupted:
            record = dataclasses.replace(record, seconds={**record.seconds,
                                                          "first_step": time.perf_counter() - begun.in_place})
        if record.kind == "join" and (record.old_world, record.old_layout) == (record.new_world, record.new_layout):
            # The holders' own generation after a change that failed before its state moved (membership.failure):
            # no change happened, none to record.
            if rank == 0:
                log.warning("training again on the same %d process(es) after %.1fs: the change they began failed "
                            "before any state moved", world_size, time.time() - begun.last_step_wall)
            return
        downtime = None if interrupted else time.time() - begun.last_step_wall
        event = ReconfigureEvent.of(record, generation=generation, downtime_seconds=downtime)
        if begun.proven_digest is not None:
            event.proven_digest = f"{begun.proven_digest:#018x}"
        self.record(trainer, event, rank=rank, choice=choice)
