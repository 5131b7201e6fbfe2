"""What a process that keeps running carries from one fit into the next: :class:`LiveHandoff`.

A live change ends the fit at an optimizer-step boundary and the next fit of the same ``trainer.fit`` call starts with
``ckpt_path=LIVE_CHECKPOINT``: the state moves inside ``strategy.load_checkpoint`` (see
:mod:`lightning_emig.change.live_join`). When the state already moved before that fit (a drain of leavers, a
rebuild after a failure) the handoff holds it laid out for the new world, and ``prior`` records that change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from lightning_emig.layout import HybridLayout
from lightning_emig.migration.change import ChangeRecord
from lightning_emig.migration.state import ShardingSpec, StateTensor

LIVE_CHECKPOINT = "live"
"""``Trainer.fit(ckpt_path=LIVE_CHECKPOINT)``: take the state from the running processes, not from a file."""


@dataclass(slots=True, kw_only=True)
class LiveHandoff:
    """What a process that kept running carries from one ``Trainer.fit`` into the next (never pickled whole)."""

    generation: int
    """The generation to join."""
    holders: tuple[tuple[str, int], ...]
    """``(node id, local rank)`` of the process holding each old rank's state (who a failure before the state moved
    must account for; empty where that is not known: outside ``lightning-emig-run``)."""
    old_layout: HybridLayout
    old_world: int
    old_rank: int
    state: dict[str, StateTensor] | None
    """References to the live local tensors of the old model and optimizer (freed by the migration)."""
    metadata: dict[str, Any]
    """Resume metadata, shaped like a Lightning checkpoint captured in ``on_train_batch_end``."""
    last_step_wall: float
    """``time.time()`` when the last step on the old world had finished (downtime starts here)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Phases measured so far (detect, agree, capture, teardown, group, ...)."""
    phase_started: float = field(default_factory=time.perf_counter)
    """``perf_counter`` when the current phase began (``lap`` closes it)."""
    prior: ChangeRecord | None = None
    """Set when the state already moved into the new world before this handoff (a drain of leavers, a rebuild after
    a failure): that change, which the next fit's local re-layout completes (one event for both)."""
    leaving: bool = False
    """This process's node was preempted: its state was handed over, it leaves the job (no next fit)."""

    @property
    def optimizer_template(self) -> dict[str, ShardingSpec]:
        return {k: t.spec for k, t in (self.state or {}).items() if k.startswith("optim/")}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.phase_started
        self.phase_started = now
