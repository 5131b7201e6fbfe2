"""The layout picker: the layout for the devices the job has now, with the table that explains it.

Pure and deterministic: every rank that calls :func:`pick_layout` with the same inputs gets the same answer (fixed
enumeration order, ties broken by :attr:`~lightning_emig.picker.candidates.Candidate.order_key`, no sets or hashes).

Rules, in order:

1. an explicit ``constraints.table[world]`` entry is the answer (checked like any candidate; an entry that cannot run
   is an error, never silently replaced);
2. candidates are every layout on all ``world`` devices (each rejected one with its reason) and, when idle devices
   are allowed, the layouts on fewer devices that could run (their structure and batch arithmetic hold);
3. feasible candidates are ranked by estimated step time; those within ``tie_tolerance`` of the fastest are a
   near-tie, won by the fewest idle devices, then the fewest migration bytes from ``current``, then the fastest;
   so a device is left idle only when every layout using it is slower by more than the tolerance, or when no
   layout uses all devices;
4. no feasible candidate is an error that lists why each one was rejected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from lightning_emig.picker.candidates import (
    Candidate,
    Problem,
    evaluate,
    evaluate_checked,
    factorizations,
    structural_reason,
)
from lightning_emig.picker.constraints import PickerConstraints, PickerError
from lightning_emig.picker.migration_cost import estimate_migration_bytes
from lightning_emig.picker.report import describe_choice, render_table
from lightning_emig.picker.throughput import HardwareProfile

if TYPE_CHECKING:
    from lightning_emig.layout import HybridLayout
    from lightning_emig.models.llama import LlamaConfig

MigrationBytes = Callable[["HybridLayout", "HybridLayout"], int]
#: Besides the near-ties, migration bytes are estimated for this many of the fastest candidates (for the table).
MIGRATION_ROWS = 8


class NoFeasibleLayoutError(PickerError):
    """No layout can run on this world under these constraints; ``candidates`` say why each was rejected."""

    def __init__(self, message: str, candidates: tuple[Candidate, ...]) -> None:
        super().__init__(message)
        self.candidates = candidates


@dataclass(frozen=True, slots=True)
class PickResult:
    """The chosen candidate, every candidate considered (chosen first, then by step time, then rejected)."""

    world: int
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    explanation: str
    current: HybridLayout | None = None

    @property
    def layout(self) -> HybridLayout:
        return self.chosen.layout

    @property
    def idle_devices(self) -> int:
        return self.chosen.idle_devices

    def table(self, max_rows: int | None = 12) -> str:
        """The candidates as text: feasible ones (up to ``max_rows``), then every rejected full-world layout."""
        return render_table(self.world, self.explanation, self.chosen, self.candidates, max_rows)

    def to_record(self) -> dict[str, object]:
        """A JSON-able record of the choice and of every candidate."""
        chosen = self.chosen.to_record()
        return {
            "world": self.world,
            **{k: v for k, v in chosen.items() if k != "rejected"},
            "current": None if self.current is None else self.current.as_dict(),
            "explanation": self.explanation,
            "candidates": [c.to_record() for c in self.candidates],
        }


def pick_layout(
    world: int,
    model: LlamaConfig,
    *,
    global_batch_size: int,
    seq_len: int,
    constraints: PickerConstraints | None = None,
    profile: HardwareProfile | None = None,
    current: HybridLayout | None = None,
    migration_bytes: MigrationBytes | None = None,
) -> PickResult:
    """Choose the layout for ``world`` devices (see the module docstring for the rules).

    Args:
        current: The layout the state is in now (resolved), or ``None`` at start (no migration cost).
        migration_bytes: ``(old, new) -> bytes`` moved by the change; default: :func:`estimate_migration_bytes`
            from the model's shapes and the planner's geometry.
    Raises:
        PickerError: settings no layout of this model can meet, or a pinned table entry that cannot run.
        NoFeasibleLayoutError: nothing fits this world.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise PickerError(f"world must be a positive int, got {world!r}")
    constraints = constraints or PickerConstraints()
    constraints.check_model(model, seq_len=seq_len)
    problem = Problem(world, model, global_batch_size, seq_len, constraints, profile or HardwareProfile())
    cost = migration_bytes or _default_cost(model, constraints.devices_per_node)
    if world in constraints.table:
        return _pinned(problem, constraints.table[world], current, cost)
    candidates = _enumerate(problem)
    feasible = sorted((c for c in candidates if c.feasible), key=lambda c: (c.est_step_seconds, c.order_key))
    if not feasible:
        raise NoFeasibleLayoutError(_nothing_fits(problem, candidates), tuple(candidates))
    tol = constraints.tie_tolerance
    near = [c for c in feasible if c.est_step_seconds <= feasible[0].est_step_seconds * (1 + tol)]
    if current is not None:
        costed = {id(c) for c in [*near, *feasible[:MIGRATION_ROWS]]}
        feasible = [dataclasses.replace(c, migration_bytes=cost(current, c.layout)) if id(c) in costed else c
                    for c in feasible]
        near = feasible[:len(near)]
    chosen = min(near, key=lambda c: (c.idle_devices, c.migration_bytes or 0, c.est_step_seconds, c.order_key))
    rest = [c for c in feasible if c is not chosen] + [c for c in candidates if not c.feasible]
    return PickResult(world, chosen, (chosen, *rest), describe_choice(problem, chosen, feasible, near, candidates),
                      current)


