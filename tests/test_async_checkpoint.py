"""Periodic checkpoints written in the background (``trainer.checkpoint_async``).

Specification:

* a checkpoint taken at step K is still being written while steps K+1, K+2, ... run (slow storage is simulated),
  is complete once the fit ends, holds exactly Lightning's sharded layout, and resuming from it gives the state
  of step K bit for bit, although training changed every parameter while it was written; the checkpoint of the
  fit's last step (2K), still being written when training ends, is complete once the fit returns;
* a save that fails in the background is logged, never counts as complete, not even in a directory that held a
  complete checkpoint before, and the next save into that directory works;
* a directory without the completion marker (``meta.pt``, written last) is never resumed from;
* a fit stopped to hand its state to a new generation writes no ``last.ckpt``; otherwise ``last.ckpt`` is a link
  to the newest step checkpoint, not a second copy.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_emig.strategy.resume import FoundCheckpoint, is_complete, newest_checkpoint
from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.runs import fit, quiet_lightning, tiny_config
from lightning_emig.testing.state import assert_states_equal, full_training_state
from lightning_emig.training.builders import build_run

K = 3
"""The step of the asynchronous checkpoint."""
WRITE_DELAY_S = 3.0
"""Simulated slow storage: every rank's shard write takes at least this long."""


def _slow_storage(delay_s: float) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def slow_write_data(self: Any, plan: Any, planner: Any) -> Any:
        time.sleep(delay_s)
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = slow_write_data  # type: ignore[method-assign]


class _Probe(Callback):
    """Records the full state at step K, and whether its checkpoint was complete one step later."""

    def __init__(self, checkpoint: Path, loader: Any) -> None:
        self.checkpoint, self.loader = checkpoint, loader
        self.state_at_k: dict[str, torch.Tensor] = {}
        self.offset_at_k = -1
        self.complete_at_k_plus_1: bool | None = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == K:
            self.state_at_k = full_training_state(pl_module.model, trainer.optimizers[0])
            self.offset_at_k = self.loader.state_dict()["sampler"]["offset"]
        elif trainer.global_step == K + 1:
            self.complete_at_k_plus_1 = is_complete(self.checkpoint)


