"""One layout considered by the picker: enumerated, checked in a fixed order, and estimated.

Pure. Invariants:

* a :class:`Candidate` is either feasible (``rejected is None``, with a batch plan, memory and step estimate) or
  rejected with exactly one human-readable reason: the first failed check in the order of :func:`evaluate`
  (allowed degrees, node boundaries, model split, sequence split, batch arithmetic, idle devices, memory);
* for a feasible candidate the memory estimate fits the usable device memory and ``global batch == micro x
  accumulation x dp`` exactly (a :class:`~lightning_emig.data.batching.BatchPlan` was built for it);
* among its (micro batch, activation checkpointing) options a feasible candidate carries the fastest, ties broken
  by no recomputation, then the larger micro batch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_emig.data.batching import BatchPlan
from lightning_emig.layout import HybridLayout, LayoutError, least_micro_batches, micro_batches_problem
from lightning_emig.picker.constraints import AXES, PickerConstraints
from lightning_emig.picker.memory import MemoryEstimate, estimate_memory
from lightning_emig.picker.throughput import HardwareProfile, StepEstimate, estimate_step_time, within_node

if TYPE_CHECKING:
    from lightning_emig.models.llama import LlamaConfig

GB = 1e9


@dataclass(frozen=True, slots=True)
class Candidate:
    """A layout on ``world - idle_devices`` devices, with its plan and estimates or the reason it was rejected."""

    layout: HybridLayout
    idle_devices: int
    rejected: str | None = None
    plan: BatchPlan | None = None
    activation_checkpointing: bool | None = None
    memory: MemoryEstimate | None = None
    step: StepEstimate | None = None
    migration_bytes: int | None = None

    @property
    def feasible(self) -> bool:
        return self.rejected is None

    @property
    def est_memory_bytes(self) -> int | None:
        return None if self.memory is None else self.memory.total

    @property
    def est_step_seconds(self) -> float | None:
        return None if self.step is None else self.step.total

    @property
    def order_key(self) -> tuple[int, ...]:
        """Fixed preference among equals: fewer idle devices, no pipeline, less TP, less replication."""
        lay = self.layout
        return (self.idle_devices, lay.pp, lay.tp, lay.dp_replicate, lay.dp_shard)

    def to_record(self) -> dict[str, object]:
        plan = self.plan
        return {
            "layout": self.layout.as_dict(),
            "devices": self.layout.world_size,
            "idle_devices": self.idle_devices,
            "micro_batch_size": plan.micro_batch_size if plan else None,
            "grad_accumulation": plan.grad_accumulation if plan else None,
            "activation_checkpointing": self.activation_checkpointing,
            "est_memory_bytes": self.est_memory_bytes,
            "est_step_seconds": self.est_step_seconds,
            "migration_bytes": self.migration_bytes,
            "rejected": self.rejected,
        }


@dataclass(frozen=True, slots=True)
class Problem:
    """Everything a candidate's checks and estimates depend on."""

    world: int
    model: LlamaConfig
    global_batch_size: int
    seq_len: int
    constraints: PickerConstraints
    profile: HardwareProfile


def devices_of(layout: HybridLayout) -> int:
    """Devices a resolved layout uses (``world_size`` without its validation: this runs for every option)."""
    return layout.dp_replicate * layout.dp_shard * layout.tp * layout.pp


