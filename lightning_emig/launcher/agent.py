"""The elastic agent of ``lightning-emig-run``: torchrun's agent, except that joins do not kill workers.

torch 2.13's ``SimpleElasticAgent._invoke_run`` handles "nodes are waiting while my workers are healthy" by
calling ``_restart_workers`` (stop, rendezvous, start). That call, made while the group state is
``HEALTHY``, is the one decision we change: :class:`MembershipAgent` runs the next rendezvous round and keeps
its worker processes (same pids, same local ranks, so torchrun's monitoring of them keeps working), then
publishes the new generation for them (see :mod:`lightning_emig.launcher.generation`). A ``_restart_workers``
call in any other state (a worker failed or became unhealthy) is torchrun's restart path, unchanged, and so
are the restart budget, the exit barrier and every other part of the loop. A restarting agent marks the
generation it leaves (``gen/<n>/restarting``) before it rejoins, so the healthy agents that then see it
waiting restart as torchrun would, rather than mistake it for a joining node.

Every rendezvous round — the first, a live change, a torchrun restart — is one generation: the agent
publishes it after ``_rendezvous`` and gives the workers it starts the ``LIGHTNING_EMIG_*`` environment.
Workers inherit the agent's ``os.environ`` (torchrun copies it into every worker), which is how the
environment reaches them without touching torchrun's per-worker code.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from lightning_emig.launcher.generation import (
    GenerationError,
    NodeEntry,
    control_prefix,
    publish_generation,
    read_generation,
    restart_key,
    worker_env,
)

logger = logging.getLogger(__name__)

ENV_LIVE_MEMBERSHIP = "LIGHTNING_EMIG_LIVE_MEMBERSHIP"
"""``"0"`` makes joins take torchrun's restart path (for comparisons); anything else, the live path."""

PUBLISH_TIMEOUT = timedelta(seconds=60)
"""How long the round's rank-0 agent waits for every agent's node entry."""

ROUND_GENERATION_KEY = "lightning_emig/generation"
"""Key in the rendezvous round's own store through which rank 0 hands the round its generation number."""


def round_node_key(group_rank: int) -> str:
    """Key in the round's own store where each agent leaves its :class:`NodeEntry` for rank 0."""
    return f"lightning_emig/node/{group_rank}"


def find_tcp_store(store: dist.Store) -> dist.TCPStore:
    """The TCPStore under the rendezvous round's PrefixStore(s): the control store."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        raise GenerationError(
            f"lightning-emig-run needs a TCPStore-backed rendezvous (--rdzv-backend=c10d with a host:port "
            f"endpoint); the rendezvous store is a {type(store).__name__}"
        )
    return store


class MembershipAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that carries live workers into the next generation when nodes join."""

    def __init__(self, *args: Any, live_membership: bool | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if live_membership is None:
            live_membership = os.environ.get(ENV_LIVE_MEMBERSHIP, "1") != "0"
        self.live_membership = live_membership
        spec = self._worker_group.spec
        self.node_id = f"{spec.local_addr or socket.getfqdn()}_{os.getpid()}"
        self.generation = -1
        self._control: dist.Store | None = None
        self._control_address = ""
        self._control_prefix = ""
        self._keeping_workers = False
        self._generation_live = False

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        # torch's loop sets the group state before calling us: HEALTHY means "nodes are waiting".
        joining = worker_group.state == WorkerState.HEALTHY and not self._peer_restarting()
        if self.live_membership and joining:
            self._continue_workers_in_next_round(worker_group)
            return
        if self._control is not None and worker_group.state != WorkerState.HEALTHY:
            self._control.set(restart_key(self.generation), self.node_id)
        super()._restart_workers(worker_group)

    def _peer_restarting(self) -> bool:
        return self._control is not None and self._control.check([restart_key(self.generation)])

    def _continue_workers_in_next_round(self, worker_group: WorkerGroup) -> None:
        started = time.monotonic()
        pids = {worker.local_rank: worker.id for worker in worker_group.workers}
        old_generation = self.generation
        self._keeping_workers = True
        try:
            self._rendezvous(worker_group)
        finally:
            self._keeping_workers = False
        # _rendezvous builds fresh Worker objects; the processes are the same, so are their ids.
        for worker in worker_group.workers:
            worker.id = pids[worker.local_rank]
        worker_group.state = WorkerState.HEALTHY
        if self.generation == old_generation:
            return
        logger.info(
            "[%s] live membership change: generation %d -> %d (world %d), workers kept (pids %s), %.2fs",
            worker_group.spec.role, old_generation, self.generation, worker_group.workers[0].world_size,
            sorted(pids.values()), time.monotonic() - started,
        )

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        started = time.monotonic()
        super()._rendezvous(worker_group)
        self._publish_generation(worker_group, started)

    def _publish_generation(self, worker_group: WorkerGroup, started: float) -> None:
        round_store = worker_group.store
        tcp = find_tcp_store(round_store)
        self._control_address = f"{tcp.host}:{tcp.port}"
        self._control_prefix = control_prefix(worker_group.spec.rdzv_handler.get_run_id())
        control = self._control = dist.PrefixStore(self._control_prefix, tcp)
        group_rank, group_world_size = worker_group.group_rank, worker_group.group_world_size
        workers = sorted(worker_group.workers, key=lambda w: w.local_rank)
        entry = NodeEntry(
            node_id=self.node_id, ranks=tuple(w.global_rank for w in workers), kept_workers=self._keeping_workers
        )
        round_store.set(round_node_key(group_rank), entry.encode())

        # One writer per generation: the round's rank-0 agent gathers the entries and publishes them.
        if group_rank == 0:
            keys = [round_node_key(r) for r in range(group_world_size)]
            round_store.wait(keys, PUBLISH_TIMEOUT)
            generation = publish_generation(
                control, nodes=[NodeEntry.decode(round_store.get(k)) for k in keys],
                world_size=workers[0].world_size, master_addr=worker_group.master_addr,
                master_port=worker_group.master_port, rendezvous_seconds=time.monotonic() - started,
            )
            round_store.set(ROUND_GENERATION_KEY, str(generation))
        generation = int(round_store.get(ROUND_GENERATION_KEY))
        info = read_generation(control, generation)
        if generation == self.generation:
            logger.info("rendezvous round changed nothing (a joining node missed it); still generation %d",
                        generation)
        else:
            logger.info(
                "generation %d: world %d on %d node(s), store %s:%d, this node %s group rank %d, ranks %s, %s",
                generation, info.world_size, len(info.nodes), info.master_addr, info.master_port, self.node_id,
                group_rank, list(entry.ranks), "workers kept" if self._keeping_workers else "workers started",
            )
        self._generation_live = info.live
        self.generation = generation

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        os.environ.update(worker_env(
            node_id=self.node_id, control_address=self._control_address, prefix=self._control_prefix,
            generation=self.generation, join_live=self._generation_live,
        ))
        return super()._start_workers(worker_group)
