"""The multi-process harness (:mod:`lightning_emig.testing.distributed`): workers fork from a server
started by an earlier call, yet see the caller's environment and working directory as they are at each
call; they may start processes of their own, which never outlive the call."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from torch.utils.data import DataLoader, Dataset

from lightning_emig.testing.distributed import WorkerFailed, _ephemeral_low, free_port, run_distributed

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


class _StuckWorker(Dataset):
    """Sample 0 is the pid of the process that read it; reading any other one never ends. A DataLoader worker stuck
    there never notices that its parent died (torch's workers look between samples): only a kill ends it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i:
            threading.Event().wait()
        return os.getpid()


def _leave_a_dataloader_worker(rank: int, world: int, pid_file: str, end: str) -> None:
    """Start a DataLoader worker, say its pid, then fail, die or hang while the worker reads on."""
    iterator = iter(DataLoader(_StuckWorker(), num_workers=1))
    Path(pid_file).write_text(str(int(next(iterator))))
    if end == "raises":
        raise RuntimeError("this rank fails while its DataLoader worker runs")
    if end == "dies":
        os._exit(3)
    threading.Event().wait()  # hangs: the harness's deadline ends it


@pytest.mark.parametrize(("end", "reported"), [("raises", "rank 0 failed"), ("dies", r"ranks \[0\] died"),
                                               ("hangs", r"ranks \[0\] did not finish")])
def test_a_ranks_dataloader_workers_are_gone_when_the_call_ends(tmp_path: Path, end: str, reported: str) -> None:
    """A rank may have children (it is not daemonic); however it ends, none of them outlives the call."""
    run_distributed(_seen, 1, timeout_s=120)  # the fork server is up: the deadline below is the rank's own time
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(WorkerFailed, match=reported):
        run_distributed(_leave_a_dataloader_worker, 1, str(pid_file), end, timeout_s=5)
    assert not _runs(int(pid_file.read_text())), "the rank's DataLoader worker outlived the call"


def _runs(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not: it waits for its reaper, init for an orphan)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
