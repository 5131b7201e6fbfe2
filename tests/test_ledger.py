"""The data ledger: the checker on synthetic ledgers, and the callback in a real two-process run.

Specification of the checker (:func:`lightning_emig.testing.ledger.check_ledger`):

* a run whose every step's last attempt trained exactly on the step's global batch passes, whatever the
  data-parallel degree of each step;
* a step attempted more than once (cut short, rolled back, trained again) is reported as rolled back, and only its
  last attempt counts, even when the earlier attempt was partial or ran on another world;
* a missing step, a missing or repeated micro-batch, a micro-batch on the wrong data-parallel slot, a sample
  trained twice in one epoch, a step beyond ``max_steps`` and an offset that disagrees with the step all fail,
  each with a message naming the step;
* a partial last line (a process killed mid-write) is skipped.

Specification of the callback (:class:`lightning_emig.training.ledger.DataLedger`), in a real run of two processes
whose layout goes dp 2 -> 1 (``tp=2``) -> 2, resumed once from a checkpoint in the same run directory: every step
exactly once, the resumed steps reported as rolled back, one writer per data-parallel rank under ``tp=2``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_emig.data.sampler import GlobalOffsetSampler
from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.ledger import Record, check_ledger, read_ledger
from lightning_emig.testing.runs import fit, tiny_config, with_schedule
from lightning_emig.training.ledger import LEDGER_DIR

GBS, MICRO = 8, 2
SAMPLER = GlobalOffsetSampler(num_samples=40, global_batch_size=GBS, seed=3)  # 5 steps per epoch


def _step(step: int, dp: int, *, generation: int = 0, start: int = 0, t: float | None = None,
          slots: list[tuple[int, int]] | None = None) -> list[Record]:
    """The records a world of data-parallel degree ``dp`` writes for ``step`` (all its slots, or ``slots``)."""
    share = GBS // dp
    batch = SAMPLER.global_batch(step * GBS)
    every = [(r, m) for r in range(dp) for m in range(share // MICRO)]
    base = float(step) if t is None else t
    return [
        {"step": step, "offset": step * GBS, "micro_step": m, "dp_rank": r, "dp_degree": dp,
         "sample_ids": batch[r * share + m * MICRO : r * share + (m + 1) * MICRO], "generation": generation,
         "restart": 0, "fit_start_step": start, "rank": r, "pid": 100 + generation, "time": base + 0.01 * i}
        for i, (r, m) in enumerate(slots if slots is not None else every)
    ]


def _run(steps: int, dp: int = 2) -> list[Record]:
    return [r for s in range(steps) for r in _step(s, dp)]


def _check(records: list[Record], max_steps: int):
    return check_ledger(records, sampler=SAMPLER, max_steps=max_steps)


# --- passes -------------------------------------------------------------------------------------------------


def test_a_clean_run_over_two_epochs_and_a_change_of_data_parallel_degree_passes() -> None:
    records = [r for s in range(4) for r in _step(s, 2)] + [r for s in range(4, 12) for r in _step(s, 4, generation=1)]
    report = _check(records, 12)
    report.assert_exactly_once()
    assert report.rolled_back_steps == []
    assert report.dp_degrees == {**dict.fromkeys(range(4), 2), **dict.fromkeys(range(4, 12), 4)}
    assert report.generations[11] == 1


@pytest.mark.parametrize(
    ("name", "retry"),
    [
        # Cut short after one micro-batch on dp=2, retried by the next generation on dp=1.
        ("partial then another world", lambda: _step(3, 2, slots=[(0, 0)]) + _step(3, 1, generation=1, start=2, t=10)),
        # A whole attempt rolled back and retried on the same degree by a torchrun restart (another generation).
        ("complete then same degree", lambda: _step(3, 2) + _step(3, 2, generation=1, start=2, t=10)),
        # Two resumes from the same checkpoint in one world: the repeated slot starts the new attempt.
        ("same world twice", lambda: _step(3, 2, slots=[(1, 0), (0, 0)]) + _step(3, 2, t=10)),
    ],
)
def test_a_rolled_back_step_is_reported_and_only_its_last_attempt_counts(name: str, retry) -> None:
    records = [r for s in (0, 1, 2, 4) for r in _step(s, 2)] + retry()
    report = _check(records, 5)
    report.assert_exactly_once()
    assert report.rolled_back_steps == [3], name
    assert report.attempts[3] == 2


def test_the_latest_attempt_wins_even_if_an_older_one_looks_complete() -> None:
    # The earlier, complete attempt would pass; the last one lost a micro-batch: that must fail.
    records = _run(3) + _step(2, 2, generation=1, start=2, t=10, slots=[(0, 0), (0, 1), (1, 0)])
    report = _check(records, 3)
    assert report.rolled_back_steps == [2]
    assert any(p.startswith("step 2: its last attempt trained on 6 sample ids") for p in report.problems), report.problems


def test_a_partial_last_line_is_skipped(tmp_path: Path) -> None:
    ledger = tmp_path / LEDGER_DIR
    ledger.mkdir()
    lines = [json.dumps(r) for r in _run(2)]
    (ledger / "rank0_pid1.jsonl").write_text("\n".join(lines) + '\n{"step": 2, "offs')
    assert len(read_ledger(tmp_path)) == len(lines)
    check_ledger(tmp_path, sampler=SAMPLER, max_steps=2).assert_exactly_once()


# --- failures -----------------------------------------------------------------------------------------------


def _drop(records: list[Record], step: int, slot: tuple[int, int]) -> list[Record]:
    return [r for r in records if (r["step"], r["dp_rank"], r["micro_step"]) != (step, *slot)]


def _edit(records: list[Record], step: int, slot: tuple[int, int], **changes) -> list[Record]:
    return [({**r, **changes} if (r["step"], r["dp_rank"], r["micro_step"]) == (step, *slot) else r) for r in records]


def _swap_ranks(records: list[Record], step: int) -> list[Record]:
    return [({**r, "dp_rank": 1 - r["dp_rank"]} if r["step"] == step else r) for r in records]


@pytest.mark.parametrize(
    ("records", "max_steps", "message"),
    [
        (_run(4), 5, "step 4: no record"),
        (_drop(_run(4), 2, (1, 1)), 4, "step 2: its last attempt trained on 6 sample ids"),
        # A second writer for one slot (say a tensor-parallel peer) reads as a new, incomplete attempt.
        (_run(4) + [{**_step(2, 2)[0], "time": 2.9, "rank": 7}], 4, "step 2: its last attempt trained on 2 sample ids"),
        (_swap_ranks(_run(4), 1), 4, "step 1, dp rank 0/2, micro-step 0 (?): trained on"),
        # Step 6 (epoch 1) trains step 1's samples (epoch 0's order): wrong for the sampler, though no repeat in
        # an epoch; step 7 trains step 6's own samples again: a repeat within epoch 1.
        (_edit(_run(8), 6, (0, 0), sample_ids=_step(1, 2)[0]["sample_ids"]), 8, "step 6, dp rank 0/2, micro-step 0"),
        (_edit(_run(8), 7, (0, 0), sample_ids=_step(6, 2)[0]["sample_ids"]), 8,
         f"epoch 1: sample {_step(6, 2)[0]['sample_ids'][0]} trained at step 6 and again at step 7"),
        (_run(4), 3, "records for steps outside 0..2: [3]"),
        (_edit(_run(3), 1, (0, 0), offset=0), 3, "data offset 0 is not step x global batch = 8"),
    ],
    ids=["missing step", "missing micro-batch", "repeated slot from another rank", "slots swapped",
         "samples of another epoch", "twice in an epoch", "beyond max_steps", "offset disagrees"],
)
def test_a_broken_ledger_fails_naming_the_step(records: list[Record], max_steps: int, message: str) -> None:
    report = _check(records, max_steps)
    assert not report.ok
    assert any(message in p for p in report.problems), report.problems
    with pytest.raises(AssertionError, match="data ledger"):
        report.assert_exactly_once()


def test_a_run_directory_needs_its_config_or_explicit_sampler() -> None:
    with pytest.raises(ValueError, match="give sampler and max_steps"):
        check_ledger(_run(2), max_steps=2)


# --- the callback in a real run -----------------------------------------------------------------------------

STEPS = 12
SCHEDULE = [(4, {"dp_shard": 1, "tp": 2}), (8, {"dp_shard": 2})]


def _train_and_resume(rank: int, world: int, root: str) -> None:
    cfg = with_schedule(
        tiny_config(layout={"dp_shard": 2}, max_steps=STEPS, world_size=world, checkpoint_every_n_steps=6),
        SCHEDULE,
    )
    cfg.data.ledger = True
    fit(cfg, Path(root))
    # Resume from step 6 in the same run directory: steps 6..11 are trained again (a rollback).
    fit(cfg, Path(root), ckpt_path=str(Path(root) / "checkpoints" / "step000006.ckpt"))


@pytest.mark.multiprocess
def test_the_ledger_of_a_real_run_shows_every_sample_once_across_layout_changes_and_a_rollback(tmp_path: Path) -> None:
    run_distributed(_train_and_resume, 2, str(tmp_path), timeout_s=240)
    cfg = tiny_config(layout={}, max_steps=STEPS)
    sampler = GlobalOffsetSampler(cfg.data.synthetic_samples, cfg.trainer.global_batch_size, seed=cfg.data.seed)
    report = check_ledger(tmp_path, sampler=sampler, max_steps=STEPS)
    report.assert_exactly_once()
    assert report.rolled_back_steps == list(range(6, STEPS))
    # First fit: dp 2 for steps 0-3, tp=2 (dp 1) for 4-7; the resumed fit (the last attempt of 6..11) starts
    # under the requested dp_shard=2 and stays there.
    assert report.dp_degrees == {**dict.fromkeys(range(4), 2), 4: 1, 5: 1, **dict.fromkeys(range(6, STEPS), 2)}
    records = read_ledger(tmp_path)
    # Under tp=2 only the tensor-parallel rank 0 writes: each (step, micro-step) once, by global rank 0.
    tp_steps = [r for r in records if r["dp_degree"] == 1]
    assert {r["rank"] for r in tp_steps} == {0}
    assert len(tp_steps) == len({(r["step"], r["micro_step"], r["fit_start_step"]) for r in tp_steps}) == 4 * 4
    assert {r["fit_start_step"] for r in records} == {0, 6}