def _default_cost(model: LlamaConfig, devices_per_node: int) -> MigrationBytes:
    @lru_cache(maxsize=256)
    def cost(old: HybridLayout, new: HybridLayout) -> int:
        return estimate_migration_bytes(model, old, new, devices_per_node=devices_per_node)

    return cost


def _pp_values(problem: Problem) -> tuple[int, ...]:
    c = problem.constraints
    if c.pp is not None:
        return c.pp
    return tuple(range(1, problem.world + 1)) if c.allow_pp else (1,)


def _enumerate(problem: Problem) -> list[Candidate]:
    """Every full-world layout, then (idle allowed) runnable layouts on fewer devices, most devices first."""
    pp_values = _pp_values(problem)
    out = [evaluate(problem, layout) for layout in factorizations(problem.world, pp_values)]
    if problem.constraints.idle_devices_allowed:
        for devices in range(problem.world - 1, 0, -1):
            out += [evaluate_checked(problem, layout, None) for layout in factorizations(devices, pp_values)
                    if structural_reason(problem, layout) is None]
    return out


def _pinned(problem: Problem, layout: HybridLayout, current: HybridLayout | None,
            cost: MigrationBytes) -> PickResult:
    # A pinned entry overrides the degree lists, not the facts: the model, nodes, batch and memory still hold.
    free = dataclasses.replace(problem.constraints, dp_replicate=None, dp_shard=None, tp=None, pp=None)
    candidate = evaluate(dataclasses.replace(problem, constraints=free), layout)
    if not candidate.feasible:
        raise PickerError(
            f"table[{problem.world}] pins {layout.describe()}, which cannot run: {candidate.rejected}; "
            "change or remove that table entry"
        )
    if current is not None:
        candidate = dataclasses.replace(candidate, migration_bytes=cost(current, layout))
    explanation = f"pinned by table[{problem.world}]"
    if candidate.idle_devices:
        explanation += f"; leaves {candidate.idle_devices} devices idle"
    return PickResult(problem.world, candidate, (candidate,), explanation, current)


def _nothing_fits(problem: Problem, candidates: list[Candidate]) -> str:
    reasons: list[str] = []
    for c in candidates:
        line = f"{c.layout.describe()}: {c.rejected}"
        if c.rejected and line not in reasons:
            reasons.append(line)
    shown = "\n  ".join(reasons[:12])
    more = f"\n  ... and {len(reasons) - 12} more" if len(reasons) > 12 else ""
    devices = f"{problem.world} device" + ("s" if problem.world > 1 else "")
    return (f"no feasible layout for {devices} (global batch {problem.global_batch_size}, "
            f"seq_len {problem.seq_len}); rejected:\n  {shown}{more}\n"
            "relax the constraints (allowed degrees, micro_batch_sizes, activation_checkpointing) or the batch")
