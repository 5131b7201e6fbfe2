"""Entering a generation: the process group a fit trains in, and the layout it trains under.

Every fit under ``lightning-emig-run`` after the first start, and every live join, enters a generation the launcher
published (:mod:`~lightning_emig.launcher.generation`) instead of torchrun's ``env://`` rendezvous:

1. a joiner (it takes the state live and holds none) faults in the host memory it will need while the old world
   still trains, then waits to be admitted: rounds overlap, so the generation it forms is the one the holders commit
   to, not always the one it was started into (:mod:`~lightning_emig.membership.admission`);
2. every member forms the generation's process group (:func:`~lightning_emig.membership.group.enter_generation`);
3. the layout for the world is chosen: the picker's choice agreed from rank 0 (which holds the live state and knows
   the layout it is in), the rule every change follows, or on a first start the layout the user asked for; state
   handed over already laid out for this world keeps the rank order it came in, so it need not move again.

The functions take what they need as arguments: they know nothing of Lightning's strategy.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_emig.host_memory import warm_host_memory
from lightning_emig.launcher.generation import (
    ENV_NODE_ID,
    GenerationError,
    control_client_from_env,
    read_generation,
)
from lightning_emig.launcher.heartbeat import HeartbeatWatch
from lightning_emig.layout import HybridLayout
from lightning_emig.membership.admission import LeftOutError, await_admission, memory_to_warm
from lightning_emig.membership.group import enter_generation, under_launcher
from lightning_emig.membership.handoff import LiveHandoff
from lightning_emig.membership.settings import ElasticSettings, FailureSettings, LayoutChoice

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Arrival:
    """How a process comes to the generation it is about to enter."""

    generation: int
    """The generation it was started into, or the one its handoff or rollback names."""
    live_join: bool
    """It takes the state live (a joiner, or a holder whose state moves in the new world)."""
    handoff: LiveHandoff | None
    """The live state it carries in (None: a joiner, or a start from a checkpoint or from nothing)."""
    backend: str
    timeout: timedelta
    failure: FailureSettings
    on_cpu: bool

    @property
    def joiner(self) -> bool:
        """It takes the state live and holds none of it."""
        return self.live_join and self.handoff is None


def form_generation_group(arrival: Arrival) -> int:
    """Under ``lightning-emig-run``, after a live change, torchrun's ``env://`` rendezvous no longer applies: form the
    generation's default process group. Returns the generation formed (a joiner's may be newer than the one it was
    started into); outside the launcher, or on a first start, forms nothing and returns ``arrival.generation``."""
    import torch.distributed as dist

    generation = arrival.generation
    if dist.is_initialized() or not under_launcher() or not (generation > 0 or arrival.live_join):
        return generation
    client = control_client_from_env()
    node_id, local_rank = os.environ[ENV_NODE_ID], int(os.environ["LOCAL_RANK"])
    if arrival.joiner:
        if arrival.on_cpu:
            _warm_before_joining(client, generation)
        patience = arrival.timeout.total_seconds() + arrival.failure.failure_timeout_s
        holders = HeartbeatWatch(client, arrival.failure.heartbeat_timeout_s)
        generation = await_admission(client, node_id, local_rank, started_in=generation, timeout_s=patience,
                                     holders=holders)
    try:
        enter_generation(read_generation(client, generation), node_id, local_rank, arrival.backend, arrival.timeout)
    except GenerationError:
        if not arrival.joiner:
            raise
        # A member died as the group formed; the holders recover among themselves (membership.failure). This
        # process holds nothing: it leaves, and its agent brings a fresh one in through a new round.
        log.exception("generation %d could not be formed: leaving as left out", generation)
        raise LeftOutError from None
    return generation


def _warm_before_joining(client: Any, generation: int) -> None:
    """A joiner on the CPU faults in the memory it will need while the old world still trains (see
    :mod:`~lightning_emig.membership.admission`), so neither the transfer nor the first step waits for it."""
    nbytes = memory_to_warm(client, read_generation(client, generation).world_size)
    if nbytes:
        seconds = warm_host_memory(nbytes)
        log.info("warmed %.2f GB of host memory in %.2fs before joining (the old world trains meanwhile)",
                 nbytes / 1e9, seconds)


def choose_layout(settings: ElasticSettings, *, world_size: int, rank: int, requested: HybridLayout,
                  handoff: LiveHandoff | None, new_world: bool) -> LayoutChoice:
    """The layout this fit trains under on ``world_size`` processes.

    ``new_world``: a world this job did not start with (joined, restarted, rolled back): the rule of every change
    decides. Otherwise (a first start) the layout asked for, or a loud error if it does not fit the world. With a
    picker, its choice, agreed from rank 0."""
    if settings.picker is not None:
        choice = _agreed_choice(settings, world_size, rank, handoff)
    elif new_world:
        choice = settings.choose(world_size)
    else:
        layout = requested.resolve(world_size)
        settings.validate_layout(layout)
        choice = LayoutChoice(layout, settings.plan_for(layout))
    return keeping_handed_order(choice, handoff, world_size)


def keeping_handed_order(choice: LayoutChoice, handed: LiveHandoff | None, world_size: int) -> LayoutChoice:
    """State handed over in this layout's degrees on this world (a drain or a rebuild laid it out for them) comes
    in the rank order chosen to keep it in place: the fit keeps that order, so the state need not move again."""
    if handed is None or handed.old_world != world_size or handed.old_layout.degrees != choice.layout.degrees:
        return choice
    return dataclasses.replace(choice, layout=handed.old_layout)


def _agreed_choice(settings: ElasticSettings, world_size: int, rank: int,
                   handoff: LiveHandoff | None) -> LayoutChoice:
    """The picker's layout for this world, decided by rank 0 and sent to every rank: rank 0 of a new generation
    holds the live state (it knows the layout the state is in, the migration cost's origin); a joiner decides
    nothing. Rank 0 logs the candidates table."""
    import torch.distributed as dist

    box: list[object] = [None]
    if rank == 0:
        current = handoff.old_layout if handoff is not None else None
        try:
            box[0] = settings.choose(world_size, current)
        except ValueError as error:  # every rank raises it, not only rank 0
            box[0] = error
    if dist.is_initialized() and world_size > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    choice = box[0]
    assert isinstance(choice, LayoutChoice) and choice.pick is not None
    if rank == 0:
        log.warning("layout picker, world %d:\n%s", world_size, choice.pick.table(max_rows=8))
    return choice
