"""A way out of a gloo collective that waits on a peer who will never answer.

A peer whose host vanished (power, kernel, network) or whose process is frozen closes no socket: a survivor blocked in
a collective with it waits for the collective's timeout (``trainer.pg_timeout_s``), however soon the peer is known to
be gone, and in torch 2.13 ``ProcessGroup.abort()`` and ``shutdown()`` on a gloo group return without ending a
collective already waiting (measured: the pending ``all_reduce`` raised only at its timeout). What does end it is the
group's own sockets: a ``shutdown()`` of a connection (on a duplicate of its descriptor: the socket is shared, gloo's
descriptor stays open and is closed by gloo as usual) makes gloo's pending reads see the end of the stream, exactly as
they do when the peer's process is killed, and the collective raises at once.

So the sockets each gloo process group connects are recorded as the group is created (:func:`recording_group_sockets`,
around the creation of a generation's default group and of every group created over it), and
:func:`interrupt_group_sockets` shuts them down when the death watch knows a peer of that generation is gone
(:mod:`~lightning_emig.membership.death_watch`): every collective of the generation ends, the recovery follows as for a
killed peer, and the groups are destroyed by it as usual. Only connected sockets are shut down: a gloo listener shut
down makes gloo's listening thread terminate the process.

A window is the whole process's: other threads may open sockets meanwhile (a mesh is built beside the training
thread when a layout change is prepared ahead). What is left alone: sockets other parts of this process declare
theirs (:func:`not_a_group_socket`: the exit watch's), connections to the control store, whenever they are opened
(:func:`not_a_group_peer`: a lazily connecting etcd client, the rendezvous callback's client), connections accepted by
a listener that existed before the window (a store this process hosts), and every socket that existed before it. The
store client a first start's ``env://`` group opens is recorded with it: only that group uses it. NCCL's sockets are
never recorded (its communicators have an abort of their own, not wired: untested without a GPU).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

_recorded: set[int] = set()
"""Inodes of the connected sockets of the current generation's groups."""
_recorded_generation: int | None = None
"""The generation whose default group :data:`_recorded` belongs to; None: nothing recorded (no gloo default group)."""
_foreign: set[int] = set()
"""Inodes of sockets declared not a group's (:func:`not_a_group_socket`)."""
_foreign_peers: set[int] = set()
"""Ports whose connections are never a group's (:func:`not_a_group_peer`)."""
_lock = threading.Lock()
"""One recording's bookkeeping, or one interrupt, at a time (the death watch's thread interrupts)."""


def not_a_group_socket(sock: socket.socket) -> None:
    """``sock`` belongs to this package, not to a process group: never shut down with them, whenever it was made."""
    with contextlib.suppress(OSError):
        _foreign.add(os.fstat(sock.fileno()).st_ino)


def not_a_group_peer(port: int) -> None:
    """Connections to ``port`` (the control store's) are never a group's, whenever they are made."""
    _foreign_peers.add(int(port))


@contextlib.contextmanager
def recording_group_sockets(*, generation: int | None = None, gloo: bool = True) -> Iterator[None]:
    """Record the connected sockets created inside as process groups' of one generation.

    ``generation``: the block creates that generation's default group (what was recorded before is forgotten: the
    earlier groups were destroyed first); None: the block creates more groups over the current default group.
    ``gloo``: False where the groups are not gloo's (nothing is recorded for that generation).
    """
    global _recorded_generation
    with _lock:
        if generation is not None:
            _recorded.clear()
            _recorded_generation = generation if gloo else None
        recording = _recorded_generation
    if recording is None or not gloo:
        yield
        return
    before = _socket_inodes()
    existed = set(before.values())
    listeners = {port for port in (_listening_port(fd, inode) for fd, inode in before.items()) if port is not None}
    yield
    found = {inode for fd, inode in _socket_inodes().items()
             if inode not in existed and inode not in _foreign and _is_group_connection(fd, inode, listeners)}
    with _lock:
        if _recorded_generation == recording:  # not if a newer generation's group formed meanwhile (another thread)
            _recorded.update(found)


def interrupt_group_sockets(generation: int) -> int:
    """Shut down the connections of ``generation``'s groups (see the module); how many. Nothing when the groups
    recorded are another generation's (this process moved on) or none were."""
    shut = 0
    with _lock:
        if generation != _recorded_generation:
            return 0
        for fd, inode in _socket_inodes().items():
            if inode in _recorded and inode not in _foreign:  # declared since it was recorded: the exit watch's race
                with _duplicate(fd, inode) as sock:
                    if sock is not None:
                        with contextlib.suppress(OSError):  # already shut, or the peer reset it
                            sock.shutdown(socket.SHUT_RDWR)
                            shut += 1
    return shut


def _socket_inodes() -> dict[int, int]:
    """This process's sockets: descriptor -> inode (what a descriptor names is read, so a reused number is told apart)."""
    found: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        with contextlib.suppress(OSError, ValueError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:["):
                found[int(name)] = int(link[len("socket:["):-1])
    return found


@contextlib.contextmanager
def _duplicate(fd: int, inode: int) -> Iterator[socket.socket | None]:
    """A socket object on a duplicate of ``fd``, if ``fd`` still names socket ``inode`` (closed in the end: the
    duplicate only; the original descriptor and the socket stay as they were)."""
    try:
        dup = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        if os.fstat(dup).st_ino != inode:
            yield None
            return
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        yield None
        return
    try:
        yield sock
    finally:
        sock.close()


def _listening(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def _tcp(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM


def _listening_port(fd: int, inode: int) -> int | None:
    with _duplicate(fd, inode) as sock:
        if sock is None or not _tcp(sock) or not _listening(sock):
            return None
        return int(sock.getsockname()[1])


def _peer_port(sock: socket.socket) -> int | None:
    try:
        return int(sock.getpeername()[1])
    except OSError:  # not connected
        return None


def _is_group_connection(fd: int, inode: int, old_listeners: set[int]) -> bool:
    """A TCP connection, not to the control store, not accepted by a listener older than the window."""
    with _duplicate(fd, inode) as sock:
        if sock is None or not _tcp(sock) or _listening(sock):
            return False
        peer = _peer_port(sock)
        return peer is not None and peer not in _foreign_peers and int(sock.getsockname()[1]) not in old_listeners
