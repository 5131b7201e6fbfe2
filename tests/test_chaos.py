"""Chaos: a seeded random schedule of joins, announced preemptions and kills, played against simulated nodes.

``lightning-emig-run`` agents on loopback addresses (node ``a`` on 127.0.0.2, over c10d the store's host: its worker
is killed, the node never leaves; the others on 127.0.0.3 .. 127.0.0.9), one worker each, ``--nnodes=2:4``, ``--max-restarts=2``, the tiny
model on synthetic data, ``layout=hsdp`` (two replicas on worlds 2 and 4, none on 3), ``trainer.pg_timeout_s=60``,
heartbeats every 0.5 s judged stale after 5 s, a checkpoint every 25 steps, ``data.ledger=true``.

The schedule (:func:`lightning_emig.testing.chaos.make_schedule`) holds bursts (events < 1.5 s apart), a join while
the previous joiner is still starting, dips below MIN followed by a join, every kind of event. Specification of the
run (:func:`lightning_emig.testing.chaos_checks.check_run`): every agent not killed exits 0 (preempted ones included);
every sample of every step trained exactly once apart from the steps the events declare rolled back; no rollback
where replicas existed; every step's loss within a relative 1e-4 of the uninterrupted single-process run;
``events.jsonl`` one event per change, worlds chaining; no process left behind.

* ``test_a_seeded_chaos_schedule``: 12 events over c10d (the store host's worker killed among them), in the default
  suite; seeds from ``LIGHTNING_EMIG_CHAOS_SEEDS`` (comma-separated, default ``1``); ``LIGHTNING_EMIG_CHAOS_MAX_STEPS``
  (default 150) for a seed whose schedule outlasts the training on a fast machine (the harness then says so).
* ``test_a_seeded_chaos_schedule_over_etcd``: the same over etcd-v2, where node ``a`` (started first) leaves too; a
  long variant (``LIGHTNING_EMIG_LONG_TESTS=1``).
* ``test_a_long_chaos_schedule``: 32 events over 2400 steps in float64, only with ``LIGHTNING_EMIG_CHAOS_LONG=1``;
  writes its results to ``docs/results/chaos_long.md`` (seed ``LIGHTNING_EMIG_CHAOS_LONG_SEED``, default 7).

Nothing here waits on a wall-clock threshold: ``trainer.max_steps`` is sized so training outlasts the schedule on a
slow machine, and a run where it did not is reported as such (the ``run`` check), not as a library failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_emig.testing.chaos import (
    HOST,
    REUSE_AFTER_S,
    Backend,
    ChaosRun,
    ChaosSettings,
    ScheduleSpec,
    has_burst,
    has_dip_in_recovery,
    has_kill_in_recovery,
    has_overlap,
    initial_nodes,
    make_schedule,
)
from lightning_emig.testing.chaos_checks import ChaosResult, check_run, unexcused_failed_saves
from lightning_emig.testing.etcd import etcd_server, has_etcd
from lightning_emig.testing.nodes import REPO, start_reference

SEEDS = [int(s) for s in os.environ.get("LIGHTNING_EMIG_CHAOS_SEEDS", "1").split(",")]
MAX_STEPS = int(os.environ.get("LIGHTNING_EMIG_CHAOS_MAX_STEPS", "150"))
LONG = os.environ.get("LIGHTNING_EMIG_CHAOS_LONG") == "1"
LONG_SEED = int(os.environ.get("LIGHTNING_EMIG_CHAOS_LONG_SEED", "7"))
LONG_RESULTS = REPO / "docs" / "results" / "chaos_long.md"


def _train(max_steps: int) -> tuple[str, ...]:
    """A global batch of 24 in micro-batches of 2: whole on 1, 2, 3 and 4 data-parallel ranks."""
    return ("data=synthetic", "model=tiny", f"trainer.max_steps={max_steps}", "trainer.global_batch_size=24",
            "trainer.micro_batch_size=2", "trainer.progress_bar=false", "trainer.pg_timeout_s=60",
            "trainer.checkpoint_every_n_steps=25", "elastic.heartbeat_interval_s=0.5",
            "elastic.heartbeat_timeout_s=5")


def _play(out_dir: Path, spec: ScheduleSpec, max_steps: int, base_args: tuple[str, ...] | None = None,
          etcd_endpoint: str | None = None) -> tuple[ChaosResult, ChaosRun]:
    schedule = make_schedule(spec)
    settings = ChaosSettings(base_args=base_args or _train(max_steps), min_nodes=spec.min_nodes,
                             max_nodes=spec.max_nodes, max_restarts=spec.max_restarts, etcd_endpoint=etcd_endpoint)
    run = ChaosRun(out_dir, schedule, settings)
    start_reference(out_dir, settings.base_args)  # check_run compares with it
    run.run()  # stops every process it started, whatever happens
    result = check_run(run, spec.seed)
    print(result.markdown(f"chaos, seed {spec.seed}"))
    return result, run


# --- the schedule --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("events", [12, 32])
def test_a_schedule_keeps_the_jobs_limits(seed: int, events: int, backend: Backend) -> None:
    spec = ScheduleSpec(seed=seed, events=events, backend=backend)
    schedule = make_schedule(spec)
    assert schedule == make_schedule(spec), "the same seed draws another schedule"
    assert len(schedule) == events and has_burst(schedule) and has_overlap(schedule)
    assert has_kill_in_recovery(schedule) and has_dip_in_recovery(schedule, spec.min_nodes)
    live = dict(initial_nodes(spec.min_nodes))  # name -> address
    ever, kills, left_at, clock = set(live), dict.fromkeys(live, 0), {}, 0.0
    for before, event in zip([None, *schedule], schedule, strict=False):
        clock += event.delay_s
        if before is not None and len(live) < spec.min_nodes:
            assert event.kind == "join", f"below MIN and no join next: {before}, then {event}"
        if event.kind == "join":
            assert event.node not in ever and event.address not in live.values(), f"{event}: name or address in use"
            vacated = left_at.get(event.address, -REUSE_AFTER_S)
            assert clock - vacated >= REUSE_AFTER_S, f"{event}: address reused {clock - vacated:.1f}s after it was left"
            live[event.node], kills[event.node] = event.address, 0
            ever.add(event.node)
        else:
            assert event.node in live, f"{event} acts on a node that is not in the job"
        if event.kind == "kill_worker":
            kills[event.node] += 1
            assert kills[event.node] <= spec.max_restarts, f"{event.node} has no restart left"
        if event.kind in ("preempt", "kill_node"):
            assert backend == "etcd" or event.node != HOST, "the c10d store's host left"
            left_at[live.pop(event.node)] = clock
        assert 1 <= len(live) <= spec.max_nodes
    assert len(live) >= spec.min_nodes, "the job ends below MIN"
    host_events = {e.kind for e in schedule if e.node == HOST}
    if backend == "etcd":
        assert host_events & {"preempt", "kill_node"}, "the node started first never left"
    else:
        assert "kill_worker" in host_events, "the store host's worker was never killed"


# --- the runs ------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # ~3 min: the one chaos schedule of make test (more seeds: LIGHTNING_EMIG_CHAOS_SEEDS)
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeded_chaos_schedule(tmp_path: Path, seed: int) -> None:
    # Gaps of 3-8 s (not 5-12): a shorter, denser schedule. Its events stall training (seed 1 ended it at steps
    # 28 to 53 on 2-core machines; older schedules of seeds 1, 2, 3 at steps 98, 215, 106): 150 steps outlast it
    # (the run check says so if they do not) and keep the test, and the reference run it is compared with, short.
    result, run = _play(tmp_path, ScheduleSpec(seed=seed, events=12, gap_s=(3.0, 8.0)), max_steps=MAX_STEPS)
    assert result.ok, result.explain(run)


@pytest.mark.long  # the same schedules as above; node a (started first) leaves too
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not has_etcd(), reason="needs the etcd extra: pip install '.[etcd]'")
@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeded_chaos_schedule_over_etcd(tmp_path: Path, seed: int) -> None:
    spec = ScheduleSpec(seed=seed, events=12, gap_s=(3.0, 8.0), backend="etcd")
    with etcd_server() as endpoint:
        result, run = _play(tmp_path, spec, max_steps=300, etcd_endpoint=endpoint)
    assert result.ok, result.explain(run)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(3000)
@pytest.mark.skipif(not LONG, reason="long chaos run: set LIGHTNING_EMIG_CHAOS_LONG=1")
def test_a_long_chaos_schedule(tmp_path: Path) -> None:
    """In float64: over 2400 steps, float32 data-parallel ranks drift from one process by themselves (they sum
    gradients in another order; measured: 3.7e-3 relative at worst, past 1e-4 from step ~440), which would hide what
    the loss check is for. In float64 that drift stays near 1e-15 (measured over 300 steps), so the documented 1e-4
    holds over the whole run, as in the short runs."""
    max_steps = 2400
    train = (*_train(max_steps), "model.dtype=float64")
    result, run = _play(tmp_path, ScheduleSpec(seed=LONG_SEED, events=32), max_steps=max_steps, base_args=train)
    LONG_RESULTS.parent.mkdir(parents=True, exist_ok=True)
    command = (f"LIGHTNING_EMIG_CHAOS_LONG=1 LIGHTNING_EMIG_CHAOS_LONG_SEED={LONG_SEED} "
               ".venv/bin/pytest -q tests/test_chaos.py -k long -s")
    page = result.markdown(f"Long chaos run: {len(result.played)} events", command)
    LONG_RESULTS.write_text(page + LONG_NOTE)
    assert result.ok, result.explain(run)


LONG_NOTE = """
## Precision

