"""A process's real memory, for measuring what a change costs: resident set size and its peak (Linux ``/proc``).

``reset_peak()`` returns freed heap pages to the OS and resets the kernel's high-water mark (``VmHWM``) to the
current RSS (``/proc/self/clear_refs``), so ``peak() - reset_peak()`` is the most this process's memory grew over
what ran in between — allocator behaviour included, nothing computed from buffer sizes. On GPUs the same question
is ``torch.cuda.reset_peak_memory_stats`` / ``max_memory_allocated``; this module covers host memory.
"""

from __future__ import annotations

import gc
from pathlib import Path

from lightning_emig.host_memory import peak_resident_bytes, resident_bytes, return_freed_host_memory


def rss() -> int:
    """Resident bytes now."""
    return _required(resident_bytes(), "VmRSS")


def peak() -> int:
    """The most resident bytes since the last :func:`reset_peak` (or since the process started)."""
    return _required(peak_resident_bytes(), "VmHWM")


def _required(value: int | None, field: str) -> int:
    if value is None:
        raise RuntimeError(f"/proc/self/status has no {field} (not Linux?)")
    return value


def trim() -> None:
    """Collect garbage and return freed heap memory to the OS, so RSS is live data."""
    gc.collect()
    return_freed_host_memory()


def reset_peak(*, trim_first: bool = True) -> int:
    """Reset the peak to the current RSS; return the current RSS. Raises where the kernel cannot reset it (the peak
    would then cover the process's whole life and every figure would be wrong). ``trim_first=False`` keeps the
    freed heap: what follows reuses its pages, and the growth measured is no longer the memory it needs."""
    if trim_first:
        trim()
    Path("/proc/self/clear_refs").write_text("5")
    return rss()


__all__ = ["peak", "reset_peak", "rss", "trim"]
