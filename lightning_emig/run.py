"""``lightning-emig-run`` / ``python -m lightning_emig.run``: torchrun, with :class:`MembershipAgent`.

The command line is torchrun's, parsed by ``torch.distributed.run``'s own parser and run by its own
``main()`` (so ``--standalone``, ``--nnodes=MIN:MAX``, ``--rdzv-*``, ``--local-addr``, error files... behave
exactly as under torchrun). The seam: ``torch.distributed.launcher.api.launch_agent`` builds its agent from
the module attribute ``LocalElasticAgent`` at call time; for the duration of ``main()``, in this process
only, that attribute is our subclass. :func:`install_agent` checks the seam is still there and fails loudly
when a torch upgrade moves it (``tests/test_launcher.py`` pins it too).

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set unless the caller set it: with torch 2.13's shared store, a
re-rendezvous with several agents deadlocks. With it set, the rank-0 agent picks a free port and the
generation's global rank-0 *worker* hosts the workers' TCPStore there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence

import torch.distributed.launcher.api as launcher_api
import torch.distributed.run as torch_run
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from lightning_emig.launcher.agent import MembershipAgent
from lightning_emig.launcher.control_store import ENV_RDZV_ENDPOINT

SEAM = "torch.distributed.launcher.api.LocalElasticAgent"


@contextlib.contextmanager
def install_agent(agent_cls: type[LocalElasticAgent] = MembershipAgent) -> Iterator[None]:
    """Make torchrun's ``launch_agent`` build ``agent_cls`` while the block runs."""
    current = getattr(launcher_api, "LocalElasticAgent", None)
    if current is not LocalElasticAgent or "LocalElasticAgent(" not in _launch_agent_source():
        raise RuntimeError(
            f"{SEAM} is no longer the class launch_agent instantiates in this torch; "
            "lightning-emig-run must be adapted to the new launcher"
        )
    launcher_api.LocalElasticAgent = agent_cls
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = current


def _launch_agent_source() -> str:
    import inspect

    try:
        return inspect.getsource(launcher_api.launch_agent)
    except (OSError, TypeError):  # no source shipped: trust the attribute check
        return "LocalElasticAgent("


def _show_launcher_log() -> None:
    """Membership changes are what this launcher is for: say them on stderr (level from ``LOGLEVEL``)."""
    log = logging.getLogger("lightning_emig.launcher")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[lightning-emig-run] %(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(os.environ.get("LOGLEVEL", "INFO"))
        log.propagate = False


def check_arguments(argv: Sequence[str] | None) -> None:
    """Refuse ``--nnodes`` that cannot hold a job's state (torch's own check is a bare assertion); tell the agent the
    rendezvous endpoint (with etcd-v2 it is also the control store)."""
    args = torch_run.parse_args(None if argv is None else list(argv))
    os.environ[ENV_RDZV_ENDPOINT] = args.rdzv_endpoint or ""
    try:
        low, high = torch_run.parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError):
        raise SystemExit(f"lightning-emig-run: --nnodes={args.nnodes!r} is neither N nor MIN:MAX") from None
    if low < 1 or high < low:
        raise SystemExit(
            f"lightning-emig-run: --nnodes={args.nnodes} cannot work: MIN must be at least 1 (a job with no node left "
            "has nobody to hold its state; below MIN the survivors wait for joiners) and MAX at least MIN, "
            "e.g. --nnodes=1:4"
        )


def main(argv: Sequence[str] | None = None) -> None:
    check_arguments(argv)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    _show_launcher_log()
    with install_agent():
        torch_run.main(None if argv is None else list(argv))


if __name__ == "__main__":
    main()
