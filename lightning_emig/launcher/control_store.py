"""The control store: where agents and workers publish generations, heartbeats and notices, by rendezvous backend.

* ``--rdzv-backend=c10d``: the TCPStore of the c10d rendezvous, hosted by one agent (the job cannot lose that node),
  addressed as ``host:port`` and used under a ``PrefixStore``.
* ``--rdzv-backend=etcd-v2``: the etcd server of the rendezvous (no node of the job hosts anything that outlives
  it), addressed as ``etcd://host:port``. torch's own ``EtcdStore`` has no ``compare_set`` or ``delete_key``, and a
  store written in Python cannot be wrapped in a C++ ``PrefixStore`` for those calls, so :class:`EtcdControlStore`
  implements the store methods this package uses (``set``, ``get``, ``check``, ``wait``, ``add``, ``compare_set``,
  ``delete_key``) itself, under its prefix, with etcd v2's atomic compare-and-swap. It is only ever called from
  Python.

Both kinds behave alike for the protocol: ``get`` and ``wait`` block up to the timeout, ``add`` and ``compare_set``
are atomic, ``compare_set`` returns the value now stored when it swapped and otherwise the current value (the
expected value when the key is missing), as ``TCPStore`` does.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_emig.collective_sockets import not_a_group_peer

ETCD_SCHEME = "etcd://"


ENV_RDZV_ENDPOINT = "LIGHTNING_EMIG_RDZV_ENDPOINT"
"""``--rdzv-endpoint`` as ``lightning-emig-run`` read it (the etcd server, with ``--rdzv-backend=etcd-v2``)."""

ETCD_BACKEND = "etcd-v2"


class ControlStoreError(RuntimeError):
    """The control store cannot be reached or a wait on it timed out."""


def parse_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ControlStoreError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def open_control_store(address: str, prefix: str, *, timeout_s: float) -> Any:
    """A client of the control store at ``address`` (``host:port`` or ``etcd://host:port``), under ``prefix``.

    Its connections are never taken for a process group's (:func:`~lightning_emig.collective_sockets.not_a_group_peer`):
    they outlive every generation."""
    if address.startswith(ETCD_SCHEME):
        host, port = parse_host_port(address.removeprefix(ETCD_SCHEME))
        not_a_group_peer(port)
        return EtcdControlStore(host, port, prefix, timeout_s=timeout_s)
    import torch.distributed as dist

    host, port = parse_host_port(address)
    not_a_group_peer(port)
    client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(prefix, client)


def _text(value: str | bytes) -> str:
    raw = value if isinstance(value, bytes) else value.encode()
    return base64.b64encode(raw).decode()


class EtcdControlStore:
    """The control store's methods on an etcd v2 server (see the module docstring)."""

    POLL_S = 0.05

    def __init__(self, host: str, port: int, prefix: str, *, timeout_s: float) -> None:
        import etcd  # python-etcd, the client torch's etcd-v2 rendezvous uses (the ``etcd`` extra)

        self._etcd = etcd
        self._client = etcd.Client(host=host, port=port, protocol="http", read_timeout=max(1, int(timeout_s)))
        self._root = "/" + prefix.strip("/")
        self.timeout = timedelta(seconds=timeout_s)
        self.address = f"{ETCD_SCHEME}{host}:{port}"

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}"

    def _read(self, key: str) -> bytes | None:
        try:
            return base64.b64decode(self._client.read(self._path(key)).value)
        except self._etcd.EtcdKeyNotFound:
            return None

    def set(self, key: str, value: str | bytes) -> None:
        self._client.write(self._path(key), _text(value))

    def check(self, keys: Sequence[str]) -> bool:
        return all(self._read(key) is not None for key in keys)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.timeout).total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise ControlStoreError(f"wait timeout on the control store ({self.address}), keys: {list(keys)}")
            time.sleep(self.POLL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._read(key)
        if value is None:  # deleted between the wait and the read
            raise ControlStoreError(f"key {key!r} vanished from the control store ({self.address})")
        return value

    def _swap(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        """Atomically: ``key = desired`` if its value is ``expected`` (None: if it does not exist); whether it did."""
        try:
            if expected is None:
                self._client.write(self._path(key), _text(desired), prevExist=False)
            else:
                self._client.write(self._path(key), _text(desired), prevValue=_text(expected))
            return True
        except (self._etcd.EtcdAlreadyExist, self._etcd.EtcdCompareFailed, self._etcd.EtcdKeyNotFound):
            return False

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        expected_raw = expected if isinstance(expected, bytes) else expected.encode()
        desired_raw = desired if isinstance(desired, bytes) else desired.encode()
        while True:
            if self._swap(key, expected_raw or None, desired_raw):
                return desired_raw
            current = self._read(key)
            if current is not None or not expected_raw:
                if current is None:  # deleted meanwhile: try again as "missing"
                    continue
                return current
            return expected_raw  # missing, and something else was expected: as TCPStore answers

    def add(self, key: str, amount: int) -> int:
        while True:
            current = self._read(key)
            value = (int(current) if current is not None else 0) + amount
            if self._swap(key, current, str(value).encode()):
                return value

    def delete_key(self, key: str) -> bool:
        try:
            self._client.delete(self._path(key))
            return True
        except self._etcd.EtcdKeyNotFound:
            return False


def find_tcp_store(store: dist.Store) -> dist.TCPStore:
    """The TCPStore under the rendezvous round's PrefixStore(s): the control store."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        raise ControlStoreError(
            f"lightning-emig-run needs a TCPStore-backed rendezvous (--rdzv-backend=c10d with a host:port "
            f"endpoint); the rendezvous store is a {type(store).__name__}"
        )
    return store
