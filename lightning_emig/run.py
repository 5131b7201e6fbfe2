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

A preemption notice (SIGTERM) can reach a node's launcher while it is still starting (importing torch takes a
second or two): before the agent's own handler is in place, the launcher leaves with exit 0 — it joined nothing and
holds nothing — instead of dying by the signal. So the module imports torch only inside :func:`main`, once that
handler is set, and the package's ``__init__`` imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

SEAM = "torch.distributed.launcher.api.LocalElasticAgent"


@contextlib.contextmanager
def install_agent(agent_cls: Any = None) -> Iterator[None]:
    """Make torchrun's ``launch_agent`` build ``agent_cls`` (default: :class:`MembershipAgent`) while the block
    runs."""
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from lightning_emig.launcher.agent import MembershipAgent

    current = getattr(launcher_api, "LocalElasticAgent", None)
    if current is not LocalElasticAgent or "LocalElasticAgent(" not in _launch_agent_source(launcher_api):
        raise RuntimeError(
            f"{SEAM} is no longer the class launch_agent instantiates in this torch; "
            "lightning-emig-run must be adapted to the new launcher"
        )
    launcher_api.LocalElasticAgent = MembershipAgent if agent_cls is None else agent_cls
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = current


def _launch_agent_source(launcher_api: Any) -> str:
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
    import torch.distributed.run as torch_run

    from lightning_emig.launcher.control_store import ENV_RDZV_ENDPOINT

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


@contextlib.contextmanager
def _leaving_on_an_early_notice() -> Iterator[None]:
    """Until the agent's own handler replaces it (first thing in its ``run``), SIGTERM ends this launcher with exit 0:
    it is in no rendezvous round yet, so it has nothing to hand off and nobody to tell. The handler it found is put
    back when ``main`` returns (it may run inside another program, e.g. a test)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, frame: Any) -> None:
        os.write(2, b"[lightning-emig-run] preemption notice (SIGTERM) while the launcher was starting: it joined "
                    b"nothing and holds nothing; leaving (exit 0)\n")
        os._exit(0)  # in the middle of an import, perhaps: nothing here needs to run on the way out

    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> None:
    with _leaving_on_an_early_notice():
        check_arguments(argv)
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        _show_launcher_log()
        import torch.distributed.run as torch_run

        with install_agent():
            torch_run.main(None if argv is None else list(argv))


if __name__ == "__main__":
    main()
