"""Generations of the world, as the launcher publishes them to live workers (the worker-facing API).

A *generation* is one membership of the job: which processes exist, their global ranks, and the address of
the store that process group is formed on. ``lightning-emig-run`` starts every worker in some generation
and, when nodes join a healthy job, publishes the next generation to the workers that keep running.

Environment of every worker (besides torchrun's own ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...; those
describe the generation the worker *started* in and go stale after a live change):

* ``LIGHTNING_EMIG_NODE_ID``: stable id of the worker's agent (its node) for the agent's whole life,
  ``"<local addr>_<agent pid>"``. A worker's identity across generations is ``(node_id, LOCAL_RANK)``.
* ``LIGHTNING_EMIG_CONTROL_STORE``: the control store: ``host:port`` of the c10d rendezvous store at the rendezvous
  endpoint, or ``etcd://host:port`` of the etcd-v2 rendezvous' server; workers open it as a client
  (:func:`control_client_from_env`, :mod:`lightning_emig.launcher.control_store`).
* ``LIGHTNING_EMIG_CONTROL_PREFIX``: every key below lives under it, ``"lightning_emig/<run_id>/"``.
* ``LIGHTNING_EMIG_GENERATION``: the generation the worker starts in (``0`` for the first).
* ``LIGHTNING_EMIG_JOIN_LIVE``: ``"1"`` when the worker starts into a generation in which other workers
  kept running (they hold the live state; this worker must receive it), else ``"0"``.
* ``LIGHTNING_EMIG_MIN_NODES``: the MIN of ``--nnodes=MIN:MAX``; below it, survivors wait for joiners.

Keys under the prefix (the control store), for generation ``n``:

* ``gen/<n>/node/<group_rank>``: JSON ``{"node_id", "ranks", "kept_workers"}``, one per agent of the
  rendezvous round; ``ranks[local_rank]`` is that worker's global rank; ``kept_workers`` says its workers
  carried over from the previous generation (the live path) instead of being started.
* ``gen/<n>/world``: JSON ``{"format", "world_size", "master_addr", "master_port", "num_nodes",
  "rendezvous_seconds"}``. The new process group is formed on a ``TCPStore`` at ``master_addr:master_port``
  that the generation's global rank 0 hosts (``is_master=True``), under ``PrefixStore(f"gen{n}")``.
* ``latest_generation``: ``str(n)``, written *after* the node entries and ``world``; a reader that sees
  ``latest_generation >= n`` always finds generation ``n`` complete.
* ``generation_counter``: the rank-0 agent takes each new number from it (``add(1) - 1``).
* ``active_generation``, ``ready/<node_id>/<local_rank>``: which generation the workers holding the state form, and
  which started workers are ready to join them (see :mod:`lightning_emig.membership.admission`).
* ``leaving/<node_id>``: JSON ``{"deadline"}`` (``time.time()`` by which the node is gone), written by an agent
  that got a preemption notice (SIGTERM, or the file named by ``LIGHTNING_EMIG_PREEMPT_FILE`` appearing). The
  workers then agree at a step boundary to hand that node's state to the survivors, its workers exit 0, and the
  survivors' lowest rank publishes the next generation without the node (``kept_workers`` on every entry).
* ``hb/<node_id>/<local_rank>``: ``str(time.time())``, rewritten every few seconds by every worker (its heartbeat);
  ``hb/<node_id>/agent``: the same, by every agent; ``holds/<node_id>/<local_rank>``: the same, by a worker only
  while it holds the live state (once it is in a generation the holders formed).
* ``dead/<node_id>``: written by an agent whose workers failed (abrupt failure) before it stops the node's other
  workers: the survivors need not wait for the heartbeats to go stale; ``last_death`` names the node marked last
  (every worker watches that one key: a survivor computing without a collective stops at once).
* ``failure/<n>/...``: the survivors' agreement after a collective of generation ``n`` failed
  (see :mod:`lightning_emig.membership.failure`).

Writers: each agent leaves its node entry in the rendezvous round's own store; the round's rank-0 agent gathers
them, validates them, writes the generation's keys (``latest_generation`` last), and hands the number back to the
round's agents through the round's store. Workers publish too (a preemption drain, the survivors of a failure); the
number comes from one counter and ``latest_generation`` only ever grows (``compare_set``). A live round that changes nothing (every node kept its workers, every worker
keeps its rank: with torch's 1 s rendezvous polling a joining node can miss a short ``last_call_timeout``)
publishes nothing and keeps the current number, so workers never see a no-op generation.

Invariants: generation numbers only grow; every rendezvous round (live change or torchrun restart) is one
generation, except a live round that changes nothing; a published generation is never rewritten; its ranks
are a permutation of ``range(world_size)`` and its node ids distinct (checked before publishing and again
when read).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lightning_emig.launcher.control_store import ETCD_SCHEME, open_control_store, parse_host_port

if TYPE_CHECKING:
    from torch.distributed import Store

ENV_NODE_ID = "LIGHTNING_EMIG_NODE_ID"
ENV_CONTROL_STORE = "LIGHTNING_EMIG_CONTROL_STORE"
ENV_CONTROL_PREFIX = "LIGHTNING_EMIG_CONTROL_PREFIX"
ENV_GENERATION = "LIGHTNING_EMIG_GENERATION"
ENV_JOIN_LIVE = "LIGHTNING_EMIG_JOIN_LIVE"
ENV_MIN_NODES = "LIGHTNING_EMIG_MIN_NODES"
ENV_MAX_NODES = "LIGHTNING_EMIG_MAX_NODES"
ENV_AGENT_PID = "LIGHTNING_EMIG_AGENT_PID"
"""The process id of the agent that started a worker (the worker dies with it: :mod:`lightning_emig.launcher.orphans`)."""
ENV_LIVE_MEMBERSHIP = "LIGHTNING_EMIG_LIVE_MEMBERSHIP"
"""``"0"`` makes the agents take torchrun's restart path (for comparisons); anything else, the live path. The workers
inherit it: on the restart path they watch no peer's exit either (:mod:`~lightning_emig.membership.exit_watch`)."""


