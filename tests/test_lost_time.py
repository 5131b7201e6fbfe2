"""Lost time, the headline of every event, from step times alone (pure; synthetic records).

Lost = last step finished on the old world to the first step *beyond it* finished on the new one, minus one steady
step on the new world: on the live path that is the pause; on the restart path the recomputed steps count too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_emig.change.lost_time import STEADY_STEPS, events_with_lost_time, lost_time


def _steps(start_step: int, start_time: float, count: int, step_s: float, world: int) -> list[dict]:
    return [{"step": start_step + i, "time": start_time + i * step_s, "world": world, "pid": 1} for i in range(count)]


def _event(kind: str, step: int, old: int, new: int, *, time: float, downtime: float, rolled_back: int = 0) -> dict:
    return {"kind": kind, "step": step, "old_world": old, "new_world": new, "time": time, "downtime_seconds": downtime,
            "steps_rolled_back": rolled_back, "seconds": {}}


def test_a_live_join_loses_its_pause_not_its_first_step() -> None:
    # world 1 at 1 s/step up to step 10 (t=9), pause of 0.7 s, then world 2 at 0.5 s/step from step 11
    times = _steps(1, 0.0, 10, 1.0, 1) + _steps(11, 9.0 + 0.7 + 0.5, 5, 0.5, 2)
    event = _event("join", 10, 1, 2, time=10.2 + 0.01, downtime=1.2)
    lost = lost_time(event, times)
    assert lost is not None
    assert lost.last_old_step == 10
    assert lost.recovery_seconds == pytest.approx(1.2)
    assert lost.steady_step_seconds == pytest.approx(0.5)
    assert lost.lost_seconds == pytest.approx(0.7)
    assert lost.steady_steps == STEADY_STEPS


def test_the_first_steps_excess_over_a_steady_step_is_read_from_the_event() -> None:
    # the join's first step took 0.8 s (its phase) against steady 0.5 s steps: 0.3 s of the lost time is that step's
    times = _steps(1, 0.0, 10, 1.0, 1) + _steps(11, 9.0 + 0.4 + 0.8, 5, 0.5, 2)
    event = {**_event("join", 10, 1, 2, time=10.2 + 0.01, downtime=1.2), "seconds": {"transfer": 0.3, "first_step": 0.8}}
    lost = lost_time(event, times)
    assert lost is not None
    assert lost.lost_seconds == pytest.approx(0.7)
    assert lost.first_step_excess_seconds == pytest.approx(0.3)
    assert lost_time({**event, "seconds": {}}, times).first_step_excess_seconds is None


def test_a_failures_pause_leaves_out_the_step_in_flight_and_the_first_step() -> None:
    # world 2 at 1 s/step to step 10 (t=9); the peer dies 0.6 s into step 11 (in flight, lost), 0.3 s to the state in
    # place, a first step of 0.9 s; then world 1 steps of 0.8, 0.85 and 1.0 s (a host wandering by 0.2 s)
    first_beyond = 9.0 + 0.6 + 0.3 + 0.9
    times = _steps(1, 0.0, 10, 1.0, 2) + [{"step": 11 + i, "time": t, "world": 1, "pid": 1}
                                          for i, t in enumerate((first_beyond, first_beyond + 0.8,
                                                                 first_beyond + 1.65, first_beyond + 2.65))]
    event = {**_event("failure", 10, 2, 1, time=first_beyond + 0.01, downtime=1.8),
             "seconds": {"in_flight": 0.6, "detect": 0.1, "transfer": 0.2, "first_step": 0.9}}
    lost = lost_time(event, times)
    assert lost is not None
    assert lost.lost_seconds == pytest.approx(1.8 - 0.8)
    assert lost.pause_seconds == pytest.approx(0.3)
    assert lost.first_step_excess_seconds == pytest.approx(0.1)
    assert lost.steady_step_spread_seconds == pytest.approx(0.2)
    # without a first-step phase there is no telling the pause from the first step
    assert lost_time({**event, "seconds": {"in_flight": 0.6}}, times).pause_seconds is None


def test_steps_shorter_than_the_lines_lag_are_not_taken_for_the_old_worlds() -> None:
    # a small model (or a GPU): 0.06 s steps, a 0.12 s pause and a 0.07 s first step: the new world's first step ends
    # 0.19 s after the old world's last, sooner than a step's line may lag behind the boundary
    times = _steps(1, 0.0, 10, 0.06, 2) + _steps(11, 0.54 + 0.19, 5, 0.06, 1)
    event = {**_event("preempt", 10, 2, 1, time=0.54 + 0.19 + 0.005, downtime=0.19),
             "seconds": {"transfer": 0.05, "first_step": 0.07}}
    lost = lost_time(event, times)
    assert lost is not None
    assert lost.last_old_step == 10
    assert lost.recovery_seconds == pytest.approx(0.19)
    assert lost.lost_seconds == pytest.approx(0.13)
    assert lost.first_step_excess_seconds == pytest.approx(0.01)
    assert lost.pause_seconds == pytest.approx(0.12)


def test_a_step_slowed_by_a_background_checkpoint_is_not_the_steady_step() -> None:
    # world 2 at 0.5 s/step, but two of the three steps after the first beyond overlap a checkpoint write (0.9 s)
    times = _steps(1, 0.0, 10, 1.0, 1) + [{"step": 11 + i, "time": t, "world": 2, "pid": 1}
                                          for i, t in enumerate((10.2, 11.1, 12.0, 12.5))]
    lost = lost_time(_event("join", 10, 1, 2, time=10.21, downtime=1.2), times)
    assert lost is not None and lost.steady_step_seconds == pytest.approx(0.5)
    assert lost.lost_seconds == pytest.approx(0.7)


def test_the_lost_time_splits_into_the_training_threads_work_and_its_waiting() -> None:
    # steady steps of 0.5 s, 0.4 s of CPU each; the change and its first step beyond: 1.2 s, 0.6 s of CPU (the pause
    # waited 0.5 s for the wire, the rest was work). The steady step the lost time subtracts is the fastest (step 13).
    # Page faults: 100 per steady step; 900 over the change and its first step (new memory touched).
    cpu, faults = [1.0, 1.6, 2.0, 2.4, 2.9], [1000, 1900, 2000, 2100, 2250]
    times = [{**t, "cpu": c, "faults": f} for t, c, f in zip(
        [{"step": 10, "time": 9.0, "world": 1, "pid": 1}]
        + [{"step": 11 + i, "time": t, "world": 2, "pid": 1} for i, t in enumerate((10.2, 10.8, 11.3, 11.9))],
        cpu, faults, strict=True)]
    lost = lost_time(_event("join", 10, 1, 2, time=10.21, downtime=1.2), times)
    assert lost is not None and lost.steady_step_seconds == pytest.approx(0.5)
    assert lost.lost_seconds == pytest.approx(0.7)
    assert lost.lost_cpu_seconds == pytest.approx(0.6 - 0.4)
    assert lost.extra_page_faults == 900 - 100
    assert lost.first_step_parts_excess is None  # these lines carry no parts
    parts = [{}, {"forward": 0.3, "backward": 0.5}, {}, {"forward": 0.2, "backward": 0.25}, {}]
    with_parts = [{**t, "parts": p} for t, p in zip(times, parts, strict=True)]
    lost = lost_time(_event("join", 10, 1, 2, time=10.21, downtime=1.2), with_parts)
    assert lost is not None and lost.first_step_parts_excess == pytest.approx({"forward": 0.1, "backward": 0.25})
    # Lines of another process (the restart path's new rank 0), or without CPU seconds: no split.
    other = [{**t, "pid": 2} if t["step"] > 10 else t for t in times]
    assert lost_time(_event("join", 10, 1, 2, time=10.21, downtime=1.2), other).lost_cpu_seconds is None
    bare = [{k: v for k, v in t.items() if k not in ("cpu", "faults")} for t in times]
    assert lost_time(_event("join", 10, 1, 2, time=10.21, downtime=1.2), bare).lost_cpu_seconds is None
    assert lost_time(_event("join", 10, 1, 2, time=10.21, downtime=1.2), bare).extra_page_faults is None


def test_the_restart_path_loses_the_steps_it_recomputes() -> None:
    # world 2 reached step 20 (t=19); restart 8 s later from the step-15 checkpoint; steps 16..20 done again
    times = _steps(1, 0.0, 20, 1.0, 2) + _steps(16, 19.0 + 8.0 + 1.0, 10, 1.0, 3)
    event = _event("restart", 15, 2, 3, time=28.0 + 0.02, downtime=9.0, rolled_back=5)
    lost = lost_time(event, times)
    assert lost is not None
    # the first step beyond 20 is step 21, finished at 28 + 5 = 33: 14 s after step 20, minus a 1 s step
    assert lost.recovery_seconds == pytest.approx(14.0)
    assert lost.lost_seconds == pytest.approx(13.0)


def test_unknown_until_the_steady_steps_are_done() -> None:
    times = _steps(1, 0.0, 10, 1.0, 1) + _steps(11, 10.5, 2, 0.5, 2)  # one gap after the first step beyond
    event = _event("join", 10, 1, 2, time=10.51, downtime=1.5)
    assert lost_time(event, times) is None
    partial = lost_time(event, times, partial=True)
    assert partial is not None and partial.steady_steps == 1


def test_the_next_event_ends_the_steady_steps() -> None:
    # after the join (world 2) only two steps before a preemption (world 1): the steady step is theirs alone
    times = _steps(1, 0.0, 5, 1.0, 1) + _steps(6, 5.0, 2, 0.5, 2) + _steps(8, 9.0, 3, 1.0, 1)
    event = _event("join", 5, 1, 2, time=5.01, downtime=1.0)
    lost = lost_time(event, times, partial=True)
    assert lost is not None and lost.steady_steps == 1 and lost.steady_step_seconds == pytest.approx(0.5)


def test_an_event_without_downtime_has_no_lost_time() -> None:
    times = _steps(1, 0.0, 10, 1.0, 2)
    assert lost_time({**_event("reconfigure", 5, 2, 2, time=5.0, downtime=0.0), "downtime_seconds": None},
                     times) is None


def test_a_run_directory_s_events_are_annotated(tmp_path: Path) -> None:
    times = _steps(1, 0.0, 10, 1.0, 1) + _steps(11, 10.2, 5, 0.5, 2)
    (tmp_path / "step_times.jsonl").write_text("".join(json.dumps(t) + "\n" for t in times))
    events = [_event("join", 10, 1, 2, time=10.21, downtime=1.2),
              {**_event("reconfigure", 12, 2, 2, time=11.0, downtime=0.0), "downtime_seconds": None}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    join, reconfigure = events_with_lost_time(tmp_path)
    assert join["lost_seconds"] == pytest.approx(0.7)
    assert "lost_seconds" not in reconfigure


def test_the_proof_after_a_change_is_its_own_phase_not_part_of_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work done between the state's arrival and the first step (the proof of the state) is set apart as a phase:
    the ``first_step`` phase, and so the first step's excess, is the step's own."""
    from types import SimpleNamespace

    from lightning_emig.change import record as record_module
    from lightning_emig.change.record import ChangeLog
    from lightning_emig.layout import HybridLayout
    from lightning_emig.migration.change import ChangeRecord

    clock = [100.0]
    monkeypatch.setattr(record_module, "time", SimpleNamespace(perf_counter=lambda: clock[0], time=lambda: clock[0]))
    changes = ChangeLog()
    one, two = HybridLayout().resolve(1), HybridLayout().resolve(2)
    changes.begin(ChangeRecord(kind="join", step=3, old_layout=one, new_layout=two, old_world=1, new_world=2,
                               seconds={"transfer": 0.25}), last_step_wall=99.0)
    clock[0] += 0.5  # the proof
    changes.set_apart("prove", 0.5)
    clock[0] += 2.0  # the first step
    changes.finish(None, generation=1, world_size=2, rank=1, choice=None)  # type: ignore[arg-type]
    (event,) = changes.events
    assert event.seconds == {"transfer": 0.25, "prove": 0.5, "first_step": 2.0}
    assert event.downtime_seconds == 3.5
    assert "proven_digest" not in event.as_dict()  # nothing was compared


