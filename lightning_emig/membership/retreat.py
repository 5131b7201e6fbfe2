"""Retreat: the generation the holders switch to cannot be formed; they form one of their own instead.

A member of the new generation can die between the moment the holders commit to it and the moment its process group
forms (a joining node killed as it became ready): every member then times out forming the group
(``trainer.pg_timeout_s``). The holders still hold the live state, in memory, in their handoffs: rather than exit
(torchrun's restart path, a rollback), they form a generation of their own — the holders only, each with the rank it
holds in the state's layout (``handoff.old_rank``), its store hosted by old rank 0 — and go on there. The joiners of
the failed generation that are alive time out as well and are left out: their agents bring them back in.

Keys under the control prefix, for the generation ``n`` that could not be formed:

* ``retreat/<n>/holder/<old rank>``: JSON ``{"node_id", "local_rank"}``, one per holder;
* ``retreat/<n>/generation``: the holders' generation, published by old rank 0 once every holder is in.

Every wait is bounded (``timeout_s``); a holder that never comes (it died too) fails the retreat, loudly: that is a
failure of a holder, which the restart path handles.
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from typing import Any

from lightning_emig.launcher.generation import (
    ENV_NODE_ID,
    GenerationError,
    NodeEntry,
    control_client_from_env,
    node_host,
    read_generation,
)
from lightning_emig.membership.admission import publish_holders_generation
from lightning_emig.membership.group import enter_generation
from lightning_emig.membership.handoff import LiveHandoff

log = logging.getLogger(__name__)


def holder_key(failed: int, old_rank: int) -> str:
    return f"retreat/{failed}/holder/{old_rank}"


def retreat_generation_key(failed: int) -> str:
    return f"retreat/{failed}/generation"


def retreat(handoff: LiveHandoff, failed: int, backend: str, group_timeout: timedelta, *, timeout_s: float) -> int:
    """Every holder whose switch to generation ``failed`` failed: form the holders' own generation; its number."""
    client = control_client_from_env()
    node_id, local_rank = os.environ[ENV_NODE_ID], int(os.environ["LOCAL_RANK"])
    client.set(holder_key(failed, handoff.old_rank), json.dumps({"node_id": node_id, "local_rank": local_rank}))
    log.error("generation %d could not be formed (a member died as it formed?): the %d holder(s) of the live state "
              "form one of their own", failed, handoff.old_world)
    if handoff.old_rank == 0:
        client.set(retreat_generation_key(failed), str(_publish(client, failed, handoff.old_world, timeout_s,
                                                                  group_timeout)))
    generation = int(_wait(client, [retreat_generation_key(failed)], timeout_s,
                           f"the holders' generation after generation {failed} was never published")[0])
    enter_generation(read_generation(client, generation), node_id, local_rank, backend, group_timeout)
    return generation


def _publish(client: Any, failed: int, holders: int, timeout_s: float, group_timeout: timedelta) -> int:
    """Old rank 0: once every holder is in, publish their generation (rank = old rank, one entry per node)."""
    keys = [holder_key(failed, rank) for rank in range(holders)]
    who = [json.loads(raw) for raw in _wait(client, keys, timeout_s,
                                            f"not every holder of the live state came back after generation {failed}")]
    ranks: dict[str, dict[int, int]] = {}
    for old_rank, member in enumerate(who):
        ranks.setdefault(member["node_id"], {})[member["local_rank"]] = old_rank
    nodes = [NodeEntry(node_id=node, ranks=tuple(by_local[lr] for lr in sorted(by_local)), kept_workers=True)
             for node, by_local in ranks.items()]
    published = publish_holders_generation(client, nodes, node_host(os.environ[ENV_NODE_ID]), group_timeout)
    assert published is not None  # published unconditionally
    return published


def _wait(client: Any, keys: list[str], timeout_s: float, what: str) -> list[bytes]:
    deadline = time.monotonic() + timeout_s
    while not client.check(keys):
        if time.monotonic() > deadline:
            raise GenerationError(f"{what} within {timeout_s:.0f}s")
        time.sleep(0.1)
    return [client.get(key) for key in keys]