def live_membership_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether the job takes the live path (:data:`ENV_LIVE_MEMBERSHIP`)."""
    return (os.environ if env is None else env).get(ENV_LIVE_MEMBERSHIP, "1") != "0"


LATEST_GENERATION_KEY = "latest_generation"
ACTIVE_GENERATION_KEY = "active_generation"
WORKING_SET_KEY = "host_working_set"
"""The holders' rank 0's memory at a step boundary; a joiner warms its own from it (membership.admission)."""
LEFT_OUT_EXIT_CODE = 75
"""A joiner's exit code when the state holders went on without it (``EX_TEMPFAIL``): its agent brings a fresh worker
back in through a new round; no restart is spent (see :mod:`lightning_emig.membership.admission`)."""
NO_HOLDERS_EXIT_CODE = 76
"""A joiner's exit code when no process holding the live state is left to admit it: its agent restarts the node's
workers, without spending a restart, into a round every node enters the same way, and that generation resumes from
the newest complete checkpoint (see :mod:`lightning_emig.membership.admission`)."""
HEARTBEAT_TIMEOUT_KEY = "heartbeat_timeout_s"
"""The workers' ``elastic.heartbeat_timeout_s``, for the agents (they have no training configuration)."""
GENERATION_COUNTER_KEY = "generation_counter"
LAST_DEATH_KEY = "last_death"
"""JSON ``{"node_id", "time"}`` of the node an agent marked dead last (with its ``dead/`` key): the one key every
worker's death watch reads (:mod:`lightning_emig.membership.death_watch`), however many nodes the job has."""
TRAINING_DONE_KEY = "training_done"
"""Set by the holders' rank 0 once training reached its end: a joiner still waiting to be admitted then exits 0
(nothing is left to train; its agent goes to the exit barrier with the others instead of waiting for it)."""
FORMAT_VERSION = 1


class GenerationError(RuntimeError):
    """A generation is missing, malformed or inconsistent, or the environment is not a launcher's."""


def control_prefix(run_id: str) -> str:
    return f"lightning_emig/{run_id}/"


def world_key(generation: int) -> str:
    return f"gen/{generation}/world"


def node_key(generation: int, group_rank: int) -> str:
    return f"gen/{generation}/node/{group_rank}"


def leaving_key(node_id: str) -> str:
    """Control-store key an agent writes when its node got a preemption notice."""
    return f"leaving/{node_id}"


def make_node_id(host: str, agent_pid: int) -> str:
    """``LIGHTNING_EMIG_NODE_ID`` of an agent: ``"<local addr>_<agent pid>"``."""
    return f"{host}_{agent_pid}"


def node_host(node_id: str) -> str:
    """The host part of a :func:`make_node_id` id (where a process of that node can host a store)."""
    return node_id.rsplit("_", 1)[0]


