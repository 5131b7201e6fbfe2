"""``python -m lightning_emig.testing.held_train [key=value ...]``: ``lightning_emig.train`` with holds that pin a
race of two membership events in end-to-end tests, so a test hits it on any machine instead of aiming at a window.

* ``LIGHTNING_EMIG_TEST_HOLD_UNTIL_GENERATION=N``: every live join of this worker (the transfer inside
  ``fit(ckpt_path="live")``, on the processes that kept running and on the joiners alike) waits, right before it
  moves any state, until generation ``N`` is published in the control store; afterwards joins run at once. A
  migration into generation ``N - 1`` is thereby running when generation ``N`` appears.
* ``LIGHTNING_EMIG_TEST_HOLD_LEAVING_EXIT=1``: a worker whose node announced its preemption, once it has handed
  its state over and its training returned, exits only when a generation newer than the one published at that
  moment appears (a preempted worker whose teardown is slow: its agent still runs while others change the world).

Each hold gives up after :data:`HOLD_TIMEOUT_S` and logs when it starts and ends. Without the variables this is
``lightning_emig.train`` unchanged.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

ENV_HOLD_UNTIL_GENERATION = "LIGHTNING_EMIG_TEST_HOLD_UNTIL_GENERATION"
ENV_HOLD_LEAVING_EXIT = "LIGHTNING_EMIG_TEST_HOLD_LEAVING_EXIT"
HOLD_TIMEOUT_S = 120.0

log = logging.getLogger(__name__)


def _wait_for_generation(what: str, newer_than: int, timeout_s: float) -> None:
    """Block until the control store's latest generation exceeds ``newer_than`` (RuntimeError after the timeout)."""
    from lightning_emig.launcher.generation import control_client_from_env, latest_generation

    client = control_client_from_env()
    started = time.monotonic()
    if latest_generation(client) > newer_than:
        return
    log.warning("test hold: %s waits until generation %d is published", what, newer_than + 1)
    while latest_generation(client) <= newer_than:
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"test hold: no generation after {newer_than} within {timeout_s:.0f}s ({what})")
        time.sleep(0.1)
    log.warning("test hold: generation %d published; %s resumes after %.2fs", latest_generation(client), what,
                time.monotonic() - started)


def hold_live_migrations(until_generation: int, timeout_s: float = HOLD_TIMEOUT_S) -> None:
    """Make every live join of this process wait for generation ``until_generation`` (see the module docstring)."""
    from lightning_emig.membership import handoff

    migrate = handoff.migrate

    def held_migrate(*args: Any, **kwargs: Any) -> Any:
        _wait_for_generation("live migration", until_generation - 1, timeout_s)
        return migrate(*args, **kwargs)

    handoff.migrate = held_migrate


def hold_exit_if_left(timeout_s: float = HOLD_TIMEOUT_S) -> None:
    """After training returned: if this worker's node announced its preemption, wait for the next generation."""
    from lightning_emig.launcher.generation import (
        ENV_NODE_ID,
        control_client_from_env,
        latest_generation,
        leaving_key,
    )

    client = control_client_from_env()
    if client.check([leaving_key(os.environ[ENV_NODE_ID])]):
        _wait_for_generation("the preempted worker's exit", latest_generation(client), timeout_s)


def main() -> None:
    import runpy

    until = os.environ.get(ENV_HOLD_UNTIL_GENERATION)
    if until:
        hold_live_migrations(int(until))
    # As ``python -m lightning_emig.train``: Hydra finds ``conf/`` relative to the file of a ``__main__`` module.
    runpy.run_module("lightning_emig.train", run_name="__main__", alter_sys=True)
    if os.environ.get(ENV_HOLD_LEAVING_EXIT) == "1":
        hold_exit_if_left()


if __name__ == "__main__":
    main()
