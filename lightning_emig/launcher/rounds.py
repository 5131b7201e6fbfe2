"""Which rendezvous rounds may become generations: a round must not split the job.

torch's rendezvous can complete a round without the nodes that hold the live state: new nodes waiting form one on
their own while the holders' agents are still leaving a round a node died in (torch's rank assignment waits for the
dead node's entries up to the store's read timeout). Published, such a round would be a second job — its workers,
all started, would train from a checkpoint beside the holders. The round's rank-0 agent refuses it instead
(:func:`holders_missing`), every agent of the round runs the next one, and the holders are in that.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from lightning_emig.launcher.generation import (
    NodeEntry,
    active_generation,
    dead_key,
    heartbeat_key,
    leaving_key,
    read_generation,
)

log = logging.getLogger(__name__)

REFUSED_ROUNDS_S = 600.0
"""How long rounds may be refused for missing holders before the agent gives up (see :func:`holders_missing`)."""

ROUND_REFUSED = "refused"
"""What the round's rank 0 hands the round instead of a generation number when it refuses the round."""

HOLDER_ALIVE_WINDOW_S = 5.0
"""A node of the holders' generation is alive when one of its workers' heartbeats changes within this window."""


ROUND_ATTEMPTS = 3
"""A rendezvous round in which a node died (its entries never come: torch's rank assignment or our node entries time
out) is run again: the others are alive, and without this the agent — perhaps the one hosting the c10d store — would
exit and take the job with it."""

ROUND_GENERATION_KEY = "lightning_emig/generation"
"""Key in the rendezvous round's own store through which rank 0 hands the round its generation number."""


def round_node_key(group_rank: int) -> str:
    """Key in the round's own store where each agent leaves its :class:`NodeEntry` for rank 0."""
    return f"lightning_emig/node/{group_rank}"


class RoundRefusedError(RuntimeError):
    """A rendezvous round that would split the job: nodes holding the live state are alive but not in it."""


def holders_missing(control: Any, nodes: list[NodeEntry], window_s: float = HOLDER_ALIVE_WINDOW_S) -> list[str]:
    """Nodes of the generation the state holders are in that are alive (a worker's heartbeat changes within
    ``window_s``), not leaving, not marked dead, and not among ``nodes``.

    torch's rendezvous can complete a round without them: new nodes waiting form one on their own while the holders'
    agents are still leaving a round a node died in. Published, such a round would be a second job: its workers would
    start from a checkpoint while the holders train on. Refused, the next round has everyone."""
    holders = active_generation(control)
    if holders < 0:
        return []
    in_round = {node.node_id for node in nodes}
    candidates = [node for node in read_generation(control, holders).nodes
                  if node.node_id not in in_round and not control.check([dead_key(node.node_id)])
                  and not control.check([leaving_key(node.node_id)])]
    if not candidates:
        return []
    keys = {node.node_id: [heartbeat_key(node.node_id, lr) for lr in range(len(node.ranks))] for node in candidates}
    first = {key: _read(control, key) for node_keys in keys.values() for key in node_keys}
    alive: set[str] = set()
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline and len(alive) < len(keys):
        time.sleep(0.25)
        alive |= {node for node, node_keys in keys.items() if any(_read(control, k) != first[k] for k in node_keys)}
    return sorted(alive)


def _read(control: Any, key: str) -> bytes | None:
    return control.get(key) if control.check([key]) else None


def leave_round(handler: Any) -> None:
    """Remove this node from the current rendezvous round without closing the rendezvous (a node leaving a job that
    goes on). torch has no public call for it: ``DynamicRendezvousHandler``'s heartbeats and exit operation (torch
    2.13), used here only, pinned by ``tests/test_launcher.py``."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        handler._stop_heartbeats()  # noqa: SLF001
        handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + 30)  # noqa: SLF001
    except Exception:  # noqa: BLE001 - the survivors' rendezvous then drops us by heartbeat timeout
        log.warning("could not leave the rendezvous explicitly", exc_info=True)
