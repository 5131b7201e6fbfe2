"""Words and tables for a pick: the explanation a choice carries and the candidates table it logs.

Pure formatting. Invariants: the explanation says why the chosen layout won (fastest, or which tie-breaker) and,
when it leaves devices idle, whether that is because no layout uses them or because it is faster (by how much);
the table lists every rejected full-world layout with its reason, so a reader sees why all devices were not used.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from lightning_emig.picker.candidates import GB, Candidate, Problem

COLUMNS = ("", "rep", "shard", "tp", "pp", "devs", "idle", "micro", "accum", "ckpt", "mem GB", "step s",
           "moved GB", "status")
WIDTHS = (2, 4, 6, 3, 3, 5, 5, 6, 6, 5, 7, 8, 9, 0)


def summary(c: Candidate) -> str:
    """``dp_replicate=.. dp_shard=.. tp=.. pp=.. (micro m x accum a x dp d, 3.2 GB, 0.512 s/step)``."""
    assert c.plan is not None and c.memory is not None and c.step is not None
    ckpt = ", activation checkpointing" if c.activation_checkpointing else ""
    return (f"{c.layout.describe()} (micro {c.plan.micro_batch_size} x accum {c.plan.grad_accumulation} x dp "
            f"{c.plan.dp_degree}{ckpt}; {_number(c.memory.total, GB, 1)} GB/device, {_number(c.step.total, 1, 3)} s/step)")


def describe_choice(problem: Problem, chosen: Candidate, feasible: list[Candidate], near: list[Candidate],
                    candidates: list[Candidate]) -> str:
    """Why ``chosen`` (one of ``near``, the near-ties of the time-sorted ``feasible``) won."""
    parts = [summary(chosen)]
    fastest = feasible[0]
    if chosen is fastest:
        parts.append("fastest feasible layout" if len(near) == 1 else
                     f"fastest of {len(near)} within {problem.constraints.tie_tolerance:.0%}")
    else:
        parts.append(f"within {problem.constraints.tie_tolerance:.0%} of the fastest "
                     f"({_number(fastest.est_step_seconds, 1, 3)} s/step), preferred for {_tie_reason(chosen, fastest)}")
    parts.append(_idle_reason(problem, chosen, feasible, candidates))
    return "; ".join(parts)


def _tie_reason(chosen: Candidate, fastest: Candidate) -> str:
    if chosen.idle_devices < fastest.idle_devices:
        return f"fewer idle devices ({chosen.idle_devices} vs {fastest.idle_devices})"
    if (chosen.migration_bytes or 0) < (fastest.migration_bytes or 0):
        return (f"fewer migration bytes ({_number(chosen.migration_bytes or 0, GB, 2)} GB vs "
                f"{_number(fastest.migration_bytes or 0, GB, 2)} GB)")
    return "the fixed order (less pipeline, tensor parallelism and replication)"


def _idle_reason(problem: Problem, chosen: Candidate, feasible: list[Candidate], candidates: list[Candidate]) -> str:
    if not chosen.idle_devices:
        return f"uses all {problem.world} devices" if problem.world > 1 else "uses the only device"
    more = [c for c in feasible if c.idle_devices < chosen.idle_devices]
    if more:
        best = min(more, key=lambda c: (c.est_step_seconds, c.order_key))
        speedup = best.est_step_seconds / chosen.est_step_seconds
        return (f"leaves {_devices(chosen.idle_devices)} idle: {speedup:.2f}x faster than the best layout on more "
                "devices"
                f" ({best.layout.describe()} on {best.layout.world_size}, {_number(best.est_step_seconds, 1, 3)} s/step)")
    # One example of each kind of reason (the same text up to its numbers), in enumeration order.
    kinds: dict[str, str] = {}
    for c in candidates:
        if c.idle_devices == 0 and c.rejected:
            kinds.setdefault(re.sub(r"\d+", "#", c.rejected), c.rejected)
    shown = "; ".join(list(kinds.values())[:3]) + ("; ..." if len(kinds) > 3 else "")
    return (f"leaves {_devices(chosen.idle_devices)} idle: no feasible layout uses more than "
            f"{chosen.layout.world_size} of {problem.world} devices (e.g. {shown})")


def _devices(n: int) -> str:
    return f"{n} device" if n == 1 else f"{n} devices"


def _candidates(n: int) -> str:
    return f"{n} candidate" if n == 1 else f"{n} candidates"


def render_table(world: int, explanation: str, chosen: Candidate, candidates: Sequence[Candidate],
                 max_rows: int | None) -> str:
    feasible = [c for c in candidates if c.feasible]
    rejected_full = [c for c in candidates if not c.feasible and c.idle_devices == 0]
    hidden_rejected = sum(1 for c in candidates if not c.feasible and c.idle_devices > 0)
    shown = feasible if max_rows is None else feasible[:max_rows]
    lines = [f"world {world}: {explanation}", _row(COLUMNS)]
    lines += [_row(_cells(c, "chosen" if c is chosen else "ok")) for c in shown]
    lines += [_row(_cells(c, f"rejected: {c.rejected}")) for c in rejected_full]
    notes = []
    if len(shown) < len(feasible):
        notes.append(f"{_candidates(len(feasible) - len(shown))} slower and feasible")
    if hidden_rejected:
        notes.append(f"{_candidates(hidden_rejected)} on fewer devices, rejected")
    if notes:
        lines.append("   (not shown: " + ", ".join(notes) + "; all are in the JSON record)")
    return "\n".join(lines)


def _cells(c: Candidate, status: str) -> tuple[str, ...]:
    lay, plan = c.layout, c.plan
    ckpt = "-" if c.activation_checkpointing is None else ("yes" if c.activation_checkpointing else "no")
    return (
        "*" if status == "chosen" else "",
        str(lay.dp_replicate), str(lay.dp_shard), str(lay.tp), str(lay.pp), str(lay.world_size),
        str(c.idle_devices),
        str(plan.micro_batch_size) if plan else "-", str(plan.grad_accumulation) if plan else "-", ckpt,
        _number(c.est_memory_bytes, GB, 1),
        _number(c.est_step_seconds, 1, 3),
        _number(c.migration_bytes, GB, 2),
        status,
    )


def _number(value: float | None, unit: float, digits: int) -> str:
    """``value / unit`` with ``digits`` decimals, or 3 significant digits when that would print as zero."""
    if value is None:
        return "-"
    scaled = value / unit
    text = f"{scaled:.{digits}f}"
    return f"{scaled:.3g}" if scaled and float(text) == 0 else text


def _row(cells: tuple[str, ...]) -> str:
    return " ".join(cell.rjust(w) if w else cell for cell, w in zip(cells, WIDTHS, strict=True)).rstrip()
