"""No orphans: a process started by an agent (or by a test harness) dies with the process that started it.

torchrun starts each worker in a session of its own, so when an agent is killed (SIGKILL, OOM) its workers are
reparented to init and train on, holding ports and memory, waiting for peers that will never come. On Linux,
``prctl(PR_SET_PDEATHSIG, SIGKILL)`` has the kernel kill a process when its parent dies; a worker asks for it at the
start of its fit under ``lightning-emig-run``, and the test harness asks for it in every agent it starts (so agents
and, through them, workers die with a test runner that is killed by a timeout). Elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None = None) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies; True when it will.

    ``expected_parent``: the parent this process was started by. If it is already gone (the process was reparented
    before it asked), the process exits at once instead of running on as an orphan.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this process may outlive its parent",
                    ctypes.get_errno())
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)  # the parent died before we asked: nobody will stop us otherwise
    return True
