"""The multi-process harness (:mod:`lightning_emig.testing.distributed`): workers fork from a server
started by an earlier call, yet see the caller's environment and working directory as they are at each
call."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_emig.testing.distributed import _ephemeral_low, free_port, run_distributed

pytestmark = pytest.mark.multiprocess

VARIABLE = "LIGHTNING_EMIG_TEST_HARNESS_VALUE"


def _seen(rank: int, world: int) -> tuple[str | None, str]:
    return os.environ.get(VARIABLE), os.getcwd()


def test_workers_see_the_environment_and_directory_of_the_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    run_distributed(_seen, 2, timeout_s=120)  # the fork server runs from here on, without the variable
    monkeypatch.setenv(VARIABLE, "set after the server started")
    monkeypatch.chdir(tmp_path)
    assert run_distributed(_seen, 2, timeout_s=120) == [("set after the server started", str(tmp_path))] * 2


def test_a_free_port_is_one_the_kernel_never_hands_out_to_a_bind_of_port_0() -> None:
    """Servers bind a picked port later: a port from the kernel's ephemeral range could be taken meanwhile by any
    process's bind(0) (it was, once: a reference run's store took a torchrun worker's port)."""
    import socket

    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports), "a port was handed out twice"
    assert all(port < _ephemeral_low() for port in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[0]))  # free when handed out
        sock.listen()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
            other.bind(("127.0.0.1", 0))
            assert other.getsockname()[1] >= _ephemeral_low()

