"""A generation's process group, and the environment that describes it to Lightning.

Invariants:

* a generation's group is formed on a ``TCPStore`` at the generation's ``master_addr:master_port`` hosted by its
  global rank 0, under ``PrefixStore(f"gen{n}")`` (see :mod:`lightning_emig.launcher.generation`), by every
  member, whether it kept running from the previous generation or was just started;
* a worker started into a live generation announces itself ready (``gen/<n>/joiners_ready`` in the control
  store, one ``add`` per worker) right before it forms the group; the running workers keep training until
  every joiner is ready, so a joiner's start-up (interpreter, imports, building its run) is no downtime;
* ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` are rewritten
  for the generation before a Trainer is built in it: Lightning's ``TorchElasticEnvironment`` reads them, and
  the values torchrun gave a process describe the generation it was *started* in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from lightning_emig.launcher.generation import (
    ENV_CONTROL_STORE,
    ENV_JOIN_LIVE,
    ENV_NODE_ID,
    GenerationError,
    GenerationInfo,
)


def joiners_ready_key(generation: int) -> str:
    return f"gen/{generation}/joiners_ready"


def announce_ready(client: dist.Store, generation: int) -> None:
    """A joining worker is about to form ``generation``'s group (its start-up is done)."""
    client.add(joiners_ready_key(generation), 1)


def joiners_ready(client: dist.Store, info: GenerationInfo) -> bool:
    """Every worker started into ``info`` (not carried over) has announced itself ready."""
    expected = sum(len(node.ranks) for node in info.nodes if not node.kept_workers)
    return client.add(joiners_ready_key(info.generation), 0) >= expected


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
    form_generation_group(info, rank, backend, timeout)
    return rank


def form_generation_group(info: GenerationInfo, rank: int, backend: str, timeout: timedelta) -> None:
    """Initialise the default process group of generation ``info`` as global ``rank`` (blocks for every member).

    Rank 0 hosts the generation's store; the others connect to it. ``wait_for_workers=False``: the group's own
    initialisation is the rendezvous, under the same ``timeout``.
    """
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised: destroy the previous generation's first")
    store = dist.TCPStore(
        info.master_addr, info.master_port, world_size=info.world_size, is_master=rank == 0,
        wait_for_workers=False, timeout=timeout,
    )
    dist.init_process_group(
        backend, store=dist.PrefixStore(info.store_prefix, store), rank=rank, world_size=info.world_size,
        timeout=timeout,
    )
