"""Run a function on N local processes under a real torch.distributed process group.

One harness for every multi-process test: gloo on CPU, NCCL when ``backend="nccl"`` and GPUs exist. Each
worker initialises the default group with an explicit timeout, runs ``fn(rank, world_size, *args)``, and sends
back its return value (which must pickle). The parent waits with a deadline and re-raises the first worker failure
with that worker's traceback, so a hung collective is a test failure, never a hung suite.

No orphans: a worker may start processes of its own (a ``DataLoader``'s workers), so it is not daemonic (a daemonic
process may not have children). Each worker leads a process group of its own, which what it starts joins; however
the call ends (results in, a failure, a death, the deadline, an exception in the caller) the parent SIGKILLs every
worker's whole group and returns only when none of its processes is left. If the caller itself is killed, its fork
server exits and the kernel kills the workers (``PR_SET_PDEATHSIG``); their ``DataLoader`` workers then exit on
their own (torch's workers watch their parent).

Workers are forked from a fork server that imported torch, Lightning and this package once per test session
(:data:`PRELOADED`): a spawned interpreter spends about 8 s of CPU importing them, which on two cores was most
of a short multi-process test. A forked worker starts from the server's environment, not the caller's, so it
is handed the caller's explicitly (multiprocessing already gives it the caller's working directory and
``sys.path``): what it sees is what a spawned one would.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning_emig.launcher.orphans import die_with_parent

PRELOADED = (
    "torch", "torch.distributed.fsdp", "torch.distributed.tensor", "lightning.pytorch",
    "lightning_emig.strategy",
)
"""What the fork server imports before it forks any worker (what every worker would import anyway)."""


class WorkerFailed(RuntimeError):
    """A worker process raised, died, or did not finish in time."""


#: Where :func:`free_port` looks: below the kernel's ephemeral range (Linux's default starts at 32768).
_PICKED_PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A free port for a server that some process binds *later*, taken outside the kernel's ephemeral range.

    A port picked with ``bind(0)`` is one the kernel hands out again: another process's ``bind(0)`` (a torchrun
    agent picking its workers' ``MASTER_PORT``, a single-process run picking its own, gloo's listeners) may take it
    before its server binds it (seen: a reference run took the port torchrun's agent had just picked for its worker,
    whose store then failed with EADDRINUSE). The kernel never picks a port outside its ephemeral range, so none of
    those can take one from here. Each port is handed out once per process."""
    import random

    low = _ephemeral_low()
    candidates = [p for p in _PICKED_PORTS if p < low and p not in _handed_out]
    for port in random.sample(candidates, min(len(candidates), 200)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # nothing free below the range: the old way
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where /proc cannot tell)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    environ: dict[str, str],
) -> None:
    os.setpgid(0, 0)  # first, before it starts anything: the parent kills this group, children included
    die_with_parent()
    # Its processes (a DataLoader's workers) start as in a process torchrun started: the interpreter's default (fork on
    # Linux), not the harness's fork server, which multiprocessing made this process's default.
    mp.set_start_method(None, force=True)
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return results by rank.

    ``fn`` must be importable by name (a module-level function), as spawned children re-import it.
    """
    ctx = _context(backend)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, backend, pg_timeout_s, fn, args, results, dict(os.environ)),
            daemon=False,  # a DataLoader's workers are its children; _stop_groups ends them
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        values = _collect(procs, results, world_size, timeout_s)
        for proc in procs:  # they have reported: let them end their children themselves (then nothing is killed)
            proc.join(timeout=EXIT_GRACE_S)
        return values
    finally:
        _kill_groups([proc for proc in procs if proc.pid is not None])


EXIT_GRACE_S = 10.0
"""How long a worker is given to exit once it has reported, and its group to be gone once killed."""


def _kill_groups(procs: list[Any]) -> None:
    """SIGKILL each worker's process group (the worker and whatever it started) until none of their processes runs,
    and reap the workers.

    A worker that already exited may have left children behind (a rank that raised while its ``DataLoader`` workers
    ran): its group outlives it as long as they do, so it is killed all the same. A worker that had not made its
    group yet is killed by pid; the signal is repeated until nothing runs, in case it made its group meanwhile."""
    deadline = time.monotonic() + EXIT_GRACE_S
    while True:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if not (left := [pid for proc in procs for pid in _running_members(proc.pid)]):
            break
        if time.monotonic() > deadline:
            raise WorkerFailed(f"processes {left} of the workers' groups outlived SIGKILL for {EXIT_GRACE_S:.0f}s")
        time.sleep(0.01)
    for proc in procs:
        proc.join(timeout=EXIT_GRACE_S)


def _running_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that still run (not zombies: those hold nothing, and their reaper, an orphan's
    init, may take a second or two). Linux's ``/proc``; elsewhere none are seen."""
    running = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            state, _parent, group = text[text.rindex(")") + 2:].split()[:3]
            if int(group) == pgid and state != "Z":
                running.append(int(stat.parent.name))
    return running


def _context(backend: str) -> Any:
    """The fork server's context (started on first use with :data:`PRELOADED`; it exits with this process).

    NCCL workers are spawned instead: CUDA cannot be used after a fork from a process that initialised it, and
    a preloaded module may have."""
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


def _collect(procs: list[Any], results: Any, world_size: int, timeout_s: float) -> list[Any]:
    import queue

    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    while len(values) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(values))
            raise WorkerFailed(f"ranks {missing} did not finish within {timeout_s:.0f}s")
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if i not in values and p.exitcode not in (None, 0)]
            if dead:
                raise WorkerFailed(f"ranks {dead} died (exit codes {[procs[i].exitcode for i in dead]})") from None
            continue
        if not ok:
            raise WorkerFailed(f"rank {rank} failed:\n{value}")
        values[rank] = value
    return [values[rank] for rank in range(world_size)]
