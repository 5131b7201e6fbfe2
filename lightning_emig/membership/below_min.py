"""Below the minimum: fewer nodes than ``--nnodes=MIN:MAX`` asks for, after a failure or a preemption.

torchrun would stop the job (a rendezvous needs MIN nodes). We keep the survivors and their state in memory instead:
before training on in the smaller generation, they wait — up to ``elastic.below_min_timeout_s`` — for a newer
generation whose joiners are ready (a replacement node's agent, or a failed node's agent rejoining, takes the
rendezvous back to MIN), then hand their state into it like any live join. If nobody comes in time they train on
with the nodes they have, saying so: nothing is lost either way. A preemption notice for one of them ends the wait
too: at the next step boundary the leaving node's state goes to the others, or, when every one of them leaves, to a
checkpoint (its grace period would otherwise run out in the wait, and the state with it).

Every survivor calls :func:`wait_for_enough_nodes` in the survivors' process group; global rank 0 polls the control
store and broadcasts what it saw, so every rank takes the same decision at the same moment.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_emig.launcher.generation import (
    ENV_NODE_ID,
    control_client_from_env,
    min_nodes_from_env,
    node_host,
    read_generation,
)
from lightning_emig.launcher.heartbeat import HeartbeatWatch
from lightning_emig.membership.admission import commit_generation, generation_to_join
from lightning_emig.membership.preempt import leaving_nodes

log = logging.getLogger(__name__)

POLL_S = 0.5


def below_min(generation: int) -> bool:
    """``generation`` has fewer nodes than ``--nnodes`` MIN."""
    return len(read_generation(control_client_from_env(), generation).nodes) < min_nodes_from_env()


def wait_for_enough_nodes(generation: int, timeout_s: float, *, heartbeat_timeout_s: float, group_timeout: timedelta
                          ) -> int | None:
    """In ``generation``'s (formed) process group: a newer generation with enough nodes to join, or None."""
    client = control_client_from_env()
    min_nodes = min_nodes_from_env()
    nodes = len(read_generation(client, generation).nodes)
    if nodes >= min_nodes:
        return None
    rank = dist.get_rank()
    watch = HeartbeatWatch(client, heartbeat_timeout_s)
    if rank == 0:
        log.warning("BELOW MIN: %d node(s) left, --nnodes MIN is %d: state kept in memory, waiting up to %.0fs for "
                    "joining nodes", nodes, min_nodes, timeout_s)
    started = time.monotonic()
    while True:
        box: list[object] = [None]
        if rank == 0:
            # A joiner that died while starting does not hold the others back (see membership.admission).
            box[0] = generation_to_join(client, generation, watch, host=node_host(os.environ[ENV_NODE_ID]),
                                        timeout=group_timeout)
            if box[0] is None and leaving_nodes(client, generation):
                box[0] = "leaving"
            elif box[0] is None and time.monotonic() - started > timeout_s:
                box[0] = "timeout"
            elif box[0] is not None:
                commit_generation(client, int(box[0]))  # type: ignore[call-overload]
        dist.broadcast_object_list(box, src=0)
        if box[0] == "timeout":
            if rank == 0:
                log.warning("BELOW MIN: no node joined within %.0fs; training on with %d node(s)", timeout_s, nodes)
            return None
        if box[0] == "leaving":
            if rank == 0:
                log.warning("BELOW MIN: a node of this generation got a preemption notice: training on to the next "
                            "step boundary, where its state is handed over (or saved, if nobody is left to take it)")
            return None
        if box[0] is not None:
            if rank == 0:
                log.warning("generation %s has enough nodes after %.1fs below MIN: joining it",
                            box[0], time.monotonic() - started)
            return int(box[0])  # type: ignore[call-overload]
        time.sleep(POLL_S)
