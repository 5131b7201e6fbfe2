"""``lightning-emig-run``: torchrun's command line, with an agent that hands joins to live workers.

* :mod:`~lightning_emig.launcher.agent`: the agent (launcher side).
* :mod:`~lightning_emig.launcher.generation`: the publication protocol and the worker-facing API;
* :mod:`~lightning_emig.launcher.control_store`: the store that protocol lives in (c10d's TCPStore or etcd);
* :mod:`~lightning_emig.launcher.rounds`: which rendezvous rounds may become generations;
* :mod:`~lightning_emig.launcher.heartbeat`: heartbeats of workers and agents, judged on the reader's clock;
* :mod:`~lightning_emig.launcher.store_host`, :mod:`~lightning_emig.launcher.orphans`: whether this agent hosts the
  c10d store; workers that die with their agent.
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