def factorizations(devices: int, pp_values: tuple[int, ...]) -> Iterator[HybridLayout]:
    """Every layout using exactly ``devices`` devices with ``pp`` in ``pp_values``, in a fixed order."""
    # Degrees that divide what the outer ones leave, ascending: the order of (pp, tp, replicate) over all divisors,
    # without trying the products that cannot divide (pp_values may list every pp up to the world).
    for pp in pp_values:
        if devices % pp:
            continue
        for tp in _divisors(devices // pp):
            for replicate in _divisors(devices // (pp * tp)):
                yield HybridLayout(dp_replicate=replicate, dp_shard=devices // (pp * tp * replicate), tp=tp, pp=pp)


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def structural_reason(problem: Problem, layout: HybridLayout) -> str | None:
    """Why ``layout`` can never run here whatever the memory, or ``None``."""
    c = problem.constraints
    for axis in AXES:
        degree = getattr(layout, axis)
        if not c.allowed(axis, degree):
            values = getattr(c, axis)
            return f"{axis}={degree} not allowed ({axis} in {list(values) if values else [1]})"
    dpn = c.devices_per_node
    if c.tp_within_node and not within_node(layout.tp, dpn):
        if layout.tp > dpn:
            return f"tp={layout.tp} crosses nodes ({dpn} devices per node)"
        return f"tp={layout.tp} groups straddle nodes ({layout.tp} does not divide {dpn} devices per node)"
    try:
        problem.model.validate_layout(layout)
    except LayoutError as error:
        return str(error)
    if problem.seq_len % layout.tp:
        return f"seq_len {problem.seq_len} not divisible by tp={layout.tp} (sequence parallelism splits it)"
    if not batch_plans(problem, layout):
        micros = c.micro_batch_options()
        micro = f"micro {micros[0]}" if len(micros) == 1 else f"any micro in {list(micros)}"
        if least_micro_batches(c.pipeline_schedule, layout.pp) > 1:
            return (f"1f1b needs >= pp={layout.pp} micro-batches per step: global batch {problem.global_batch_size} "
                    f"gives fewer with {micro} x dp {layout.dp}")
        if layout.pp > 1 and c.pipeline_schedule == "interleaved_1f1b":
            return (f"interleaved_1f1b needs micro-batches per step fewer than pp={layout.pp} or in equal rounds of "
                    f"it: global batch {problem.global_batch_size} gives none with {micro} x dp {layout.dp}")
        return f"global batch {problem.global_batch_size} not divisible by {micro} x dp {layout.dp}"
    return None


def batch_plans(problem: Problem, layout: HybridLayout) -> list[BatchPlan]:
    dp = layout.dp_replicate * layout.dp_shard
    # BatchPlan validates again; the modulo first keeps the search off its (costly) error path.
    plans = [BatchPlan(problem.global_batch_size, micro, dp) for micro in problem.constraints.micro_batch_options()
             if problem.global_batch_size % (micro * dp) == 0]
    schedule = problem.constraints.pipeline_schedule
    return [plan for plan in plans if micro_batches_problem(schedule, layout.pp, plan.grad_accumulation) is None]


def evaluate(problem: Problem, layout: HybridLayout) -> Candidate:
    """Check ``layout`` (resolved, on at most ``problem.world`` devices) and estimate its best option."""
    return evaluate_checked(problem, layout, structural_reason(problem, layout))


def evaluate_checked(problem: Problem, layout: HybridLayout, reason: str | None) -> Candidate:
    """:func:`evaluate` with :func:`structural_reason` already computed."""
    idle = problem.world - devices_of(layout)
    if reason is None and idle and not problem.constraints.idle_devices_allowed:
        reason = f"leaves {idle} devices idle (idle_devices_allowed is false)"
    if reason is not None:
        return Candidate(layout, idle, rejected=reason)
    options = [_option(problem, layout, plan, ac) for plan in batch_plans(problem, layout)
               for ac in problem.constraints.checkpointing_options()]
    limit = problem.constraints.device_memory_bytes
    fitting = [o for o in options if limit is None or o.memory.total <= limit]
    if not fitting:
        smallest = min(options, key=lambda o: (o.memory.total, o.plan.micro_batch_size))
        return Candidate(layout, idle, rejected=_memory_reason(smallest, problem.constraints))
    return min(fitting, key=lambda o: (o.step.total, o.activation_checkpointing, -o.plan.micro_batch_size))


def _option(problem: Problem, layout: HybridLayout, plan: BatchPlan, checkpointing: bool) -> Candidate:
    c = problem.constraints
    common = {"seq_len": problem.seq_len, "micro_batch_size": plan.micro_batch_size,
              "mixed_precision": c.mixed_precision, "activation_checkpointing": checkpointing}
    memory = estimate_memory(problem.model, layout, grad_accumulation=plan.grad_accumulation,
                             pipeline_schedule=c.pipeline_schedule, defer_grad_sync=c.defer_grad_sync, **common)
    step = estimate_step_time(problem.model, layout, grad_accumulation=plan.grad_accumulation,
                              devices_per_node=c.devices_per_node, profile=problem.profile,
                              defer_grad_sync=c.defer_grad_sync, **common)
    return Candidate(layout, problem.world - devices_of(layout), plan=plan, activation_checkpointing=checkpointing,
                     memory=memory, step=step)


def _memory_reason(smallest: Candidate, c: PickerConstraints) -> str:
    assert smallest.memory is not None and smallest.plan is not None and c.device_memory_gb is not None
    how = f"micro {smallest.plan.micro_batch_size}"
    if smallest.activation_checkpointing:
        how += ", activation checkpointing"
    return (f"memory {smallest.memory.total / GB:.1f} GB > {c.device_memory_bytes / GB:.1f} GB usable "
            f"({c.usable_memory_fraction:.0%} of {c.device_memory_gb:g} GB) even at {how}")
