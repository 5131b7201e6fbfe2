"""Which rendezvous rounds may become generations: a round must not split the job.

torch's rendezvous can complete a round without the nodes that hold the live state: new nodes waiting form one on
their own while the holders' agents are still leaving a round a node died in (torch's rank assignment waits for the
dead node's entries up to the store's read timeout). Published, such a round would be a second job — its workers,
all started, would train from a checkpoint beside the holders. The round's rank-0 agent refuses it instead
(:func:`holders_missing`), every agent of the round runs the next one, and the holders are in that.
"""

from __future__ import annotations

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

REFUSED_ROUNDS_S = 600.0
"""How long rounds may be refused for missing holders before the agent gives up (see :func:`holders_missing`)."""

ROUND_REFUSED = "refused"
"""What the round's rank 0 hands the round instead of a generation number when it refuses the round."""

HOLDER_ALIVE_WINDOW_S = 5.0
"""A node of the holders' generation is alive when one of its workers' heartbeats changes within this window."""


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
