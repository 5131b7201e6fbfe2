"""Abrupt failure: a peer died without notice; the survivors carry on in this process, without a restart.

A collective of generation ``n`` fails on every survivor (gloo raises when the dead peer's sockets close, or at the
process-group timeout), or, sooner, the death watch raises as the dead worker's agent marks its node
(:mod:`~lightning_emig.membership.death_watch`). ``Trainer.fit`` re-raises; ``train.py`` hands the error to
:func:`recover_from_failure`, which every survivor runs:

1. **detect**: leave the broken group, report in (``failure/<n>/report/<rank>``: node, step of the last consistent
   state), and wait until every rank of generation ``n`` has either reported or is dead — its agent marked the node
   (``dead/<node_id>``) or its heartbeat (:mod:`~lightning_emig.launcher.heartbeat`) has not changed for
   ``heartbeat_timeout_s`` as this survivor's clock counts. A node with one dead worker is dead as a whole (its
   agent stops the others).
2. **agree**: the first survivor to see everyone accounted for writes the decision (``compare_set``, so there is
   exactly one): the surviving ranks. The lowest survivor publishes generation ``n+1`` (survivors only, all kept)
   and every survivor forms its process group.
3. **rebuild**: if every survivor's state is the same step's (the last optimizer-step boundary, captured by
   :class:`~lightning_emig.strategy.rendezvous.RendezvousCallback`, with the optimizer's own step count agreeing),
   :func:`~lightning_emig.migration.engine.migrate` lays it out for the new world, taking what the dead held from
   its replicas. The result is a :class:`LiveHandoff` (``prior.kind == "failure"``, no step lost).
4. **rollback** otherwise — a shard with no surviving copy (``StateLostError``), survivors at different steps, or a
   survivor without a consistent state (it failed inside a migration) — returns a :class:`Rollback`: the caller
   restores the newest complete checkpoint resharded for the new world (step 0 if there is none) and says loudly
   how many steps were lost and why. Training never continues on partially restored state.

**A change that fails before its state moves.** A member of the generation the holders switch to can die before
any state has moved: as its process group forms, or while the next fit sets up (the mesh's sub-groups, the join's
handshake). The holders still hold the live state, intact, in their handoff. They recover over *the holders* (keys
``failure/<n>/holders/...``, ranks = the handoff's old ranks), with the same steps: a dead holder's shards are rebuilt
from replicas, or they roll back; if no holder died (a joiner did), they form a generation of their own at their old
ranks and go on with the handoff unchanged — no change happened, no event is recorded. The joiners of the failed
generation hold nothing: they leave as left out and their agents bring them back in through a new round.

**A survivor that dies during the recovery** — before the survivors' group forms, or during the rebuild (which
keeps the old state until it is done) — makes the others recover again, from the same state, among the same members
(keys ``.../again<k>``): the one that died is found dead this time. At most :data:`RECOVERY_ATTEMPTS` in a row.

A survivor excluded by the decision (it reported too late) raises :class:`ExcludedFromRecovery` and exits non-zero;
its agent then treats its node as failed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_emig.launcher.generation import (
    GenerationError,
    GenerationInfo,
    NodeEntry,
    control_client_from_env,
    dead_key,
    node_host,
    read_dead_mark,
    read_generation,
)
from lightning_emig.launcher.heartbeat import HeartbeatWatch, last_beat
from lightning_emig.membership.exit_watch import gone_how, member_exited
from lightning_emig.membership.group import enter_generation
from lightning_emig.membership.handoff import LiveHandoff
from lightning_emig.membership.settings import FailureSettings
from lightning_emig.migration.change import (
    HeldShards,
    adopted_storages,
    allocate_shards,
    device_of,
    execute_change,
    in_place_order,
    whole_state_specs,
)
from lightning_emig.migration.engine import MigrationFailedError
from lightning_emig.migration.identity import IdentityMap, ProcessInfo
from lightning_emig.migration.planner import StateLostError
from lightning_emig.migration.state import release_storage

if TYPE_CHECKING:
    from datetime import timedelta

    from lightning_emig.layout import HybridLayout
    from lightning_emig.membership.settings import ElasticWorker

log = logging.getLogger(__name__)

#: Substrings of the errors gloo and NCCL raise when a peer is gone or a collective timed out.
PEER_FAILURE_MARKERS = ("gloo", "Connection reset", "Connection closed", "Broken pipe", "timed out", "Timed out",
                        "NCCL", "ProcessGroup")


class ExcludedFromRecovery(RuntimeError):
    """This process was not among the survivors the others agreed on (it reported too late)."""


@dataclass(slots=True, kw_only=True)
class Rollback:
    """Survivors must restore a checkpoint: what is known about the failure, for the event and the log."""

    generation: int
    """The survivors' generation (its process group is already formed)."""
    from_step: int
    """The furthest step any survivor had reached."""
    reason: str
    dead_nodes: list[str]
    old_layout: HybridLayout
    old_world: int
    last_step_wall: float
    seconds: dict[str, float] = field(default_factory=dict)
    checkpoint: str | None = None
    """Filled in by the caller: the checkpoint to restore (None = start over from step 0)."""


