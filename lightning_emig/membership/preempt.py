"""Announced preemption: a node leaves with notice and its workers hand their state to the survivors first.

The drain runs at an optimizer-step boundary, on the *old* process group (still whole: it is old ∪ new), by every
old rank, once :class:`~lightning_emig.strategy.rendezvous.RendezvousCallback` agreed that a node announced its
departure (``leaving/<node_id>`` in the control store, written by its agent on SIGTERM):

1. global rank 0 broadcasts the current generation and the leaving nodes; every rank derives the survivors
   (ranked in old-rank order) and the new layout (``ElasticSettings.layout_for_world``, checked before anything moves);
2. the lowest surviving old rank (new rank 0) binds the new generation's store on its host, publishes the next
   generation (survivors only, all ``kept_workers``) and broadcasts its number — unless the agents published a round
   meanwhile (a node joined) that holds the survivors, no leaver, and only joiners that are ready: the survivors go
   into that one instead;
3. survivors allocate plain local buffers for their new shards (from the geometry, no mesh needed) and
   :func:`~lightning_emig.migration.engine.migrate` moves every parameter and optimizer-state shard; leavers only
   send (``new_state=None``);
4. every rank stops the fit: a survivor carries a :class:`LiveHandoff` whose state is already laid out for the
   new world (the next ``fit(ckpt_path="live")`` only copies locally) and records one ``preempt`` event; a
   leaver's handoff says ``leaving`` and its process exits 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_emig.consistency import settle_handoff_proof
from lightning_emig.launcher.generation import (
    ENV_NODE_ID,
    NodeEntry,
    latest_generation,
    leaving_key,
    node_host,
    read_generation,
)
from lightning_emig.membership.admission import commit_generation, joiners_ready, publish_holders_generation
from lightning_emig.membership.handoff import LiveHandoff
from lightning_emig.migration.change import (
    HeldShards,
    adopted_storages,
    allocate_shards,
    device_of,
    execute_change,
    in_place_order,
    whole_state_specs,
)
from lightning_emig.migration.identity import IdentityMap, ProcessInfo
from lightning_emig.migration.state import release_storage

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_emig.membership.settings import ElasticWorker


log = logging.getLogger(__name__)


def leaving_nodes(client: dist.Store, generation: int) -> list[str]:
    """Rank 0: the nodes of ``generation`` that announced their departure."""
    info = read_generation(client, generation)
    return [node.node_id for node in info.nodes if client.check([leaving_key(node.node_id)])]


def publish_survivors(
    client: Any, info: Any, new_rank_of: dict[int, int], host: str, timeout: timedelta, *, only_after: int | None = None
) -> int | None:
    """Publish the generation of the processes of ``info`` that have a new rank (all kept), with its store hosted by
    this process (their new rank 0) on ``host`` (see :func:`~lightning_emig.membership.admission.publish_holders_generation`).
    """
    nodes = [
        NodeEntry(node_id=n.node_id, ranks=tuple(new_rank_of[r] for r in n.ranks), kept_workers=True)
        for n in info.nodes if all(r in new_rank_of for r in n.ranks)
    ]
    return publish_holders_generation(client, nodes, host, timeout, only_after=only_after)


def _joined_meanwhile(client: Any, info: Any, leaving: list[str]) -> tuple[int | None, int]:
    """A generation the agents published after ``info`` (nodes joined) that holds every surviving node and none of
    the leavers, and whose joiners are ready — the survivors go straight into it — or None; and the latest
    generation seen. (One that still holds a leaver is joined first and the leaver drained there, when its joiners
    are ready: see :class:`~lightning_emig.strategy.rendezvous.RendezvousCallback`. Joiners of a generation the
    survivors do not go into are left out and rejoin: see :mod:`~lightning_emig.membership.admission`.)"""
    latest = latest_generation(client)
    if latest <= info.generation:
        return None, latest
    newer = read_generation(client, latest)
    nodes = {node.node_id for node in newer.nodes}
    staying = {node.node_id for node in info.nodes} - set(leaving)
    fits = staying <= nodes and not nodes & set(leaving) and joiners_ready(client, newer, info)
    return (latest if fits else None), latest


def _publish_survivors_or_join(
    client: Any, info: Any, new_rank_of: dict[int, int], host: str, leaving: list[str], seen_latest: int,
    timeout: timedelta,
) -> int:
    """New rank 0: the generation the survivors go into. Theirs is published only if no round was published since
    ``seen_latest``: a round the agents publish meanwhile (a node joining) starts its joiners' workers into it, and
    the survivors go into it if they can; else theirs comes after it (its joiners are left out and rejoin)."""
    published = publish_survivors(client, info, new_rank_of, host, timeout, only_after=seen_latest)
    if published is not None:
        return published
    joined, latest = _joined_meanwhile(client, info, leaving)
    if joined is not None:
        log.warning("generation %d was published during the drain: the survivors go into it", joined)
        commit_generation(client, joined)
        return joined
    log.warning("generation %d, published during the drain, holds a leaving node or joiners not ready yet; the "
                "survivors' generation comes after it (its joiners rejoin)", latest)
    published = publish_survivors(client, info, new_rank_of, host, timeout)
    assert published is not None
    return published


class NobodyToHandOffToError(RuntimeError):
    """Every node of the generation got a notice (raised on every rank alike): the state can only go to a checkpoint
    (see ``RendezvousCallback``)."""


def drain_leavers(trainer: pl.Trainer, client: Any, handoff: LiveHandoff) -> LiveHandoff:
    """Run the drain (see the module docstring) on every old rank; returns this process's handoff.

    ``client`` is the control-store client on global rank 0 (None elsewhere); ``handoff`` was captured at this
    step boundary (old layout, old state, resume metadata). Survivors open their own client to publish.
    """
    from lightning_emig.launcher.generation import control_client_from_env

    strategy: ElasticWorker = trainer.strategy  # type: ignore[assignment]
    rank, old_world, old_layout = strategy.global_rank, strategy.world_size, strategy.layout
    started = time.perf_counter()
    box: list[Any] = [None]
    if rank == 0:
        box[0] = (strategy.generation, leaving_nodes(client, strategy.generation))
    dist.broadcast_object_list(box, src=0)
    generation, leaving = box[0]
    info = read_generation(client, generation) if rank == 0 else None
    box = [(info, *_joined_meanwhile(client, info, leaving)) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    info, pending, seen_latest = box[0]
    node_of = {info.rank_of(node.node_id, lr): node.node_id for node in info.nodes for lr in range(len(node.ranks))}
    survivors = [r for r in range(old_world) if node_of[r] not in leaving]
    if not survivors:
        raise NobodyToHandOffToError(f"every node of generation {generation} announced its departure")
    new_rank_of = {old: new for new, old in enumerate(survivors)}
    new_world = len(survivors)
    # Decided, and checked against the model and the global batch, before anything is published or moved.
    new_layout, _ = strategy.elastic_settings.layout_for_world(new_world, current=old_layout)
    my_new_rank = new_rank_of.get(rank)

    # The new generation: one the agents published meanwhile (survivors + joiners), else the survivors', published
    # by new rank 0, which hosts its store.
    master = survivors[0]
    box = [pending]
    if rank == master and pending is None:
        host = info.master_addr if master == 0 else node_host(node_of[master])
        own_client = client if client is not None else control_client_from_env()
        box[0] = _publish_survivors_or_join(own_client, info, new_rank_of, host, leaving, seen_latest,
                                            strategy.timeout)
    if pending is None:
        dist.broadcast_object_list(box, src=master)
    new_generation = int(box[0])
    agree = time.perf_counter() - started

    # Survivors' new shards: plain local buffers, shaped by the geometry of the new layout.
    started = time.perf_counter()
    old_state = handoff.state
    assert old_state is not None
    specs = whole_state_specs({k: t.spec for k, t in old_state.items()}, old_layout, new_layout)
    identity = IdentityMap(
        tuple(ProcessInfo(pid=r, node=node_of[r], old_rank=r, new_rank=new_rank_of.get(r)) for r in range(old_world)),
        old_world, new_world,
    )
    new_layout = in_place_order(specs, old_layout, new_layout, identity)  # the next fit keeps it (setup_environment)
    new_state = (allocate_shards(specs, new_layout, my_new_rank, device_of(old_state),
                                 held=HeldShards(old_state, old_layout, rank))
                 if my_new_rank is not None else None)
    allocate = time.perf_counter() - started
    record = execute_change(
        kind="preempt", step=trainer.global_step, old_state=old_state, new_state=new_state, old_layout=old_layout,
        new_layout=new_layout, identity=identity, pid=rank, release_old=False,
        transfer=strategy.elastic_settings.transfer,
    )
    # The proof of the state handed over, begun by the save hooks and summed during the transfer: completed over the
    # old group, still whole, while the old shards are still there.
    prove_handed = settle_handoff_proof(handoff.metadata)
    # Handed over on every process: the old shards are read no more (saves are skipped while a handoff is pending).
    # Kept until here so a drain that fails leaves them intact for the survivors' recovery.
    release_storage(old_state, keep=strategy.live_storages() | adopted_storages(new_state))
    handoff.seconds = {**handoff.seconds, "agree_leave": agree, "allocate": allocate, "prove_handed": prove_handed}
    handoff.phase_started = time.perf_counter()
    handoff.generation = new_generation
    handoff.state = new_state
    handoff.prior = dataclasses.replace(record, nodes=tuple(leaving))  # its seconds: the transfer
    if my_new_rank is None:
        handoff.leaving = True
        log.warning("node %s preempted: state handed over at step %d (%.1f MB sent), exiting",
                    os.environ.get(ENV_NODE_ID, "?"), trainer.global_step, record.bytes_moved / 1e6)
    else:
        handoff.old_layout, handoff.old_world, handoff.old_rank = new_layout, new_world, my_new_rank
        handoff.holders = tuple(info.members[r] for r in survivors)
        if my_new_rank == 0:
            log.warning(
                "node(s) %s preempted at step %d: world %d -> %d, %s -> %s, %.1f MB moved; generation %d",
                leaving, trainer.global_step, old_world, new_world, old_layout.describe(), new_layout.describe(),
                record.bytes_moved / 1e6, new_generation,
            )
    return handoff