def heartbeat_key(node_id: str, local_rank: int) -> str:
    return f"hb/{node_id}/{local_rank}"


def agent_heartbeat_key(node_id: str) -> str:
    """The heartbeat of a node's agent (its workers': :func:`heartbeat_key`)."""
    return f"hb/{node_id}/agent"


def holding_key(node_id: str, local_rank: int) -> str:
    """A worker's second heartbeat, written only while it holds the live state (it is in the generation the holders
    formed): a fresh worker on the same node and local rank, not admitted yet, does not write it."""
    return f"holds/{node_id}/{local_rank}"


def ready_key(node_id: str, local_rank: int) -> str:
    """Control-store key a worker started into a live generation sets once its start-up is done."""
    return f"ready/{node_id}/{local_rank}"


def dead_key(node_id: str) -> str:
    """Control-store key an agent writes when its node's workers failed."""
    return f"dead/{node_id}"


def read_dead_mark(client: Store, node_id: str) -> dict[str, Any] | None:
    """The ``dead/`` mark of ``node_id`` (``{"time", "generation"}`` as its agent wrote it), or None if unmarked."""
    key = dead_key(node_id)
    return json.loads(client.get(key) or b"{}") if client.check([key]) else None


def store_prefix(generation: int) -> str:
    """The ``PrefixStore`` prefix a generation's process group is formed under."""
    return f"gen{generation}"


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeEntry:
    """One agent (node) of a generation."""

    node_id: str
    """Stable id of the agent, ``LIGHTNING_EMIG_NODE_ID`` of its workers."""
    ranks: tuple[int, ...]
    """Global rank of the worker with each local rank."""
    kept_workers: bool
    """The node's workers carried over from the previous generation (live path) rather than started."""

    def encode(self) -> bytes:
        return json.dumps(
            {"node_id": self.node_id, "ranks": list(self.ranks), "kept_workers": self.kept_workers}
        ).encode()

    @staticmethod
    def decode(data: bytes) -> NodeEntry:
        raw = _loads(data, "node entry")
        return NodeEntry(
            node_id=str(raw["node_id"]), ranks=tuple(int(r) for r in raw["ranks"]),
            kept_workers=bool(raw["kept_workers"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationInfo:
    """One published generation: who is in the world, with which rank, and where to form the group."""

    generation: int
    world_size: int
    master_addr: str
    """Host of the generation's TCPStore; its global rank 0 hosts it."""
    master_port: int
    nodes: tuple[NodeEntry, ...]
    """In group-rank order of the rendezvous round."""
    rendezvous_seconds: float = 0.0
    """How long the rank-0 agent spent from entering the round to publishing it."""
    _rank_table: dict[tuple[str, int], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.generation < 0 or self.world_size < 1:
            raise GenerationError(f"bad generation {self.generation} / world size {self.world_size}")
        table: dict[tuple[str, int], int] = {}
        for node in self.nodes:
            for local_rank, rank in enumerate(node.ranks):
                if (node.node_id, local_rank) in table:
                    raise GenerationError(f"generation {self.generation}: node {node.node_id!r} appears twice")
                table[(node.node_id, local_rank)] = rank
        if sorted(table.values()) != list(range(self.world_size)):
            raise GenerationError(
                f"generation {self.generation}: ranks {sorted(table.values())} are not a permutation of "
                f"range({self.world_size})"
            )
        object.__setattr__(self, "_rank_table", table)

    @property
    def live(self) -> bool:
        """Some workers of this generation kept running from the previous one (they hold the state)."""
        return any(node.kept_workers for node in self.nodes)

    @property
    def store_prefix(self) -> str:
        return store_prefix(self.generation)

    @property
    def members(self) -> tuple[tuple[str, int], ...]:
        """``(node id, local rank)`` of each global rank, in rank order."""
        by_rank = {rank: member for member, rank in self._rank_table.items()}
        return tuple(by_rank[rank] for rank in range(self.world_size))

    def rank_of(self, node_id: str, local_rank: int) -> int:
        """Global rank of the worker ``(node_id, local_rank)`` in this generation."""
        try:
            return self._rank_table[(node_id, local_rank)]
        except KeyError:
            raise GenerationError(
                f"worker ({node_id!r}, local rank {local_rank}) is not part of generation {self.generation}; "
                f"members: {sorted(self._rank_table)}"
            ) from None

    def encode_world(self) -> bytes:
        return json.dumps({
            "format": FORMAT_VERSION, "world_size": self.world_size, "master_addr": self.master_addr,
            "master_port": self.master_port, "num_nodes": len(self.nodes),
            "rendezvous_seconds": self.rendezvous_seconds,
        }).encode()

    @staticmethod
    def decode(generation: int, world: bytes, nodes: Sequence[bytes]) -> GenerationInfo:
        raw = _loads(world, "world entry")
        if raw.get("format") != FORMAT_VERSION:
            raise GenerationError(f"generation {generation}: format {raw.get('format')!r}, expected {FORMAT_VERSION}")
        if int(raw["num_nodes"]) != len(nodes):
            raise GenerationError(f"generation {generation}: {len(nodes)} node entries, world says {raw['num_nodes']}")
        return GenerationInfo(
            generation=generation, world_size=int(raw["world_size"]), master_addr=str(raw["master_addr"]),
            master_port=int(raw["master_port"]), nodes=tuple(NodeEntry.decode(n) for n in nodes),
            rendezvous_seconds=float(raw["rendezvous_seconds"]),
        )


def _loads(data: bytes, what: str) -> dict:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GenerationError(f"malformed {what}: {data[:200]!r}") from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerIdentity:
    """Who this worker is across generations, from the environment the launcher gave it."""

    node_id: str
    local_rank: int
    generation: int
    """The generation the worker started in."""
    join_live: bool
    """Started into a generation where other workers kept running: receive state, do not initialise it."""
    control_address: str
    """``host:port`` (c10d) or ``etcd://host:port`` (etcd-v2): see :mod:`lightning_emig.launcher.control_store`."""
    control_prefix: str


def current_identity_from_env(env: Mapping[str, str] | None = None) -> WorkerIdentity:
    env = os.environ if env is None else env
    missing = [k for k in (ENV_NODE_ID, ENV_CONTROL_STORE, ENV_CONTROL_PREFIX, ENV_GENERATION, "LOCAL_RANK")
               if k not in env]
    if missing:
        raise GenerationError(
            f"{', '.join(missing)} not set: this process was not started by lightning-emig-run "
            "(plain torchrun has no live membership changes)"
        )
    parse_host_port(env[ENV_CONTROL_STORE].removeprefix(ETCD_SCHEME))  # a malformed address fails here, by name
    return WorkerIdentity(
        node_id=env[ENV_NODE_ID], local_rank=int(env["LOCAL_RANK"]), generation=int(env[ENV_GENERATION]),
        join_live=env.get(ENV_JOIN_LIVE, "0") == "1", control_address=env[ENV_CONTROL_STORE],
        control_prefix=env[ENV_CONTROL_PREFIX],
    )


def worker_env(
    *, node_id: str, control_address: str, prefix: str, generation: int, join_live: bool, min_nodes: int = 1,
    max_nodes: int | None = None,
) -> dict[str, str]:
    """The launcher's part of a worker's environment (the inverse of :func:`current_identity_from_env`)."""
    return {
        ENV_NODE_ID: node_id, ENV_CONTROL_STORE: control_address, ENV_CONTROL_PREFIX: prefix,
        ENV_GENERATION: str(generation), ENV_JOIN_LIVE: "1" if join_live else "0", ENV_MIN_NODES: str(min_nodes),
        ENV_MAX_NODES: str(max_nodes if max_nodes is not None else min_nodes),
    }


def min_nodes_from_env(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    return int(env.get(ENV_MIN_NODES, "1"))


def allowed_worlds_from_env(env: Mapping[str, str] | None = None) -> list[int]:
    """The world sizes this job may take: ``--nnodes`` MIN to MAX nodes of ``LOCAL_WORLD_SIZE`` processes each."""
    env = os.environ if env is None else env
    per_node = int(env.get("LOCAL_WORLD_SIZE", "1"))
    low = min_nodes_from_env(env)
    high = int(env.get(ENV_MAX_NODES, str(low)))
    return [nodes * per_node for nodes in range(low, high + 1)]


def control_client_from_env(env: Mapping[str, str] | None = None, *, timeout_s: float = 60.0) -> Store:
    """A client of the control store, already under the run's prefix."""
    identity = current_identity_from_env(env)
    return open_control_store(identity.control_address, identity.control_prefix, timeout_s=timeout_s)


def latest_generation(client: Store) -> int:
    """The newest complete generation, or -1 when none is published yet. Never blocks."""
    if not client.check([LATEST_GENERATION_KEY]):
        return -1
    return int(client.get(LATEST_GENERATION_KEY))


def active_generation(client: Store) -> int:
    """The generation the workers holding the state committed to last (``active_generation``), or -1."""
    return int(client.get(ACTIVE_GENERATION_KEY)) if client.check([ACTIVE_GENERATION_KEY]) else -1


def generation_going_on_without(client: Store, node_id: str) -> int | None:
    """A generation the job goes on in without ``node_id`` (whose workers failed), or None while the survivors may
    still be waiting for it.

    The newest published generation when it leaves the node out; else the one the state holders committed to last
    when that leaves it out. The second case: the holders recovered into a generation of their own (committed) while
    this node's agent, busy in an overlapping rendezvous round, published a newer one that still lists its dead
    workers as kept; nobody forms that one, and no agent publishes another unless this node comes back in."""
    for generation in (latest_generation(client), active_generation(client)):
        if generation >= 0 and node_id not in {n.node_id for n in read_generation(client, generation).nodes}:
            return generation
    return None


def wait_for_generation(client: Store, newer_than: int, *, timeout_s: float, poll_s: float = 0.2) -> int:
    """Poll until a generation newer than ``newer_than`` is published; return its number."""
    deadline = time.monotonic() + timeout_s
    while (latest := latest_generation(client)) <= newer_than:
        if time.monotonic() > deadline:
            raise GenerationError(f"no generation newer than {newer_than} within {timeout_s:.0f}s")
        time.sleep(poll_s)
    return latest


def read_generation(client: Store, generation: int) -> GenerationInfo:
    """Read a published generation (``latest_generation(client) >= generation`` must hold)."""
    if latest_generation(client) < generation:
        raise GenerationError(f"generation {generation} is not published yet")
    world = client.get(world_key(generation))
    num_nodes = int(_loads(world, "world entry")["num_nodes"])
    nodes = [client.get(node_key(generation, r)) for r in range(num_nodes)]
    return GenerationInfo.decode(generation, world, nodes)


def changes_nothing(previous: GenerationInfo | None, nodes: Sequence[NodeEntry]) -> bool:
    """A round in which every node kept its workers and every worker keeps its rank (a joiner missed it)."""
    if previous is None or not all(node.kept_workers for node in nodes):
        return False
    return {n.node_id: n.ranks for n in nodes} == {n.node_id: n.ranks for n in previous.nodes}


def publish_generation(
    store: Store, *, nodes: Sequence[NodeEntry], world_size: int, master_addr: str, master_port: int,
    rendezvous_seconds: float, only_after: int | None = None,
) -> int | None:
    """Publish a round (the round's rank-0 agent) or the survivors of a departure (their new rank 0) as a generation;
    its number.

    The entries are validated before anything is written, and ``latest_generation`` is written last. A round
    that :func:`changes_nothing` is no new generation: the current number is returned, nothing is written. With
    ``only_after``, the generation is published only if ``latest_generation`` is still ``only_after`` (atomically);
    otherwise None is returned and the number it took is never used.
    """
    latest = latest_generation(store)
    if changes_nothing(read_generation(store, latest) if latest >= 0 else None, nodes):
        return latest
    draft = GenerationInfo(  # validates the round before a number is taken or a key written
        generation=latest + 1, world_size=world_size, master_addr=master_addr, master_port=master_port,
        nodes=tuple(nodes), rendezvous_seconds=rendezvous_seconds,
    )
    generation = store.add(GENERATION_COUNTER_KEY, 1) - 1
    info = replace(draft, generation=generation)
    for group_rank, node in enumerate(info.nodes):
        store.set(node_key(generation, group_rank), node.encode())
    store.set(world_key(generation), info.encode_world())
    if only_after is not None:
        swapped = store.compare_set(LATEST_GENERATION_KEY, str(only_after), str(generation)).decode()
        return generation if swapped == str(generation) else None
    _raise_latest(store, generation)
    return generation


def _raise_latest(store: Store, generation: int) -> None:
    """``latest_generation = max(latest_generation, generation)``: workers (a preemption drain, the survivors of a
    failure) and the agents' rounds may publish at the same time."""
    raise_key(store, LATEST_GENERATION_KEY, generation)


def raise_key(store: Store, key: str, value: int) -> None:
    """``store[key] = max(store[key], value)``, atomically (``compare_set`` until it holds)."""
    current = store.get(key).decode() if store.check([key]) else ""
    while current == "" or int(current) < value:
        seen = store.compare_set(key, current, str(value)).decode()
        if seen == str(value):
            return
        current = seen
