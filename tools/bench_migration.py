"""Migration cost: direct migration vs DCP (disk, tmpfs) vs gather-to-rank-0 + broadcast, same state, one run.

For every model and transition (same world, or a world that loses or gains processes) the same source state —
parameters plus AdamW ``exp_avg`` / ``exp_avg_sq`` / ``step`` — is moved from the old layout into the same
pre-allocated model and optimizer under the new layout, by each method in turn:

Every method is timed the same way: one warm-up run (its time kept as ``cold_seconds``), then ``--repeats`` timed
runs, the median reported (``samples`` lists them). The processes keep freed heap pages, as an elastic worker does
(``keep_freed_host_memory``): the warm-up starts from a trimmed heap (its RSS growth is the memory figure), the timed
runs on the pages the runs before them freed, as a live change on a worker whose steps used them (measured on
2026-12-07: a direct run from a trimmed heap faulted in its staging, 61-71 MiB a process at 125M ``s4:t2s2``, every
time; the link limit's buffers are faulted in before its clock starts). Direct's run on fresh pages is its memory
run (``release_run_seconds``).

* ``direct``: ``lightning_emig.migration.engine.migrate`` (planned point-to-point transfer). After the timed runs one
  more run frees the old state as it goes (``release_old``, as a live change does) with the new state's storage
  freshly allocated, and measures the process's real peak memory (below).
* ``dcp_disk``: ``torch.distributed.checkpoint.save`` of the live DTensors to a directory on disk (files fsynced,
  ``sync_files=True``), then ``dcp.load`` into the new layout's DTensors (DCP reshards on load). This is DCP's best
  case: loaded in place, no process restart, no optimizer rebuild, and the files are read back from the page cache.
* ``dcp_tmpfs``: the same through a directory in ``/dev/shm``.
* ``dcp_load``: only the load-with-reshard from disk, the checkpoint already written (untimed) before: the restart
  path's cost when an asynchronous checkpoint of exactly this step exists.
* ``dcp_disk_cold``, ``dcp_load_cold``: the same two, but the checkpoint's files are evicted from the page cache
  between the save and the load (``posix_fadvise(DONTNEED)`` on the fsynced files, untimed), so the load reads them
  from the device, as a node that did not write them (a joiner, a replacement) or one whose cache they left would.
* ``gather_bcast``: every tensor made full (``DTensor.full_tensor``, as ``get_state_dict(full_state_dict=True)`` does)
  and kept on rank 0, then broadcast tensor by tensor from rank 0 to the new ranks, each of which keeps its own slice
  (``distribute_tensor(src_data_rank=None)``, as ``set_state_dict(broadcast_from_rank0=True)`` does). It runs last
  and frees the old shards once rank 0 holds the full state, as a gather-based migration would (they are refilled
  before the next run). Not run where a layout has pipeline stages (``p``): it walks every tensor on every old
  process, and a stage holds its own tensors only.

Transitions are written ``OLD:NEW`` with ``r`` dp_replicate, ``s`` dp_shard, ``t`` tp, ``p`` pp, ``v`` pp_virtual
and a degree each (``p2s2:s4``: two stages of FSDP2 over two processes each, to FSDP2 over four; ``p2:p2v2``: two
stages to four, two a process, interleaved; a stage is built by ``parallelize_model``, and the state's specs say
which stage holds each tensor). A side may end in ``@`` and the four
letters in rank order, slowest first (``s4:p2s2@rspt``: dp_shard numbered before pp, the order a live change on one
node chooses for it; see ``lightning_emig.migration.rank_order``).

Source state and its check: ``tools/migration_sides.py`` (every shard filled with an exact function of its global
indices, checked on every new rank with nothing gathered). DCP and ``gather_bcast`` place data by DTensor's own rules,
so their checks also cross-check the geometry; ``--full-check`` additionally compares ``full_tensor()`` of the source
and of ``direct``'s result.

Each record's fields:

* ``seconds``: barrier, method, barrier, on the slowest process; ``phases``: per-phase seconds, max over processes;
* ``bytes_moved``: ``direct``: bytes received over the wire (sum over processes); ``dcp_*``: checkpoint bytes
  written + bytes read back by the new ranks; ``gather_bcast``: logical bytes, what a gather to rank 0 receives
  plus what the broadcast delivers (``full_tensor`` all-gathers, so the wire carries more);
* ``link_limit_seconds``: a raw ``batch_isend_irecv`` of preallocated contiguous buffers with exactly ``direct``'s
  per-pair byte counts, after a warm-up exchange, median of ``--repeats`` (the same for every method of a transition;
  like every method, timed after the disk has been synced, untimed);
* ``host_limit_seconds``: the same exchange with each process's local copies (``direct``'s ``bytes_copied``) done
  as one contiguous copy while it is on the wire: on a host whose cores run the wire's copies too (gloo over
  loopback, this project's development machines) the least any migration that keeps a layout's bytes local costs;
* ``peak_extra_bytes``: ``direct``: the transfer's largest send + receive buffer space in one round
  (``TransferStats.peak_buffer_bytes``, max over processes); the others: measured growth of the busiest process's
  peak RSS over its RSS just before (freed heap returned with ``malloc_trim``, VmHWM reset through
  ``/proc/self/clear_refs``), plus the checkpoint's bytes for ``dcp_tmpfs`` (tmpfs is RAM; the disk page cache is
  not counted), and at least the full state for ``gather_bcast`` (rank 0 holds all of it at once).
  ``peak_rss_extra_bytes`` is the measured figure for every method (from the warm-up, started on a trimmed heap).
* ``direct`` only, from its memory run (per process, the busiest reported; ``release_run_seconds`` is that run's
  time, barrier to barrier, on this process): ``peak_extra_bytes_measured`` (peak RSS
  over RSS with the old state resident and the new one allocated but untouched), ``old_state_bytes``,
  ``new_state_bytes``, ``largest_shard_bytes``, and ``memory_bound_bytes`` = max(old, new) + ``bucket_bytes`` +
  largest shard - old, the growth the transfer promises; ``within_memory_bound`` holds on every process.

    .venv/bin/python tools/bench_migration.py --models llama_25m --out bench_results/migration.json
    .venv/bin/python tools/bench_migration.py --plot-only --out bench_results/migration.json  # or tools/plot_migration.py
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from migration_sides import (  # tools/, beside this script
    Side,
    Transition,
    build_side,
    check_full,
    check_pattern,
    fill_pattern,
    layout_mesh,
    locals_of,
    parse_transitions,
    reallocate,
    release,
    reset_nan,
    transitions_for,
)
from plot_migration import METHODS, plot, summary  # tools/, beside this script
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_emig.host_memory import keep_freed_host_memory
from lightning_emig.layout import HybridLayout
from lightning_emig.migration.engine import migrate
from lightning_emig.migration.identity import IdentityMap
from lightning_emig.migration.state import local_of, training_state
from lightning_emig.migration.transfer import (
    TransferOptions,
    largest_shard_bytes,
    local_bytes,
    max_single_row_bytes,
    memory_bound_bytes,
)
from lightning_emig.models.llama import Llama, get_model_config
from lightning_emig.testing import memory
from lightning_emig.testing.distributed import WorkerFailed, run_distributed

DEFAULT_TRANSITIONS = "s4:t2s2,t2s2:r2s2,s4:s3,s3:s4,p2s2:s4,p2t2:p4"


# ------------------------------------------------------------------------------------------------ methods
@dataclass(slots=True)
class Ctx:
    """Everything one transition's methods share on this process (``old`` / ``new`` None off that world)."""

    rank: int
    transition: Transition
    old_layout: HybridLayout
    new_layout: HybridLayout
    old: Side | None
    new: Side | None
    old_group: Any
    new_group: Any
    bucket_bytes: int
    repeats: int


