"""Admission: which generation the state holders are in, and how a worker started into a later one gets in.

Rendezvous rounds overlap. A node joins (the agents publish generation ``N``, its worker starts up, which takes
seconds); before that worker is ready another node joins, and the agents publish ``N+1``, listing the first
joiner's still-starting worker among the *kept* workers (its agent keeps it running). The workers that hold the
state may then form ``N+1`` and never ``N``; a drain or the survivors of a failure may publish a generation of their
own without it. So a worker started into a live generation does not form the generation it was started into: it
forms the one the holders *commit* to, once one includes it.

Keys under the control prefix (see :mod:`lightning_emig.launcher.generation`):

* ``ready/<node_id>/<local_rank>``: set by a worker started into a live generation once its start-up is done
  (interpreter, imports, its run built), right before it waits for admission; deleted by its agent before it starts
  a worker with that local rank (a fresh process is not ready).
* ``active_generation``: the generation the state holders form next (or are in). Only the holders' rank 0 writes it
  (the new rank 0 after a drain or a failure), before any holder forms that generation's group, and it only grows.
* ``host_working_set``: the holders' rank 0's peak resident memory, its share of the training state and its world
  size, refreshed at step boundaries (CPU training only). Before a joiner says it is ready it faults in as much heap
  as it will need (:func:`memory_to_warm`), while the old world still trains: otherwise it faults its whole working
  set in during the transfer and the first step on the new world, which every process waits for (measured at
  ``llama_125m``: +4 to +6 s on a 7-10 s step).

The rules:

* the holders go into a newer generation only once every worker of it that is not one of theirs is ready
  (:func:`joiners_ready`): a joiner's start-up costs no downtime, however the rounds interleave;
* a joiner forms the first committed generation that includes it (:func:`await_admission`); when the holders commit
  to a generation at or past the one it was started into without it, it is *left out*: it exits with
  :data:`LEFT_OUT_EXIT_CODE`, and its agent brings a fresh worker back in through a new rendezvous round (not a
  failure: no restart is spent, nothing is marked dead);
* a joiner whose node got a preemption notice (``leaving/<node_id>``) before it was admitted holds nothing: it exits 0
  (:class:`PreemptedBeforeAdmissionError`), so a preempted node leaves with exit 0 whatever its worker was doing;
* a joiner still waiting when the holders' training has ended (its node joined in the last steps) exits 0
  (:class:`TrainingDoneError`): nothing is left to train, and its agent must reach the exit barrier the others
  wait at; the holders' rank 0 announces the end (:func:`announce_training_done`) once its last fit returned;
* a joiner whose holders are all gone — every worker of the generation they committed to last has stopped beating
  ``holds/<node_id>/<local_rank>`` (the heartbeat a worker writes only while it holds the live state) for the
  heartbeat timeout — can never be admitted: it exits with :data:`NO_HOLDERS_EXIT_CODE`
  (:class:`NoHoldersError`), and its agent restarts the node's workers into a round in which no node keeps any, so
  the generation that forms next resumes from the newest complete checkpoint, all of its ranks alike
  (:func:`holders_alive`; the agents of the nodes whose workers died judge the same way);
* a generation with a joiner that died while starting (its agent's heartbeat stopped, or its agent marked it dead)
  can never form, and no agent publishes another unless a node joins: the holders publish their own — themselves and
  the joiners that are ready (:func:`generation_to_join`) — and go into it.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lightning_emig.host_memory import available_bytes, peak_resident_bytes, resident_bytes
from lightning_emig.launcher.generation import (
    ACTIVE_GENERATION_KEY,
    LEFT_OUT_EXIT_CODE,
    NO_HOLDERS_EXIT_CODE,
    TRAINING_DONE_KEY,
    WORKING_SET_KEY,
    GenerationError,
    GenerationInfo,
    NodeEntry,
    active_generation,
    agent_heartbeat_key,
    dead_key,
    latest_generation,
    leaving_key,
    publish_generation,
    raise_key,
    read_generation,
    ready_key,
)
from lightning_emig.launcher.heartbeat import HeartbeatWatch, holders_alive
from lightning_emig.membership.group import host_generation_store, keep_hosted_store

log = logging.getLogger(__name__)


HOLDERS_POLL_S = 1.0
"""How often a joiner waiting for admission looks at the holders' heartbeats."""


class LeftOutError(SystemExit):
    """The holders committed to a generation without this joiner: the process exits with LEFT_OUT_EXIT_CODE."""

    def __init__(self) -> None:
        super().__init__(LEFT_OUT_EXIT_CODE)


class PreemptedBeforeAdmissionError(SystemExit):
    """This joiner's node got a preemption notice before the holders admitted it: it holds nothing to hand off, so it
    exits 0 at once (its agent then leaves the job with exit 0, well inside the grace period)."""

    def __init__(self) -> None:
        super().__init__(0)


