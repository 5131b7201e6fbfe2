"""Simulate a reconfiguration at cluster scale with the project's real planner and geometry, without tensors.

For each model and world change (``--transitions 1024:768,...``) it builds the migrated state's tensors from the
model's shapes (:mod:`lightning_emig.picker.migration_cost`: tensors of equal geometry planned once, weighted by
their count), the identity map of a live change, and then reports:

* ``plan_seconds_per_rank``: the median wall time of the real :func:`~lightning_emig.migration.planner.plan_for_rank`
  over sampled processes (``--samples`` spread over the union of old and new processes, plus the one receiving the
  most bytes), each with the geometry caches cleared first, as a fresh process plans once;
* ``total_bytes``, ``max_rank_bytes``, ``mean_rank_bytes`` (over new ranks), ``intra_node_bytes``,
  ``inter_node_bytes``: bytes received over the wire (local copies excluded), from the real plans of every process
  (:func:`~lightning_emig.migration.planner.plan_all`), the peers' nodes saying intra or inter; with
  ``--per-class N``, from ``plan_for_rank`` on N processes spread over each class (survivors, joiners, leavers),
  scaled to the class's size (``traffic_exact`` is then false, and ``max_rank_bytes`` is the sample's). Planning
  every process holds every transfer at once: with HSDP replicas, the naive shuffle below or the picker's layouts
  a plan can have thousands of transfers a process, so use ``--per-class`` there;
* ``est_transfer_seconds``: the slowest process's busiest link direction, ``max(bytes / intra_bw)`` over what it
  receives and sends within its node and ``max(bytes / inter_bw)`` across nodes (a link sends and receives at
  once), plus ``latency_s``; ``est_transfer_bandwidth_seconds`` is the same without the latency;
* ``peak_extra_bytes_per_rank``: the transfer's bound on memory above ``max(old, new)`` state
  (:mod:`~lightning_emig.migration.transfer`): one round's buffers (``bucket_bytes``) plus the largest single fp32
  tensor shard the process holds, old or new; the max over processes;
* ``est_checkpoint_restart_seconds``: the alternative, writing the whole state and reading it back at aggregate
  storage bandwidth, plus a restart;
* ``naive_*``: the same bytes under a naive rank assignment, survivors' new ranks shuffled (seeded) over the new
  world, so few survivors keep their shards and tensor-parallel groups span nodes (``tp_groups_across_nodes`` and
  ``naive_tp_groups_across_nodes`` count those of the new layout). The project's assignment for a change of world
  is the default rank order (:mod:`~lightning_emig.migration.rank_order` chooses among orders only on unchanged
  processes), so this compares that default with no assignment at all.

Identity: ``IdentityMap.first_ranks`` with nodes: process ``p`` keeps old rank ``p`` and gets new rank ``p``; a
shrinking world loses its top processes (whole nodes), a growing one appends joiners; every old process, leavers
included, is alive to send (a change with notice); ``node = rank // devices_per_node``.

Layouts: ``--layout WORLD:tp=8,pp=4`` or ``--layout '*:dp_replicate=-1,dp_shard=8,tp=8'`` for every world (missing
degrees: 1, and ``dp_shard`` the rest unless another is ``-1``); otherwise
``--picker`` asks :func:`~lightning_emig.picker.search.pick_layout` (with ``--global-batch`` and ``--seq-len``, 80 GB
devices, 8 per node, pipeline allowed, no idle devices; the new world's pick knows the old layout, so migration bytes
break near-ties as in a live change), or else the fixed rule of :func:`rule_layout`: ``tp`` =
devices per node, ``pp`` the smallest power of two for which one stage's TP-local bf16 weights take at most a quarter
of device memory (the rest is for activations, sharded state and buffers), ``dp_shard`` the rest. The picker is not
the default: it takes 1-7 s a world at 1024 GPUs and 24-28 s at 16384 on one CPU core (every candidate layout of
every device count up to the world is estimated), and its layouts at 16384 (thousands of HSDP replicas, some devices
idle) make plans of tens of thousands of transfers a process, which only ``--per-class`` sampling keeps short.

Assumptions (defaults; every one a flag, none measured here):

* ``--intra-bw 400e9``: bytes/s per GPU inside a node, NVLink class (NVLink 4 is 450 GB/s each way on H100 SXM);
* ``--inter-bw 50e9``: bytes/s per GPU across nodes, one 400 Gb/s NIC per GPU (H100/H200 reference nodes);
* ``--latency-s 2``: fixed cost of a change (union process group creation, plan, synchronization), a guess;
* ``--bucket-bytes`` 256 MiB: the transfer's default round budget (``DEFAULT_BUCKET_BYTES``);
* ``--storage-bw 100e9``: aggregate bytes/s of the checkpoint file system, each direction (a mid-size parallel
  file system; large Lustre/GPFS/VAST installations quote 100 GB/s to a few TB/s), an assumption;
* ``--restart-s 120``: relaunching the job, process group and model initialization, an assumption.

Example (the committed results, ``docs/results/simulate.md``)::

    .venv/bin/python tools/simulate.py --models 8b 70b 405b --out docs/results/simulate.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from lightning_emig.layout import HybridLayout, MeshAxis
from lightning_emig.migration import geometry
from lightning_emig.migration.identity import IdentityMap, ProcessInfo
from lightning_emig.migration.planner import (
    PlanOptions,
    RankPlan,
    TensorMigration,
    Transfer,
    plan_all,
    plan_for_rank,
)
from lightning_emig.migration.rank_order import groups_across_nodes
from lightning_emig.migration.transfer import DEFAULT_BUCKET_BYTES
from lightning_emig.models.llama import LlamaConfig
from lightning_emig.picker.migration_cost import MIGRATED_BYTES_PER_ELEMENT, grouped_migrations
from lightning_emig.picker.shapes import param_counts

#: Llama 3 shapes (Meta's model cards / params.json); max_seq_len only bounds the picker's sequence length.
MODELS: dict[str, LlamaConfig] = {
    "8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256,
                      max_seq_len=8192),
    "70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, vocab_size=128256,
                       max_seq_len=8192),
    "405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248, vocab_size=128256,
                        max_seq_len=8192),
}
DEFAULT_TRANSITIONS = ((1024, 768), (4096, 4608), (16384, 12288))
#: The live state holds the parameter and each AdamW moment as separate fp32 tensors.
FP32_BYTES = 4
BF16_BYTES = 2


@dataclass(frozen=True, slots=True)
class Assumptions:
    """The cost model's constants (see the module docstring for where each comes from)."""

    devices_per_node: int = 8
    device_memory_gb: float = 80.0
    intra_bw: float = 400e9
    inter_bw: float = 50e9
    latency_s: float = 2.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    storage_bw: float = 100e9
    restart_s: float = 120.0
    bytes_per_element: int = MIGRATED_BYTES_PER_ELEMENT


