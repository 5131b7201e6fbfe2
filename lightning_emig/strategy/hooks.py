"""What the strategy installs into Lightning's ``Trainer`` at every fit: its own callbacks, and the SIGTERM rule
under torchrun."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_emig.change.boundary import StepBoundaryHook
from lightning_emig.change.consistency import ConsistencyGuard
from lightning_emig.membership.death_watch import DeathWatchHooks
from lightning_emig.membership.group import under_launcher
from lightning_emig.strategy.rendezvous import RendezvousCallback
from lightning_emig.strategy.step_times import StepTimeRecorder

if TYPE_CHECKING:
    import lightning.pytorch as pl


def add_callbacks(trainer: pl.Trainer) -> None:
    """The strategy's own callbacks, added once, before any checkpoint callback (so a step that hands the state over is
    known to be one before a periodic save would fall on it): the step times of ``default_root_dir``, the run
    directory the events go to (every script, not only ``train.py``, gets each event's lost time and, on the restart
    path, its ``restart`` event), the step-boundary hook, the rendezvous callback and the death watch's hooks under
    ``lightning-emig-run``, the consistency guard."""
    from lightning.pytorch.callbacks import Checkpoint

    # The step times first: a step's line is written as it ends, before the boundary's own work (a capture, a proof,
    # a save), and a restart's event is begun before the guard's proof of it, which is then a phase of that event.
    wanted: list[Any] = [StepTimeRecorder(Path(trainer.default_root_dir)), StepBoundaryHook()]
    if under_launcher():
        wanted += [RendezvousCallback(), DeathWatchHooks()]
    # After the rendezvous callback: it captures the boundary state before the step's first collective (a periodic
    # proof is one), so a peer dying in the proof leaves the survivors that step's state.
    wanted.append(ConsistencyGuard())
    for callback in wanted:
        if any(isinstance(cb, type(callback)) for cb in trainer.callbacks):
            continue
        first_checkpoint = next((i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)),
                                len(trainer.callbacks))
        trainer.callbacks.insert(first_checkpoint, callback)


def terminate_on_sigterm_under_torchrun() -> None:
    """Let torchrun's agent stop a worker with SIGTERM, as it expects.

    Lightning 2.6 installs a SIGTERM handler (at every fit, after the strategy's setup) that runs a
    ``dist.broadcast`` inside the handler and then ignores the signal: a worker told to stop mid-collective hangs
    with its peers until the agent's SIGKILL 30 s later — the restart path's stop would cost half a minute. Under
    torchrun the agent owns the workers' lifecycle, so the default action (terminate) is restored.
    """
    import signal
    import threading

    if "TORCHELASTIC_RUN_ID" in os.environ and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
