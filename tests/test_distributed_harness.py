"""The multi-process harness (:mod:`lightning_emig.testing.distributed`): workers fork from a server
started by an earlier call, yet see the caller's environment and working directory as they are at each
call."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_emig.testing.distributed import run_distributed

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
