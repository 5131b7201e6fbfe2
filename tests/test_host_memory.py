"""The host heap: warmed pages are kept and reused (real RSS, in a fresh interpreter: allocator settings are
process-wide), and what a joiner warms follows what the holders' rank 0 published."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch.distributed as dist

from lightning_emig import host_memory
from lightning_emig.membership import admission
from lightning_emig.testing.commands import run_command

MiB = 1 << 20

# Resident growth while a 256 MiB tensor is written, with or without 320 MiB warmed beforehand.
_GROWTH = textwrap.dedent("""
    import json, sys, torch
    from lightning_emig import host_memory
    if sys.argv[1] == "warm":
        host_memory.warm_host_memory(320 << 20)
    before = host_memory.resident_bytes()
    state = torch.ones(64 << 20)  # 256 MiB, written
    print(json.dumps({"growth": host_memory.resident_bytes() - before}))
""")


def _measured(script: str, *args: str) -> dict[str, int]:
    """What ``script`` printed last (one JSON object), run in a fresh interpreter: allocator settings are
    process-wide."""
    result = run_command([sys.executable, "-c", script, *args], timeout_s=120)
    assert result.returncode == 0, result.stdout[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _growth(mode: str) -> int:
    return _measured(_GROWTH, mode)["growth"]


@pytest.mark.skipif(host_memory.resident_bytes() is None or not sys.platform.startswith("linux"),
                    reason="needs /proc and glibc")
def test_warmed_pages_are_reused_by_later_tensors() -> None:
    cold, warm = _growth("cold"), _growth("warm")
    assert cold > 200 * MiB, f"a cold process should fault the tensor in: grew {cold / MiB:.0f} MiB"
    assert warm < 32 * MiB, f"the warmed heap should hold the tensor: grew {warm / MiB:.0f} MiB"


# Resident memory after 2.5 GiB written in adjacent blocks is freed: the blocks merge into the heap's top, more than
# the largest trim threshold mallopt takes (an int) lies free there.
_FREED_TOP = textwrap.dedent("""
    import ctypes, json
    from lightning_emig import host_memory
    host_memory.keep_freed_host_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(512 << 20) for _ in range(5)]
    for block in blocks:
        ctypes.memset(block, 1, 512 << 20)
    held = host_memory.resident_bytes()
    for block in blocks:
        libc.free(block)
    print(json.dumps({"given_back": held - host_memory.resident_bytes()}))
""")


@pytest.mark.skipif(host_memory.resident_bytes() is None or not sys.platform.startswith("linux"),
                    reason="needs /proc and glibc")
def test_more_than_2_gib_freed_at_the_heaps_top_stays() -> None:
    given_back = _measured(_FREED_TOP)["given_back"]
    # With the largest int as trim threshold glibc gave all 2.5 GiB back at the last free.
    assert given_back < 64 * MiB, f"freed heap should stay resident: {given_back / MiB:.0f} MiB went back"


# Resident growth while the main thread writes a 128 MiB tensor after another thread (as gloo's, which run the
# collectives) wrote and freed a larger one (a freed block exactly as large may not take the next aligned request).
_AFTER_THREAD = textwrap.dedent("""
    import json, threading, torch
    from lightning_emig import host_memory
    host_memory.keep_freed_host_memory()
    thread = threading.Thread(target=lambda: torch.ones(40 << 20).sum())
    thread.start()
    thread.join()
    before = host_memory.resident_bytes()
    state = torch.ones(32 << 20)
    print(json.dumps({"growth": host_memory.resident_bytes() - before}))
""")


@pytest.mark.skipif(host_memory.resident_bytes() is None or not sys.platform.startswith("linux"),
                    reason="needs /proc and glibc")
def test_pages_another_thread_freed_are_reused() -> None:
    growth = _measured(_AFTER_THREAD)["growth"]
    # A heap of the thread's own would have mapped its tensor apart and unmapped it when freed (grew 128 MiB).
    assert growth < 32 * MiB, f"the thread's freed pages should hold the tensor: grew {growth / MiB:.0f} MiB"


def test_the_holders_publish_their_own_peak_and_state_share() -> None:
    store = dist.HashStore()
    assert admission.memory_to_warm(store, 2) == 0  # nothing published: nothing to warm
    admission.publish_working_set(store, state_bytes=600 * MiB, world=2)
    published = json.loads(store.get(admission.WORKING_SET_KEY))
    assert published["peak_bytes"] >= host_memory.resident_bytes() - 64 * MiB  # this process's peak, not a guess
    assert (published["state_bytes"], published["world"]) == (600 * MiB, 2)


def test_memory_to_warm_grows_the_state_share_but_never_shrinks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "resident_bytes", lambda: 0)  # a joiner holding nothing yet
    monkeypatch.setattr(admission, "available_bytes", lambda: None)  # no cap from this machine's free memory
    store = dist.HashStore()
    store.set(admission.WORKING_SET_KEY, json.dumps({"peak_bytes": 2 << 30, "state_bytes": 600 * MiB, "world": 3}))
    # Into a world of 1 the share grows from a third of the state to all of it; the rest is kept as is.
    assert admission.memory_to_warm(store, 1) == (2 << 30) + 1200 * MiB
    assert admission.memory_to_warm(store, 3) == 2 << 30
    # A larger world's smaller share is not taken off: its collectives' buffers take more (see memory_to_warm).
    assert admission.memory_to_warm(store, 6) == 2 << 30


def test_memory_to_warm_leaves_half_the_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    store.set(admission.WORKING_SET_KEY, json.dumps({"peak_bytes": 8 << 30, "state_bytes": 0, "world": 1}))
    monkeypatch.setattr(admission, "available_bytes", lambda: 1 << 30)
    assert admission.memory_to_warm(store, 2) == 512 * MiB


def test_a_joiner_warms_only_what_it_does_not_hold_already(monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    store.set(admission.WORKING_SET_KEY, json.dumps({"peak_bytes": 900 * MiB, "state_bytes": 0, "world": 1}))
    monkeypatch.setattr(admission, "resident_bytes", lambda: 600 * MiB)  # the interpreter, torch, the run's objects
    assert admission.memory_to_warm(store, 2) == 300 * MiB
    monkeypatch.setattr(admission, "resident_bytes", lambda: 1000 * MiB)
    assert admission.memory_to_warm(store, 2) == 0
