"""When a layout schedule prepares and applies its changes (the strategy is a stand-in that records the calls)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_emig.layout import HybridLayout, LayoutError
from lightning_emig.strategy.schedule import LayoutSchedule

FSDP, TP, HSDP = HybridLayout(dp_shard=2), HybridLayout(dp_shard=1, tp=2), HybridLayout(dp_replicate=2, dp_shard=1)


class _Strategy:
    world_size = 2

    def __init__(self) -> None:
        self.layout = FSDP.resolve(2)
        self.calls: list[tuple[int, str, dict[str, int]]] = []
        self.step = 0

    def reconfigure(self, layout: HybridLayout) -> None:
        self.calls.append((self.step, "reconfigure", layout.degrees.as_dict()))
        self.layout = layout.resolve(self.world_size)

    def prepare_reconfigure(self, layout: HybridLayout) -> None:
        self.calls.append((self.step, "prepare", layout.degrees.as_dict()))


def _steps(schedule: LayoutSchedule, last: int) -> list[tuple[int, str, dict[str, int]]]:
    strategy = _Strategy()
    trainer: Any = SimpleNamespace(strategy=strategy, global_step=0)
    for step in range(1, last + 1):
        trainer.global_step = strategy.step = step
        schedule.on_train_batch_end(trainer, None, None, None, step)  # type: ignore[arg-type]
        schedule.on_train_batch_end(trainer, None, None, None, step)  # a second micro-batch at the same step
    return strategy.calls


@pytest.mark.parametrize(("ahead", "expected"), [
    (0, [(3, "reconfigure", TP), (5, "reconfigure", HSDP)]),
    (1, [(2, "prepare", TP), (3, "reconfigure", TP), (4, "prepare", HSDP), (5, "reconfigure", HSDP)]),
    (2, [(1, "prepare", TP), (3, "reconfigure", TP), (3, "prepare", HSDP), (5, "reconfigure", HSDP)]),
])
def test_a_schedule_prepares_each_change_ahead_once_then_applies_it(ahead: int, expected: list[Any]) -> None:
    calls = _steps(LayoutSchedule([(3, TP), (5, HSDP)], prepare_ahead_steps=ahead), 6)
    assert calls == [(step, what, layout.resolve(2).degrees.as_dict()) for step, what, layout in expected]


def test_a_users_configure_model_runs_in_a_background_thread_only_when_the_schedule_asks_for_it() -> None:
    """Preparing ahead runs the module's configure_model beside training's collectives: never by default."""
    calls = _steps(LayoutSchedule([(3, TP), (5, HSDP)]), 6)
    assert [what for _, what, _ in calls] == ["reconfigure", "reconfigure"]


def test_a_schedule_refuses_a_negative_lead_and_unordered_steps() -> None:
    with pytest.raises(ValueError, match="prepare_ahead_steps must be >= 0"):
        LayoutSchedule([(3, TP)], prepare_ahead_steps=-1)
    with pytest.raises(ValueError, match="strictly increasing"):
        LayoutSchedule([(5, TP), (3, HSDP)])


def test_an_entry_that_no_longer_fits_the_world_is_skipped_and_one_that_never_fit_is_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    schedule = LayoutSchedule([(3, TP), (5, HSDP), (7, FSDP)], prepare_ahead_steps=1)
    strategy = _Strategy()
    trainer: Any = SimpleNamespace(strategy=strategy, global_step=0)
    schedule.on_train_start(trainer, None)  # type: ignore[arg-type]  # the job starts on 2 processes
    worlds = {1: 2, 2: 1, 3: 1, 4: 1, 5: 1, 6: 2, 7: 2}  # a preemption after step 1, a join after step 5
    for step, world in worlds.items():
        if world != strategy.world_size:  # what a membership change leaves: the first fit's layout on the new world
            strategy.world_size, strategy.layout = world, HybridLayout(dp_shard=-1).resolve(world)
        trainer.global_step = strategy.step = step
        for _ in range(2):  # two micro-batches at each step
            schedule.on_train_batch_end(trainer, None, None, None, step)  # type: ignore[arg-type]
    # tp 2 and 2 replicas need 2 processes: skipped on 1, each said once; FSDP fits any world (already in it at 7)
    assert strategy.calls == []
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 2 and "after step 3" in skipped[0] and "after step 5" in skipped[1]
    # on the world the job started with, a layout that cannot be laid out is a wrong schedule
    wrong = LayoutSchedule([(2, HybridLayout(dp_shard=-1, tp=3))], prepare_ahead_steps=1)
    wrong.on_train_start(SimpleNamespace(strategy=_Strategy()), None)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="does not divide the world size 2"):
        _steps(wrong, 2)
