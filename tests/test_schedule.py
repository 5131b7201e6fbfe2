"""When a layout schedule prepares and applies its changes (the strategy is a stand-in that records the calls)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_emig.layout import HybridLayout
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


def test_a_schedule_refuses_a_negative_lead_and_unordered_steps() -> None:
    with pytest.raises(ValueError, match="prepare_ahead_steps must be >= 0"):
        LayoutSchedule([(3, TP)], prepare_ahead_steps=-1)
    with pytest.raises(ValueError, match="strictly increasing"):
        LayoutSchedule([(5, TP), (3, HSDP)])