def test_a_change_proven_equal_to_its_state_before_says_so_in_its_event() -> None:
    from lightning_emig.change.record import ChangeLog
    from lightning_emig.layout import HybridLayout
    from lightning_emig.migration.change import ChangeRecord

    changes = ChangeLog()
    changes.note_proven(0xABC)  # no change begun: nothing to say it of
    two, one = HybridLayout().resolve(2), HybridLayout().resolve(1)
    changes.begin(ChangeRecord(kind="preempt", step=5, old_layout=two, new_layout=one, old_world=2, new_world=1),
                  last_step_wall=0.0)
    changes.note_proven(0x9E37ECEAB620F6C2)
    changes.finish(None, generation=1, world_size=1, rank=1, choice=None)  # type: ignore[arg-type]
    (event,) = changes.events
    assert event.as_dict()["proven_digest"] == "0x9e37eceab620f6c2"


def test_a_rollback_after_a_change_refused_at_its_start_loses_the_change_too() -> None:
    # World 1 reached step 20 (t=19); a join to world 2 was refused before its first step (its state failed the proof:
    # no step on world 2), and world 2 rolled back to the step-10 checkpoint, 2 s later, and recomputed steps 11..20
    # at 0.5 s a step. The rollback's old world (2) never finished a step: its lost time runs from world 1's last one.
    times = _steps(1, 0.0, 20, 1.0, 1) + _steps(11, 19.0 + 2.0 + 0.5, 14, 0.5, 2)
    rollback = _event("failure", 10, 2, 2, time=21.5 + 0.01, downtime=2.5, rolled_back=10)
    lost = lost_time(rollback, times)
    assert lost is not None and lost.last_old_step == 20
    assert lost.steady_step_seconds == pytest.approx(0.5)
    assert lost.lost_seconds == pytest.approx(2.0 + 10 * 0.5)  # the pause and the ten steps trained again
    # The same after an earlier period on a world of two (steps 1-5, before a failure left one process): the span
    # still starts at world 1's step 20, not at world 2's step 5.
    earlier = [{**t, "world": 2} if t["step"] <= 5 else t for t in times[:20]] + times[20:]
    lost = lost_time(rollback, earlier)
    assert lost is not None and lost.last_old_step == 20 and lost.lost_seconds == pytest.approx(7.0)
