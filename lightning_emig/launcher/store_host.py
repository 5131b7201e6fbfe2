"""Does this process host the rendezvous store? (The c10d backend's one node that must never leave.)

With ``--rdzv-backend=c10d`` one agent hosts the TCPStore every agent and worker talks to; torch decides which at
start-up (``is_host`` in ``--rdzv-conf``, else the agent on the endpoint's machine that binds first) and does not
say. The answer is read from the operating system: a socket listening on the store's port that is one of this
process's own file descriptors (Linux ``/proc``; elsewhere: unknown, None).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from lightning_emig.launcher.control_store import ETCD_SCHEME, parse_host_port

log = logging.getLogger(__name__)

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def hosts_port(port: int) -> bool | None:
    """True when this process listens on TCP ``port``; None where ``/proc`` cannot tell."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    listening = set()
    for table in ("tcp", "tcp6"):
        path = proc / "net" / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                listening.add(f"socket:[{fields[9]}]")
    own = set()
    for fd in os.listdir(proc / "self" / "fd"):
        try:
            own.add(os.readlink(proc / "self" / "fd" / fd))
        except OSError:  # closed meanwhile
            continue
    return bool(listening & own)


def warn_if_hosting(control_address: str, node_id: str) -> None:
    """A node that got a notice: with the c10d backend the store lives in one agent, and when that node goes, the
    job's control store goes too. Say so loudly when it is this one."""
    if not control_address or control_address.startswith(ETCD_SCHEME):
        return  # etcd: no node of the job hosts the store
    port = parse_host_port(control_address)[1]
    if hosts_port(port):
        log.error(
            "[%s] THIS NODE HOSTS THE RENDEZVOUS STORE (--rdzv-backend=c10d, port %d): when it leaves, every other "
            "node loses the job's store and the job ends. Pin the store to a node that is not preempted "
            "(--rdzv-conf=is_host=true on that node only).", node_id, port,
        )
