"""The elastic agent of ``lightning-emig-run``: torchrun's agent, except that joins do not kill workers.

torch 2.13's ``SimpleElasticAgent._invoke_run`` handles "nodes are waiting while my workers are healthy" by
calling ``_restart_workers`` (stop, rendezvous, start). That call, made while the group state is
``HEALTHY``, is the one decision we change: :class:`MembershipAgent` runs the next rendezvous round and keeps
its worker processes (same pids, same local ranks, so torchrun's monitoring of them keeps working), then
publishes the new generation for them (see :mod:`lightning_emig.launcher.generation`). A ``_restart_workers``
call in any other state (a worker failed or became unhealthy) is torchrun's restart path, unchanged, and so
are the restart budget, the exit barrier and every other part of the loop. No restart path while a live path
exists: healthy agents carry their workers over whenever some worker of the job still holds the live state (its
``holds/`` heartbeat beats), also when the waiting node is one restarting after a failure (its fresh workers then join
live); only when no holder is left do they restart theirs, so that the whole next generation resumes from the newest
complete checkpoint.

Announced preemption: SIGTERM to the agent (or the file named by ``LIGHTNING_EMIG_PREEMPT_FILE`` appearing,
the way to simulate a notice) does not stop the workers. The agent writes ``leaving/<node_id>`` with a deadline
``LIGHTNING_EMIG_GRACE_S`` seconds away (default 60) into the control store and keeps monitoring: the workers
hand their state to the survivors at the next step boundary and exit 0; the agent then leaves the rendezvous
without closing it and without the exit barrier (the others wait only for the nodes still in the job:
:mod:`~lightning_emig.launcher.exit_barrier`). A node with notice takes part in no further rendezvous round: nodes that join meanwhile
form the next generation without it. A second SIGTERM is torchrun's SIGTERM: workers are killed, and for the
survivors it is an abrupt failure. A grace period that runs out stops the workers too (marked dead for the survivors),
and the node leaves with exit 0 like any preempted node, whatever its workers were doing. Without live membership
(``LIGHTNING_EMIG_LIVE_MEMBERSHIP=0``) every SIGTERM is torchrun's, and the preemption file is ignored.

Abrupt failure of a worker (it died, or exited non-zero): with live membership the agent does not restart the
whole job. It writes ``dead/<node_id>`` (the survivors' workers then need not wait for stale heartbeats), stops its
other workers (the node counts as failed as a whole), waits until the survivors have published a generation
without this node (:mod:`lightning_emig.membership.failure`), and then re-enters the rendezvous: the survivors'
agents see a waiting node and carry their workers into the next round, where this node's fresh workers join live,
like any new node. When no worker of the job holds the live state any more (their ``holds/`` heartbeats stopped
for the heartbeat timeout), or this node was the whole job, it stops waiting: every node then restarts its workers
and the next generation resumes from the newest complete checkpoint. After ``LIGHTNING_EMIG_FAILURE_WAIT_S`` (default
120 s) it rejoins anyway (its fresh workers join live if holders are left). Either way it uses one of torchrun's
``--max-restarts``.
A node killed whole (agent and workers) is noticed by the survivors' workers alone (heartbeats).

Every rendezvous round — the first, a live change, a torchrun restart — is one generation: the agent
publishes it after ``_rendezvous`` and gives the workers it starts the ``LIGHTNING_EMIG_*`` environment.
Workers inherit the agent's ``os.environ`` (torchrun copies it into every worker), which is how the
environment reaches them without touching torchrun's per-worker code.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousError

from lightning_emig.launcher.control_store import (
    ENV_RDZV_ENDPOINT,
    ETCD_BACKEND,
    ETCD_SCHEME,
    find_tcp_store,
    open_control_store,
)
from lightning_emig.launcher.exit_barrier import wait_at_exit
from lightning_emig.launcher.generation import (
    ACTIVE_GENERATION_KEY,
    ENV_AGENT_PID,
    LAST_DEATH_KEY,
    LEFT_OUT_EXIT_CODE,
    NO_HOLDERS_EXIT_CODE,
    NodeEntry,
    agent_heartbeat_key,
    control_prefix,
    dead_key,
    generation_going_on_without,
    latest_generation,
    leaving_key,
    live_membership_from_env,
    make_node_id,
    publish_generation,
    raise_key,
    read_generation,
    ready_key,
    worker_env,
)
from lightning_emig.launcher.heartbeat import Heartbeat, HoldersMonitor, forget_holders, mark_gone
from lightning_emig.launcher.leaving import yield_cpu_to_the_job
from lightning_emig.launcher.rounds import (
    REFUSED_ROUNDS_S,
    ROUND_ATTEMPTS,
    ROUND_GENERATION_KEY,
    ROUND_REFUSED,
    RoundRefusedError,
    holders_missing,
    leave_round,
    round_node_key,
)
from lightning_emig.launcher.store_host import warn_if_hosting

logger = logging.getLogger(__name__)

PUBLISH_TIMEOUT = timedelta(seconds=60)
"""How long the round's rank-0 agent waits for every agent's node entry."""

ENV_GRACE_S = "LIGHTNING_EMIG_GRACE_S"
"""Seconds a preempted node's workers get to hand off their state and exit (default 60)."""