@dataclass(frozen=True, slots=True)
class Traffic:
    """What one process receives and sends, split by whether the peer is on its node, and its largest single fp32
    tensor shard."""

    recv_intra: int
    recv_inter: int
    send_intra: int
    send_inter: int
    largest_shard_bytes: int

    @property
    def received(self) -> int:
        return self.recv_intra + self.recv_inter

    def seconds(self, assumptions: Assumptions) -> float:
        """Its links' busiest direction: NVLink and the NIC each send and receive at once."""
        intra = max(self.recv_intra, self.send_intra) / assumptions.intra_bw
        return max(intra, max(self.recv_inter, self.send_inter) / assumptions.inter_bw)


# ------------------------------------------------------------------------------------------------ layouts
def rule_layout(model: LlamaConfig, world: int, devices_per_node: int = 8, device_memory_gb: float = 80.0
                ) -> HybridLayout:
    """tp over a node, the fewest (power of two) stages whose TP-local bf16 weights fit a quarter of a device."""
    tp = devices_per_node
    counts = param_counts(model)
    pp = 1
    while counts.stage_local(tp, pp) * BF16_BYTES > device_memory_gb * 1e9 / 4:
        pp *= 2
        if pp > model.n_layers or (world // tp) % pp:
            raise ValueError(f"no power-of-two pp fits {model} on {world} devices under the rule")
    return HybridLayout(tp=tp, pp=pp).resolve(world)


def picker_layout(model: LlamaConfig, world: int, *, global_batch: int, seq_len: int, assumptions: Assumptions,
                  current: HybridLayout | None = None) -> HybridLayout:
    """The picker's choice; with ``current`` (the layout the state is in) migration bytes break near-ties, as in a
    live change."""
    from lightning_emig.picker.constraints import PickerConstraints
    from lightning_emig.picker.search import pick_layout

    constraints = PickerConstraints(devices_per_node=assumptions.devices_per_node,
                                    device_memory_gb=assumptions.device_memory_gb, allow_pp=True,
                                    idle_devices_allowed=False)
    return pick_layout(world, model, global_batch_size=global_batch, seq_len=seq_len, constraints=constraints,
                       current=current).layout


def parse_layout(text: str) -> tuple[str, HybridLayout]:
    """``WORLD:tp=8,pp=4`` (or ``*:...`` for any world) -> (world key, layout); ``dp_shard`` fills the world
    unless another degree is ``-1``."""
    world, _, degrees = text.partition(":")
    kwargs = {k.strip(): int(v) for k, v in (part.split("=") for part in degrees.split(",") if part.strip())}
    if -1 not in kwargs.values():
        kwargs.setdefault("dp_shard", -1)
    return world.strip(), HybridLayout(**kwargs)


# ------------------------------------------------------------------------------------------- the change
def identity_for(old_world: int, new_world: int, devices_per_node: int, shuffle_seed: int | None = None
                 ) -> IdentityMap:
    """``first_ranks`` with nodes; with ``shuffle_seed`` the new ranks are a seeded permutation (the naive case)."""
    n = max(old_world, new_world)
    new_ranks = list(range(new_world))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(new_ranks)
    procs = tuple(ProcessInfo(p, p // devices_per_node, p if p < old_world else None,
                              new_ranks[p] if p < new_world else None) for p in range(n))
    return IdentityMap(procs, old_world, new_world)


def migrations(model: LlamaConfig, old: HybridLayout, new: HybridLayout, bytes_per_element: int
               ) -> list[TensorMigration]:
    return grouped_migrations(model, old, new, bytes_per_element)


# ------------------------------------------------------------------------------------------- traffic
def traffic_of(plan: RankPlan, tensors: Sequence[TensorMigration], identity: IdentityMap) -> Traffic:
    """A real plan's bytes by where the peers sit."""
    me = identity.process(plan.pid)

    def local(pids: Sequence[int], transfers: Sequence[Transfer]) -> int:
        return sum(t.nbytes for t, pid in zip(transfers, pids, strict=True) if identity.process(pid).node == me.node)

    recv_intra = local([t.src for t in plan.recvs], plan.recvs)
    send_intra = local([t.dst for t in plan.sends], plan.sends)
    largest = max(_largest_piece_bytes(t, me) for t in tensors)
    return Traffic(recv_intra, plan.bytes_received - recv_intra, send_intra, plan.bytes_sent - send_intra, largest)


def _largest_piece_bytes(tensor: TensorMigration, me: ProcessInfo) -> int:
    """Largest single fp32 tensor shard ``me`` holds of this group, old or new (the group's count divided out)."""
    sizes = [0]
    for sharding, rank in ((tensor.old, me.old_rank), (tensor.new, me.new_rank)):
        holding = sharding.holding_of_rank(rank) if rank is not None else None
        sizes.append(holding.numel if holding is not None else 0)
    return max(sizes) * FP32_BYTES


def process_classes(identity: IdentityMap) -> dict[str, list[int]]:
    """Pids of survivors, joiners and leavers: processes of one class do alike, so a sample stands for its class."""
    classes: dict[str, list[int]] = {"stay": [], "join": [], "leave": []}
    for p in identity.processes:
        kind = "join" if p.old_rank is None else "leave" if p.new_rank is None else "stay"
        classes[kind].append(p.pid)
    return classes


def spread(pids: Sequence[int], count: int | None) -> list[int]:
    """``count`` pids evenly spread over ``pids`` (first and last included); all of them for ``None``."""
    if count is None or count >= len(pids):
        return list(pids)
    if count == 1:
        return [pids[0]]
    return sorted({pids[(i * (len(pids) - 1)) // (count - 1)] for i in range(count)})


def plans_of(tensors: Sequence[TensorMigration], identity: IdentityMap, per_class: int | None
             ) -> dict[int, RankPlan]:
    """Every process's plan (``plan_all``), or ``per_class`` processes of each class (``plan_for_rank``)."""
    if per_class is None:
        return plan_all(tensors, identity)
    pids = [pid for members in process_classes(identity).values() for pid in spread(members, per_class)]
    return {pid: plan_for_rank(tensors, identity, pid) for pid in pids}


@dataclass(frozen=True, slots=True)
class TrafficTotals:
    """Sums over processes: exact when every process was planned, else each class's sample scaled to its size."""

    total: float
    intra: float
    inter: float
    max_rank: int
    busiest_pid: int
    max_link_seconds: float
    largest_shard_bytes: int
    exact: bool


def traffic_totals(tensors: Sequence[TensorMigration], identity: IdentityMap, assumptions: Assumptions,
                   per_class: int | None = None) -> TrafficTotals:
    """Bytes of every process (``per_class=None``) or of ``per_class`` spread over each class, extrapolated."""
    plans = plans_of(tensors, identity, per_class)
    counted = {pid: traffic_of(plan, tensors, identity) for pid, plan in plans.items()}
    intra = inter = 0.0
    exact = True
    for members in process_classes(identity).values():
        sample = [pid for pid in members if pid in counted]
        exact = exact and len(sample) == len(members)
        weight = len(members) / len(sample) if sample else 0.0
        intra += weight * sum(counted[pid].recv_intra for pid in sample)
        inter += weight * sum(counted[pid].recv_inter for pid in sample)
    busiest = max(counted, key=lambda p: (counted[p].received, -p))
    return TrafficTotals(total=intra + inter, intra=intra, inter=inter, max_rank=counted[busiest].received,
                         busiest_pid=busiest, max_link_seconds=max(t.seconds(assumptions) for t in counted.values()),
                         largest_shard_bytes=max(t.largest_shard_bytes for t in counted.values()), exact=exact)


# --------------------------------------------------------------------------------------- sampled plans
def timed_plan(tensors: Sequence[TensorMigration], identity: IdentityMap, pid: int, repeats: int = 3
               ) -> tuple[float, RankPlan]:
    """One process's real plan, the best of ``repeats`` runs, each from cold geometry caches (a process plans once,
    and the best run is the one least disturbed by the rest of this machine)."""
    best = math.inf
    for _ in range(repeats):
        geometry._holding.cache_clear()  # noqa: SLF001 - a cold cache is what a process planning once sees
        geometry._sources.cache_clear()  # noqa: SLF001
        start = time.perf_counter()
        plan = plan_for_rank(tensors, identity, pid, PlanOptions())
        best = min(best, time.perf_counter() - start)
    return best, plan


# ------------------------------------------------------------------------------------------ the record
def simulate(name: str, model: LlamaConfig, old: HybridLayout, new: HybridLayout, assumptions: Assumptions, *,
             samples: int = 8, per_class: int | None = None, naive: bool = True) -> dict[str, object]:
    """Everything the module docstring lists, for one model and one change of layout (``per_class``: count that
    many processes of each class and extrapolate, instead of every process)."""
    identity = identity_for(old.world_size, new.world_size, assumptions.devices_per_node)
    tensors = migrations(model, old, new, assumptions.bytes_per_element)
    totals = traffic_totals(tensors, identity, assumptions, per_class)
    pids = list(dict.fromkeys([*spread(identity.pids, samples), totals.busiest_pid]))
    timed = [timed_plan(tensors, identity, pid) for pid in pids]
    record: dict[str, object] = {
        "model": name,
        "world_from": old.world_size,
        "world_to": new.world_size,
        "layout_from": old.as_dict(),
        "layout_to": new.as_dict(),
        "plan_seconds_per_rank": statistics.median(seconds for seconds, _ in timed),
        "plan_seconds_max": max(seconds for seconds, _ in timed),
        "planned_pids": pids,
        "traffic_exact": totals.exact,
        "total_bytes": round(totals.total),
        "max_rank_bytes": totals.max_rank,
        "mean_rank_bytes": totals.total / new.world_size,
        "intra_node_bytes": round(totals.intra),
        "inter_node_bytes": round(totals.inter),
        "est_transfer_bandwidth_seconds": totals.max_link_seconds,
        "est_transfer_seconds": totals.max_link_seconds + assumptions.latency_s,
        "peak_extra_bytes_per_rank": assumptions.bucket_bytes + totals.largest_shard_bytes,
        "state_bytes": _state_bytes(model, assumptions),
        "est_checkpoint_restart_seconds": checkpoint_restart_seconds(model, assumptions),
        "tp_groups_across_nodes": _tp_spread(new, identity),
    }
    if naive:
        record.update(_naive(tensors, old, new, assumptions, per_class))
    return record


def _tp_spread(layout: HybridLayout, identity: IdentityMap) -> int:
    """Tensor-parallel groups of the new layout whose processes sit on more than one node."""
    nodes = [identity.by_new_rank(r).node for r in range(identity.new_world)]
    return groups_across_nodes(layout, nodes)[MeshAxis.TP]


def _naive(tensors: Sequence[TensorMigration], old: HybridLayout, new: HybridLayout, assumptions: Assumptions,
           per_class: int | None) -> dict[str, object]:
    """Bytes under shuffled new ranks (seed 0): no rank assignment at all."""
    identity = identity_for(old.world_size, new.world_size, assumptions.devices_per_node, shuffle_seed=0)
    totals = traffic_totals(tensors, identity, assumptions, per_class)
    return {
        "naive_total_bytes": round(totals.total),
        "naive_inter_node_bytes": round(totals.inter),
        "naive_tp_groups_across_nodes": _tp_spread(new, identity),
    }


def _state_bytes(model: LlamaConfig, assumptions: Assumptions) -> int:
    return model_numel(model) * assumptions.bytes_per_element


def model_numel(model: LlamaConfig) -> int:
    return param_counts(model).total


def checkpoint_restart_seconds(model: LlamaConfig, assumptions: Assumptions) -> float:
    """Write the whole state, read it back (both at aggregate storage bandwidth), restart the job."""
    return 2 * _state_bytes(model, assumptions) / assumptions.storage_bw + assumptions.restart_s


# ---------------------------------------------------------------------------------------------- output
COLUMNS = (
    ("model", "model", "{}"),
    ("change", None, "{}"),
    ("layout from > to", None, "{}"),
    ("plan ms/rank", "plan_seconds_per_rank", "ms"),
    ("total GB", "total_bytes", "gb"),
    ("max/rank MB", "max_rank_bytes", "mb"),
    ("mean/rank MB", "mean_rank_bytes", "mb"),
    ("intra GB", "intra_node_bytes", "gb"),
    ("inter GB", "inter_node_bytes", "gb"),
    ("naive total GB", "naive_total_bytes", "gb"),
    ("naive inter GB", "naive_inter_node_bytes", "gb"),
    ("TP groups off-node (naive)", None, "{}"),
    ("links s", "est_transfer_bandwidth_seconds", "{:.3f}"),
    ("transfer s", "est_transfer_seconds", "{:.2f}"),
    ("peak extra MB", "peak_extra_bytes_per_rank", "mb"),
    ("ckpt+restart s", "est_checkpoint_restart_seconds", "{:.0f}"),
)


def short_layout(layout: dict[str, object]) -> str:
    """``r2s4t2p1``: dp_replicate, dp_shard, tp, pp degrees."""
    return "r{dp_replicate}s{dp_shard}t{tp}p{pp}".format(**layout)


def _cell(record: dict[str, object], title: str, key: str | None, fmt: str) -> str:
    if title == "change":
        return f"{record['world_from']}->{record['world_to']}"
    if title == "layout from > to":
        return f"{short_layout(record['layout_from'])} > {short_layout(record['layout_to'])}"  # type: ignore[arg-type]
    if title.startswith("TP groups"):
        return f"{record['tp_groups_across_nodes']} ({record.get('naive_tp_groups_across_nodes', '-')})"
    value = record.get(key or "")
    if value is None:
        return "-"
    scale = {"gb": 1e-9, "mb": 1e-6, "ms": 1e3}
    return f"{value * scale[fmt]:.2f}" if fmt in scale else fmt.format(value)


def table(records: Sequence[dict[str, object]]) -> str:
    """A Markdown table (GB = 1e9 bytes, MB = 1e6)."""
    rows = [[_cell(r, title, key, fmt) for title, key, fmt in COLUMNS] for r in records]
    head = [title for title, _, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def plan_time_growth(records: Sequence[dict[str, object]], small: int = 1024, large: int = 16384
                     ) -> dict[str, float]:
    """Per model: plan seconds per rank leaving a world of ``large`` over leaving one of ``small``."""
    by_model: dict[str, dict[int, float]] = {}
    for r in records:
        by_model.setdefault(str(r["model"]), {})[int(r["world_from"])] = float(r["plan_seconds_per_rank"])
    return {m: t[large] / t[small] for m, t in by_model.items() if small in t and large in t}


# ---------------------------------------------------------------------------------------------- command
def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = Assumptions()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--transitions", default=",".join(f"{a}:{b}" for a, b in DEFAULT_TRANSITIONS),
                   help="comma-separated OLD:NEW world sizes")
    p.add_argument("--layout", action="append", default=[],
                   help="WORLD:tp=8,pp=4, or *:... for every world (repeatable; all models)")
    p.add_argument("--picker", action="store_true", help="ask the layout picker for worlds without --layout")
    p.add_argument("--global-batch", type=int, default=3072, help="sequences per step (--picker only)")
    p.add_argument("--seq-len", type=int, default=8192, help="--picker only")
    p.add_argument("--with-bf16-params", action="store_true", help="migrate a bf16 copy of the parameters too")
    p.add_argument("--samples", type=int, default=8, help="processes whose plans are timed (plus the busiest)")
    p.add_argument("--per-class", type=int, default=None,
                   help="plan this many survivors, joiners and leavers each and extrapolate (default: every process, "
                        "exact; use it with replicas, where plans are large)")
    p.add_argument("--no-naive", action="store_true", help="skip the shuffled-rank comparison")
    for field in ("intra_bw", "inter_bw", "latency_s", "storage_bw", "restart_s"):
        p.add_argument("--" + field.replace("_", "-"), type=float, default=getattr(defaults, field))
    p.add_argument("--bucket-bytes", type=int, default=defaults.bucket_bytes)
    p.add_argument("--devices-per-node", type=int, default=defaults.devices_per_node)
    p.add_argument("--out", help="write the records as JSON here")
    return p.parse_args(argv)


def _assumptions(args: argparse.Namespace) -> Assumptions:
    extra = BF16_BYTES if args.with_bf16_params else 0
    return Assumptions(devices_per_node=args.devices_per_node, intra_bw=args.intra_bw, inter_bw=args.inter_bw,
                       latency_s=args.latency_s, bucket_bytes=args.bucket_bytes, storage_bw=args.storage_bw,
                       restart_s=args.restart_s, bytes_per_element=MIGRATED_BYTES_PER_ELEMENT + extra)


def _layout_for(args: argparse.Namespace, model: LlamaConfig, world: int, given: dict[str, HybridLayout],
                assumptions: Assumptions, current: HybridLayout | None = None) -> HybridLayout:
    for key in (str(world), "*"):
        if key in given:
            return given[key].resolve(world)
    if args.picker:
        return picker_layout(model, world, global_batch=args.global_batch, seq_len=args.seq_len,
                             assumptions=assumptions, current=current)
    return rule_layout(model, world, assumptions.devices_per_node, assumptions.device_memory_gb)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    assumptions = _assumptions(args)
    given = dict(parse_layout(text) for text in args.layout)
    transitions = [tuple(int(w) for w in pair.split(":")) for pair in args.transitions.split(",")]
    records = []
    for name in args.models:
        model = MODELS[name]
        for old_world, new_world in transitions:
            start = time.perf_counter()
            old = _layout_for(args, model, old_world, given, assumptions)
            new = _layout_for(args, model, new_world, given, assumptions, current=old)
            record = simulate(name, model, old, new, assumptions, samples=args.samples, per_class=args.per_class,
                              naive=not args.no_naive)
            record["simulate_seconds"] = time.perf_counter() - start
            records.append(record)
            print(f"{name} {old_world}->{new_world}: {record['simulate_seconds']:.1f}s", file=sys.stderr, flush=True)
    growth = plan_time_growth(records)
    print(table(records))
    print("plan time per rank, leaving 16384 over leaving 1024:",
          ", ".join(f"{m} {g:.2f}x" for m, g in growth.items()) or "-")
    if args.out:
        payload = {"command": " ".join(["tools/simulate.py", *(argv if argv is not None else sys.argv[1:])]),
                   "assumptions": asdict(assumptions), "plan_time_growth_16384_over_1024": growth,
                   "records": records}
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
