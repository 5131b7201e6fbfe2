"""Run a command line (a launcher and its workers) with a deadline, and stop everything it started.

The command gets its own session, so on a timeout the whole process group — torchrun, its agents, the
workers they spawned — is killed by id and none is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def python_module_command(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def run_command(
    cmd: Sequence[str], *, timeout_s: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        list(cmd), cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd)} did not finish within {timeout_s:.0f}s; output:\n{out[-4000:]}") from None
    finally:
        # Workers that outlive their launcher are ours too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)