ENV_PREEMPT_FILE = "LIGHTNING_EMIG_PREEMPT_FILE"
"""A path; when that file appears, the agent acts as on SIGTERM (a simulated preemption notice)."""

ENV_FAILURE_WAIT_S = "LIGHTNING_EMIG_FAILURE_WAIT_S"
"""Seconds a node whose workers failed waits for the survivors' generation before it rejoins regardless."""

AGENT_HEARTBEAT_S = 1.0
"""How often an agent rewrites its heartbeat (``hb/<node_id>/agent``)."""

class _LeaveJob(Exception):  # noqa: N818 - a way out, not an error
    """A preempted node with nothing (left) to hand off: its agent leaves the job, exit 0 (``MembershipAgent.run``)."""


def _joiner_exit(result: RunResult) -> int | None:
    """:data:`LEFT_OUT_EXIT_CODE` when every failed worker was a joiner left out, :data:`NO_HOLDERS_EXIT_CODE` when
    one found no holder left and the others were left out (they too wait for nobody); else None (a real failure)."""
    codes = {failure.exitcode for failure in result.failures.values()}
    if codes == {LEFT_OUT_EXIT_CODE}:
        return LEFT_OUT_EXIT_CODE
    joiners_only = codes <= {NO_HOLDERS_EXIT_CODE, LEFT_OUT_EXIT_CODE}
    return NO_HOLDERS_EXIT_CODE if joiners_only and NO_HOLDERS_EXIT_CODE in codes else None


class MembershipAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that carries live workers into the next generation when nodes join."""

    def __init__(self, *args: Any, live_membership: bool | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.live_membership = live_membership_from_env() if live_membership is None else live_membership
        spec = self._worker_group.spec
        self.node_id = make_node_id(spec.local_addr or socket.getfqdn(), os.getpid())
        self.generation = -1
        self._control: dist.Store | None = None
        self._control_address = ""
        self._control_prefix = ""
        self._keeping_workers = False
        self._generation_live = False
        self.grace_s = float(os.environ.get(ENV_GRACE_S, "60"))
        self._preempt_file = os.environ.get(ENV_PREEMPT_FILE) or None
        self._notice_at: float | None = None  # monotonic time of the preemption notice
        self._leaving_deadline: float | None = None  # monotonic; set once leaving/<node_id> is written
        self._left_round = False
        self._heartbeat: Heartbeat | None = None
        settings = getattr(spec.rdzv_handler, "_settings", None)  # DynamicRendezvousHandler (torch 2.13)
        self.min_nodes = int(getattr(settings, "min_nodes", 1))
        self.max_nodes = int(getattr(settings, "max_nodes", self.min_nodes))
        self.failure_wait_s = float(os.environ.get(ENV_FAILURE_WAIT_S, "120"))
        self._holders: HoldersMonitor | None = None

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        # torch's loop sets the group state before calling us: HEALTHY means "nodes are waiting".
        if worker_group.state == WorkerState.HEALTHY and self._notice_at is not None:
            # This node is leaving: its workers hand off and exit. It takes part in no further round, and leaves the
            # current one, since torch starts the next round only once every participant of this one has left.
            self._exit_rendezvous_round()
            return
        # Nodes wait and our workers are healthy: they are carried into the next round whenever some worker of the job
        # still holds the live state (ours, or another node's that ours wait to be admitted by); with no holder left,
        # every node restarts its workers, and the next generation resumes from the newest checkpoint.
        joining = worker_group.state == WorkerState.HEALTHY and self._live_holders(fresh=True)
        if self.live_membership and joining:
            self._continue_workers_in_next_round(worker_group)
            return
        if self._control is not None and worker_group.state != WorkerState.HEALTHY and self.live_membership:
            self._wait_for_survivors(worker_group)
        # Stop (done by now, on the live path), rendezvous, start: as a joining node if the survivors carried on, else
        # as part of a generation that resumes from the newest checkpoint.
        super()._restart_workers(worker_group)

    def _wait_for_survivors(self, worker_group: WorkerGroup) -> None:
        """Our workers failed: tell the survivors, stop the rest, wait for their generation without this node; give
        up when nobody carries on (this node was the whole job, no holder of the live state is left, or nothing came
        within ``LIGHTNING_EMIG_FAILURE_WAIT_S``)."""
        assert self._control is not None
        control = self._control
        self._mark_dead(worker_group)
        logger.error("[%s] WORKER FAILURE on this node: marked it dead for the survivors; stopping its workers",
                     self.node_id)
        self._stop_workers(worker_group)
        latest = latest_generation(control)
        if latest < 0 or {n.node_id for n in read_generation(control, latest).nodes} == {self.node_id}:
            return  # this node was the whole job: nobody carries on, it restarts from the newest checkpoint
        deadline = time.monotonic() + self.failure_wait_s
        while time.monotonic() < deadline:
            without = generation_going_on_without(control, self.node_id)
            if without is not None:
                logger.warning("[%s] the survivors carried on as generation %d; rejoining with fresh workers",
                               self.node_id, without)
                control.delete_key(dead_key(self.node_id))  # decided; a later failure must not read it again
                return
            if not self._live_holders(fresh=True):
                logger.error("[%s] no worker holds the live state any more: every node restarts its workers, from the "
                             "newest complete checkpoint", self.node_id)
                return
            time.sleep(0.2)
        logger.error("[%s] no generation without this node within %.0fs: rejoining with fresh workers (they join the "
                     "holders live if any are left)", self.node_id, self.failure_wait_s)

    def _mark_dead(self, worker_group: WorkerGroup) -> None:
        """``dead/<node_id>``: this node's workers failed; the survivors need not wait for stale heartbeats."""
        assert self._control is not None
        # A dead worker is not ready: the holders must not take its stale ready key for a joiner that can form a group.
        for local_rank in range(worker_group.spec.local_world_size):
            self._control.delete_key(ready_key(self.node_id, local_rank))
        mark_gone(self._control, self.node_id, range(worker_group.spec.local_world_size))
        self._control.set(dead_key(self.node_id), json.dumps({"time": time.time(), "generation": self.generation}))
        self._control.set(LAST_DEATH_KEY, json.dumps({"node_id": self.node_id, "time": time.time()}))  # watched

    def _live_holders(self, *, fresh: bool = False) -> bool:
        """Whether some worker of the job still holds the live state (:class:`~lightning_emig.launcher.heartbeat.
        HoldersMonitor`; True without live membership: nothing is carried over then anyway)."""
        if self._control is None or not self.live_membership:
            return True
        if self._holders is None:
            self._holders = HoldersMonitor(self._control)
        return self._holders.alive(fresh=fresh)

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
        """torch's round, then its generation. A round a node died in is run again without it (see
        :data:`ROUND_ATTEMPTS`); a round refused because the nodes holding the live state are not in it (they are still
        leaving a round that failed) is run again until they are, for up to :data:`REFUSED_ROUNDS_S`."""
        attempt, refused_since = 1, None
        while True:
            started = time.monotonic()
            try:
                super()._rendezvous(worker_group)
                self._publish_generation(worker_group, started)
                return
            except RoundRefusedError as exc:
                refused_since = refused_since or time.monotonic()
                if time.monotonic() - refused_since > REFUSED_ROUNDS_S:
                    raise
                logger.warning("[%s] %s; running the next round", self.node_id, exc)
            except (dist.DistError, RendezvousError) as exc:
                if isinstance(exc, RendezvousClosedError) or attempt == ROUND_ATTEMPTS:
                    raise
                logger.error("[%s] rendezvous round failed (attempt %d of %d; a node of the round is gone?): %s; "
                             "running the next round", self.node_id, attempt, ROUND_ATTEMPTS,
                             str(exc).splitlines()[0][:300])
                attempt += 1

    def _publish_generation(self, worker_group: WorkerGroup, started: float) -> None:
        round_store = worker_group.store
        control = self._open_control_store(worker_group)
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
            nodes = [NodeEntry.decode(round_store.get(k)) for k in keys]
            missing = holders_missing(control, nodes)
            if missing:
                round_store.set(ROUND_GENERATION_KEY, ROUND_REFUSED)
                raise RoundRefusedError(f"nodes holding the live state are not in this round: {missing}")
            generation = publish_generation(
                control, nodes=nodes, world_size=workers[0].world_size, master_addr=worker_group.master_addr,
                master_port=worker_group.master_port, rendezvous_seconds=time.monotonic() - started,
            )
            if not any(node.kept_workers for node in nodes):  # every worker starts (from a checkpoint): they hold it
                forget_holders(control, read_generation(control, generation).members)
                raise_key(control, ACTIVE_GENERATION_KEY, generation)
            round_store.set(ROUND_GENERATION_KEY, str(generation))
        published = round_store.get(ROUND_GENERATION_KEY).decode()
        if published == ROUND_REFUSED:
            raise RoundRefusedError("the round's rank 0 refused it: nodes holding the live state are not in it")
        generation = int(published)
        control.delete_key(dead_key(self.node_id))  # this node is in a round again: any failure marker is history
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

    def _open_control_store(self, worker_group: WorkerGroup) -> Any:
        """The control store of the rendezvous backend (see :mod:`lightning_emig.launcher.control_store`): the c10d
        round's own TCPStore, or the etcd server the rendezvous uses."""
        handler = worker_group.spec.rdzv_handler
        self._control_prefix = control_prefix(handler.get_run_id())
        if handler.get_backend() == ETCD_BACKEND:
            if self._control is None:
                self._control_address = ETCD_SCHEME + os.environ[ENV_RDZV_ENDPOINT]
                self._control = open_control_store(self._control_address, self._control_prefix,
                                                   timeout_s=PUBLISH_TIMEOUT.total_seconds())
        else:
            tcp = find_tcp_store(worker_group.store)
            self._control_address = f"{tcp.host}:{tcp.port}"
            self._control = dist.PrefixStore(self._control_prefix, tcp)
        self._start_heartbeat()
        return self._control

    def _start_heartbeat(self) -> None:
        """This agent's own heartbeat (once): the workers holding the state tell a joining node that died before its
        worker beat once from a slow one by it."""
        if self._heartbeat is not None:
            return
        client = open_control_store(self._control_address, self._control_prefix, timeout_s=10.0)
        self._heartbeat = Heartbeat(AGENT_HEARTBEAT_S, key=agent_heartbeat_key(self.node_id), client=client)
        atexit.register(self._heartbeat.stop)  # a daemon thread inside a store call must not outlive the interpreter

    def run(self, role: str = "default") -> Any:
        # A notice may come before this node is in any generation (still in its first round): it has nothing to hand
        # off and leaves at once, exit 0, instead of dying by the signal. (torchrun's process context replaces the
        # handler when it starts workers; _start_workers installs it again.)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return super().run(role)
        except _LeaveJob as why:
            logger.warning("[%s] %s: nothing to hand off; leaving the rendezvous", self.node_id, why)
            self._leave_job()
            return RunResult(state=WorkerState.SUCCEEDED)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self._control is not None:  # a fresh process is not ready to join yet (see membership.admission)
            local_ranks = range(worker_group.spec.local_world_size)
            for local_rank in local_ranks:
                self._control.delete_key(ready_key(self.node_id, local_rank))
            if self._generation_live:  # the processes these replace hold nothing any more (see launcher.heartbeat)
                mark_gone(self._control, self.node_id, local_ranks)
        os.environ.update(worker_env(
            node_id=self.node_id, control_address=self._control_address, prefix=self._control_prefix,
            generation=self.generation, join_live=self._generation_live, min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
        ))
        os.environ[ENV_AGENT_PID] = str(os.getpid())  # each worker dies with this agent (see launcher.orphans)
        pids = super()._start_workers(worker_group)
        # torchrun's process context just registered its SIGTERM handler (kill the workers); ours opens the grace
        # period instead. Only the main thread may set handlers (the agent's loop runs there).
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        return pids

    # ------------------------------------------------------------------ announced preemption
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # A second SIGTERM, or any without live membership (the restart path): torchrun's behaviour, the workers
        # are killed and the job restarts without this node from the newest checkpoint.
        if self._notice_at is not None or not self.live_membership:
            raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        if self.generation < 0:
            raise _LeaveJob("preemption notice before this node joined a generation")
        self._notice_at = time.monotonic()  # the store write happens in the monitor loop (not re-entrant here)

    def _monitor_workers(self, worker_group: WorkerGroup) -> Any:
        if self._notice_at is None and self.live_membership and self._preempt_file and os.path.exists(self._preempt_file):
            self._notice_at = time.monotonic()
        if self._notice_at is not None:
            self._announce_leaving(worker_group)
        try:
            self._live_holders()  # keeps the watch's timers running (see _live_holders)
        except Exception:  # noqa: BLE001 - a store hiccup must not fail the agent; the next tick reads again
            logger.debug("could not read the holders' heartbeats", exc_info=True)
        result = super()._monitor_workers(worker_group)
        failed = result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
        if failed and self._notice_at is not None and self._control is not None:
            # Preempted, and its workers are gone (killed, left out, or died handing off): the node goes, as announced;
            # for the survivors it is a failure (marked, so they need not wait for stale heartbeats).
            self._mark_dead(worker_group)
            raise _LeaveJob("preemption notice, and this node's workers failed")
        joiner_exit = _joiner_exit(result) if result.state == WorkerState.FAILED else None
        if joiner_exit is not None:  # not a failure: no restart spent, nothing marked dead
            rejoin = self._rejoin_left_out if joiner_exit == LEFT_OUT_EXIT_CODE else self._restart_without_holders
            rejoin(worker_group)
            return RunResult(state=WorkerState.HEALTHY)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self._remaining_restarts == 0:
            self._fail_without_restart()
        return result

    def _rejoin_left_out(self, worker_group: WorkerGroup) -> None:
        """Our workers, started into a generation, were left out of the one the state holders formed (rounds
        overlapped): a new rendezvous round brings fresh workers in. Not a failure: no restart spent, nothing marked
        dead."""
        logger.warning("[%s] workers left out of the generation the others formed: rejoining with fresh workers",
                       self.node_id)
        super()._restart_workers(worker_group)  # stop (they exited), rendezvous as a joining node, start

    def _restart_without_holders(self, worker_group: WorkerGroup) -> None:
        """Our joiners found no holder of the live state (:mod:`~lightning_emig.membership.admission`), or workers of
        a fresh generation lost a peer before their layout (:mod:`~lightning_emig.membership.death_watch`): restart
        them as torchrun would, no restart spent; the other agents do too, and the next generation resumes from the
        newest checkpoint. Marked gone: else, never having held, they look still starting up to a dead node's agent."""
        assert self._control is not None
        mark_gone(self._control, self.node_id, range(worker_group.spec.local_world_size))
        logger.error("[%s] nobody holds the live state any more: restarting this node's workers from the newest "
                     "complete checkpoint", self.node_id)
        super()._restart_workers(worker_group)

    def _fail_without_restart(self) -> None:
        """Our workers failed with no torchrun restart left: this node leaves; the survivors carry on without it.

        torchrun would close the rendezvous on the way out (``launch_agent`` calls ``shutdown``), after which no node
        could ever join the job again; and the survivors would wait for our heartbeats to go stale.
        """
        if not self.live_membership or self._control is None:
            return
        self._mark_dead(self._worker_group)
        logger.error("[%s] WORKER FAILURE and no restart left (--max-restarts): this node leaves the job",
                     self.node_id)
        self._leave_job()

    def _announce_leaving(self, worker_group: WorkerGroup) -> None:
        if self._leaving_deadline is None:
            self._leaving_deadline = self._notice_at + self.grace_s
            if self._control is not None:
                self._control.set(leaving_key(self.node_id), json.dumps({"deadline": time.time() + self.grace_s}))
            logger.warning("[%s] preemption notice: workers hand off their state and exit within %.0fs",
                           self.node_id, self.grace_s)
            warn_if_hosting(self._control_address, self.node_id)
        elif time.monotonic() > self._leaving_deadline:
            # The node goes as announced, whatever its workers were doing (recovering from a peer's failure, say):
            # exit 0, as for any preempted node; for the survivors it is an abrupt failure, marked so.
            logger.error(
                "[%s] PREEMPTION GRACE PERIOD OF %.0fs RAN OUT before the workers handed off their state: stopping "
                "them; for the survivors this is an abrupt failure", self.node_id, self.grace_s,
            )
            if self._control is not None:  # first: the survivors need not wait for stale heartbeats
                self._mark_dead(worker_group)
            self._stop_workers(worker_group)
            raise _LeaveJob("preemption grace period ran out")

    def _exit_barrier(self) -> None:
        if self._leaving_deadline is not None:  # preempted, its workers handed off their state
            self._leave_job()
            niceness = yield_cpu_to_the_job()  # out of the round: nobody waits for this agent (launcher.leaving)
            logger.warning("[%s] workers handed off their state and exited; leaving the job (niceness %d)",
                           self.node_id, niceness)
            return
        if self._control is None:
            super()._exit_barrier()
            return
        logger.info("waiting at the exit barrier for the nodes of the newest generation still in the job")
        try:  # not torch's: it waits for every node of the last round, also one that left since (launcher.exit_barrier)
            wait_at_exit(self._store, self._control, self.generation, timeout_s=self._exit_barrier_timeout)
        except SignalException:
            raise
        except Exception:
            logger.exception("error waiting on the exit barrier")

    def _leave_job(self) -> None:
        """This node leaves a job that goes on: out of the rendezvous round, and the rendezvous left open
        (``launch_agent`` closes it on success, when the whole job is over)."""
        self._exit_rendezvous_round()
        self._worker_group.spec.rdzv_handler.shutdown = lambda: True

    def _exit_rendezvous_round(self) -> None:
        """Remove this node from the rendezvous round (once), without closing the rendezvous."""
        if not self._left_round:
            self._left_round = True
            leave_round(self._worker_group.spec.rdzv_handler)