class NoHoldersError(SystemExit):
    """No process holding the live state is left to admit this joiner: exit :data:`NO_HOLDERS_EXIT_CODE`."""

    def __init__(self) -> None:
        super().__init__(NO_HOLDERS_EXIT_CODE)


class TrainingDoneError(SystemExit):
    """The holders finished training before this joiner was admitted: the process exits 0 (see the module)."""

    def __init__(self) -> None:
        super().__init__(0)


def announce_training_done(client: dist.Store, generation: int) -> None:
    """The holders' rank 0, once its last fit returned: joiners still waiting for admission leave (exit 0)."""
    client.set(TRAINING_DONE_KEY, str(generation))


def training_done(client: dist.Store) -> bool:
    return client.check([TRAINING_DONE_KEY])


def _joining_workers(info: GenerationInfo, holders: GenerationInfo) -> dict[str, list[tuple[str, int]]]:
    """Per node of ``info``: its workers that are not workers of ``holders`` (nodes with none are left out)."""
    members = {(node.node_id, local_rank) for node in holders.nodes for local_rank in range(len(node.ranks))}
    joining = {node.node_id: [(node.node_id, lr) for lr in range(len(node.ranks)) if (node.node_id, lr) not in members]
               for node in info.nodes}
    return {node_id: workers for node_id, workers in joining.items() if workers}


def joiners_ready(client: dist.Store, info: GenerationInfo, holders: GenerationInfo) -> bool:
    """Every worker of ``info`` that is not a worker of ``holders`` (the generation the state holders are in) has
    announced its start-up done."""
    return all(client.check([ready_key(*worker)])
               for workers in _joining_workers(info, holders).values() for worker in workers)


@dataclass(frozen=True, slots=True)
class Joiners:
    """The nodes of a newer generation that are not the holders', by state (node ids)."""

    ready: tuple[str, ...]
    """Every worker of the node announced its start-up done."""
    starting: tuple[str, ...]
    dead: tuple[str, ...]
    """Its agent marked it dead, or its agent's heartbeat stopped (judged by the watch, on this process's clock)."""


def joiners_of(client: dist.Store, info: GenerationInfo, holders: GenerationInfo, watch: HeartbeatWatch) -> Joiners:
    ready, starting, dead = [], [], []
    for node_id, workers in _joining_workers(info, holders).items():
        if client.check([dead_key(node_id)]) or watch.stale_key(agent_heartbeat_key(node_id)):
            dead.append(node_id)
        elif all(client.check([ready_key(*worker)]) for worker in workers):
            ready.append(node_id)
        else:
            starting.append(node_id)
    return Joiners(tuple(ready), tuple(starting), tuple(dead))


def generation_to_join(client: dist.Store, holders_generation: int, watch: HeartbeatWatch, *, host: str,
                       timeout: timedelta, give_up_on_starting: bool = False) -> int | None:
    """The holders' rank 0: the generation to go into now, or None (none newer, or its joiners still starting).

    The newest generation when every joiner of it is ready; when some died while starting (or, with
    ``give_up_on_starting``, are still starting), the holders' own generation with the joiners that are ready,
    published here (its store hosted by this process, on ``host``) unless a newer round came meanwhile."""
    latest = latest_generation(client)
    if latest <= holders_generation:
        return None
    info, holders = read_generation(client, latest), read_generation(client, holders_generation)
    joiners = joiners_of(client, info, holders, watch)
    if joiners.starting and not give_up_on_starting:
        return None
    if not joiners.dead and not joiners.starting:
        return latest
    if not joiners.ready:
        return None
    log.warning("generation %d cannot form (joiners %s %s): the holders publish their own with the ready joiners %s",
                latest, ", ".join(joiners.dead + joiners.starting), "died" if joiners.dead else "never got ready",
                list(joiners.ready))
    joining = [node for node in info.nodes if node.node_id in joiners.ready]
    rank = holders.world_size
    entries = [NodeEntry(node_id=n.node_id, ranks=n.ranks, kept_workers=True) for n in holders.nodes]
    for node in joining:
        entries.append(NodeEntry(node_id=node.node_id, ranks=tuple(range(rank, rank + len(node.ranks))),
                                 kept_workers=True))
        rank += len(node.ranks)
    return publish_holders_generation(client, entries, host, timeout, only_after=latest)


def publish_holders_generation(client: dist.Store, nodes: list[NodeEntry], host: str, timeout: timedelta, *,
                               only_after: int | None = None) -> int | None:
    """Publish a generation of the holders' own (after a drain, a failure, a joiner's death), its store hosted by
    this process (their new rank 0) on ``host``, bound before the number is published; commit the holders to it. With
    ``only_after``: only if that is still the latest generation, else None (see ``publish_generation``)."""
    store = host_generation_store(host, timeout)
    published = publish_generation(client, nodes=nodes, world_size=sum(len(n.ranks) for n in nodes), master_addr=host,
                                   master_port=store.port, rendezvous_seconds=0.0, only_after=only_after)
    if published is not None:
        keep_hosted_store(published, store)
        commit_generation(client, published)
    return published


