"""Announced preemption: the pure parts of a drain (batch counters re-expressed for the new accumulation; which
generation the survivors go into when the agents publish one meanwhile).

End to end, a node leaving with notice is run through a user's own script in ``tests/test_user_script.py`` (its
state handed to the survivor, one ``preempt`` event, the loss and the data ledger against the uninterrupted run),
and in quick succession with a join in ``tests/test_elastic_sequences.py``.
"""

from __future__ import annotations

import pytest


def test_batch_counters_are_re_expressed_for_the_new_accumulation() -> None:
    from lightning_emig.change.boundary import rescale_batch_progress

    # Captured in on_train_batch_end of step 21 under accumulation 2 (completed lags by the batch being ended).
    counters = {"ready": 42, "started": 42, "processed": 42, "completed": 41}
    metadata = {"loops": {"fit_loop": {"epoch_loop.batch_progress": {"current": dict(counters),
                                                                      "total": dict(counters)}}}}
    rescale_batch_progress(metadata, 2, 4)
    progress = metadata["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for scope in ("current", "total"):
        assert progress[scope] == {"ready": 84, "started": 84, "processed": 84, "completed": 83}



def _entries(*nodes: tuple[str, tuple[int, ...], bool]) -> list:
    from lightning_emig.launcher.generation import NodeEntry

    return [NodeEntry(node_id=n, ranks=r, kept_workers=k) for n, r, k in nodes]


def _agents_publish(store: object, nodes: list) -> int:
    from lightning_emig.launcher.generation import publish_generation

    return publish_generation(store, nodes=nodes, world_size=sum(len(n.ranks) for n in nodes),  # type: ignore[arg-type]
                              master_addr="127.0.0.2", master_port=1, rendezvous_seconds=0.0)


@pytest.mark.parametrize("meanwhile", ["nothing", "a join", "a join, its joiner starting", "a round that kept the leaver"])
def test_the_survivors_generation_never_hides_one_the_agents_published_during_the_drain(meanwhile: str) -> None:
    """A drain that saw generation 0 (A, B; B leaving) publishes A's generation only if nothing came since; a round
    published meanwhile with joiner C and without B is the one A goes into once C's worker is ready (it was started
    into it); while C is still starting, or when the round kept B, A's generation comes after it (C is left out and
    rejoins). Either way the survivors' generation is the one committed to, and the newest."""
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_emig.launcher.generation import latest_generation, read_generation, ready_key
    from lightning_emig.membership.admission import active_generation
    from lightning_emig.membership.preempt import _publish_survivors_or_join

    store = dist.HashStore()
    _agents_publish(store, _entries(("a", (0,), False), ("b", (1,), False)))
    info = read_generation(store, 0)
    if meanwhile.startswith("a join"):
        _agents_publish(store, _entries(("a", (0,), True), ("c", (1,), False)))
        if meanwhile == "a join":
            store.set(ready_key("c", 0), "1")
    elif meanwhile == "a round that kept the leaver":
        _agents_publish(store, _entries(("a", (0,), True), ("b", (1,), True), ("c", (2,), False)))
    went_into = _publish_survivors_or_join(store, info, {0: 0}, "127.0.0.1", ["b"], seen_latest=0,
                                           timeout=timedelta(seconds=10))
    assert went_into == latest_generation(store) == active_generation(store)
    nodes = [n.node_id for n in read_generation(store, went_into).nodes]
    assert nodes == (["a", "c"] if meanwhile == "a join" else ["a"])
    assert went_into == {"nothing": 1, "a join": 1}.get(meanwhile, 3)


@pytest.mark.long  # a notice: test_user_script's preemption; a drain racing a round: the test above
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_notice_before_the_node_joined_a_generation_leaves_cleanly_and_the_job_forms_without_it(tmp_path) -> None:
    """``--nnodes=3:3``: A (hosting the store) and B wait in their first round for a third node; B gets SIGTERM. It
    has nothing to hand off: its agent leaves the rendezvous without closing it and exits 0 (torchrun's default was
    death by the signal). C and D then join A, the three form the job and train to the end."""
    import json
    import signal

    from lightning_emig.testing.distributed import free_port
    from lightning_emig.testing.nodes import (
        assert_agents_succeed,
        log_tail,
        start_node,
        stop_agents,
        wait_for,
    )

    port, run_dir = free_port(), tmp_path / "run"
    args = ["data=synthetic", "model=tiny", "trainer.max_steps=20", "trainer.global_batch_size=6",
            "trainer.micro_batch_size=2", "trainer.progress_bar=false"]
    addresses = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4", "d": "127.0.0.5"}
    agents = {}

    def start(name: str) -> None:
        agents[name] = start_node(tmp_path, name, local_addr=addresses[name], port=port, run_dir=run_dir,
                                  nnodes="3:3", rdzv_id="early-notice", rdzv_conf=f"is_host={str(name == 'a').lower()}",
                                  train_args=args, env={"LOGLEVEL": "INFO"})

    try:
        start("a")
        start("b")
        wait_for(lambda: "rendezvous'ing worker group" in log_tail(tmp_path, "b").lower(), 60,
                 f"B never entered the rendezvous:\n{log_tail(tmp_path, 'b')}")
        agents["b"].send_signal(signal.SIGTERM)
        assert agents["b"].wait(timeout=60) == 0, log_tail(tmp_path, "b")
        assert "notice before this node joined a generation" in log_tail(tmp_path, "b", 10**6)
        start("c")
        start("d")
        assert_agents_succeed(tmp_path, agents, 200, ["a", "c", "d"])
    finally:
        stop_agents(agents)
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 3