This run trains in float64 (`model.dtype=float64`) and is held to the same 1e-4 as the short runs. In float32, two
data-parallel ranks drift from one process by themselves over 2400 steps (they sum gradients in another order:
3.7e-3 relative at the worst step, measured), so a float32 comparison would have to tolerate what it is meant to catch.
"""


# --- the checks ----------------------------------------------------------------------------------------------------


def test_a_failed_save_is_excused_only_by_a_failure_before_the_next_save_was_due() -> None:
    log = ("... CHECKPOINT FAILED: writing /runs/x/checkpoints/step000025.ckpt (step 25) in the background failed\n"
           "... CHECKPOINT FAILED: writing /runs/x/checkpoints/step000075.ckpt (step 75) in the background failed\n")
    join = {"kind": "join", "step": 30}
    died_at_27 = {"kind": "failure", "step": 27}
    rolled_back_to_50 = {"kind": "restart", "step": 50, "steps_rolled_back": 26}  # struck at 76
    assert unexcused_failed_saves(log, [join], every=25) == [25, 75]
    assert unexcused_failed_saves(log, [join, died_at_27], every=25) == [75]
    assert unexcused_failed_saves(log, [died_at_27, rolled_back_to_50], every=25) == []
    assert unexcused_failed_saves(log, [{"kind": "failure", "step": 24}], every=25) == [25, 75]  # before the save
    assert unexcused_failed_saves(log, [{"kind": "failure", "step": 50}], every=25) == [25, 75]  # after the next
    assert unexcused_failed_saves("no failed save here", [], every=25) == []


def test_a_rollback_is_excused_only_when_every_replica_was_killed() -> None:
    from lightning_emig.testing.chaos import ChaosEvent, Played
    from lightning_emig.testing.chaos_checks import _check_rollbacks

    hsdp = {"dp_replicate": 2, "dp_shard": 1, "tp": 1, "pp": 1}
    restart = {"kind": "restart", "step": 75, "steps_rolled_back": 2, "old_world": 2, "new_world": 2,
               "old_layout": hsdp, "new_layout": hsdp}
    kill_b = Played(ChaosEvent("kill_node", "b1", "127.0.0.3", 7.8), 7.8, 77)
    kill_a = Played(ChaosEvent("kill_worker", "a", "127.0.0.2", 4.6), 12.4, 77)
    missed = Played(ChaosEvent("kill_worker", "a", "127.0.0.2", 0.2), 12.6, 77, note="no worker was running")
    assert not _check_rollbacks([restart], [kill_b]).ok  # one replica left: the live path had a copy
    assert not _check_rollbacks([restart], [kill_b, missed]).ok  # a kill that found no worker killed nothing
    both = _check_rollbacks([restart], [kill_b, kill_a])
    assert both.ok and "every replica's node was killed (a, b1)" in both.detail
    earlier = Played(ChaosEvent("kill_worker", "a", "127.0.0.2", 1.0), 1.0, 40)
    assert not _check_rollbacks([restart], [kill_b, earlier]).ok  # killed long before: it had been recovered from



def test_a_missing_loss_line_is_excused_only_at_a_kill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 writes a step's loss line after the step: a kill at that step may take it first, nowhere else."""
    import json
    from types import SimpleNamespace

    from lightning_emig.testing import chaos_checks
    from lightning_emig.testing.chaos import ChaosEvent, Played

    monkeypatch.setattr(chaos_checks, "reference_losses", lambda *_: {str(s): 1.0 for s in range(4)})
    (tmp_path / "step_times.jsonl").write_text("".join(
        json.dumps({"step": s, "time": float(s), "world": 2, "loss": 1.0}) + "\n" for s in (1, 2, 4)))  # not step 3

    def check(*played: Played) -> chaos_checks.Check:
        run = SimpleNamespace(run_dir=tmp_path, out_dir=tmp_path, played=list(played),
                              settings=SimpleNamespace(base_args=("trainer.max_steps=4",)))
        return chaos_checks._check_loss(run, {"world_size": 2}, 1e-4)[0]  # type: ignore[arg-type]

    kill = ChaosEvent("kill_worker", "a", "127.0.0.2", 1.0)
    assert not check().ok and "no loss recorded for steps 2" in check().detail
    assert check(Played(kill, 1.0, 2)).ok  # killed while step 2 (line 3) was in flight
    assert "no line for steps 2" in check(Played(kill, 1.0, 2)).detail
    assert not check(Played(kill, 1.0, 0)).ok  # long before
    assert not check(Played(kill, 1.0, 2, note="no worker was running")).ok
