"""A generation's process group, and the environment that describes it to Lightning.

Invariants:

* a generation's group is formed on a ``TCPStore`` at the generation's ``master_addr:master_port`` hosted by its
  global rank 0, under ``PrefixStore(f"gen{n}")`` (see :mod:`lightning_emig.launcher.generation`), by every
  member, whether it kept running from the previous generation or was just started;
* a worker started into a live generation forms the generation the state holders admit it to
  (:mod:`~lightning_emig.membership.admission`); the holders keep training until every joiner is ready, so a
  joiner's start-up (interpreter, imports, building its run) is no downtime;
* the survivors' own generations (a drain, a failure) are published with a store their new rank 0 already hosts on
  a port the OS picked (:func:`host_generation_store`): no port is chosen first and bound later;
* ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` are rewritten
  for the generation before a Trainer is built in it: Lightning's ``TorchElasticEnvironment`` reads them, and
  the values torchrun gave a process describe the generation it was *started* in.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from lightning_emig.collective_sockets import recording_group_sockets
from lightning_emig.launcher.generation import (
    ENV_CONTROL_STORE,
    ENV_JOIN_LIVE,
    ENV_NODE_ID,
    GenerationError,
    GenerationInfo,
)

log = logging.getLogger(__name__)


def under_launcher(env: Mapping[str, str] | None = None) -> bool:
    """This process was started by ``lightning-emig-run`` (it can follow generations live)."""
    env = os.environ if env is None else env
    return ENV_NODE_ID in env and ENV_CONTROL_STORE in env


def joining_live(env: Mapping[str, str] | None = None) -> bool:
    """Started into a generation whose state lives in other, running workers: receive it, do not initialise."""
    env = os.environ if env is None else env
    return under_launcher(env) and env.get(ENV_JOIN_LIVE, "0") == "1"


def generation_env(info: GenerationInfo, node_id: str, local_rank: int) -> dict[str, str]:
    """torchrun's per-worker variables, for worker ``(node_id, local_rank)`` in generation ``info``."""
    found = [(i, node) for i, node in enumerate(info.nodes) if node.node_id == node_id]
    if not found:
        raise GenerationError(f"node {node_id!r} is not part of generation {info.generation}")
    group_rank, node = found[0]
    return {
        "RANK": str(info.rank_of(node_id, local_rank)),
        "WORLD_SIZE": str(info.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(len(node.ranks)),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(len(info.nodes)),
        "MASTER_ADDR": info.master_addr,
        "MASTER_PORT": str(info.master_port),
    }


def apply_generation_env(info: GenerationInfo, node_id: str, local_rank: int) -> int:
    """Rewrite this process's torchrun variables for ``info``; returns its global rank there."""
    env = generation_env(info, node_id, local_rank)
    os.environ.update(env)
    return int(env["RANK"])


def enter_generation(info: GenerationInfo, node_id: str, local_rank: int, backend: str, timeout: timedelta) -> int:
    """This worker's environment rewritten for ``info`` and its group formed (blocks for every member); returns its
    global rank there. Every way into a generation goes through here: a joiner's start, a live switch, a recovery."""
    rank = apply_generation_env(info, node_id, local_rank)
    try:
        form_generation_group(info, rank, backend, timeout)
    except Exception as exc:  # noqa: BLE001 - re-raised with what this process waited for
        raise GenerationError(
            f"rank {rank} could not form generation {info.generation}'s process group (world {info.world_size}, store "
            f"{info.master_addr}:{info.master_port}, timeout {timeout.total_seconds():.0f}s): {exc}"
        ) from exc
    return rank


_hosted_stores: dict[int, dist.TCPStore] = {}
"""Stores this process hosts for generations it published (taken when it forms the generation's group)."""


def host_generation_store(host: str, timeout: timedelta) -> dist.TCPStore:
    """A store for a generation this process is about to publish and will be rank 0 of: bound now, on a port the OS
    picks, so the generation is published with a port that is already ours. Keep it with :func:`keep_hosted_store`
    once the generation's number is known."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)


def keep_hosted_store(generation: int, store: dist.TCPStore) -> None:
    _hosted_stores[generation] = store


def open_generation_store(info: GenerationInfo, node_id: str, local_rank: int, timeout: timedelta) -> None:
    """The holders' rank 0, right before it commits to ``info`` (a generation the agents published): if it is rank 0
    there, bind the generation's store now. Joiners connect as soon as they read the commit, while the holders still
    finish their fit; a client that finds no server retries with growing pauses, which made forming the group take
    up to a second. Where the port cannot be bound now, the store is opened when the group forms, as before."""
    if info.generation in _hosted_stores or info.members[0] != (node_id, local_rank):
        return
    try:
        store = dist.TCPStore(info.master_addr, info.master_port, world_size=info.world_size, is_master=True,
                              wait_for_workers=False, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - an optimisation: the group forms the usual way
        log.warning("could not open generation %d's store at %s:%d early (%s); it opens when the group forms",
                    info.generation, info.master_addr, info.master_port, exc)
        return
    keep_hosted_store(info.generation, store)


def form_generation_group(info: GenerationInfo, rank: int, backend: str, timeout: timedelta) -> None:
    """Initialise the default process group of generation ``info`` as global ``rank`` (blocks for every member).

    Rank 0 hosts the generation's store (the one it bound when it published the generation, if it did); the others
    connect to it. ``wait_for_workers=False``: the group's own initialisation is the rendezvous, under the same
    ``timeout``.
    """
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised: destroy the previous generation's first")
    store = _hosted_stores.pop(info.generation, None) if rank == 0 else None
    if store is None:
        store = dist.TCPStore(
            info.master_addr, info.master_port, world_size=info.world_size, is_master=rank == 0,
            wait_for_workers=False, timeout=timeout,
        )
    with recording_group_sockets(generation=info.generation, gloo=backend == "gloo"):  # a way out of its collectives
        dist.init_process_group(
            backend, store=dist.PrefixStore(info.store_prefix, store), rank=rank, world_size=info.world_size,
            timeout=timeout,
        )
