"""Run a command line (a launcher and its workers) with a deadline, and stop everything it started.

The command gets its own session and, when it ends or times out, its process group and every descendant
are killed by id: torchrun starts its workers in sessions of their own, so a process-group kill alone would
leave them behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, read from /proc (children before grandchildren)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def is_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s descendants, then its process group (``pid`` must lead a session of its own)."""
    for child in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def python_module_command(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def run_command(
    cmd: Sequence[str], *, timeout_s: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    from lightning_emig.launcher.orphans import die_with_parent

    full_env = {**os.environ, **(env or {})}
    caller = os.getpid()
    proc = subprocess.Popen(  # dies with the caller: a test runner killed by a timeout leaves no command running
        list(cmd), cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=lambda: die_with_parent(expected_parent=caller),
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd)} did not finish within {timeout_s:.0f}s; output:\n{out[-4000:]}") from None
    finally:
        # Workers that outlive their launcher are ours too.
        kill_tree(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)
