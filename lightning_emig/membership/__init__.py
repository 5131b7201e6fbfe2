"""Membership: generations of the world as the training process sees them (below the strategy: it sees only
:class:`~lightning_emig.membership.settings.ElasticSettings` and plain callables, never the strategy class).

* :mod:`~lightning_emig.membership.group`: forming a generation's process group and the environment Lightning
  reads for it;
* :mod:`~lightning_emig.membership.settings`: what every change asks, and the one rule that lays out a new world;
* :mod:`~lightning_emig.membership.handoff`: :class:`LiveHandoff`, what a running process carries into its next fit;
* :mod:`~lightning_emig.membership.admission`: which generation the holders of the state are in, and how a worker
  started into a later one gets in (overlapping rounds);
* :mod:`~lightning_emig.membership.preempt`, :mod:`~lightning_emig.membership.failure`,
  :mod:`~lightning_emig.membership.below_min`: leaving with notice, abrupt failure (also of a change before its state
  moved), waiting below MIN.

Heartbeats (liveness judged on the reader's clock) are the launcher's: :mod:`lightning_emig.launcher.heartbeat`.

The Lightning side (the per-step agreement callback, the live join, one fit call per job) is in
:mod:`lightning_emig.strategy`.
"""

from lightning_emig.membership.group import (
    apply_generation_env,
    form_generation_group,
    generation_env,
    joining_live,
    under_launcher,
)
from lightning_emig.membership.handoff import LIVE_CHECKPOINT, LiveHandoff
from lightning_emig.membership.settings import ElasticSettings, layout_for_new_world

__all__ = [
    "LIVE_CHECKPOINT",
    "ElasticSettings",
    "LiveHandoff",
    "apply_generation_env",
    "form_generation_group",
    "generation_env",
    "joining_live",
    "layout_for_new_world",
    "under_launcher",
]
