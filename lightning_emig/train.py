"""Hydra entry point: ``python -m lightning_emig.train [recipe=NAME] [key=value ...]``.

Works under Lightning's own launcher (``trainer.devices=4`` spawns the processes) and under torchrun
(``torchrun --nproc-per-node=4 -m lightning_emig.train``), with one run directory shared by every rank.
At the end rank 0 prints and writes ``summary.json``: first and last loss, tokens per second, layout.

Under ``lightning-emig-run`` a fit may end early to hand its live state to a newer generation (a node
joined, see :mod:`lightning_emig.membership`). This process then switches to the new generation's process
group and starts the next ``fit(ckpt_path="live")`` with the same LightningModule (its model dropped, its
history kept); a worker started into a live generation begins with ``fit(ckpt_path="live")`` directly.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lightning_emig.config import register_configs

register_configs()


def run_training(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    from lightning_emig.membership import LIVE_CHECKPOINT, joining_live
    from lightning_emig.membership.below_min import wait_for_enough_nodes
    from lightning_emig.membership.failure import Rollback
    from lightning_emig.training.builders import build_run, resolve_resume

    start = time.perf_counter()
    parts = build_run(cfg, run_dir)  # type: ignore[arg-type]
    ckpt_path = LIVE_CHECKPOINT if joining_live() else resolve_resume(cfg, run_dir)  # type: ignore[arg-type]
    agree_seconds: list[float] = []
    events: list[Any] = []
    while True:
        failure = _fit(parts, ckpt_path)
        if failure is None:  # a join at max_steps: that fit ran no step, its event is still due
            parts.strategy.finish_join_event(parts.trainer)
        agree_seconds += _agree_seconds(parts)
        events += parts.strategy.events
        if failure is not None:  # a peer died: the survivors carry on (see lightning_emig.membership.failure)
            outcome = _recover(parts, failure)
            _drop_model(parts.module)
            if isinstance(outcome, Rollback):
                parts = build_run(cfg, run_dir, rollback=outcome, module=parts.module)  # type: ignore[arg-type]
                ckpt_path = outcome.checkpoint
                continue
            handoff = outcome
        else:
            handoff = parts.strategy.pending_handoff
            if handoff is None:
                break
            if handoff.leaving:  # preempted with notice: the state went to the survivors; leave the job (exit 0)
                import torch.distributed as dist

                dist.destroy_process_group()
                return {"left": True, "step": parts.trainer.global_step, "pid": os.getpid()}
            handoff.lap("teardown")
            switch_to_generation(handoff.generation, timeout=parts.strategy.timeout)
            handoff.lap("group")
            _drop_model(parts.module)
        waiting_since = time.perf_counter()
        newer = wait_for_enough_nodes(handoff.generation, parts.strategy.failure_settings.below_min_timeout_s)
        if newer is not None:  # fewer nodes than MIN were left: join the generation that brought more
            if handoff.prior is not None:  # the change that left too few nodes is an event of its own
                events.append(_record_prior_event(parts, handoff, time.perf_counter() - waiting_since))
            handoff.generation = newer
            switch_to_generation(newer, timeout=parts.strategy.timeout)
            handoff.phase_started = time.perf_counter()
        parts = build_run(cfg, run_dir, handoff=handoff, module=parts.module)  # type: ignore[arg-type]
        ckpt_path = LIVE_CHECKPOINT
    seconds = time.perf_counter() - start
    summary = _summary(parts, seconds, cfg)
    summary["events"] = [event.as_dict() for event in events]
    summary["agree_seconds"] = agree_seconds
    if parts.trainer.is_global_zero:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        _print_summary(summary)
    return summary


def _fit(parts: Any, ckpt_path: str | None) -> BaseException | None:
    """Run one ``Trainer.fit``; a collective that failed because a peer died is returned, anything else raised."""
    from lightning_emig.membership import under_launcher
    from lightning_emig.membership.failure import is_peer_failure

    try:
        parts.trainer.fit(parts.module, train_dataloaders=parts.loader, ckpt_path=ckpt_path)
    except Exception as exc:
        # A process that failed before it had a layout (a joiner forming its first group) holds no state: it exits,
        # and its agent treats the node as failed.
        if under_launcher() and is_peer_failure(exc) and parts.strategy.has_layout:
            return exc
        raise
    return None


def _recover(parts: Any, failure: BaseException) -> Any:
    """The survivors' side of an abrupt failure: a handoff into their generation, or a rollback to a checkpoint."""
    import torch.distributed as dist

    from lightning_emig.launcher.generation import ENV_NODE_ID
    from lightning_emig.membership.failure import Rollback, recover_from_failure
    from lightning_emig.training.resume import newest_checkpoint

    _drop_model(parts.module)  # the model's FSDP state references the broken groups; the state is in the stash
    outcome = recover_from_failure(parts.strategy, failure, os.environ[ENV_NODE_ID], int(os.environ["LOCAL_RANK"]))
    if isinstance(outcome, Rollback):
        box: list[Any] = [None]
        if dist.get_rank() == 0:  # one rank decides: a background save might complete while the others look
            found = newest_checkpoint(parts.run_dir / "checkpoints")
            box[0] = str(found.path) if found is not None else None
        dist.broadcast_object_list(box, src=0)
        outcome.checkpoint = box[0]
    return outcome


