"""A second host on this one, whose network can be cut: a network namespace joined to this one by a virtual link.

A process started under :attr:`HostBehindALink.prefix` reaches this host at :attr:`HostBehindALink.here` and is
reached at :attr:`HostBehindALink.there`; :meth:`HostBehindALink.cut` takes its side of the link down, so that from
here it is as a host whose power or network went: nothing it had open is closed, and no packet comes back. Needs
root and ``ip`` (iproute2): :func:`can_make_network_namespaces` says whether this machine has both.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@functools.cache
def can_make_network_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"emig-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made


@dataclass(frozen=True)
class HostBehindALink:
    here: str
    """This side's address on the link."""
    there: str
    """The namespace's address."""
    prefix: tuple[str, ...]
    """The command prefix that runs a process in the namespace."""
    here_device: str
    """This side's network device (gloo binds to it: ``GLOO_SOCKET_IFNAME``)."""
    there_device: str
    """The namespace's."""

    def address(self, *, far: bool) -> str:
        """The address of a node on the namespace's side (``far``) or on this one."""
        return self.there if far else self.here

    def gloo_env(self, *, far: bool) -> dict[str, str]:
        """Where gloo must bind on that side: by default it binds where the host's name resolves, which the namespace
        cannot reach."""
        return {"GLOO_SOCKET_IFNAME": self.there_device if far else self.here_device}

    def cut(self) -> None:
        subprocess.run([*self.prefix, "ip", "link", "set", self.there_device, "down"], check=True, capture_output=True)

    def mend(self) -> None:
        """The link back up (a blip, not a host gone)."""
        subprocess.run([*self.prefix, "ip", "link", "set", self.there_device, "up"], check=True, capture_output=True)


@contextlib.contextmanager
def host_behind_a_link() -> Iterator[HostBehindALink]:
    """The namespace and its link (``10.231.<n>.1`` here, ``.2`` there, ``n`` from this process's id: two runs on one
    machine do not collide), removed on exit; processes still in it must have been stopped by then."""
    subnet = 1 + os.getpid() % 250
    name, link = f"emig-{os.getpid()}-{subnet}", f"emig{os.getpid() % 10000}x{subnet}"
    run = functools.partial(subprocess.run, check=True, capture_output=True)
    prefix = ("ip", "netns", "exec", name)
    here, there = f"10.231.{subnet}.1", f"10.231.{subnet}.2"
    run(["ip", "netns", "add", name])
    try:
        run(["ip", "link", "add", f"{link}a", "type", "veth", "peer", "name", f"{link}b"])
        run(["ip", "link", "set", f"{link}b", "netns", name])
        run(["ip", "addr", "add", f"{here}/24", "dev", f"{link}a"])
        run(["ip", "link", "set", f"{link}a", "up"])
        run([*prefix, "ip", "addr", "add", f"{there}/24", "dev", f"{link}b"])
        run([*prefix, "ip", "link", "set", f"{link}b", "up"])
        run([*prefix, "ip", "link", "set", "lo", "up"])
        yield HostBehindALink(here=here, there=there, prefix=prefix, here_device=f"{link}a", there_device=f"{link}b")
    finally:
        subprocess.run(["ip", "link", "del", f"{link}a"], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
