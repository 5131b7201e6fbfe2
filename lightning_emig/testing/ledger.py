"""Checking a run's data ledger: every sample of an epoch trained on exactly once, across membership events.

A ledger (written by :class:`lightning_emig.training.ledger.DataLedger`) holds one record per micro-batch and
data-parallel rank. A step can be *attempted* more than once: a failure cuts it short, the job rolls back to a
checkpoint (or, for the live path, to the state the survivors agreed on) and trains it again. Only the last
attempt of a step counts; earlier ones were discarded with the state they built.

Attempts: records of one step are grouped by the world that trained them, ``(generation, restart, fit_start_step,
dp_degree)``; a re-attempt always runs in a later ``Trainer.fit`` (a new generation, a torchrun restart, or a
resume at an earlier step), and within one world a data-parallel slot ``(dp_rank, micro_step)`` seen again also
starts a new attempt (a job resumed twice from the same checkpoint). Attempts are ordered by their first
record's ``time``.

:func:`check_ledger` then holds, for every step ``0 .. max_steps - 1``, the invariant of
:class:`~lightning_emig.data.sampler.GlobalOffsetSampler`: the last attempt's records are the step's global
batch, recomputed from the sampler itself, each micro-batch exactly the one the sampler gives its
``(dp_rank, micro_step)``, all of them together exactly ``global_batch_size`` ids; and, independently of the sampler, no sample id
appears twice among the last attempts of one epoch.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_emig.data.sampler import GlobalOffsetSampler
from lightning_emig.training.ledger import LEDGER_DIR

Record = dict[str, Any]


def read_ledger(run_dir: Path) -> list[Record]:
    """Every complete record of ``run_dir``'s ledger (a process killed mid-write leaves a partial last line).

    Each record gets ``file`` and ``line`` (its position), which break ties between equal times.
    """
    records: list[Record] = []
    for path in sorted((Path(run_dir) / LEDGER_DIR).glob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines()):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            records.append({**record, "file": path.name, "line": number})
    return records


def sampler_of_run(run_dir: Path) -> tuple[GlobalOffsetSampler, int]:
    """The sampler and ``max_steps`` of a run started by ``lightning_emig.train`` (from its saved Hydra config)."""
    from omegaconf import OmegaConf

    from lightning_emig.training.builders import build_dataset

    cfg: Any = OmegaConf.load(Path(run_dir) / ".hydra" / "config.yaml")
    dataset = build_dataset(cfg)
    sampler = GlobalOffsetSampler(len(dataset), cfg.trainer.global_batch_size, seed=cfg.data.seed)
    return sampler, int(cfg.trainer.max_steps)


@dataclass(slots=True)
class LedgerReport:
    """What :func:`check_ledger` found."""

    max_steps: int
    records: int
    attempts: dict[int, int] = field(default_factory=dict)
    """Step -> how many times it was attempted (1 for a step trained once)."""
    dp_degrees: dict[int, int] = field(default_factory=dict)
    """Step -> data-parallel degree of its last attempt."""
    generations: dict[int, int | None] = field(default_factory=dict)
    """Step -> launcher generation of its last attempt."""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def rolled_back_steps(self) -> list[int]:
        """Steps attempted more than once (cut short, rolled back and trained again)."""
        return sorted(step for step, count in self.attempts.items() if count > 1)

    def describe(self) -> str:
        degrees = sorted(Counter(self.dp_degrees.values()).items())
        return (
            f"{self.records} ledger records, steps 0..{self.max_steps - 1}: "
            + ", ".join(f"{n} step(s) at dp={d}" for d, n in degrees)
            + f"; rolled back: {self.rolled_back_steps or 'none'}; "
            + (f"{len(self.problems)} problem(s)" if self.problems else "every sample exactly once")
        )

    def assert_exactly_once(self, limit: int = 20) -> None:
        """Raise AssertionError listing (the first ``limit``) problems, if any."""
        if self.problems:
            shown = "\n  ".join(self.problems[:limit])
            more = f"\n  ... and {len(self.problems) - limit} more" if len(self.problems) > limit else ""
            raise AssertionError(f"data ledger: {self.describe()}\n  {shown}{more}")


def check_ledger(
    source: Path | Iterable[Record], *, sampler: GlobalOffsetSampler | None = None, max_steps: int | None = None
) -> LedgerReport:
    """Check the ledger of a run directory (or a list of records) against the sampler's data order.

    Args:
        source: A run directory, or records as :func:`read_ledger` returns them.
        sampler: The run's sampler (its offset is not used). Default: rebuilt from the run's Hydra config.
        max_steps: Steps the run trained. Default: from the run's Hydra config.
    """
    if sampler is None or max_steps is None:
        if not isinstance(source, Path):
            raise ValueError("give sampler and max_steps when checking records rather than a run directory")
        found_sampler, found_max_steps = sampler_of_run(source)
        sampler = sampler if sampler is not None else found_sampler
        max_steps = max_steps if max_steps is not None else found_max_steps
    records = read_ledger(source) if isinstance(source, Path) else list(source)
    report = LedgerReport(max_steps=max_steps, records=len(records))
    by_step: dict[int, list[Record]] = defaultdict(list)
    for record in records:
        by_step[int(record["step"])].append(record)
    beyond = sorted(step for step in by_step if not 0 <= step < max_steps)
    if beyond:
        report.problems.append(f"records for steps outside 0..{max_steps - 1}: {beyond}")
    last_attempts: dict[int, list[Record]] = {}
    for step in range(max_steps):
        if step not in by_step:
            report.problems.append(f"step {step}: no record (never trained, or its ledger is missing)")
            continue
        attempts = split_attempts(by_step[step])
        report.attempts[step] = len(attempts)
        last = last_attempts[step] = attempts[-1]
        report.dp_degrees[step] = int(last[0]["dp_degree"])
        report.generations[step] = last[0].get("generation")
        report.problems += _check_step(step, last, sampler)
    report.problems += _check_epochs(last_attempts, sampler)
    return report


def split_attempts(records: Iterable[Record]) -> list[list[Record]]:
    """One step's records as attempts, oldest first (see the module docstring for the rule)."""
    ordered = sorted(records, key=lambda r: (r["time"], r.get("file", ""), r.get("line", 0)))
    by_world: dict[tuple[Any, ...], list[list[Record]]] = {}
    for record in ordered:
        # Under lightning-emig-run every round (torchrun restarts included) is a generation of its own, and the
        # workers of one generation may differ in torchrun's restart count (a failed node rejoined); under plain
        # torchrun the generation stays 0 and the restart count tells attempts apart.
        generation = record.get("generation")
        restart = None if generation else record.get("restart", 0)
        world = (generation, restart, record.get("fit_start_step"), record["dp_degree"])
        attempts = by_world.setdefault(world, [[]])
        slot = (record["dp_rank"], record["micro_step"])
        if any((r["dp_rank"], r["micro_step"]) == slot for r in attempts[-1]):
            attempts.append([])
        attempts[-1].append(record)
    every = [attempt for attempts in by_world.values() for attempt in attempts]
    return sorted(every, key=lambda attempt: attempt[0]["time"])