def _record_prior_event(parts: Any, handoff: Any, waited: float) -> Any:
    """Record the failure or preemption that left the survivors below MIN; the join that follows is another event."""
    from lightning_emig.strategy.reconfigure import ReconfigureEvent

    prior, handoff.prior = handoff.prior, None
    event = ReconfigureEvent(
        kind=prior["kind"], step=int(handoff.metadata["global_step"]), old_layout=prior["old_layout"],
        new_layout=handoff.old_layout.as_dict(), old_world=prior["old_world"], new_world=handoff.old_world,
        bytes_moved=prior["bytes_moved"], bytes_copied_locally=prior["bytes_copied_locally"],
        seconds={**handoff.seconds, "below_min_wait": waited}, generation=handoff.generation,
        steps_rolled_back=prior.get("steps_rolled_back"),
    )
    parts.strategy._record_event(parts.trainer, event)  # noqa: SLF001 - its rank is the new world's (env rewritten)
    handoff.seconds = {"below_min_wait": waited}
    return event


def switch_to_generation(generation: int, *, timeout: Any) -> None:
    """Leave the current process group and form ``generation``'s, same backend (this process keeps running)."""
    import os

    import torch.distributed as dist

    from lightning_emig.launcher.generation import ENV_NODE_ID, control_client_from_env, read_generation
    from lightning_emig.membership import apply_generation_env, form_generation_group

    info = read_generation(control_client_from_env(), generation)
    rank = apply_generation_env(info, os.environ[ENV_NODE_ID], int(os.environ["LOCAL_RANK"]))
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    if dist.is_initialized():
        dist.destroy_process_group()
    form_generation_group(info, rank, backend, timeout)


def _drop_model(module: Any) -> None:
    """The next fit's ``configure_model`` builds the model for the new world (the live state is in the handoff)."""
    import gc

    for name, _ in list(module.named_children()):
        setattr(module, name, None)
    gc.collect()


def _summary(parts: Any, seconds: float, cfg: DictConfig) -> dict[str, Any]:
    losses = parts.module.step_losses
    steps = sorted(losses)
    plan = parts.strategy.batch_plan
    times = parts.module.step_end_times
    # Throughput from the steady state: the first step pays for warm-up (allocation, first messages).
    timed_steps = len(steps) - 1
    span = times[steps[-1]] - times[steps[0]] if timed_steps > 0 else 0.0
    tokens_per_second = timed_steps * plan.tokens_per_step(cfg.data.seq_len) / span if span > 0 else 0.0
    return {
        "layout": parts.strategy.layout.as_dict(),
        "world_size": parts.strategy.world_size,
        "batch": plan.describe(),
        "steps": len(steps),
        "first_loss": losses[steps[0]] if steps else None,
        "last_loss": losses[steps[-1]] if steps else None,
        "step_losses": {str(k): losses[k] for k in steps},
        "seconds": seconds,
        "tokens_per_second": tokens_per_second,
        "run_dir": str(parts.run_dir),
        "pid": os.getpid(),
    }


def _agree_seconds(parts: Any) -> list[float]:
    from lightning_emig.membership import RendezvousCallback

    for callback in parts.trainer.callbacks:
        if isinstance(callback, RendezvousCallback):
            return callback.agree_seconds
    return []


def _print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lightning-emig run summary")
    table.add_column("what")
    table.add_column("value")
    table.add_row("layout", " ".join(f"{k}={v}" for k, v in summary["layout"].items()))
    table.add_row("processes", str(summary["world_size"]))
    table.add_row("batch", summary["batch"])
    table.add_row("steps", str(summary["steps"]))
    if summary["first_loss"] is not None:
        table.add_row("loss", f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}")
    table.add_row("tokens/s", f"{summary['tokens_per_second']:.0f}")
    table.add_row("run dir", summary["run_dir"])
    Console().print(table)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_training(cfg, run_dir)


if __name__ == "__main__":
    main()
