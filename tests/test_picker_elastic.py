"""An elastic run whose layouts come from the layout picker (``elastic.picker.enabled=true``), end to end.

``lightning-emig-run`` agents on loopback addresses, one worker each, ``--nnodes=1:2``, the tiny model. Node A trains
alone; at step 10 node B joins (1 -> 2); at step 30 B's agent gets its preemption notice (2 -> 1). Test holds stop
rank 0 at those steps until the test has acted, so each change lands where the test says on any machine.

For this model without a memory limit the picker's choice at world 2 is pure replication (``dp_replicate=2``: no
all-gathers), where the fixed rule would shard (``dp_shard=2``): the run must take the picker's, record why in the
event, log the candidates table, and still train every sample once on the uninterrupted run's loss curve.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from lightning_emig.change.events import read_events
from lightning_emig.layout import HybridLayout
from lightning_emig.membership.settings import layout_for_new_world
from lightning_emig.models.llama import MODEL_SIZES
from lightning_emig.picker.policy import LayoutPicker
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.ledger import check_ledger
from lightning_emig.testing.nodes import (
    assert_agents_succeed,
    log_tail,
    start_node,
    start_reference,
    stop_agents,
    wait_for,
    worst_loss_gap,
)

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

MAX_STEPS = 50
GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN = 12, 2, 128
TRAIN = ["data=synthetic", "model=tiny", f"trainer.max_steps={MAX_STEPS}", f"trainer.global_batch_size={GLOBAL_BATCH}",
         f"trainer.micro_batch_size={MICRO_BATCH}", f"data.seq_len={SEQ_LEN}", "trainer.progress_bar=false",
         "trainer.pg_timeout_s=60", "elastic.picker.enabled=true"]
REL_TOL = 1e-4


def _picked(world: int, current: HybridLayout | None) -> HybridLayout:
    """What the picker answers offline, from the same settings the run has (one process per node)."""
    picker = LayoutPicker.from_section({"enabled": True}, model=MODEL_SIZES["tiny"], seq_len=SEQ_LEN,
                                       local_world_size=1)
    assert picker is not None
    return picker.pick(world, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, current=current).layout


def _start(tmp_path: Path, name: str, addr: str, port: int, *, hosts_store: bool) -> subprocess.Popen:
    env = {"LIGHTNING_EMIG_TEST_HOLD_DIR": str(tmp_path), "LIGHTNING_EMIG_TEST_HOLD_AT_STEPS": "10,30",
           "LIGHTNING_EMIG_TEST_HOLD_STEPS_FOR_JOINERS": "1"}
    return start_node(tmp_path, name, local_addr=addr, port=port, run_dir=tmp_path / "run", rdzv_id="picker",
                      rdzv_conf=f"is_host={str(hosts_store).lower()}", nnodes="1:2", env=env,
                      train_args=[*TRAIN, "data.ledger=true"], module="lightning_emig.testing.held_train")


def _held_at(tmp_path: Path, step: int, agents: dict[str, subprocess.Popen]) -> None:
    wait_for(lambda: f"test hold: step {step} waits" in log_tail(tmp_path, "a", 10**6) or agents["a"].poll() is not None,
             180, f"rank 0 never reached step {step}:\n" + "".join(log_tail(tmp_path, n) for n in agents))
    assert agents["a"].poll() is None, log_tail(tmp_path, "a")


def test_a_join_and_a_preemption_take_the_layouts_the_picker_chooses(tmp_path: Path) -> None:
    two = _picked(2, current=HybridLayout(dp_shard=1))
    assert two != layout_for_new_world(HybridLayout(), 2), "the picker agrees with the fixed rule: nothing is shown"
    start_reference(tmp_path, TRAIN)
    port = free_port()
    agents: dict[str, subprocess.Popen] = {}
    try:
        agents["a"] = _start(tmp_path, "a", "127.0.0.2", port, hosts_store=True)
        _held_at(tmp_path, 10, agents)
        agents["b"] = _start(tmp_path, "b", "127.0.0.3", port, hosts_store=False)
        wait_for(lambda: "world 2 on 2 node(s)" in log_tail(tmp_path, "a", 10**6), 120, "B's round was not published")
        (tmp_path / "release-10").touch()
        _held_at(tmp_path, 30, agents)
        os.kill(agents["b"].pid, signal.SIGTERM)  # the notice
        wait_for(lambda: "preemption notice" in log_tail(tmp_path, "b", 10**6) or agents["b"].poll() is not None, 60,
                 f"B's agent did not announce its departure:\n{log_tail(tmp_path, 'b')}")
        (tmp_path / "release-30").touch()
        assert_agents_succeed(tmp_path, agents, 200)
    finally:
        stop_agents(agents)

    run_dir = tmp_path / "run"
    events = read_events(run_dir)
    assert [(e["kind"], e["old_world"], e["new_world"]) for e in events] == [("join", 1, 2), ("preempt", 2, 1)], events
    join, preempt = events
    assert join["new_layout"] == two.as_dict(), join
    assert preempt["new_layout"] == _picked(1, current=two).as_dict(), preempt
    for event in events:
        assert "fastest" in event["layout_choice"]["explanation"], event
        assert event["layout_choice"]["est_step_seconds"] > 0
    assert join["layout_choice"]["migration_bytes"] > 0, "a change of world moves bytes: the tie-break saw none"
    assert "layout picker, world 2" in log_tail(tmp_path, "a", 10**7), "no candidates table in the log"

    ledger = check_ledger(run_dir)
    ledger.assert_exactly_once()
    assert ledger.rolled_back_steps == [] and set(ledger.dp_degrees.values()) == {1, 2}, ledger.describe()
    import json

    losses = json.loads((run_dir / "summary.json").read_text())["step_losses"]
    assert sorted(int(k) for k in losses) == list(range(MAX_STEPS))
    worst = worst_loss_gap(tmp_path, TRAIN, losses)
    assert worst < REL_TOL, f"loss curve departs from the uninterrupted run by {worst:.2e} (relative)"