def _async_then_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    _slow_storage(WRITE_DELAY_S)
    quiet_lightning()
    run_dir = Path(root) / "a"
    checkpoints = run_dir / "checkpoints"
    cfg = tiny_config(layout={"dp_shard": 2}, max_steps=2 * K, world_size=world, checkpoint_every_n_steps=K)
    assert cfg.trainer.checkpoint_async
    parts = build_run(cfg, run_dir)
    probe = _Probe(checkpoints / f"step{K:06d}.ckpt", parts.loader)
    parts.trainer.callbacks.append(probe)
    started = time.perf_counter()
    parts.trainer.fit(parts.module, train_dataloaders=parts.loader)
    fit_seconds = time.perf_counter() - started
    assert parts.trainer.global_step == 2 * K
    final_complete = is_complete(checkpoints / f"step{2 * K:06d}.ckpt")

    resumed = fit(tiny_config(layout={"dp_shard": 2}, max_steps=K, world_size=world), Path(root) / "b",
                  ckpt_path=str(probe.checkpoint))
    assert_states_equal(probe.state_at_k, full_training_state(resumed.module.model, resumed.trainer.optimizers[0]))
    last = checkpoints / "last.ckpt"
    return {
        "complete_at_k_plus_1": probe.complete_at_k_plus_1,
        "complete_after_fit": (is_complete(probe.checkpoint), final_complete),
        "files": sorted(p.name for p in probe.checkpoint.iterdir()),
        "last_links_to": os.readlink(last) if last.is_symlink() else None,
        "newest": newest_checkpoint(checkpoints),
        "resumed_step": resumed.trainer.global_step,
        "offset": (probe.offset_at_k, resumed.loader.state_dict()["sampler"]["offset"]),
        "fit_seconds": fit_seconds,
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_an_async_checkpoint_is_written_while_training_goes_on_and_resumes_bit_exact(tmp_path: Path) -> None:
    results = run_distributed(_async_then_resume, 2, str(tmp_path), timeout_s=200)
    final = tmp_path / "a" / "checkpoints" / f"step{2 * K:06d}.ckpt"
    for result in results:
        assert result["complete_at_k_plus_1"] is False, "the step-K save blocked training until it was written"
        assert result["complete_after_fit"] == (True, True), "the fit ended without waiting for its checkpoint"
        # Lightning's layout: DCP's shards and .metadata, Lightning's meta.pt, nothing else left behind.
        assert result["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
        assert result["last_links_to"] == final.name
        assert result["newest"] == FoundCheckpoint(final, 2 * K)
        assert result["resumed_step"] == K
        offset_at_k, offset_resumed = result["offset"]
        assert offset_resumed == offset_at_k


def _failing_save(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_emig.strategy.async_checkpoint import AsyncCheckpointWriter

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_emig.strategy.async_checkpoint").addHandler(handler)

    path = Path(root) / "step.ckpt"
    writer = AsyncCheckpointWriter(timedelta(seconds=30))

    def checkpoint(step: int) -> dict[str, Any]:
        return {"state_dict": {f"weight{rank}": torch.full((4,), float(step + rank))}, "global_step": step}

    writer.save(checkpoint(1), path)
    first = writer.wait(), is_complete(path)
    dist.barrier()  # rank 0's next save clears the markers first: every rank looks before it does

    write_data = FileSystemWriter.write_data

    def broken_write_data(self: Any, plan: Any, planner: Any) -> Any:
        if rank == 1:
            raise OSError("No space left on device (simulated)")
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = broken_write_data  # type: ignore[method-assign]
    writer.save(checkpoint(2), path)
    failed = writer.wait(), is_complete(path)
    dist.barrier()

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    writer.save(checkpoint(3), path)
    writer.close()
    loaded = {"state_dict": {f"weight{r}": torch.zeros(4) for r in range(world)}}
    dcp.load(loaded, checkpoint_id=path)
    meta = torch.load(path / "meta.pt", weights_only=False)
    return {
        "first": first, "failed": failed, "third_complete": is_complete(path), "meta": meta,
        "loaded": {k: v.tolist() for k, v in loaded["state_dict"].items()},
        "failure_logged": any("CHECKPOINT FAILED" in message for message in records),
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_failed_background_save_is_logged_and_never_counts_as_complete(tmp_path: Path) -> None:
    results = run_distributed(_failing_save, 2, str(tmp_path), timeout_s=90)
    for result in results:
        assert result["first"] == (True, True)
        assert result["failed"] == (False, False), "a failed save over a complete one still looked complete"
        assert result["failure_logged"]
        assert result["third_complete"]
        assert result["meta"] == {"global_step": 3}
        assert result["loaded"] == {"weight0": [3.0] * 4, "weight1": [4.0] * 4}


def test_a_save_without_its_completion_marker_is_never_resumed_from(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    done = checkpoints / "step000005.ckpt"
    done.mkdir(parents=True)
    (done / "__0_0.distcp").write_bytes(b"")
    (done / ".metadata").write_bytes(b"")
    torch.save({"global_step": 5}, done / "meta.pt")
    in_flight = checkpoints / "step000010.ckpt"  # shards and DCP's metadata written, meta.pt not yet
    in_flight.mkdir()
    (in_flight / "__0_0.distcp").write_bytes(b"")
    (in_flight / ".metadata").write_bytes(b"")
    (in_flight / "meta.pt.tmp").write_bytes(b"")  # the marker half-written
    (checkpoints / "last.ckpt").symlink_to("step000010.ckpt")

    assert is_complete(done) and not is_complete(in_flight) and not is_complete(checkpoints / "last.ckpt")
    assert newest_checkpoint(checkpoints) == FoundCheckpoint(done, 5)
    # Only last.ckpt, a link to a complete checkpoint, is left to resume from: its step comes from meta.pt.
    done.rename(checkpoints / "other")
    (checkpoints / "last.ckpt").unlink()
    (checkpoints / "last.ckpt").symlink_to("other")
    assert newest_checkpoint(checkpoints) == FoundCheckpoint(checkpoints / "last.ckpt", 5)


class _StopAt(Callback):
    """Stops the fit after ``step``, as ``RendezvousCallback`` does for a live handoff when ``handoff`` is set."""

    def __init__(self, step: int, *, handoff: bool) -> None:
        self.step, self.handoff = step, handoff

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            if self.handoff:
                trainer.strategy.pending_handoff = object()  # what train.py then hands to the next generation
            trainer.should_stop = True


def _stop_early(rank: int, world: int, root: str) -> dict[str, list[str]]:
    quiet_lightning()
    written = {}
    for name, handoff in (("handoff", True), ("plain", False)):
        run_dir = Path(root) / name
        parts = build_run(tiny_config(layout={}, max_steps=10, world_size=world), run_dir)
        parts.trainer.callbacks.append(_StopAt(2, handoff=handoff))
        parts.trainer.fit(parts.module, train_dataloaders=parts.loader)
        checkpoints = run_dir / "checkpoints"
        written[name] = sorted(
            f"{p.name} -> {os.readlink(p)}" if p.is_symlink() else p.name for p in checkpoints.glob("*")
        )
    return written


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_fit_stopped_for_a_handoff_writes_no_last_checkpoint(tmp_path: Path) -> None:
    (written,) = run_distributed(_stop_early, 1, str(tmp_path), timeout_s=100)
    assert written["handoff"] == []
    # The same stop without a handoff saves once: last.ckpt links that step's checkpoint.
    assert written["plain"] == ["last.ckpt -> step000002.ckpt", "step000002.ckpt"]