def is_peer_failure(exc: BaseException) -> bool:
    """Did a collective fail because a peer is gone (as opposed to a bug in this process)? The error or one it was
    raised *from* (torch's pipeline schedule wraps what a stage's forward or backward raised in a plain
    ``RuntimeError``, ``[Stage k] failed to run forward``, ``from`` it). Not an error merely raised while another was
    handled (``__context__``): a recovery runs inside the handler of the failure it recovers from, and its own errors
    (a shard no survivor holds) are no peer's death."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, dist.DistError) or (
                isinstance(cause, RuntimeError) and any(marker in str(cause) for marker in PEER_FAILURE_MARKERS)):
            return True
        cause = cause.__cause__
    return False


RECOVERY_ATTEMPTS = 3
"""Recoveries in a row a survivor runs when survivors keep dying during them (each finds more of them dead)."""


def report_key(scope: str, rank: int) -> str:
    return f"{scope}/report/{rank}"


def decision_key(scope: str) -> str:
    return f"{scope}/decision"


def new_generation_key(scope: str) -> str:
    return f"{scope}/new_generation"


@dataclass(frozen=True, slots=True)
class _Accounted:
    """Whose state one recovery accounts for: its members, this process's rank among them, their layout, and this
    process's consistent state."""

    scope: str
    """Prefix of the recovery's keys in the control store."""
    members: GenerationInfo
    rank: int
    layout: HybridLayout
    stash: LiveHandoff | None
    exits_since: int
    """The oldest generation whose watchers' exit marks count for these members
    (:func:`~lightning_emig.membership.exit_watch.member_exited`)."""

    @property
    def world(self) -> int:
        return self.members.world_size


def _generation_members(strategy: ElasticWorker, client: Any) -> _Accounted:
    """A collective of the strategy's generation failed: account for its members (the last boundary's state)."""
    return _Accounted(scope=f"failure/{strategy.generation}", members=read_generation(client, strategy.generation),
                      rank=strategy.global_rank, layout=strategy.layout, stash=strategy.last_boundary,
                      exits_since=strategy.generation)


def _holders_of(held: LiveHandoff) -> _Accounted:
    """A change failed before its state moved: account for the holders of ``held`` (at their old ranks), whatever
    generation they were forming; the joiners of that generation hold nothing and leave."""
    if len(held.holders) != held.old_world:
        raise RuntimeError(f"the change to generation {held.generation} failed before its state moved, but this "
                           f"handoff does not say who holds its {held.old_world} rank(s): cannot recover live")
    by_node: dict[str, dict[int, int]] = {}
    for old_rank, (node_id, local_rank) in enumerate(held.holders):
        by_node.setdefault(node_id, {})[local_rank] = old_rank
    nodes = tuple(NodeEntry(node_id=node, ranks=tuple(ranks[lr] for lr in sorted(ranks)), kept_workers=True)
                  for node, ranks in by_node.items())
    members = GenerationInfo(generation=held.generation, world_size=held.old_world, master_addr="", master_port=0,
                             nodes=nodes)
    # Holders are the processes that held the state before: the endpoints published at their places are theirs, so
    # a mark naming one is about them whichever generation its watcher followed (theirs, or the one being formed).
    return _Accounted(scope=f"failure/{held.generation}/holders", members=members, rank=held.old_rank,
                      layout=held.old_layout, stash=held, exits_since=-1)


