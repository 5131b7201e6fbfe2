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
