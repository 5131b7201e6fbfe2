"""tools/bench_plan.py: it times the plans the live path's join and preemption make, for a model's real state."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from bench_plan import _worker  # noqa: E402

from lightning_emig.testing.distributed import run_distributed  # noqa: E402


@pytest.mark.multiprocess
def test_the_plans_it_times_are_the_live_paths() -> None:
    records = {r["change"]: r for r in run_distributed(_worker, 2, ["tiny"], 1, timeout_s=120)[0]}
    tensors = records["join"]["tensors"]
    steps = tensors // 4  # a parameter, its two moments and its step count
    # The survivor of a join keeps half of every tensor and sends the other half; the survivor of a preemption keeps
    # its half and receives the other, but the step counts, which every process holds whole, are only copied.
    assert records["join"]["transfers"] == 2 * tensors
    assert records["preempt"]["transfers"] == 2 * tensors - steps
    assert all(r["median_seconds"] > 0 for r in records.values())