def _check_step(step: int, records: list[Record], sampler: GlobalOffsetSampler) -> list[str]:
    gbs = sampler.global_batch_size
    expected = sampler.global_batch(step * gbs)
    problems = []
    degree = int(records[0]["dp_degree"])
    for r in records:
        where = f"step {step}, dp rank {r['dp_rank']}/{degree}, micro-step {r['micro_step']} ({r.get('file', '?')})"
        if r.get("offset", step * gbs) != step * gbs:
            problems.append(f"{where}: data offset {r['offset']} is not step x global batch = {step * gbs}")
        ids = list(r["sample_ids"])
        given = sampler.indices_for_step(step * gbs, degree, int(r["dp_rank"]), len(ids))[int(r["micro_step"])]
        if ids != given:
            problems.append(f"{where}: trained on {ids}, the sampler gives {given}")
    counts = Counter(i for r in records for i in r["sample_ids"])
    missing = sorted(set(expected) - set(counts))
    unexpected = sorted(set(counts) - set(expected))
    repeated = sorted(i for i, n in counts.items() if n > 1)
    if missing or unexpected or repeated or sum(counts.values()) != gbs:
        problems.append(
            f"step {step}: its last attempt trained on {sum(counts.values())} sample ids, expected the {gbs} of"
            f" its global batch; missing {missing}, not of this step {unexpected}, repeated {repeated}"
        )
    return problems


def _check_epochs(last_attempts: dict[int, list[Record]], sampler: GlobalOffsetSampler) -> list[str]:
    seen: dict[tuple[int, int], int] = {}  # (epoch, sample id) -> first step
    problems = []
    for step in sorted(last_attempts):
        epoch = step // sampler.steps_per_epoch
        for sample in {i for r in last_attempts[step] for i in r["sample_ids"]}:
            first = seen.setdefault((epoch, sample), step)
            if first != step:
                problems.append(f"epoch {epoch}: sample {sample} trained at step {first} and again at step {step}")
    return problems
