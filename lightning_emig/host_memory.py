"""The process's host heap: when its pages go back to the OS, and faulting them in before they are needed.

Why this matters for a change: on the development machines a page fault costs ~3 s per GiB (measured: a fresh
process of a 2-process FSDP world of ``llama_125m`` takes 14.5 s for its first step against 7.3 s steady; with its
heap faulted in beforehand, 6.5 s). With glibc's defaults the pages of large freed tensors go back to the OS at once
(above the mmap threshold, and at the top of the heap above the trim threshold), so a process that has not run the
step before — a joiner — faults its whole working set inside the first step on the new world, while every other
process waits for it in a collective.

* :func:`keep_freed_host_memory`: freed pages stay in the heap for the next allocation (glibc ``mallopt``), so a
  warmed heap stays warm; called once by an elastic worker on the CPU. Every thread allocates from that one heap:
  glibc gives other threads (gloo's, which run the collectives) heaps of their own of at most 64 MiB, so their
  larger buffers were mapped and unmapped anew at every collective (measured at ``llama_125m`` over 2 processes:
  0.5-2 GiB of page faults per process and step, none with one heap).
* :func:`warm_host_memory`: fault in ``nbytes`` of heap and free it again; a joiner does this before it says it is
  ready, while the old world still trains (see :mod:`lightning_emig.membership.admission`).
* :func:`return_freed_host_memory`: give freed pages back now (``malloc_trim``); a migration calls it between rounds,
  after old shards were released, which is what bounds a change's peak memory.

Elsewhere than glibc every function is a no-op. GPU memory is not this module's concern (the CUDA caching allocator
keeps freed blocks by itself).
"""

from __future__ import annotations

import ctypes
import functools
import re
import time
from pathlib import Path
from typing import Any

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_KEEP_BYTES = (1 << 31) - 1
"""The largest value ``mallopt`` takes (an ``int``): allocations below it come from the heap."""
_NEVER = -1
"""``M_TRIM_THRESHOLD`` -1: glibc never trims the heap's top on ``free``. (With the largest ``int`` as threshold it
still did, once more than 2 GiB lay free at the top: a joiner that warmed 2.7 GB at ``llama_125m``, freed in one
piece, had given all of it back before it joined, and faulted 2 GB in its first step.)"""
_WARM_BLOCK_BYTES = 512 << 20


def _proc_bytes(path: str, field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path(path).read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def resident_bytes() -> int | None:
    """This process's resident bytes now (``VmRSS``; ``None`` where ``/proc`` has no such field)."""
    return _proc_bytes("/proc/self/status", "VmRSS")


def peak_resident_bytes() -> int | None:
    """The most resident bytes of this process so far (``VmHWM``; ``None`` without ``/proc``)."""
    return _proc_bytes("/proc/self/status", "VmHWM")


def available_bytes() -> int | None:
    """Memory the machine can still give without swapping (``MemAvailable``; ``None`` without ``/proc``)."""
    return _proc_bytes("/proc/meminfo", "MemAvailable")


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def return_freed_host_memory() -> None:
    """Give the pages of freed host tensors back to the OS now (glibc ``malloc_trim``; a no-op elsewhere).

    A model's shards are mostly a few MiB each, below glibc's dynamic mmap threshold: freeing one returns it to the
    heap, not to the OS, so without this the process's memory would not shrink as old shards leave and the new
    state's pages would come on top of them."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def keep_freed_host_memory() -> bool:
    """From now on, allocations of up to 2 GiB come from the heap, from every thread that has not allocated yet
    (call it before the process groups start theirs), and freed memory stays there, however much (until
    :func:`return_freed_host_memory`): a step reuses the previous step's pages instead of faulting new ones.
    Returns whether the allocator took the settings."""
    libc = _libc()
    if libc is None:
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _KEEP_BYTES), (_M_TRIM_THRESHOLD, _NEVER))
    return all([bool(libc.mallopt(option, value)) for option, value in settings])


def warm_host_memory(nbytes: int) -> float:
    """Fault in ``nbytes`` of heap and free it (kept by :func:`keep_freed_host_memory`, which this calls): the
    state and step allocations that follow find pages already mapped. Returns the seconds it took."""
    if nbytes <= 0 or not keep_freed_host_memory():
        return 0.0
    started = time.perf_counter()
    # Few, large blocks (below the mmap threshold): freed, they merge into the heap's top, from which later
    # allocations are carved. (Many small blocks left a fresh tensor on new pages in 1 run of 6.)
    blocks = [torch.ones(min(_WARM_BLOCK_BYTES, nbytes - start), dtype=torch.uint8)
              for start in range(0, nbytes, _WARM_BLOCK_BYTES)]
    del blocks
    return time.perf_counter() - started


__all__ = [
    "available_bytes",
    "keep_freed_host_memory",
    "peak_resident_bytes",
    "resident_bytes",
    "return_freed_host_memory",
    "warm_host_memory",
]
