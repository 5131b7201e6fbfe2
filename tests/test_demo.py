"""The elastic demo's report, from synthetic records (no process is started; the demo itself runs by ``make demo``).

* each event is one table row: kind, step, worlds, layouts, MB moved, downtime, steps rolled back, and how the job
  recovered: a failure is either "rebuilt from replicas" or "ROLLED BACK" with the steps lost, said plainly;
* each event's phases are listed in the order they ran;
* the live join is compared with the restart path's join of the same worlds (ratio of downtimes);
* ``loss.png`` is written from ``summary.json``'s losses with the events marked, and ``demo.json`` holds the events
  with their recovery, the comparison and the files;
* the settings refuse a global batch that 1, 2 or 3 data-parallel ranks cannot share.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from lightning_emig.demo.report import (
    compare_join,
    demo_record,
    event_rows,
    is_rollback,
    layout_label,
    load_losses,
    phase_rows,
    print_report,
    running_mean,
    write_demo_json,
    write_plot,
)
from lightning_emig.demo.scenario import DemoSettings

HSDP2 = {"dp_replicate": 2, "dp_shard": 1, "tp": 1, "pp": 1}
FSDP3 = {"dp_replicate": 1, "dp_shard": 3, "tp": 1, "pp": 1}
FSDP2 = {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1}
ONE = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1}


def _event(kind: str, step: int, old: tuple[int, dict], new: tuple[int, dict], *, mb: float = 0.0,
           downtime: float = 0.5, seconds: dict | None = None, rolled_back: int | None = None) -> dict:
    record = {"kind": kind, "step": step, "old_world": old[0], "new_world": new[0], "old_layout": old[1],
              "new_layout": new[1], "bytes_moved": int(mb * 1e6), "seconds": seconds or {"transfer": 0.01},
              "downtime_seconds": downtime}
    if rolled_back is not None:
        record["steps_rolled_back"] = rolled_back
    return record


JOIN = {**_event("join", 60, (2, HSDP2), (3, FSDP3), mb=0.75, downtime=0.61,
                 seconds={"detect": 0.002, "group": 0.1, "build": 0.2, "transfer": 0.02, "first_step": 0.12}),
        "lost_seconds": 0.49}  # as events_with_lost_time annotates it
PREEMPT = _event("preempt", 90, (3, FSDP3), (2, HSDP2), mb=0.5, downtime=0.42)
REBUILT = _event("failure", 120, (2, HSDP2), (1, ONE), downtime=3.4, rolled_back=0,
                 seconds={"detect": 3.1, "agree": 0.01, "transfer": 0.02})
ROLLED = _event("failure", 110, (2, FSDP2), (1, ONE), downtime=4.1, rolled_back=7,
                seconds={"detect": 3.1, "agree": 0.01, "load": 0.3})
RESTART_JOIN = {"event": "join", "path": "restart", "model": "tiny", "old_world": 2, "new_world": 3, "step": 20,
                "steps_rolled_back": 6, "lost_seconds": 9.78, "downtime_seconds": 9.15, "recovery_seconds": 9.9,
                "phases": {"stop_and_start": 3.0, "startup": 5.5, "load": 0.3, "first_step": 0.35},
                "bytes_moved": 0, "run_dir": "/tmp/x/restart"}


@pytest.mark.parametrize(
    ("layout", "label"),
    [(HSDP2, "rep=2 shard=1"), (FSDP3, "rep=1 shard=3"),
     ({"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}, "rep=1 shard=2 tp=2")],
)
def test_layouts_are_labelled_briefly(layout: dict, label: str) -> None:
    assert layout_label(layout) == label


def test_each_event_is_one_row_that_says_how_the_job_recovered() -> None:
    rows = event_rows([JOIN, PREEMPT, REBUILT])
    assert rows == [
        ("join", "60", "2 -> 3", "rep=2 shard=1 -> rep=1 shard=3", "0.75", "0.49", "0.61", "0",
         "live: state moved to the joiner"),
        ("preempt", "90", "3 -> 2", "rep=1 shard=3 -> rep=2 shard=1", "0.50", "-", "0.42", "0",
         "live: the leaver handed off its state"),
        ("failure", "120", "2 -> 1", "rep=2 shard=1 -> rep=1 shard=1", "0.00", "-", "3.40", "0",
         "rebuilt from replicas, no step lost"),
    ]


def test_a_rollback_says_how_many_steps_were_lost() -> None:
    assert is_rollback(ROLLED) and not is_rollback(REBUILT)
    (row,) = event_rows([ROLLED])
    assert row[7] == "7"
    assert row[8] == "ROLLED BACK to the step-110 checkpoint, 7 step(s) lost"
    # A rollback that lost no step (killed right at a checkpoint) is still a rollback: it read the checkpoint.
    assert is_rollback({**ROLLED, "steps_rolled_back": 0})


def test_phases_are_listed_in_the_order_they_ran() -> None:
    assert phase_rows([JOIN]) == [
        ("join @ 60", "detect 0.002 · group 0.100 · build 0.200 · transfer 0.020 · first_step 0.120")]


def test_the_live_join_is_compared_with_the_restart_path() -> None:
    comparison = compare_join(JOIN, RESTART_JOIN)
    assert comparison is not None
    assert comparison["worlds"] == "2 -> 3"
    assert comparison["downtime_ratio"] == pytest.approx(9.15 / 0.61)
    assert comparison["lost_ratio"] == pytest.approx(9.78 / 0.49)
    assert compare_join({**JOIN, "lost_seconds": None}, RESTART_JOIN)["lost_ratio"] is None
    assert comparison["restart_steps_rolled_back"] == 6
    assert compare_join(JOIN, None) is None and compare_join(None, RESTART_JOIN) is None


def _summary(steps: int) -> dict:
    return {"step_losses": {str(s): 6.0 - 0.01 * s for s in range(steps)}, "layout": ONE, "world_size": 1,
            "steps": steps, "first_loss": 6.0, "last_loss": 6.0 - 0.01 * (steps - 1), "tokens_per_second": 1.0,
            "pid": 1}


def test_losses_come_back_in_step_order() -> None:
    summary = {"step_losses": {"10": 1.0, "2": 3.0, "1": 4.0}}
    assert list(load_losses(summary).items()) == [(1, 4.0), (2, 3.0), (10, 1.0)]


@pytest.mark.parametrize("restart", [RESTART_JOIN, None], ids=["with_restart", "skip_restart"])
def test_plot_and_json_are_written(tmp_path: Path, restart: dict | None) -> None:
    events = [JOIN, PREEMPT, ROLLED]
    summary = _summary(200)
    worlds = [(s, 2 if s < 60 else 3 if s < 90 else 2 if s < 117 else 1) for s in range(200)]
    png = write_plot(tmp_path / "out" / "loss.png", load_losses(summary), events, worlds=worlds, restart=restart)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000

    record = demo_record(settings={"layout": "hsdp"}, run_dir=tmp_path / "run", events=events, summary=summary,
                         restart=restart, timeline=[{"seconds": 0.0, "action": "start"}], wall_seconds=150.0,
                         files={"loss plot": str(png)})
    written = json.loads(write_demo_json(tmp_path / "out" / "demo.json", record).read_text())
    assert [e["recovery"] for e in written["events"]] == [
        "live: state moved to the joiner", "live: the leaver handed off its state",
        "ROLLED BACK to the step-110 checkpoint, 7 step(s) lost"]
    assert written["final"]["steps"] == 200
    if restart is None:
        assert written["join_comparison"] is None
    else:
        assert written["join_comparison"]["downtime_ratio"] == pytest.approx(9.15 / 0.61)

    from rich.console import Console

    out = io.StringIO()
    print_report(Console(file=out, width=160), written)
    text = out.getvalue()
    assert "ROLLED BACK to the step-110 checkpoint" in text and "seconds per phase" in text
    assert ("restart/live 15.0x" in text) == (restart is not None)


def test_settings_refuse_a_batch_that_three_ranks_cannot_share() -> None:
    with pytest.raises(ValueError, match="micro-batches"):
        DemoSettings(global_batch_size=8)
    with pytest.raises(ValueError, match="layout"):
        DemoSettings(layout="tp")
    args = DemoSettings(layout="fsdp").train_args(max_steps=7)
    assert "layout=fsdp" in args and "trainer.max_steps=7" in args and "elastic.heartbeat_timeout_s=3.0" in args


def test_the_running_mean_averages_what_came_before() -> None:
    assert running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