def _direct(ctx: Ctx, release_old: bool = False) -> dict[str, Any]:
    t = ctx.transition
    identity = IdentityMap.first_ranks(t.old_world, t.new_world)
    report = migrate(
        old_state=training_state(ctx.old.model, ctx.old.optimizer) if ctx.old else None,
        new_state=training_state(ctx.new.model, ctx.new.optimizer) if ctx.new else None,
        old_layout=ctx.old_layout,
        new_layout=ctx.new_layout,
        identity=identity,
        pid=ctx.rank,
        transfer=TransferOptions(bucket_bytes=ctx.bucket_bytes),
        release_old=release_old,
    )
    plan, stats = report.plan, report.stats
    return {
        "phases": {**report.seconds, "copy": stats.seconds_copy, "p2p": stats.seconds_transfer},
        "bytes_received": stats.bytes_received,
        "bytes_copied": stats.bytes_copied,
        "peak_buffer_bytes": stats.peak_buffer_bytes,
        "max_row_bytes": max_single_row_bytes(plan),
        "rounds": stats.rounds,
        "sends": {p: sum(x.nbytes for x in plan.sends_to(p)) for p in plan.peers},
        "recvs": {p: sum(x.nbytes for x in plan.recvs_from(p)) for p in plan.peers},
    }


