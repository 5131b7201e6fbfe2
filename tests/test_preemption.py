"""Announced preemption: a node leaves a running ``lightning-emig-run`` job with notice, its state goes first.

Nodes A (127.0.0.2) and B (127.0.0.3) start together and train as a world of two (``dp_shard=2``: B's worker
holds half of every shard and there is no replica anywhere else; should B's agent miss A's first rendezvous round,
B joins live instead). Twenty-odd steps later, B's agent gets SIGTERM. Specification:

* B's agent does not kill its worker: at the next step boundary the worker sends its shards to A over the old
  process group and exits 0, and B's agent exits 0;
* A's agent exits 0, and A's worker finishes ``max_steps`` with its original process id, alone (world 1);
* ``events.jsonl`` holds a ``join`` (1 -> 2) then exactly one ``preempt`` event, world 2 -> 1, with bytes moved;
* every step's loss equals the uninterrupted single-process run with the same global batch, to a relative 1e-4
  (two FSDP ranks sum gradients in another order than one process accumulating four micro-batches).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from lightning_emig.testing.commands import (
    descendants,
    is_alive,
)
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.ledger import check_ledger
from lightning_emig.testing.nodes import (
    assert_agents_succeed,
    start_node,
    stop_agents,
    wait_for,
    worst_loss_gap,
)
from lightning_emig.testing.nodes import log_tail as _log
from lightning_emig.training.events import read_events

MAX_STEPS = 150
TRAIN = ["data=synthetic", "model=tiny", f"trainer.max_steps={MAX_STEPS}", "trainer.global_batch_size=8",
         "trainer.micro_batch_size=2", "trainer.progress_bar=false", "trainer.pg_timeout_s=60"]
REL_TOL = 1e-4


def _start_node(log_dir: Path, name: str, local_addr: str, port: int, run_dir: Path, *, hosts_store: bool
                ) -> subprocess.Popen:
    """One agent, one worker. The rendezvous store lives in one agent: it must be a node that stays (torchrun's own
    rule for the c10d backend), so it is pinned with ``is_host`` instead of going to whichever agent binds first."""
    return start_node(
        log_dir, name, local_addr=local_addr, port=port, run_dir=run_dir, rdzv_id="preempt",
        rdzv_conf=f"is_host={str(hosts_store).lower()}", env={"LIGHTNING_EMIG_GRACE_S": "180"},
        train_args=[*TRAIN, "trainer.checkpoint_every_n_steps=10", "data.ledger=true"],
    )


def test_batch_counters_are_re_expressed_for_the_new_accumulation() -> None:
    from lightning_emig.strategy.boundary import rescale_batch_progress

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


@pytest.mark.parametrize("meanwhile", ["nothing", "a join", "a round that kept the leaver"])
def test_the_survivors_generation_never_hides_one_the_agents_published_during_the_drain(meanwhile: str) -> None:
    """A drain that saw generation 0 (A, B; B leaving) publishes A's generation only if nothing came since; a round
    published meanwhile with joiner C and without B is the one A goes into (C's worker was started into it)."""
    import torch.distributed as dist

    from lightning_emig.launcher.generation import latest_generation, read_generation
    from lightning_emig.membership.preempt import _publish_survivors_or_join

    store = dist.HashStore()
    _agents_publish(store, _entries(("a", (0,), False), ("b", (1,), False)))
    info = read_generation(store, 0)
    if meanwhile == "a join":
        _agents_publish(store, _entries(("a", (0,), True), ("c", (1,), False)))
    elif meanwhile == "a round that kept the leaver":
        _agents_publish(store, _entries(("a", (0,), True), ("b", (1,), True), ("c", (2,), False)))
    went_into = _publish_survivors_or_join(store, info, {0: 0}, "127.0.0.1", ["b"], seen_latest=0)
    assert went_into == latest_generation(store)
    nodes = [n.node_id for n in read_generation(store, went_into).nodes]
    assert nodes == {"nothing": ["a"], "a join": ["a", "c"], "a round that kept the leaver": ["a"]}[meanwhile]
    assert went_into == {"nothing": 1, "a join": 1, "a round that kept the leaver": 3}[meanwhile]

@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_preempted_node_hands_off_its_state_and_the_survivor_continues(tmp_path: Path) -> None:
    port = free_port()
    run_dir = tmp_path / "run"
    agents: dict[str, subprocess.Popen] = {}
    try:
        # Both nodes at once: one rendezvous round of two (or, if B's agent comes late, A alone and then B joins).
        agents["a"] = _start_node(tmp_path, "a", "127.0.0.2", port, run_dir, hosts_store=True)
        agents["b"] = _start_node(tmp_path, "b", "127.0.0.3", port, run_dir, hosts_store=False)
        wait_for(lambda: "generation 0: world 2 on 2 node(s)" in (tmp_path / "a.log").read_text()
                 or any(e["kind"] == "join" for e in read_events(run_dir))
                 or any(p.poll() is not None for p in agents.values()),
                 120, f"the two nodes did not form a world of two:\n{_log(tmp_path, 'a')}\n{_log(tmp_path, 'b')}")
        # A few steps on the world of two (a checkpoint every 10 steps), then the notice.
        start = max([e["step"] for e in read_events(run_dir)], default=0)
        after = (start // 10 + 2) * 10
        wait_for(lambda: (run_dir / "checkpoints" / f"step{after:06d}.ckpt").exists()
                 or any(p.poll() is not None for p in agents.values()),
                 120, f"no checkpoint at step {after} on the world of two:\n{_log(tmp_path, 'a')}")
        a_workers = [p for p in descendants(agents["a"].pid) if is_alive(p)]
        b_workers = [p for p in descendants(agents["b"].pid) if is_alive(p)]
        assert b_workers and all(p.poll() is None for p in agents.values())
        os.kill(agents["b"].pid, signal.SIGTERM)
        assert_agents_succeed(tmp_path, agents, 150)
        assert not any(is_alive(p) for p in b_workers), "B's worker outlived its agent"
    finally:
        stop_agents(agents)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["pid"] in a_workers, "node A's worker was restarted"
    assert summary["world_size"] == 1
    events = read_events(run_dir)
    kinds = [(e["kind"], e["old_world"], e["new_world"]) for e in events]
    assert kinds in ([("preempt", 2, 1)], [("join", 1, 2), ("preempt", 2, 1)]), events
    preempt = events[-1]
    assert preempt["old_layout"]["dp_shard"] == 2 and preempt["new_layout"]["dp_shard"] == 1
    assert preempt["bytes_moved"] > 0
    assert after <= preempt["step"] < MAX_STEPS
    assert not (run_dir / "checkpoints" / f"step{preempt['step']:06d}.ckpt").exists(), "the handoff wrote a checkpoint"

    ledger = check_ledger(run_dir)  # every sample of every step's global batch exactly once, across the handoff
    ledger.assert_exactly_once()
    assert ledger.rolled_back_steps == [] and set(ledger.dp_degrees.values()) == {1, 2}, ledger.describe()

    losses = summary["step_losses"]
    assert sorted(int(k) for k in losses) == list(range(MAX_STEPS))
    worst = worst_loss_gap(tmp_path, TRAIN, losses)
    assert worst < REL_TOL, f"loss curve departs from the reference by {worst:.2e} (relative)"
    print(
        f"\npreemption at step {preempt['step']}: downtime {preempt['downtime_seconds']:.2f}s, "
        f"{preempt['bytes_moved'] / 1e6:.2f} MB moved; phases "
        + ", ".join(f"{k} {v:.3f}s" for k, v in preempt["seconds"].items())
        + f"; worst relative loss gap {worst:.1e}"
    )
