"""A process whose node left the job gives the CPU to those that stay (:mod:`lightning_emig.launcher.leaving`).

Through the public path (a user's script preempted under ``lightning-emig-run``: the leaving worker and its agent
say their niceness as they go): ``tests/test_user_script.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import os, threading
from lightning_emig.launcher.leaving import yield_cpu_to_the_job
started, stop = threading.Event(), threading.Event()
def other():
    started.set()
    stop.wait(30)
thread = threading.Thread(target=other)
thread.start()
started.wait(30)
mine = yield_cpu_to_the_job()
others = sorted({os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")})
stop.set()
thread.join()
print(mine, others)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads' niceness is read from /proc")
def test_every_thread_of_a_leaving_process_gets_the_lowest_normal_priority() -> None:
    # In a process of its own: niceness only goes up for an unprivileged process, and the test runner must keep its.
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split("\n")[0] == "19 [19]", done.stdout + done.stderr


def test_the_exit_barrier_waits_only_for_the_nodes_still_in_the_job() -> None:
    """The newest generation has nodes a, b, c; c announced its departure before the end, or announces it while a and
    b wait: they leave the barrier without waiting for c (torch's waited for every node of its last round: 300 s). A
    node that never comes and never announced anything is waited for, to the barrier's timeout."""
    import json
    import threading

    import torch.distributed as dist

    from lightning_emig.launcher.exit_barrier import nodes_staying, wait_at_exit
    from lightning_emig.launcher.generation import NodeEntry, leaving_key, publish_generation

    def job() -> tuple[dist.Store, int]:
        control = dist.HashStore()
        nodes = [NodeEntry(node_id=n, ranks=(r,), kept_workers=True) for r, n in enumerate("abc")]
        generation = publish_generation(control, nodes=nodes, world_size=3, master_addr="127.0.0.1", master_port=1,
                                        rendezvous_seconds=0.0)
        assert generation is not None
        return control, generation

    def leave(control: dist.Store) -> None:
        control.set(leaving_key("c"), json.dumps({"deadline": 0}))

    for c_leaves_while_they_wait in (False, True):
        control, generation = job()
        store = dist.HashStore()
        if not c_leaves_while_they_wait:
            leave(control)
        errors: list[BaseException] = []

        def agent(control: dist.Store = control, store: dist.Store = store, generation: int = generation,
                  errors: list[BaseException] = errors) -> None:
            try:
                wait_at_exit(store, control, generation, timeout_s=30, poll_s=0.05)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=agent) for _ in "ab"]
        for thread in threads:
            thread.start()
        if c_leaves_while_they_wait:
            threads[0].join(0.5)
            assert all(t.is_alive() for t in threads), "the agents did not wait for c"
            leave(control)
        for thread in threads:
            thread.join(20)
        assert not any(t.is_alive() for t in threads) and not errors, errors
        assert nodes_staying(control) == 2

    control, generation = job()
    with pytest.raises(TimeoutError, match="1 of the 3 node"):
        wait_at_exit(dist.HashStore(), control, generation, timeout_s=0.3, poll_s=0.05)