def publish_working_set(client: dist.Store, *, state_bytes: int, world: int) -> None:
    """The holders' rank 0 at a step boundary: its peak memory so far and its share of the state (see the module
    docstring); nothing where the peak is unknown."""
    peak = peak_resident_bytes()
    if peak is not None:
        client.set(WORKING_SET_KEY, json.dumps({"peak_bytes": peak, "state_bytes": state_bytes, "world": world}))


def memory_to_warm(client: dist.Store, world: int) -> int:
    """The bytes a joiner into a world of ``world`` processes should fault in before it is ready: the holders' rank
    0's peak, grown by the state its share gains where ``world`` is smaller than theirs, less what this process
    already holds (the interpreter and its libraries, resident in both); at most half of the memory the machine has
    available. 0 when nothing was published.

    A larger world's smaller share is not taken off: what that world's collectives hold (FSDP's gathered parameters
    and unreduced gradients, gloo's buffers), which the holders' peak does not show where they trained without
    them, outweighs it. Measured at ``llama_125m``, 1 -> 2 processes: a process of the new world holds 3.46 GB
    steady, against the holder's 3.06 GB peak in world 1 (1.5 GB of it state, half of which the new world no longer
    holds); warming the rescaled 1.93 GB, the joiner still faulted 0.8 GB in its first step on the new world."""
    if not client.check([WORKING_SET_KEY]):
        return 0
    seen = json.loads(client.get(WORKING_SET_KEY))
    state = int(seen["state_bytes"])
    gained = max(0, state * int(seen["world"]) // max(world, 1) - state)
    need = int(seen["peak_bytes"]) + gained - (resident_bytes() or 0)
    available = available_bytes()
    return max(0, min(need, available // 2 if available is not None else need))


def commit_generation(client: dist.Store, generation: int) -> None:
    """The holders' rank 0: they form ``generation`` next (joiners waiting for admission read it)."""
    raise_key(client, ACTIVE_GENERATION_KEY, generation)


def await_admission(client: dist.Store, node_id: str, local_rank: int, *, started_in: int, timeout_s: float,
                    holders: HeartbeatWatch, poll_s: float = 0.1) -> int:
    """A joiner whose start-up is done: announce it, then wait for the generation to form (see the module
    docstring). Raises :class:`LeftOutError` when the holders went on without this worker, :class:`NoHoldersError`
    when none of them is left (judged by ``holders``, a watch with the heartbeat timeout)."""
    client.set(ready_key(node_id, local_rank), str(started_in))
    log.info("start-up done (started into generation %d): this worker waits for admission", started_in)
    deadline = time.monotonic() + timeout_s
    holders_read_at = time.monotonic()
    while True:
        active = active_generation(client)
        if active >= started_in:
            info = read_generation(client, active)
            if any(node.node_id == node_id and local_rank < len(node.ranks) for node in info.nodes):
                if active != started_in:
                    log.warning("started into generation %d; the workers holding the state went into generation %d "
                                "(rounds overlapped): forming that one", started_in, active)
                return active
            log.error("the workers holding the state went into generation %d without this worker (started into %d): "
                      "leaving, so that this node's agent brings it back in through a new round", active, started_in)
            client.delete_key(ready_key(node_id, local_rank))
            raise LeftOutError
        if client.check([leaving_key(node_id)]):  # after the generations, too: admitted, it hands off like a holder
            log.warning("this node got a preemption notice before this worker was admitted (started into generation "
                        "%d): it holds no state to hand off, leaving (exit 0)", started_in)
            client.delete_key(ready_key(node_id, local_rank))
            raise PreemptedBeforeAdmissionError
        if training_done(client):  # checked after the generations: holders that admitted this worker wait for it
            log.warning("the workers holding the state finished training before this worker was admitted (started "
                        "into generation %d): nothing left to train, leaving (exit 0)", started_in)
            client.delete_key(ready_key(node_id, local_rank))
            raise TrainingDoneError
        if time.monotonic() - holders_read_at >= HOLDERS_POLL_S:  # a few store reads per member: not every poll
            holders_read_at, gone = time.monotonic(), not holders_alive(client, holders)
        else:
            gone = False
        if gone:
            log.error("NO WORKER HOLDS THE LIVE STATE ANY MORE (generation %d's stopped beating for %.0fs): nobody is "
                      "left to admit this worker; its agent restarts the job's workers from the newest complete "
                      "checkpoint", active, holders.timeout_s)
            client.delete_key(ready_key(node_id, local_rank))
            raise NoHoldersError
        if time.monotonic() > deadline:
            raise GenerationError(
                f"started into generation {started_in}, ready, and no generation including this worker was formed "
                f"by the workers holding the state within {timeout_s:.0f}s (latest they committed to: {active})"
            )
        time.sleep(poll_s)
