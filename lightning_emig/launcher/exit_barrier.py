"""The agents' exit barrier, over the nodes still in the job.

At the end torchrun's agents wait for every node of their last rendezvous round (its ``group_world_size``). A node
that left since — preempted, its state handed over, or failed with no restart left — never comes, and the others
waited out the barrier's timeout: 300 s by default (seen in the chaos test, a node preempted in the round of the last
generation as training ended). Here each agent checks in once and waits until as many agents checked in as the
newest generation has nodes that neither announced their departure (``leaving/<node_id>``) nor were marked dead
(``dead/<node_id>``), counted again at every poll: a departure announced while the others wait still ends the wait.
"""

from __future__ import annotations

import time
from typing import Any

from lightning_emig.launcher.generation import dead_key, latest_generation, leaving_key, read_generation

POLL_S = 0.2


def nodes_staying(control: Any) -> int | None:
    """How many nodes of the newest generation are still in the job; None when none is published or the store is
    gone (at the very end of a job the agent hosting it may have exited)."""
    try:
        latest = latest_generation(control)
        if latest < 0:
            return None
        nodes = read_generation(control, latest).nodes
        return sum(1 for n in nodes if not control.check([leaving_key(n.node_id)]) and not control.check(
            [dead_key(n.node_id)]))
    except Exception:  # noqa: BLE001 - whatever the store raises as it goes away
        return None


def wait_at_exit(store: Any, control: Any, generation: int, *, timeout_s: float, poll_s: float = POLL_S) -> None:
    """Check in at the exit of ``generation`` (in the rendezvous ``store`` the agents share) and wait for the nodes
    still in the job (read from ``control``); TimeoutError after ``timeout_s``. No generation known, or the store
    gone once checked in (the agent hosting it passed the barrier and exited): no wait."""
    key = f"lightning_emig/exit/{generation}"
    arrived = store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        expected = nodes_staying(control)
        if expected is None or arrived >= expected:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{arrived} of the {expected} node(s) still in the job reached the exit within "
                               f"{timeout_s:.0f}s")
        time.sleep(poll_s)
        try:
            arrived = store.add(key, 0)
        except Exception:  # noqa: BLE001 - the store is gone: its host (an agent) passed the barrier and exited
            return
