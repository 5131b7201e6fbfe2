"""A gloo collective waiting on a peer that never answers ends when its group's sockets are shut down
(:mod:`lightning_emig.collective_sockets`), and nothing else of the process is touched.

Three real processes on gloo; rank 2 is "frozen": alive, its sockets open, it never enters the collective. Ranks 0
and 1 each shut down their own group's connections a moment after entering it, as their death watches do once the
peer is known gone: the collective raises gloo's "connection closed" error (a peer's death), not its timeout, and the
sockets that are not the groups' — a store client opened before, one opened to a store declared not a group's peer
while the groups formed, a socket declared the package's own, a listener — still work. End to end (a frozen node under the launcher): ``tests/test_user_script.py::test_the_script_survives_a_killed_peer``
(``node_frozen``).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_emig.testing.distributed import free_port, run_distributed

PG_TIMEOUT_S = 60.0
"""The blocked collective's own timeout: its error would say so."""


def _frozen_peer_case(rank: int, world_size: int, store_port: int) -> dict[str, object]:
    from lightning_emig.collective_sockets import (
        interrupt_group_sockets,
        not_a_group_peer,
        not_a_group_socket,
        recording_group_sockets,
    )

    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=rank == 0, timeout=timedelta(seconds=60))
    listener = socket.create_server(("127.0.0.1", 0))  # a listener older than the groups: its connections are not
    not_a_group_peer(store_port)  # as the control store's port is: a client of it opened in a window is not a group's
    with recording_group_sockets(generation=7):  # the generation's "default" group: here a group over the real one
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
        late_client = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=60))
        ours = socket.create_connection(listener.getsockname())  # made inside the window, declared the package's
        not_a_group_socket(ours)
        accepted, _ = listener.accept()
    with recording_group_sockets():  # more groups over the same generation's
        more = dist.new_group(backend="gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    if rank == 2:  # frozen: never enters the collective, keeps every socket open until the others are done
        store.wait(["done/0", "done/1"], timedelta(seconds=120))
        store.set("done/2", "1")
        return {}
    shut: list[int] = []
    timer = threading.Timer(1.0, lambda: shut.append(interrupt_group_sockets(7)))
    timer.start()
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
        error = ""
    except Exception as exc:  # noqa: BLE001 - what gloo raised is the result
        error = str(exc)
    ended_after = time.monotonic() - started
    timer.join()
    try:
        dist.all_reduce(torch.ones(4), group=more)  # the later group's connections were shut down too
        more_error = ""
    except Exception as exc:  # noqa: BLE001
        more_error = str(exc)
    ours.sendall(b"x")
    echoed = accepted.recv(1)
    late_client.set(f"late/{rank}", "1")  # so does the one opened while the groups formed
    store.set(f"done/{rank}", "1")  # the store client still works
    if rank == 0:  # it hosts the store: it outlives every other rank's last use of it
        store.wait(["done/1", "done/2"], timedelta(seconds=60))
    return {"error": error, "more_error": more_error, "shut": shut, "echoed": echoed,
            "other_generation": interrupt_group_sockets(6), "ended_before_timeout": ended_after < PG_TIMEOUT_S}


@pytest.mark.timeout(180)
def test_a_collective_waiting_on_a_frozen_peer_ends_when_the_group_sockets_are_shut_down() -> None:
    results = run_distributed(_frozen_peer_case, 3, free_port(), timeout_s=150)
    for rank in (0, 1):
        result = results[rank]
        assert "Connection closed by peer" in result["error"], result  # gloo's error for a peer gone, not a timeout
        assert result["ended_before_timeout"], result
        assert "Connection closed" in result["more_error"] or "Connection reset" in result["more_error"], result
        assert result["shut"] and result["shut"][0] >= 2, result  # at least one connection a peer, each group
        assert result["echoed"] == b"x", result  # the package's own socket, made in the window, untouched
        assert result["other_generation"] == 0, result  # another generation's groups: nothing recorded, nothing shut
