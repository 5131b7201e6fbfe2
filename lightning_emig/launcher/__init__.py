"""``lightning-emig-run``: torchrun's command line, with an agent that hands joins to live workers.

* :mod:`~lightning_emig.launcher.agent`: the agent (launcher side).
* :mod:`~lightning_emig.launcher.generation`: the publication protocol and the worker-facing API.
* :mod:`lightning_emig.run`: the entry point (``python -m lightning_emig.run``).
"""

from lightning_emig.launcher.generation import (
    GenerationError,
    GenerationInfo,
    NodeEntry,
    WorkerIdentity,
    control_client_from_env,
    current_identity_from_env,
    latest_generation,
    read_generation,
    wait_for_generation,
)

__all__ = [
    "GenerationError",
    "GenerationInfo",
    "NodeEntry",
    "WorkerIdentity",
    "control_client_from_env",
    "current_identity_from_env",
    "latest_generation",
    "read_generation",
    "wait_for_generation",
]
