"""Live ``strategy.reconfigure(layout)`` inside ``Trainer.fit`` on the same processes.

Tolerance: the reconfigured run replays the uninterrupted run's arithmetic except for reduction order under
the temporary layouts (TP partial sums, HSDP all-reduce), so per-step losses agree to LOSS_RTOL (the same
bound as the static-layout comparison in test_training.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_emig.layout import HybridLayout
from lightning_emig.testing.distributed import WorkerFailed, run_distributed
from lightning_emig.testing.runs import fit, step_losses, tiny_config, with_schedule

pytestmark = pytest.mark.multiprocess

STEPS = 30
LOSS_RTOL = 1e-4
SCHEDULE = [(10, {"dp_shard": 2, "tp": 2}), (20, {"dp_replicate": 2, "dp_shard": 2})]


def _run(rank: int, world: int, root: str, scheduled: bool) -> dict[str, object]:
    cfg = tiny_config(layout={"dp_shard": 4}, max_steps=STEPS, world_size=world)
    if scheduled:
        with_schedule(cfg, SCHEDULE)
    parts = fit(cfg, Path(root))
    scheduler = parts.trainer.lr_scheduler_configs[0].scheduler
    return {
        "losses": step_losses(parts),
        "events": [event.as_dict() for event in parts.strategy.events],
        "offset": parts.loader.state_dict()["sampler"]["offset"],
        "scheduler_epoch": scheduler.last_epoch,
        "lr": parts.trainer.optimizers[0].param_groups[0]["lr"],
        "accumulation": parts.trainer.accumulate_grad_batches,
        "layout": parts.strategy.layout.as_dict(),
    }


def test_two_live_reconfigures_follow_the_uninterrupted_loss_curve(tmp_path: Path) -> None:
    reference = run_distributed(_run, 4, str(tmp_path / "ref"), False, timeout_s=300)[0]
    results = run_distributed(_run, 4, str(tmp_path / "live"), True, timeout_s=300)
    live = results[0]
    assert len(live["losses"]) == STEPS
    gaps = [abs(a - b) / abs(b) for a, b in zip(live["losses"], reference["losses"], strict=True)]
    assert max(gaps) < LOSS_RTOL, f"loss deviates by {max(gaps):.2e} from the uninterrupted run"
    # Same data position, same LR schedule position, same step count: training carried on, not restarted.
    assert live["offset"] == reference["offset"] == STEPS * 8
    assert live["scheduler_epoch"] == reference["scheduler_epoch"] == STEPS
    assert live["lr"] == pytest.approx(reference["lr"], rel=1e-12)
    assert live["layout"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "pp": 1}
    assert live["accumulation"] == 1
    # One event per change, on every rank, with the bytes that moved.
    assert [e["step"] for e in live["events"]] == [10, 20]
    assert all(e["bytes_moved"] > 0 for e in live["events"])
    assert all(r["events"] and len(r["events"]) == 2 for r in results)
    lines = (tmp_path / "live" / "events.jsonl").read_text().splitlines()
    layouts = [json.loads(line)["new_layout"] for line in lines]
    assert [HybridLayout(**lay).degrees.as_dict() for lay in layouts] == [
        {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1},
        {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "pp": 1},
    ]
    # FSDP over 4 -> dp_shard 2 x tp 2 on one node: tp numbered before dp_shard keeps more of each process's quarter
    # in place (the planner's tests count the bytes); the loss curve above is trained on that order
    assert layouts[0]["rank_order"] == ["pp", "dp_replicate", "tp", "dp_shard"]


def _impossible(rank: int, world: int, root: str) -> None:
    cfg = with_schedule(tiny_config(layout={"dp_shard": 2}, max_steps=4, world_size=world), [(2, {"tp": 3})])
    fit(cfg, Path(root))


def test_an_impossible_layout_fails_loudly(tmp_path: Path) -> None:
    # Raised while validating, before any state is touched.
    with pytest.raises(WorkerFailed, match="LayoutError: cannot fill dp_shard=-1: .* does not divide the world size 2"):
        run_distributed(_impossible, 2, str(tmp_path), timeout_s=120)


def _prepared_or_not(rank: int, world: int, root: str, ahead: int) -> dict[str, object]:
    import hashlib
    import threading

    import torch

    import lightning_emig.migration.engine as engine
    from lightning_emig.migration.state import planned_optimizer_specs, training_state

    planned_on: list[str] = []
    allocated_on: list[str] = []
    plan_for_rank, to_empty = engine.plan_for_rank, torch.nn.Module.to_empty

    def recording(*args: object, **kwargs: object) -> object:
        planned_on.append(threading.current_thread().name)
        return plan_for_rank(*args, **kwargs)

    def recording_to_empty(self: torch.nn.Module, **kwargs: object) -> object:
        allocated_on.append(threading.current_thread().name)
        return to_empty(self, **kwargs)

    engine.plan_for_rank = recording
    torch.nn.Module.to_empty = recording_to_empty
    cfg = with_schedule(tiny_config(layout={"dp_shard": 2}, max_steps=5, world_size=world), [(3, {"tp": 2})])
    cfg.elastic.prepare_ahead_steps = ahead
    parts = fit(cfg, Path(root))
    optimizer = parts.trainer.optimizers[0]
    optim = {k: t.spec for k, t in training_state(parts.module, optimizer).items() if k.startswith("optim/")}
    weights = hashlib.sha256()
    for _, param in sorted(parts.module.named_parameters()):
        weights.update(param.detach().full_tensor().numpy().tobytes())
    return {"losses": step_losses(parts), "events": [e.as_dict() for e in parts.strategy.events],
            "planned_on": planned_on, "allocated_on": allocated_on, "weights": weights.hexdigest(),
            "specs_as_allocated": planned_optimizer_specs(parts.module, optim) == optim}


def test_a_change_prepared_while_training_equals_one_built_in_the_pause(tmp_path: Path) -> None:
    built = run_distributed(_prepared_or_not, 2, str(tmp_path / "built"), 0, timeout_s=300)
    prepared = run_distributed(_prepared_or_not, 2, str(tmp_path / "prepared"), 1, timeout_s=300)
    # the same arithmetic: bit for bit, every step and the final weights
    assert prepared[0]["losses"] == built[0]["losses"] and len(built[0]["losses"]) == 5
    assert prepared[0]["weights"] == built[0]["weights"]
    (event,) = prepared[0]["events"]
    (at_boundary,) = built[0]["events"]
    assert {"mesh", "build"} <= set(at_boundary["seconds"]) and at_boundary.get("prepared_seconds") is None
    # prepared: the pause waited for the thread and swapped the model in; mesh, model and plan were built meanwhile
    assert {"prepare wait", "install"} <= set(event["seconds"]) and not {"mesh", "build"} & set(event["seconds"])
    assert set(event["prepared_seconds"]) >= {"build", "plan"}
    for result in prepared:  # every rank planned in the background thread, and migrate found that plan cached
        assert result["planned_on"] and set(result["planned_on"]) == {"lightning-emig-prepare"}
    assert all(r["specs_as_allocated"] for r in prepared + built)
    # the prepared model was built on the meta device: its storage allocated at the boundary, as a built one's is
    for result in prepared + built:
        assert result["allocated_on"] == ["MainThread", "MainThread"], result["allocated_on"]  # at start, at change
