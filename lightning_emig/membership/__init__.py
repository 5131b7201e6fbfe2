"""Membership: generations of the world as the training process sees them.

* :mod:`~lightning_emig.membership.group`: forming a generation's process group and the environment Lightning
  reads for it;
* :mod:`~lightning_emig.membership.callback`: :class:`RendezvousCallback`, which agrees on a new generation at an
  optimizer-step boundary and captures the live state to hand over;
* :mod:`~lightning_emig.membership.handoff`: :class:`LiveHandoff` and :func:`join_live`, where the state moves
  into the new world inside ``strategy.load_checkpoint("live")``.
"""

from lightning_emig.membership.callback import HandoffAwareCheckpoint, RendezvousCallback
from lightning_emig.membership.group import (
    apply_generation_env,
    form_generation_group,
    generation_env,
    joining_live,
    under_launcher,
)
from lightning_emig.membership.handoff import LIVE_CHECKPOINT, LiveHandoff, join_live, layout_for_new_world

__all__ = [
    "LIVE_CHECKPOINT",
    "HandoffAwareCheckpoint",
    "LiveHandoff",
    "RendezvousCallback",
    "apply_generation_env",
    "form_generation_group",
    "generation_env",
    "join_live",
    "joining_live",
    "layout_for_new_world",
    "under_launcher",
]