def _memory_run(ctx: Ctx) -> dict[str, Any]:
    """One direct run as a live change does it: the old state freed as it leaves, the new state's storage fresh
    (allocated, untouched) — measured as this process's peak RSS over its RSS just before."""
    if ctx.new is not None:
        release(ctx.new)
        memory.trim()  # or the new storage may land on the freed pages, resident already, and hide their cost
        reallocate(ctx.new)
    old, new = locals_of(ctx.old), locals_of(ctx.new)
    facts = {
        "old_state_bytes": local_bytes(old), "new_state_bytes": local_bytes(new),
        "largest_shard_bytes": largest_shard_bytes(old, new),
        "memory_bound_bytes": memory_bound_bytes(old, new, ctx.bucket_bytes),
    }
    before = memory.reset_peak()
    dist.barrier()
    start = time.perf_counter()
    _direct(ctx, release_old=True)
    dist.barrier()
    facts["release_run_seconds"] = time.perf_counter() - start  # as timed runs, but freeing the old state
    facts["peak_extra_bytes_measured"] = memory.peak() - before
    facts["bad"] = check_pattern(ctx.new, ctx.rank) if ctx.new is not None else None
    if ctx.old is not None:  # the methods after this one read the old state again
        reallocate(ctx.old)
        fill_pattern(ctx.old, ctx.rank)
    return facts


def _dcp(ctx: Ctx, directory: str, cold: bool = False) -> dict[str, Any]:
    info = _dcp_save(ctx, directory)
    evict = _evict_page_cache(ctx, directory) if cold else 0.0
    loaded = _dcp_load(ctx, directory)
    return {"phases": {**info["phases"], **loaded["phases"]}, "bytes_written": info["bytes_written"],
            "bytes_read": loaded["bytes_read"], "evict_seconds": evict}


def _evict_page_cache(ctx: Ctx, directory: str) -> float:
    """Drop the checkpoint's files from the page cache (rank 0 for the machine; fsynced by the save, so their pages
    are clean and go); returns the seconds it took, barrier to barrier, which the caller leaves out of the time."""
    start = time.perf_counter()
    dist.barrier()
    if ctx.rank == 0:
        for path in Path(directory).rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    dist.barrier()
    return time.perf_counter() - start


def _dcp_save(ctx: Ctx, directory: str) -> dict[str, Any]:
    phases: dict[str, float] = {}
    if ctx.old is not None:
        start = time.perf_counter()
        writer = dcp.FileSystemWriter(directory, sync_files=True)
        dcp.save(ctx.old.tensors, storage_writer=writer, process_group=ctx.old_group)
        phases["save"] = time.perf_counter() - start
    dist.barrier()  # the checkpoint is complete before anyone loads (a restart would wait for it too)
    written = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file()) if ctx.rank == 0 else 0
    return {"phases": phases, "bytes_written": written}


