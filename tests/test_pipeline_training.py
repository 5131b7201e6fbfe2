"""Training with pipeline stages through ``Trainer.fit``: the strategy drives the schedule, the module stays as it is.

The project's own ``LlamaLightningModule`` (its ``training_step`` calls ``self(inputs)`` and returns the loss, as
without stages) trains under ``pp = 2`` alone and combined with FSDP2, TP and HSDP inside the stages, and with two
stages a process (``pp_virtual = 2``, the interleaved 1F1B schedule), and each run is compared with the same steps
under FSDP2 alone: the loss of every step on every rank (the last stage computes it,
every rank logs it) and the full gradients of the first step. Tolerance: the float32 arithmetic is the same but for
reduction order (FSDP2's and TP's sums, the schedule's micro-batch sum), measured at most 1e-7 relative on the loss;
the bound is 1e-5. The gradients are compared directly because AdamW hides a wrong scale: with the schedule's
1/micro-batches scale left out (gradients 4x too large) the losses still agree to 2e-7, the gradient check fails.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_emig.testing.distributed import WorkerFailed, run_distributed
from lightning_emig.testing.runs import fit, quiet_lightning, step_losses, tiny_config, with_schedule
from lightning_emig.training.builders import build_run

pytestmark = pytest.mark.multiprocess

STEPS = 4
LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-7


class FirstGradients(pl.Callback):
    """The full gradient of every parameter this rank's stage holds at the first step: before clipping, and as the
    optimizer used them (after clipping; still there when the step's last batch ends)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.clipped: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == 0:
            self.grads = _full_gradients(module)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 1 and not self.clipped:
            self.clipped = _full_gradients(module)


def _full_gradients(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    # None after a layout change at this step's end: the new model has no gradients yet
    grads = {name: param.grad for name, param in module.named_parameters() if param.grad is not None}
    return {name: (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone() for name, g in grads.items()}


def _train(rank: int, world: int, root: str, layout: dict[str, int], schedule: str,
           changes: list[tuple[int, dict[str, int]]] | None = None, steps: int = STEPS,
           clip: float | None = None, size: str = "tiny") -> dict[str, Any]:
    cfg = tiny_config(layout=layout, max_steps=steps, world_size=world)
    cfg.model.size = size
    cfg.trainer.pipeline_schedule = schedule
    cfg.trainer.gradient_clip_val = clip
    if changes:
        with_schedule(cfg, changes)
    quiet_lightning()
    parts = build_run(cfg, Path(root))
    grads = FirstGradients()
    parts.trainer.callbacks.append(grads)
    parts.trainer.fit(parts.module, train_dataloaders=parts.loader)
    # numpy, not tensors: torch sends tensors between processes through shared memory the worker takes with it
    return {"losses": step_losses(parts), "grads": {k: v.numpy() for k, v in grads.grads.items()},
            "clipped": {k: v.numpy() for k, v in grads.clipped.items()},
            "layout": parts.strategy.layout.as_dict(),
            "events": [e.as_dict() for e in parts.strategy.events],
            "offset": parts.loader.state_dict()["sampler"]["offset"]}


def _assert_same_training(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    for rank, result in enumerate(results):
        for step, (got, want) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
            assert abs(got - want) <= LOSS_RTOL * abs(want), f"rank {rank} step {step}: loss {got} vs {want}"
    held = {}
    for result in results:
        held.update(result["grads"])
    assert set(held) == set(reference["grads"]), "the stages together do not hold every parameter"
    for name, grad in held.items():
        torch.testing.assert_close(torch.from_numpy(grad), torch.from_numpy(reference["grads"][name]), rtol=GRAD_RTOL,
                                   atol=GRAD_ATOL, msg=name)


@pytest.fixture(scope="module")
def reference_2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_distributed(_train, 2, str(tmp_path_factory.mktemp("ref2")), {"dp_shard": 2}, "gpipe",
                           timeout_s=200)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_train_like_fsdp(tmp_path: Path, reference_2: dict[str, Any], schedule: str) -> None:
    results = run_distributed(_train, 2, str(tmp_path), {"dp_shard": 1, "pp": 2}, schedule, timeout_s=200)
    assert results[0]["layout"]["pp"] == 2
    assert len(results[0]["grads"]) and len(results[1]["grads"])  # each stage holds parameters
    _assert_same_training(results, reference_2)


def _in_turn(rank: int, world: int, calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
    """Each ``fn(rank, world, *args)`` of ``calls`` in turn, in the same processes: one start-up for all of them
    (each costs about 10 s of imports and process-group set-up on two cores)."""
    return [fn(rank, world, *args) for fn, args in calls]


@pytest.mark.timeout(600)
def test_stages_with_fsdp_tp_and_replicas_inside_train_like_fsdp(tmp_path: Path) -> None:
    """pp=2 with FSDP2, TP or replicas inside (1F1B), and two stages a process (pp_virtual=2: 4 blocks over 2
    processes) with FSDP2 or TP inside under the interleaved 1F1B schedule (4 micro-batches: 2 rounds of pp)."""
    runs = [({"dp_shard": 4}, "gpipe"),  # the reference
            ({"dp_shard": 2, "pp": 2}, "1f1b"), ({"dp_shard": 1, "tp": 2, "pp": 2}, "1f1b"),
            ({"dp_replicate": 2, "dp_shard": 1, "pp": 2}, "1f1b"),
            ({"dp_shard": 2, "pp": 2, "pp_virtual": 2}, "interleaved_1f1b"),
            ({"dp_shard": 1, "tp": 2, "pp": 2, "pp_virtual": 2}, "interleaved_1f1b")]
    calls = [(_train, (str(tmp_path / str(i)), layout, schedule, None, STEPS, None, "tiny_deep"))
             for i, (layout, schedule) in enumerate(runs)]
    by_rank = run_distributed(_in_turn, 4, calls, timeout_s=400)
    reference = by_rank[0][0]
    for index, (layout, _) in enumerate(runs[1:], start=1):
        name = "-".join(f"{k}{v}" for k, v in layout.items())
        results = [runs_of_rank[index] for runs_of_rank in by_rank]
        assert results[0]["layout"]["pp"] == 2, name
        # each process holds its stages' blocks: with two a process, the first blocks 0 and 2, the last 1 and 3
        blocks = {rank: sorted({int(n.split(".")[2]) for n in r["grads"] if ".layers." in n})
                  for rank, r in enumerate(results)}
        assert blocks[0] == ([0, 2] if layout.get("pp_virtual") else [0, 1]), (name, blocks)
        assert blocks[3] == ([1, 3] if layout.get("pp_virtual") else [2, 3]), (name, blocks)
        _assert_same_training(results, reference)


@pytest.mark.timeout(300)
def test_live_changes_into_and_out_of_stages_follow_the_uninterrupted_run(tmp_path: Path) -> None:
    """FSDP over 4 -> 2 stages with FSDP2 inside -> two stages a process (blocks move between processes, not only
    shards) -> 4 stages -> two a process with TP inside -> FSDP; the interleaved schedule runs every stage layout
    (with one stage a process it is 1F1B's order)."""
    changes = [(1, {"dp_shard": 2, "pp": 2}), (2, {"dp_shard": 2, "pp": 2, "pp_virtual": 2}),
               (3, {"dp_shard": 1, "pp": 4}), (4, {"dp_shard": 1, "tp": 2, "pp": 2, "pp_virtual": 2}),
               (5, {"dp_shard": 4})]
    by_rank = run_distributed(_in_turn, 4, [
        (_train, (str(tmp_path / "ref"), {"dp_shard": 4}, "gpipe", None, 7, None, "tiny_deep")),
        (_train, (str(tmp_path / "live"), {"dp_shard": 4}, "interleaved_1f1b", changes, 7, None, "tiny_deep")),
    ], timeout_s=400)
    reference, results = by_rank[0][0], [runs[1] for runs in by_rank]
    for rank, result in enumerate(results):
        assert [(e["step"], e["new_layout"].get("pp_virtual", 1)) for e in result["events"]] == \
            [(1, 1), (2, 2), (3, 1), (4, 2), (5, 1)], rank
        assert all(e["bytes_moved"] > 0 for e in result["events"])
        # FSDP over 4 -> 2 stages x FSDP over 2 numbers dp_shard before pp: each process keeps its quarter
        # (tests/test_planner.py counts the bytes); training on it goes on like the uninterrupted run
        first = result["events"][0]["new_layout"]["rank_order"]
        assert first.index("dp_shard") < first.index("pp"), result["events"][0]
        for step, (got, want) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
            assert abs(got - want) <= LOSS_RTOL * abs(want), f"rank {rank} step {step}: loss {got} vs {want}"
    assert results[0]["offset"] == reference["offset"]


def _too_few_micro_batches(rank: int, world: int, root: str) -> None:
    cfg = tiny_config(layout={"dp_shard": 1, "pp": 2}, max_steps=2, world_size=world, global_batch_size=2,
                      micro_batch_size=2)
    cfg.trainer.pipeline_schedule = "1f1b"
    fit(cfg, Path(root))


@pytest.mark.timeout(120)
def test_1f1b_with_fewer_micro_batches_than_stages_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(WorkerFailed, match=r"the 1f1b schedule needs at least 2 micro-batches per step"):
        run_distributed(_too_few_micro_batches, 2, str(tmp_path), timeout_s=100)


def test_an_unknown_schedule_is_refused() -> None:
    from lightning_emig.strategy import ElasticMigrationStrategy

    with pytest.raises(ValueError, match="pipeline_schedule must be one of"):
        ElasticMigrationStrategy(global_batch_size=8, micro_batch_size=2, pipeline_schedule="interleaved")


def test_a_schedule_that_cannot_run_the_layouts_stages_is_refused() -> None:
    from lightning_emig.strategy.pipeline import PipelineError, check_schedule

    with pytest.raises(PipelineError, match="the 1f1b schedule runs one; use pipeline_schedule='interleaved_1f1b'"):
        check_schedule("1f1b", pp=2, micro_batches=4, pp_virtual=2)
    # torch's interleaved schedule runs max(1, m // pp) equal rounds: 5 over pp=2 cannot be split into 2
    with pytest.raises(PipelineError, match=r"5 micro-batches per step do not divide into them"):
        check_schedule("interleaved_1f1b", pp=2, micro_batches=5, pp_virtual=2)
    for micro_batches in (1, 2, 4, 6):
        check_schedule("interleaved_1f1b", pp=2, micro_batches=micro_batches, pp_virtual=2)


def test_a_module_without_a_stage_is_refused() -> None:
    from lightning_emig.strategy.pipeline import PipelineError, find_stage

    with pytest.raises(PipelineError, match="exactly one pipeline stage"):
        find_stage(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.timeout(300)
def test_gradient_clipping_takes_the_norm_over_every_stage(tmp_path: Path) -> None:
    """Clipped to a norm well below the first step's (0.88): every stage scales by the same, global coefficient."""
    clip = 0.2
    by_rank = run_distributed(_in_turn, 2, [
        (_train, (str(tmp_path / "ref"), {"dp_shard": 2}, "gpipe", None, 2, clip)),
        (_train, (str(tmp_path / "pp"), {"dp_shard": 1, "pp": 2}, "gpipe", None, 2, clip)),
    ], timeout_s=280)
    reference, results = by_rank[0][0], [runs[1] for runs in by_rank]
    full = torch.cat([torch.from_numpy(g).flatten() for g in reference["grads"].values()])
    clipped = {k: torch.from_numpy(v) for r in results for k, v in r["clipped"].items()}
    assert float(full.norm()) > 4 * clip, "the test needs gradients that clipping changes"
    assert float(torch.cat([g.flatten() for g in clipped.values()]).norm()) == pytest.approx(clip, rel=1e-4)
    for name, grad in clipped.items():
        torch.testing.assert_close(grad, torch.from_numpy(reference["clipped"][name]), rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=name)


def _losses_bf16(rank: int, world: int, root: str, layout: dict[str, int], checkpointing: bool) -> list[float]:
    cfg = tiny_config(layout=layout, max_steps=3, world_size=world)
    cfg.model.compute_dtype = "bfloat16"
    cfg.model.activation_checkpointing = checkpointing
    return step_losses(fit(cfg, Path(root)))


@pytest.mark.timeout(300)
def test_stages_with_bf16_compute_and_activation_checkpointing_train_like_fsdp(tmp_path: Path) -> None:
    """A stage sends bf16 activations (FSDP2 mixed precision) and recomputes its blocks in backward: the step losses
    are FSDP's (measured: identical)."""
    by_rank = run_distributed(_in_turn, 2, [(_losses_bf16, (str(tmp_path / "ref"), {"dp_shard": 2}, False)),
                                            (_losses_bf16, (str(tmp_path / "pp"), {"dp_shard": 1, "pp": 2}, True))],
                              timeout_s=280)
    reference = by_rank[0][0]
    for losses in (runs[1] for runs in by_rank):
        assert losses == pytest.approx(reference, rel=LOSS_RTOL)


def _resume(rank: int, world: int, root: str, layout: dict[str, int], steps: int, ckpt: str | None) -> list[float]:
    cfg = tiny_config(layout=layout, max_steps=steps, world_size=world, checkpoint_every_n_steps=2)
    return step_losses(fit(cfg, Path(root), ckpt_path=ckpt))


@pytest.mark.timeout(300)
def test_a_checkpoint_written_by_stages_resumes_under_stages_and_without(tmp_path: Path) -> None:
    """Each stage writes its own tensors and the parameter groups name every stage's parameters (one copy of them is
    kept: with each stage's own list a resume under stages lost its hyper-parameters). Resumed at step 2 under
    stages and under FSDP, the next steps equal a resume of FSDP's own checkpoint."""
    stages, fsdp = {"dp_shard": 1, "pp": 2}, {"dp_shard": 2}
    written_by_stages = str(tmp_path / "pp" / "checkpoints" / "step000002.ckpt")
    calls = [(_resume, (str(tmp_path / "pp"), stages, 2, None)), (_resume, (str(tmp_path / "fsdp"), fsdp, 2, None)),
             (_resume, (str(tmp_path / "fsdp"), fsdp, 4, "last")),  # the reference: FSDP resuming its own
             (_resume, (str(tmp_path / "pp_pp"), stages, 4, written_by_stages)),
             (_resume, (str(tmp_path / "pp_fsdp"), fsdp, 4, written_by_stages))]
    on_rank_0 = run_distributed(_in_turn, 2, calls, timeout_s=400)[0]
    reference = on_rank_0[2]
    for name, losses in zip(("pp_pp", "pp_fsdp"), on_rank_0[3:], strict=True):
        assert len(losses) == 2 and losses == pytest.approx(reference, rel=LOSS_RTOL), name