def recover_from_failure(
    strategy: ElasticWorker, error: BaseException, node_id: str, local_rank: int, *, held: LiveHandoff | None = None
) -> LiveHandoff | Rollback:
    """Every survivor: steps 1-4 of the module docstring. Returns the handoff into the survivors' generation, or
    what a rollback needs; the survivors' process group is formed either way.

    ``held``: the change to ``held.generation`` failed before any state moved (its group could not form, or a member
    died while the next fit set up): the holders of ``held`` recover among themselves. If none of them died they go
    on with ``held`` unchanged in a generation of their own, at their old ranks (no change happened: no event)."""
    backend = _backend(strategy)
    client = control_client_from_env()
    ours = _holders_of(held) if held is not None else _generation_members(strategy, client)  # before the release
    first_scope = ours.scope
    for attempt in range(1, RECOVERY_ATTEMPTS + 1):
        try:
            return _recover_once(strategy, error, node_id, local_rank, ours, held, backend, client)
        except _SurvivorLost as lost:
            # The state has not moved (the rebuild keeps the old state until it is done): recover again, among the
            # same members, from the same state; the survivor that died is found dead this time.
            log.error("a survivor died while the survivors of generation %d recovered (%s): recovering again "
                      "(attempt %d)", ours.members.generation, lost, attempt + 1)
            error = lost
            ours = dataclasses.replace(ours, scope=f"{first_scope}/again{attempt}")
    raise RuntimeError(f"the survivors of generation {ours.members.generation} lost a member in each of "
                       f"{RECOVERY_ATTEMPTS} recoveries in a row; giving up (torchrun's restart path)") from error


class _SurvivorLost(RuntimeError):
    """A survivor died during the recovery, before any state moved: the survivors recover again."""