def _dcp_load(ctx: Ctx, directory: str) -> dict[str, Any]:
    phases: dict[str, float] = {}
    read = 0
    if ctx.new is not None:
        start = time.perf_counter()
        with torch.no_grad():
            dcp.load(
                ctx.new.tensors, storage_reader=dcp.FileSystemReader(directory), process_group=ctx.new_group
            )
        phases["load"] = time.perf_counter() - start
        read = sum(_local_nbytes(t) for t in ctx.new.tensors.values())
    return {"phases": phases, "bytes_read": read}


def _gather_bcast(ctx: Ctx, catalog: list[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
    kept: dict[str, torch.Tensor] = {}
    gathered = delivered = 0
    phases = {"gather": 0.0, "broadcast": 0.0, "reshard": 0.0}
    if ctx.old is not None:
        start = time.perf_counter()
        for key, _, _ in catalog:
            tensor = ctx.old.tensors[key]
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()
            if ctx.rank == 0:
                kept[key] = full
            else:
                gathered += _local_nbytes(tensor)
            del full
        release(
            ctx.old
        )  # rank 0 holds everything now; this method runs last, so nothing reads the old state
        phases["gather"] = time.perf_counter() - start
    dist.barrier()
    for key, shape, dtype in catalog if ctx.new is not None else ():  # new rank 0 is process 0, the source
        start = time.perf_counter()
        buffer = kept.pop(key) if ctx.rank == 0 else torch.empty(shape, dtype=dtype)
        dist.broadcast(buffer, src=0, group=ctx.new_group)
        delivered += 0 if ctx.rank == 0 else buffer.numel() * buffer.element_size()
        middle = time.perf_counter()
        target = ctx.new.tensors[key]
        if isinstance(target, DTensor):
            piece = distribute_tensor(buffer, target.device_mesh, target.placements, src_data_rank=None)
            local_of(target).copy_(piece.to_local())
        else:
            target.copy_(buffer)
        del buffer
        phases["broadcast"] += middle - start
        phases["reshard"] += time.perf_counter() - middle
    return {"phases": phases, "bytes_gathered": gathered, "bytes_delivered": delivered}


def _local_nbytes(tensor: torch.Tensor) -> int:
    local = local_of(tensor)
    return local.numel() * local.element_size()


def _settle_disk() -> None:
    """Untimed: the disk settles (``os.sync``) before the next method or the link limit is timed. The link limit, timed
    right after the DCP methods, once took 1.21 s for a 350M exchange that took 0.71 s with a sync first (0.69 s between
    two fresh processes); which of DCP's leftovers slowed it (its files are fsynced, then deleted) is not pinned down."""
    os.sync()
    dist.barrier()


def _link_limit(sends: dict[int, int], recvs: dict[int, int], repeats: int, copy_bytes: int = 0) -> list[float]:
    """Seconds of a raw exchange of exactly these per-peer byte counts (barrier to barrier), after a warm-up; with
    ``copy_bytes``, one contiguous copy of that many bytes done while the exchange is on the wire (as direct does its
    local copies)."""
    out_buffers = {p: torch.full((n,), 7, dtype=torch.uint8) for p, n in sends.items() if n}
    # Zero-filled, so the pages exist before the clock starts.
    in_buffers = {p: torch.zeros(n, dtype=torch.uint8) for p, n in recvs.items() if n}
    source, target = torch.full((copy_bytes,), 3, dtype=torch.uint8), torch.zeros(copy_bytes, dtype=torch.uint8)
    samples = []
    for _ in range(repeats + 1):
        ops = [dist.P2POp(dist.isend, b, p) for p, b in sorted(out_buffers.items())]
        ops += [dist.P2POp(dist.irecv, b, p) for p, b in sorted(in_buffers.items())]
        dist.barrier()
        start = time.perf_counter()
        works = dist.batch_isend_irecv(ops) if ops else ()
        target.copy_(source)
        for work in works:
            work.wait()
        dist.barrier()
        samples.append(time.perf_counter() - start)
    return samples[1:]


def _measure(fn: Any, *args: Any, warm: bool) -> dict[str, Any]:
    """Run ``fn`` barrier to barrier on every process; return this process's seconds, RSS growth and details.
    ``warm``: on the heap's freed pages (the RSS growth is then not the memory ``fn`` needs)."""
    rss = memory.reset_peak(trim_first=not warm)
    dist.barrier()
    start = time.perf_counter()
    info = fn(*args)
    dist.barrier()
    info["seconds"] = time.perf_counter() - start
    info["rss_extra"] = memory.peak() - rss
    return info


def _merge(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    phases: dict[str, float] = {}
    for info in per_rank:
        for name, value in info["phases"].items():
            phases[name] = max(phases.get(name, 0.0), value)
    return {
        "seconds": max(i["seconds"] for i in per_rank),
        "phases": phases,
        "peak_rss_extra_bytes": max(i["rss_extra"] for i in per_rank),
    }


def _run_method(ctx: Ctx, method: str, catalog: list, workdir: str) -> list[list[dict[str, Any]]]:
    """Every run of ``method`` (a warm-up, then ``repeats``), each as per-process details."""
    runs = []
    for index in range(1 + ctx.repeats):
        warm = index > 0
        if ctx.new is not None:
            reset_nan(ctx.new)  # anything a method fails to write fails the check
        if method == "direct":
            info = _measure(_direct, ctx, warm=warm)
        elif method == "gather_bcast":
            if runs and ctx.old is not None:  # the previous run freed the old state
                reallocate(ctx.old)
                fill_pattern(ctx.old, ctx.rank)
            info = _measure(_gather_bcast, ctx, catalog, warm=warm)
        else:
            if ctx.rank == 0:
                shutil.rmtree(workdir, ignore_errors=True)
            cold = method.endswith("_cold")
            if method.startswith("dcp_load"):
                written = _dcp_save(ctx, workdir)
                if cold:
                    _evict_page_cache(ctx, workdir)
                info = _measure(_dcp_load, ctx, workdir, warm=warm)
                info["bytes_written"] = written["bytes_written"]
            else:
                info = _measure(_dcp, ctx, workdir, cold, warm=warm)
                info["seconds"] -= info.pop("evict_seconds")  # not part of a save or a load
            if ctx.rank == 0:
                shutil.rmtree(workdir, ignore_errors=True)
        info["bad"] = check_pattern(ctx.new, ctx.rank) if ctx.new is not None else None
        runs.append(_all_gather(info))
    return runs


# --------------------------------------------------------------------------------------------- the worker
def _catalog(model_name: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every state key with its global shape and dtype, sorted (from a meta model: no memory)."""
    with torch.device("meta"):
        model = Llama(get_model_config(model_name))
    out = []
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        out += [(f"param/{name}", shape, param.dtype), (f"optim/{name}/exp_avg", shape, param.dtype)]
        out += [(f"optim/{name}/exp_avg_sq", shape, param.dtype), (f"optim/{name}/step", (), torch.float32)]
    return sorted(out)


def _all_gather(value: Any) -> list[Any]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _log(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def _record(
    method: str, runs: list[list[dict[str, Any]]], bucket_bytes: int, state_bytes: int
) -> dict[str, Any]:
    """One JSON record from every run of a method (direct: the first run is the warm-up)."""
    merged = [_merge(r) for r in runs]
    timed = sorted(range(1, len(runs)), key=lambda i: merged[i]["seconds"])
    median = timed[(len(timed) - 1) // 2]  # the lower median: a run that happened, phases and all
    per_rank = runs[median]
    bad = sorted({i["bad"] for r in runs for i in r if i["bad"]})
    record = {"method": method, **merged[median], "samples": [merged[i]["seconds"] for i in range(1, len(runs))],
              "cold_seconds": merged[0]["seconds"], "peak_rss_extra_bytes": merged[0]["peak_rss_extra_bytes"]}
    record["seconds"] = statistics.median(record["samples"])
    record.update(bit_exact=not bad, mismatch=bad[:3])
    if method == "direct":
        record.update(
            bytes_moved=sum(i["bytes_received"] for i in per_rank),
            bytes_copied=sum(i["bytes_copied"] for i in per_rank),
            peak_extra_bytes=max(i["peak_buffer_bytes"] for i in per_rank),
            peak_bound_bytes=bucket_bytes + max(i["max_row_bytes"] for i in per_rank),
            rounds=max(i["rounds"] for i in per_rank),
        )
    elif method == "gather_bcast":
        record["bytes_moved"] = sum(i["bytes_gathered"] + i["bytes_delivered"] for i in per_rank)
        # Rank 0 holds the whole state at once, whatever the RSS figure says.
        record["peak_extra_bytes"] = max(record["peak_rss_extra_bytes"], state_bytes)
    else:
        written = sum(i["bytes_written"] for i in per_rank)
        read = sum(i["bytes_read"] for i in per_rank)
        record.update(bytes_moved=read if method.startswith("dcp_load") else written + read, bytes_written=written)
        record["peak_extra_bytes"] = record["peak_rss_extra_bytes"] + (
            written if method == "dcp_tmpfs" else 0
        )
    return record


def _memory_record(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The memory run's figures of the process that grew most, and whether every process kept the bound."""
    busiest = max(per_rank, key=lambda r: r["peak_extra_bytes_measured"])
    out = {k: v for k, v in busiest.items() if k != "bad"}
    out["within_memory_bound"] = all(r["peak_extra_bytes_measured"] <= r["memory_bound_bytes"] for r in per_rank)
    out["memory_run_bit_exact"] = not any(r["bad"] for r in per_rank)
    return out


def _bench_transition(
    rank: int, model_name: str, t: Transition, args: dict[str, Any], cache: dict
) -> list[dict]:
    catalog = _catalog(model_name)
    start = time.perf_counter()
    old_mesh, new_mesh = layout_mesh(t.old, t.old_world, cache), layout_mesh(t.new, t.new_world, cache)
    old = build_side(model_name, old_mesh) if old_mesh is not None else None
    new = build_side(model_name, new_mesh) if new_mesh is not None else None
    if old is not None:
        fill_pattern(old, rank)
    if args["full_check"] and old is not None:
        bad = check_full(old)
        assert bad is None, (
            f"source {bad} differs from the pattern under DTensor's own rules: geometry is wrong"
        )
    dist.barrier()
    common = {
        "model": model_name,
        "transition": t.name,
        "old_layout": t.old,
        "new_layout": t.new,
        "old_world": t.old_world,
        "new_world": t.new_world,
        "state_bytes": sum(math.prod(s) * torch.empty((), dtype=d).element_size() for _, s, d in catalog),
        "bucket_bytes": args["bucket_bytes"],
        "build_seconds": time.perf_counter() - start,
    }
    _log(
        rank,
        f"[{model_name} {t.name}] built in {common['build_seconds']:.1f}s, "
        f"state {common['state_bytes'] / 2**20:.0f} MiB",
    )
    ctx = Ctx(
        rank,
        t,
        HybridLayout(**t.old).resolve(t.old_world),
        HybridLayout(**t.new).resolve(t.new_world),
        old,
        new,
        _subgroup(t.old_world, cache),
        _subgroup(t.new_world, cache),
        args["bucket_bytes"],
        args["repeats"],
    )
    records, traffic = [], None
    staged = ctx.old_layout.pp > 1 or ctx.new_layout.pp > 1
    for method in args["methods"]:
        if method == "gather_bcast" and staged:
            # Its catalog walk assumes every old process holds every tensor; with stages each holds its own.
            _log(rank, f"  {method:14s} skipped: not built for pipeline stages")
            continue
        workdir = os.path.join(  # every DCP method on disk but the one named for tmpfs
            args["tmpfs_dir" if method == "dcp_tmpfs" else "disk_dir"], f"bench-mig-{os.getppid()}"
        )
        _settle_disk()
        runs = _run_method(ctx, method, catalog, workdir)
        record = {**common, **_record(method, runs, args["bucket_bytes"], common["state_bytes"])}
        if method == "direct":
            record.update(_memory_record(_all_gather(_memory_run(ctx))))
        if method.startswith("dcp"):
            record["directory"] = workdir
        if method == "direct":
            traffic = (runs[-1][rank]["sends"], runs[-1][rank]["recvs"], runs[-1][rank]["bytes_copied"])
            if args["full_check"] and new is not None:
                bad = check_full(new)  # the new state still holds direct's last result
                record["bit_exact"] = record["bit_exact"] and bad is None
        records.append(record)
        phases = ", ".join(f"{k}={v:.3f}" for k, v in record["phases"].items())
        _log(rank, f"  {method:14s} {record['seconds']:8.3f}s exact={record['bit_exact']} {phases}")
    del ctx, old, new
    memory.trim()
    limits = {}
    if traffic is not None:  # the models are freed first: the raw buffers are as large as the traffic
        sends, recvs, copied = traffic
        for name, copy_bytes in (("link", 0), ("host", copied)):
            _settle_disk()
            limits[name] = max(_all_gather(statistics.median(_link_limit(sends, recvs, args["repeats"], copy_bytes))))
            _log(rank, f"  {name + ' limit':14s} {limits[name]:8.3f}s")
    for record in records:
        record["link_limit_seconds"] = limits.get("link")
        record["host_limit_seconds"] = limits.get("host")
    return records


def _subgroup(size: int, cache: dict) -> Any:
    """A process group over processes ``0..size-1`` (None: the whole world); created once, on every process."""
    if size == dist.get_world_size():
        return None
    if ("group", size) not in cache:
        cache["group", size] = dist.new_group(list(range(size)))
    return cache["group", size]


def _worker(rank: int, world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    keep_freed_host_memory()  # as an elastic worker (see the module's docstring)
    cache: dict[Any, Any] = {}
    records: list[dict[str, Any]] = []
    for model_name, transitions in args["transitions_by_model"].items():
        for t in transitions:
            records += _bench_transition(rank, model_name, t, args, cache)
            if rank == 0:  # after every transition, so a stopped run keeps what it measured
                Path(args["out"]).write_text(json.dumps(records, indent=1))
    return records if rank == 0 else []


# ------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama_25m,llama_125m,llama_350m")
    parser.add_argument("--transitions", default=DEFAULT_TRANSITIONS, help="OLD:NEW,...; r/s/t/p/v + degree")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--world", type=int, default=4, help="processes (the largest world of any transition)"
    )
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="direct migration's buffer budget")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of every method and of the link limit")
    parser.add_argument("--disk-dir", default="/tmp", help="parent of the DCP directory on disk")
    parser.add_argument("--tmpfs-dir", default="/dev/shm", help="parent of the DCP directory on tmpfs")
    parser.add_argument(
        "--full-check", action="store_true", help="also compare full_tensor() with the source"
    )
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--out", default="bench_results/migration.json")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot and summary from --out")
    args = parser.parse_args()
    out = Path(args.out)
    if not args.plot_only:
        methods = [m for m in args.methods.split(",") if m]
        unknown = sorted(set(methods) - set(METHODS))
        if unknown:
            parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
        out.parent.mkdir(parents=True, exist_ok=True)
        transitions = parse_transitions(args.transitions, args.world)
        by_model, skipped = {}, []
        for model_name in filter(None, args.models.split(",")):
            by_model[model_name], cannot = transitions_for(model_name, transitions)
            skipped += cannot
        for reason in skipped:
            print(f"skipped {reason}", flush=True)
        config = {
            "transitions_by_model": by_model,
            "methods": sorted(methods, key=METHODS.index),  # gather_bcast last: it frees the old state
            "bucket_bytes": int(args.bucket_mb * 2**20),
            "repeats": max(1, args.repeats),
            "disk_dir": args.disk_dir,
            "tmpfs_dir": args.tmpfs_dir,
            "full_check": args.full_check,
            "out": str(out),
        }
        try:
            run_distributed(_worker, args.world, config, timeout_s=args.timeout_s, pg_timeout_s=900.0)
        except WorkerFailed as exc:  # keep (and show) what was measured before the failure
            print(f"benchmark stopped early: {exc}", flush=True)
    records = json.loads(out.read_text()) if out.exists() else []
    if not records:
        raise SystemExit(f"no results in {out}")
    plot(records, out.with_suffix(".png"))
    print(summary(records))
    print(f"results: {out}  plot: {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
