"""A process whose node has left the job gives the CPU to the processes that stay.

Once a preempted node's workers have handed off their state, nobody waits for them or for their agent: what is left
is the interpreters' exits (module teardown, the heap given back) and the agent's way out of the rendezvous. On a
host shared with survivors that work ran on the core the survivors' first step needed. Measured on the development
machine (2 cores; one process's 125M forward and backward beside its proof's digest thread and a busy process, the
stand-in for a leaver's exit): 2.06 s alone, 2.53 s with the busy process at the normal priority, 2.15 s with it at
niceness 19. Lowered, not stopped: the exit still runs, and a host busy enough to starve it for the grace period
would end it with the kill its agent would send anyway, after the state has left.
"""

from __future__ import annotations

import contextlib
import os

LEAVING_NICENESS = 19
"""The lowest priority of the normal scheduling class: a thread on a busy core still gets a slice now and then."""


def yield_cpu_to_the_job() -> int:
    """Put every thread of this process at :data:`LEAVING_NICENESS` (on Linux each thread has a niceness of its own:
    gloo's, the heartbeat's, the digest's); returns the calling thread's niceness now."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the process as a whole, where the platform has niceness
        threads = [0]
    for tid in threads:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, max(LEAVING_NICENESS, os.getpriority(os.PRIO_PROCESS, tid)))
    return os.getpriority(os.PRIO_PROCESS, 0)
