"""Live membership changes in training: a node joins a running ``lightning-emig-run`` job.

Node A (127.0.0.2) starts alone and trains; once it has saved its step-10 checkpoint, node B (127.0.0.3)
starts. Once B's worker is ready (A's training waits for it here, :mod:`lightning_emig.testing.held_train`, so the
join lands inside the run on any machine; training going on meanwhile is exercised by the other membership tests),
at the next optimizer-step boundary A's worker agrees on generation 1, ends its ``fit`` without
writing a checkpoint, switches process groups and starts ``fit(ckpt_path="live")`` in the same process; B's
worker starts there directly, and the parameters and optimizer state move point to point. Specification:

* both agents exit 0 and A's worker keeps its process id (it is never restarted);
* ``events.jsonl`` holds exactly one ``join`` event, world 1 -> 2, with bytes moved;
* the run reaches ``max_steps`` and every step's loss equals the uninterrupted single-process run with the
  same global batch, to a relative 1e-4 (two FSDP ranks sum gradients in another order than one process
  accumulating four micro-batches; the data order is the same by construction);
* pure helpers: the layout rule for a new world and the generation environment.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from lightning_emig.change.events import read_events
from lightning_emig.change.lost_time import STEADY_STEPS, events_with_lost_time
from lightning_emig.launcher.generation import GenerationInfo, NodeEntry
from lightning_emig.layout import HybridLayout
from lightning_emig.membership import generation_env, layout_for_new_world
from lightning_emig.testing.commands import (
    descendants,
    is_alive,
)
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.held_train import (
    ENV_HOLD_STEPS_FOR_JOINERS,
    ENV_HOLD_TRAINING_FROM_STEP,
    ENV_HOLD_TRAINING_UNTIL_GENERATION,
)
from lightning_emig.testing.ledger import check_ledger
from lightning_emig.testing.nodes import (
    assert_agents_succeed,
    start_node,
    start_reference,
    stop_agents,
    worst_loss_gap,
)
from lightning_emig.testing.nodes import log_tail as _log
from lightning_emig.testing.nodes import wait_for as _wait_for

REPO = Path(__file__).resolve().parents[1]
MAX_STEPS = 150
TRAIN = ["data=synthetic", "model=tiny", f"trainer.max_steps={MAX_STEPS}", "trainer.global_batch_size=8",
         "trainer.micro_batch_size=2", "trainer.progress_bar=false", "trainer.pg_timeout_s=60"]
REL_TOL = 1e-4


# --- pure ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "world", "expected"),
    [
        (HybridLayout(), 2, HybridLayout(dp_shard=2)),
        (HybridLayout(tp=2), 4, HybridLayout(dp_shard=2, tp=2)),
        (HybridLayout(tp=2), 3, HybridLayout(dp_shard=3)),  # tp does not divide: pure FSDP
        (HybridLayout(dp_replicate=2, dp_shard=2), 6, HybridLayout(dp_replicate=2, dp_shard=3)),
        (HybridLayout(dp_shard=2, tp=2), 8, HybridLayout(dp_shard=4, tp=2)),
        (HybridLayout(pp=2, pp_virtual=2), 4, HybridLayout(dp_shard=2, pp=2, pp_virtual=2)),
        (HybridLayout(pp=2, pp_virtual=2), 3, HybridLayout(dp_shard=3)),  # pp does not divide: no stages at all
    ],
)
def test_layout_for_a_new_world_keeps_what_divides_it(requested: HybridLayout, world: int,
                                                      expected: HybridLayout) -> None:
    assert layout_for_new_world(requested, world) == expected.resolve(world)


def test_generation_env_describes_the_new_world_to_lightning() -> None:
    info = GenerationInfo(
        generation=1, world_size=3, master_addr="127.0.0.2", master_port=29511,
        nodes=(NodeEntry(node_id="a_1", ranks=(0,), kept_workers=True),
               NodeEntry(node_id="b_2", ranks=(2, 1), kept_workers=False)),
    )
    env = generation_env(info, "b_2", 1)
    assert env == {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                   "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.2", "MASTER_PORT": "29511"}


# --- two simulated nodes ---------------------------------------------------------------------------


JOINED_FROM_STEP = 25
"""A alone waits, from this step on, in its membership check for generation 1 and B's worker: on a slow machine B
(its start-up and rendezvous once outlasted 150 tiny steps) could otherwise miss the short run."""


def _start_node(tmp_path: Path, name: str, local_addr: str, port: int, run_dir: Path) -> subprocess.Popen:
    return start_node(tmp_path, name, local_addr=local_addr, port=port, run_dir=run_dir,
                      train_args=[*TRAIN, "trainer.checkpoint_every_n_steps=10", "data.ledger=true"],
                      module="lightning_emig.testing.held_train",
                      env={ENV_HOLD_STEPS_FOR_JOINERS: "1", ENV_HOLD_TRAINING_UNTIL_GENERATION: "1",
                           ENV_HOLD_TRAINING_FROM_STEP: str(JOINED_FROM_STEP)})


def _median_ms(seconds: list[float]) -> float:
    return sorted(seconds)[len(seconds) // 2] * 1e3 if seconds else float("nan")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_node_joins_live_training_without_restarting_the_survivor(tmp_path: Path) -> None:
    start_reference(tmp_path, TRAIN)
    port = free_port()
    run_dir = tmp_path / "run"
    agents: dict[str, subprocess.Popen] = {}
    try:
        agents["a"] = _start_node(tmp_path, "a", "127.0.0.2", port, run_dir)
        _wait_for(lambda: (run_dir / "checkpoints" / "step000010.ckpt").exists() or agents["a"].poll() is not None,
                  90, f"node A did not reach step 10:\n{_log(tmp_path, 'a')}")
        assert agents["a"].poll() is None, _log(tmp_path, "a")
        a_workers = [p for p in descendants(agents["a"].pid) if is_alive(p)]
        agents["b"] = _start_node(tmp_path, "b", "127.0.0.3", port, run_dir)
        assert_agents_succeed(tmp_path, agents, 120)
    finally:
        stop_agents(agents)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["pid"] in a_workers, "node A's worker was restarted (rank 0 of the final world is A's)"
    assert summary["world_size"] == 2 and summary["layout"]["dp_shard"] == 2
    events = read_events(run_dir)
    assert [(e["kind"], e["old_world"], e["new_world"]) for e in events] == [("join", 1, 2)], events
    (join,) = events
    assert join["bytes_moved"] > 0
    assert 10 <= join["step"] < MAX_STEPS, "B joined too late to test training on the bigger world"
    assert not (run_dir / "checkpoints" / f"step{join['step']:06d}.ckpt").exists(), "the handoff wrote a checkpoint"
    # The headline figure: rank 0 reported the join's lost time once the steady steps after it were done, and the
    # run directory's events carry it (the same function reads both from step_times.jsonl).
    (annotated,) = events_with_lost_time(run_dir)
    assert annotated["steady_steps"] == STEADY_STEPS
    assert annotated["lost_seconds"] < annotated["downtime_seconds"]
    reported = re.search(r"join at step (\d+): (-?[\d.]+)s of training lost", (tmp_path / "a.log").read_text())
    assert reported is not None, "rank 0 did not report the join's lost time"
    assert int(reported.group(1)) == join["step"]
    assert float(reported.group(2)) == pytest.approx(annotated["lost_seconds"], abs=0.01)
    pause = re.search(r"join at step \d+: .*the change itself ([\d.]+)s\)", (tmp_path / "a.log").read_text())
    assert pause is not None, "rank 0 did not say how much of the lost time was the change itself"
    assert annotated["pause_seconds"] > 0
    assert float(pause.group(1)) == pytest.approx(annotated["pause_seconds"], abs=0.01)
    # The model is summarised when training starts, not again in the join's pause (the same model, rank 0 working
    # the summary out while B waited for it).
    assert (tmp_path / "a.log").read_text().count("Total params") == 1
    # B faulted in A's published working set (rescaled to its share of the state) before it said it was ready.
    warmed = re.search(r"warmed ([\d.]+) GB of host memory", (tmp_path / "b.log").read_text())
    assert warmed is not None and float(warmed.group(1)) > 0, "the joiner did not warm its memory before joining"

    ledger = check_ledger(run_dir)  # every sample of every step's global batch exactly once, across the join
    ledger.assert_exactly_once()
    assert ledger.rolled_back_steps == [] and set(ledger.dp_degrees.values()) == {1, 2}, ledger.describe()

    losses = summary["step_losses"]
    assert sorted(int(k) for k in losses) == list(range(MAX_STEPS))
    worst = worst_loss_gap(tmp_path, TRAIN, losses)
    assert worst < REL_TOL, f"loss curve departs from the reference by {worst:.2e} (relative)"
    agree = summary["agree_seconds"]
    print(
        f"\nlive join at step {join['step']}: downtime {join['downtime_seconds']:.2f}s (detect includes the test's "
        f"wait for B's worker), "
        f"{join['bytes_moved'] / 1e6:.2f} MB moved; phases "
        + ", ".join(f"{k} {v:.3f}s" for k, v in join["seconds"].items())
        + f"; per-step check median {_median_ms(agree[:join['step']]):.2f} ms on 1 rank, "
        f"{_median_ms(agree[join['step']:]):.2f} ms on 2 (includes waiting for the slower rank); "
        f"worst relative loss gap {worst:.1e}"
    )