def _recover_once(
    strategy: ElasticWorker, error: BaseException, node_id: str, local_rank: int, ours: _Accounted,
    held: LiveHandoff | None, backend: str, client: Any,
) -> LiveHandoff | Rollback:
    settings: FailureSettings = strategy.failure_settings
    started_wall = time.time()
    # Gloo has no abort: a group's sockets close only when nothing references it any more, and survivors blocked on
    # *us* (not on the dead) learn of the failure only then, or at their collective timeout. So drop what holds the
    # group (the traceback's frames, the mesh, the optimizers' DTensors; the caller dropped the model) first.
    error.__traceback__ = None
    strategy.release_process_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
    generation, rank, old_world, old_layout, stash = (ours.members.generation, ours.rank, ours.world, ours.layout,
                                                      ours.stash)
    log.error("PEER FAILURE in generation %d on rank %d: %s", generation, rank, str(error).splitlines()[0][:300])
    step, consistent = _consistent_step(stash)
    client.set(report_key(ours.scope, rank), json.dumps(
        {"node_id": node_id, "local_rank": local_rank, "step": step, "consistent": consistent,
         "reached": strategy.reached_step}))
    # A survivor blocked on another survivor may only fail at its own collective timeout: wait at least that long.
    patience = max(settings.failure_timeout_s,
                   strategy.timeout.total_seconds() + settings.heartbeat_timeout_s + 10.0)
    decision = _decide_survivors(client, ours.members, settings, timeout_s=patience, scope=ours.scope,
                                 exits_since=ours.exits_since)
    detected = _detection_phases(started_wall, decision, stash.last_step_wall if stash is not None else None)
    if not decision["dead_nodes"] and held is None:  # everyone reported: no peer died, not a failure we can mend
        raise error
    if decision["dead_nodes"] and rank == next(iter(decision["survivors"]), None):
        log.error("found dead in generation %d: %s", generation,
                  "; ".join(f"node {node} ({how})" for node, how in decision.get("found_by", {}).items()))

    started = time.perf_counter()
    survivors: list[int] = decision["survivors"]
    if rank not in survivors:
        raise ExcludedFromRecovery(
            f"rank {rank} of generation {generation} was left out by the survivors ({survivors}); exiting"
        ) from error
    reports = {r: json.loads(client.get(report_key(ours.scope, r))) for r in survivors}
    new_rank_of = {old: new for new, old in enumerate(survivors)}
    publisher_host = node_host(node_id) if rank == survivors[0] else None  # new rank 0 hosts the new store
    new_generation = _publish_or_wait(client, ours, new_rank_of, publisher_host, settings, strategy.timeout)
    try:
        enter_generation(read_generation(client, new_generation), node_id, local_rank, backend, strategy.timeout)
    except GenerationError as exc:  # a survivor died before the survivors' group formed
        raise _SurvivorLost(str(exc)) from exc
    agree = time.perf_counter() - started
    seconds = {**detected, "agree": agree}
    if held is not None and not decision["dead_nodes"]:
        return _go_on_unchanged(held, new_generation, seconds)

    new_world, my_new_rank = len(survivors), new_rank_of[rank]
    # Decided, and checked against the model and the global batch, before anything moves.
    new_layout, _ = strategy.elastic_settings.layout_for_world(new_world, current=old_layout)
    steps = {reports[r]["step"] for r in survivors}
    # A survivor without a consistent state (it failed inside a step or a migration) still knows how far it got.
    furthest = max(max(steps), *(reports[r].get("reached", -1) for r in survivors))
    last_wall = stash.last_step_wall if stash is not None else time.time()
    rollback = Rollback(generation=new_generation, from_step=furthest, reason="", dead_nodes=decision["dead_nodes"],
                        old_layout=old_layout, old_world=old_world, last_step_wall=last_wall, seconds=seconds)
    if not all(reports[r]["consistent"] for r in survivors) or len(steps) != 1:
        rollback.reason = (f"survivors hold no common consistent state (steps {sorted(steps)}; a failure inside a "
                           "step or a migration)")
        return _announce_rollback(rollback, my_new_rank)
    assert stash is not None and stash.state is not None
    holders = tuple((reports[r]["node_id"], reports[r]["local_rank"]) for r in survivors)
    try:
        handoff = _rebuild_from_replicas(strategy, stash, old_layout, old_world, new_layout, survivors, rank, holders)
    except Exception as exc:
        if is_peer_failure(exc):  # another survivor died during the rebuild (which released nothing)
            raise _SurvivorLost(str(exc).splitlines()[0]) from exc
        # migrate() makes every process learn of a failure anywhere, so all survivors get here together.
        stash.state = None
        lost = isinstance(exc, (StateLostError, MigrationFailedError))
        rollback.reason = (f"state held only by the dead node(s) has no surviving copy ({str(exc).splitlines()[0]})"
                           if lost else f"rebuilding from replicas failed: {exc!r}")
        return _announce_rollback(rollback, my_new_rank)
    handoff.seconds = {**stash.seconds, **seconds, **handoff.seconds}
    handoff.generation = new_generation
    assert handoff.prior is not None
    handoff.prior = dataclasses.replace(handoff.prior, nodes=tuple(decision["dead_nodes"]))
    if my_new_rank == 0:
        log.error(
            "ABRUPT FAILURE of node(s) %s at step %d: world %d -> %d, %s -> %s; every lost shard rebuilt from "
            "replicas (%.1f MB moved), no step lost; generation %d", decision["dead_nodes"], furthest, old_world,
            new_world, old_layout.describe(), new_layout.describe(), handoff.prior.bytes_moved / 1e6,
            new_generation,
        )
    return handoff


def _go_on_unchanged(held: LiveHandoff, new_generation: int, seconds: dict[str, float]) -> LiveHandoff:
    """Every holder is alive: the change that failed (a joiner died) did not happen; ``held`` goes on as it was, in
    the holders' own generation (its next fit is a join with no change, which records no event)."""
    if held.old_rank == 0:
        log.error("generation %d could not be formed or set up (a joiner died?): the %d holder(s) of the live state "
                  "go on in a generation of their own, %d", held.generation, held.old_world, new_generation)
    held.generation = new_generation
    held.seconds = {**held.seconds, **seconds}
    return held


