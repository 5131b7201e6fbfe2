"""``python -m lightning_emig.picker.calibrate --out RUN_DIR/hardware_profile.json [--device cuda]``: a short
measurement of this machine, saved as the layout picker's :class:`~lightning_emig.picker.HardwareProfile`.

What it measures (a few seconds), and what it keeps from the defaults:

* dense matmul FLOP/s in fp32 and bf16 on one device (square matmuls large enough to be compute-bound): the picker
  multiplies them by ``compute_efficiency`` (default kept: a training step does not reach a bare matmul's rate);
* device memory bandwidth (a large copy reads and writes every byte): bounds the optimizer step;
* under ``torchrun`` / ``lightning-emig-run`` with several processes on this node: all-reduce bus bandwidth between
  them (``intra_node_bandwidth``) and the latency of a small all-reduce; one process keeps the defaults;
* ``inter_node_bandwidth`` is kept from the defaults: one node cannot measure it.

Training reads ``RUN_DIR/hardware_profile.json`` when ``elastic.picker.profile`` is null and that file exists, so a
profile saved in the run directory calibrates every later choice of that run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_emig.picker.throughput import HardwareProfile, save_profile

PROFILE_FILE = "hardware_profile.json"


def _timed(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call of ``fn`` (after one warm-up call), synchronised on CUDA."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def matmul_flops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / _timed(lambda: a @ b, repeats)


def copy_bandwidth(device: torch.device, numel: int, repeats: int = 5) -> float:
    """Bytes read plus written per second by a device-to-device copy."""
    src = torch.empty(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / _timed(lambda: dst.copy_(src), repeats)


def all_reduce_bandwidth(device: torch.device, numel: int, repeats: int = 5) -> tuple[float, float]:
    """``(bus bytes/s per rank, seconds of a small all-reduce)`` in the default group (a ring moves
    ``2 (n - 1) / n`` of the buffer per rank)."""
    n = dist.get_world_size()
    big = torch.ones(numel, device=device, dtype=torch.float32)
    small = torch.ones(1, device=device, dtype=torch.float32)
    seconds = _timed(lambda: dist.all_reduce(big), repeats)
    latency = _timed(lambda: dist.all_reduce(small), 20)
    return 2 * (n - 1) / n * big.numel() * big.element_size() / seconds, latency


def measure_profile(device: torch.device, *, quick: bool = False) -> HardwareProfile:
    """This machine's profile (the module docstring says what is measured and what is kept)."""
    size = 512 if quick or device.type == "cpu" else 8192
    numel = (1 << 22) if quick or device.type == "cpu" else (1 << 28)
    measured = {
        "flops_fp32": matmul_flops(device, torch.float32, size),
        "flops_bf16": matmul_flops(device, torch.bfloat16, size),
        "hbm_bandwidth": copy_bandwidth(device, numel),
    }
    where = f"measured on {device.type}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        measured["intra_node_bandwidth"], measured["collective_latency"] = all_reduce_bandwidth(device, numel)
        where += f" with {dist.get_world_size()} processes"
    return dataclasses.replace(HardwareProfile(), name=where, **measured)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="where to save the profile (JSON)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds on any machine)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    profile = measure_profile(device, quick=args.quick)
    if not dist.is_initialized() or dist.get_rank() == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_profile(profile, args.out)
        print(f"{args.out}: {profile}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