def _consistent_step(stash: LiveHandoff | None) -> tuple[int, bool]:
    """(step of the state captured at the last boundary, whether the optimizer's step count agrees with it)."""
    if stash is None or stash.state is None:
        return -1, False
    step = int(stash.metadata["global_step"])
    counts = [t.local for key, t in stash.state.items() if key.startswith("optim/") and key.endswith("/step")]
    applied = int(counts[0].item()) if counts else 0
    return step, applied == step


def _decide_survivors(
    client: Any, info: GenerationInfo, settings: FailureSettings, timeout_s: float | None = None, *,
    scope: str | None = None, exits_since: int | None = None,
) -> dict[str, Any]:
    """Wait until every rank of ``info`` reported or is dead; the first to see it writes the one decision.

    A node its agent marked dead is dead whatever its workers reported (the agent is stopping them). A worker that
    has not reported is dead once its process was seen exiting (by a watcher of generation ``exits_since``, default
    ``info``'s, or later) or its heartbeat stopped.
    """
    exits_since = info.generation if exits_since is None else exits_since
    scope = f"failure/{info.generation}" if scope is None else scope
    key = decision_key(scope)
    timeout_s = settings.failure_timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    members = [(node.node_id, local_rank, rank) for node in info.nodes for local_rank, rank in enumerate(node.ranks)]
    heartbeats = HeartbeatWatch(client, settings.heartbeat_timeout_s)
    while not client.check([key]):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"could not tell the survivors of generation {info.generation} from the dead within "
                f"{timeout_s:.0f}s (elastic.failure_timeout_s, at least the collective timeout); giving up"
            )
        reported = {rank for _, _, rank in members if client.check([report_key(scope, rank)])}
        found_by = {node: "its agent's mark" for node, _, _ in members if client.check([dead_key(node)])}
        for node, local_rank, rank in members:
            if rank in reported or node in found_by:
                continue
            # A process seen exiting is dead before its heartbeat could go stale.
            if (exited := member_exited(client, node, local_rank, exits_since)) is not None:
                found_by[node] = f"worker {local_rank}'s process {gone_how(exited)}"
            elif heartbeats.stale(node, local_rank):
                found_by[node] = f"worker {local_rank}'s heartbeat stopped"
        dead_nodes = set(found_by)
        accounted = all(rank in reported or node in dead_nodes for node, _, rank in members)
        if accounted:
            survivors = sorted(rank for node, _, rank in members if rank in reported and node not in dead_nodes)
            decided = {"survivors": survivors, "dead_nodes": sorted(dead_nodes), "found_by": found_by}
            seen = [t for node, local_rank, _ in members if node in dead_nodes
                    if (t := _last_seen_alive(client, node, local_rank, exits_since)) is not None]
            if seen:
                decided["last_seen_alive"] = min(seen)
            proposal = json.dumps(decided)
            client.compare_set(key, "", proposal)  # the first proposal wins; later ones change nothing
            break
        time.sleep(0.1)
    return json.loads(client.get(key))


def _last_seen_alive(client: Any, node_id: str, local_rank: int, generation: int) -> float | None:
    """When a dead worker was last known alive (``time.time()`` on its own host): its agent's ``dead/`` mark, else
    the mark of its process's exit (:mod:`~lightning_emig.membership.exit_watch`), else its last heartbeat; None when
    none says. For the report's phases only (see :func:`_detection_phases`)."""
    marked = read_dead_mark(client, node_id) or member_exited(client, node_id, local_rank, generation)
    if marked is not None and "time" in marked:
        return float(marked.get("alive_at", marked["time"]))
    return last_beat(client, node_id, local_rank)


def _detection_phases(started_wall: float, decision: dict[str, Any], last_step_wall: float | None
                      ) -> dict[str, float]:
    """The failure's first phases. The failure was known from when the first dead worker was last seen alive (its
    agent's mark, else its last heartbeat) or when this survivor began to recover (its collective failed, or its death
    watch saw the mark: :mod:`~lightning_emig.membership.death_watch`), whichever came first. ``in_flight``: from the
    last step boundary to then, the step in flight, lost; ``detect``: from then to the decision — a collective's error
    (at once, or at ``trainer.pg_timeout_s``) or the heartbeat timeout, and the survivors' agreement. Host clocks are
    compared here, for a report only: nothing is decided by it."""
    now, last_seen = time.time(), decision.get("last_seen_alive")
    known = started_wall if last_seen is None else min(started_wall, float(last_seen))
    phases = {"detect": now - known}
    if last_step_wall is not None:
        phases = {"in_flight": max(0.0, known - last_step_wall), **phases}
    return phases


def _publish_or_wait(
    client: Any, ours: _Accounted, new_rank_of: dict[int, int], host: str | None, settings: FailureSettings,
    timeout: timedelta,
) -> int:
    """The lowest survivor (given its ``host``) publishes the survivors' generation, its store on that host; the
    others (``host=None``) read its number."""
    from lightning_emig.membership.preempt import publish_survivors

    key = new_generation_key(ours.scope)
    if host is not None:
        published = publish_survivors(client, ours.members, new_rank_of, host, timeout)
        assert published is not None  # published unconditionally
        client.set(key, str(published))
    deadline = time.monotonic() + settings.failure_timeout_s
    while not client.check([key]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the survivors' generation after generation {ours.members.generation} was never "
                               "published")
        time.sleep(0.05)
    return int(client.get(key))


def _backend(strategy: ElasticWorker) -> str:
    if dist.is_initialized():
        return str(dist.get_backend())
    return strategy.process_group_backend or ("nccl" if strategy.root_device.type == "cuda" else "gloo")


def _rebuild_from_replicas(
    strategy: ElasticWorker, stash: LiveHandoff, old_layout: HybridLayout, old_world: int,
    new_layout: HybridLayout, survivors: list[int], rank: int, holders: tuple[tuple[str, int], ...],
) -> LiveHandoff:
    """Lay the survivors' state out for the new world; what the dead held comes from its replicas."""
    started = time.perf_counter()
    assert stash.state is not None
    new_rank = survivors.index(rank)
    specs = whole_state_specs({k: t.spec for k, t in stash.state.items()}, old_layout, new_layout)
    identity = IdentityMap(
        tuple(ProcessInfo(pid=new, node=holders[new][0], old_rank=old, new_rank=new)
              for new, old in enumerate(survivors)),
        old_world, len(survivors),
    )
    new_layout = in_place_order(specs, old_layout, new_layout, identity)  # the next fit keeps it (setup_environment)
    # The survivor's own shards that the new layout keeps where they are (a replica of the dead's, under HSDP) are
    # adopted, not copied.
    new_state = allocate_shards(specs, new_layout, new_rank, device_of(stash.state),
                                held=HeldShards(stash.state, old_layout, rank))
    allocate = time.perf_counter() - started
    record = execute_change(
        kind="failure", step=int(stash.metadata["global_step"]), old_state=stash.state, new_state=new_state,
        old_layout=old_layout, new_layout=new_layout, identity=identity, pid=new_rank, release_old=False,
        transfer=strategy.elastic_settings.transfer,
    )
    # Rebuilt on every survivor: the stash (the dropped model's storage) is read no more. Kept until here so a
    # rebuild that fails leaves it intact for another try.
    release_storage(stash.state, keep=strategy.live_storages() | adopted_storages(new_state))
    stash.state = None
    return LiveHandoff(
        generation=-1, holders=holders, old_layout=new_layout, old_world=len(survivors),
        old_rank=new_rank, state=new_state, metadata=stash.metadata, last_step_wall=stash.last_step_wall,
        seconds={"allocate": allocate}, prior=record,
    )


def _announce_rollback(rollback: Rollback, new_rank: int) -> Rollback:
    if new_rank == 0:
        log.error(
            "ABRUPT FAILURE of node(s) %s at step %d: %s. ROLLING BACK to the last checkpoint; the steps since it are "
            "lost and will be recomputed", rollback.dead_nodes, rollback.from_step, rollback.reason,
        )
    return rollback
