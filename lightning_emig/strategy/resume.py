"""The restart path: after torchrun restarts the workers, the same script resumes from the newest checkpoint.

Under plain ``torchrun`` (and under ``lightning-emig-run`` with ``LIGHTNING_EMIG_LIVE_MEMBERSHIP=0``) a membership
change stops every worker and starts new ones. They find the run directory again (its name comes from
``TORCHELASTIC_RUN_ID``, the same for the whole job, see :func:`lightning_emig.config.run_id`), load its newest
*complete* checkpoint, resharded on load for the new world's layout, and recompute the steps after it.

When is a start a restart? torch 2.13's agent counts failures in ``TORCHELASTIC_RESTART_COUNT`` but restarts
for a membership change (nodes waiting) without counting it, so:

* ``TORCHELASTIC_RESTART_COUNT > 0``: torchrun restarted the workers after a failure;
* ``LIGHTNING_EMIG_GENERATION > 0`` without ``LIGHTNING_EMIG_JOIN_LIVE=1``: ``lightning-emig-run`` numbers every
  rendezvous round, so a worker started in a later round than the first was restarted (or joined a
  restarted world);
* otherwise only ``run.resume=last`` resumes: under plain ``torchrun`` set it, with one ``--rdzv-id`` per job,
  so that membership restarts resume too (a fresh job with a fresh id finds no checkpoint and starts at 0).

Invariants: a checkpoint counts only once its last file is written (DCP's ``.metadata`` and Lightning's
``meta.pt``: a worker killed while saving leaves an incomplete directory that is never picked); the choice is
made from files alone, so every rank of the new world picks the same one.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_emig.migration.state import holds_stage

log = logging.getLogger(__name__)

#: ``ModelCheckpoint(filename="step{step:06d}")`` names, as ``build_run`` configures it.
_STEP_NAME = re.compile(r"^step(\d+)\.ckpt$")
_LIGHTNING_META = "meta.pt"
_DCP_META = ".metadata"


@dataclass(frozen=True, slots=True)
class FoundCheckpoint:
    path: Path
    step: int
    """Optimizer steps completed when it was saved."""


def restart_reason(env: Mapping[str, str] | None = None) -> str | None:
    """Why this start is a restart of a running job (None: a first start, or a live join).

    A worker started into a generation whose other workers kept running joins them live (it receives their state),
    even when its agent started it through torchrun's restart after a crash (``TORCHELASTIC_RESTART_COUNT > 0``):
    every worker of a generation starts from the same state at the same step, so that worker must not also resume
    from a checkpoint (nor record a restart event beside the generation's join)."""
    env = os.environ if env is None else env
    if env.get("LIGHTNING_EMIG_JOIN_LIVE", "0") == "1":
        return None
    restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restarts > 0:
        return f"torchrun restart #{restarts} (TORCHELASTIC_RESTART_COUNT)"
    generation = int(env.get("LIGHTNING_EMIG_GENERATION", "0") or 0)
    if generation > 0 and env.get("LIGHTNING_EMIG_JOIN_LIVE", "0") != "1":
        return f"lightning-emig-run generation {generation} started by torchrun's restart path"
    return None


def is_complete(path: Path) -> bool:
    """A Lightning checkpoint whose writing finished (a sharded directory or a single file)."""
    if path.is_dir():
        return (path / _DCP_META).is_file() and (path / _LIGHTNING_META).is_file()
    return path.is_file()


def newest_checkpoint(checkpoint_dir: Path, excluding: frozenset[Path] = frozenset()) -> FoundCheckpoint | None:
    """The complete ``step*.ckpt`` with the most steps, else a complete ``last.ckpt``, else None; never one of
    ``excluding`` (resolved paths: checkpoints whose state failed its proof), nor a ``last.ckpt`` linking to one."""
    found = []
    if checkpoint_dir.is_dir():
        for path in checkpoint_dir.iterdir():
            match = _STEP_NAME.match(path.name)
            if match and is_complete(path) and path.resolve() not in excluding:
                found.append(FoundCheckpoint(path, int(match.group(1))))
    if found:
        return max(found, key=lambda c: c.step)
    last = checkpoint_dir / "last.ckpt"
    if is_complete(last) and last.resolve() not in excluding:
        return FoundCheckpoint(last, _saved_step(last))
    return None


class CheckpointMismatchError(ValueError):
    """A checkpoint written by another model (other tensors, or other shapes): refused before anything loads."""


_MODEL_PREFIX = "state_dict."  # where Lightning's sharded checkpoints keep the module's state_dict


def check_checkpoint_matches(path: Path, module: Any) -> None:
    """Refuse a sharded checkpoint whose model tensors are not this module's (names and global shapes), with what
    differs and what to do; the checkpoint's metadata alone is read, so nothing is loaded, trained or overwritten.
    With ``module.strict_loading`` off only the shapes of the tensors both hold are compared."""
    from torch.distributed.checkpoint import FileSystemReader

    if not path.is_dir():
        return  # a single-file checkpoint: torch.load's own errors apply
    saved = {key.removeprefix(_MODEL_PREFIX): tuple(meta.size)
             for key, meta in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
             if key.startswith(_MODEL_PREFIX) and hasattr(meta, "size")}
    ours = {key: tuple(tensor.shape) for key, tensor in module.state_dict().items()}
    problems = [f"{key}: saved {list(saved[key])}, this model {list(shape)}"
                for key, shape in ours.items() if key in saved and saved[key] != shape]
    if getattr(module, "strict_loading", True):
        problems += [f"{key}: not in the checkpoint" for key in ours if key not in saved]
        if not holds_stage(module):  # a pipeline stage holds its own tensors; the other stages load the rest
            problems += [f"{key}: in the checkpoint, not in this model" for key in saved if key not in ours]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointMismatchError(
            f"checkpoint {path} was written by another model ({len(problems)} tensor(s) differ: {shown}). Resume it "
            "with the model configuration it was written with, or start this run elsewhere (another run directory "
            "or ModelCheckpoint dirpath, run.resume=null); nothing was loaded or overwritten"
        )


def _saved_step(path: Path) -> int:
    import torch

    meta = torch.load(path / _LIGHTNING_META if path.is_dir() else path, map_location="cpu", weights_only=False)
    return int(meta.get("global_step", -1))


def resolve_checkpoint(resume: str | None, run_dir: Path, env: Mapping[str, str] | None = None) -> str | None:
    """``run.resume`` (None, ``last`` or a path) -> the checkpoint ``Trainer.fit`` starts from.

    On a restart (:func:`restart_reason`) ``None`` means ``last``: the job goes on from its newest checkpoint.
    """
    reason = restart_reason(env)
    if resume is None and reason is not None:
        resume = "last"
    if resume is None:
        return None
    if resume != "last":
        if not Path(resume).exists():
            raise FileNotFoundError(f"run.resume={resume!r} does not exist")
        return resume
    found = newest_checkpoint(run_dir / "checkpoints")
    if _is_rank_zero(env):
        if found is None and reason is not None:
            log.warning("RESTART (%s): no complete checkpoint in %s; training starts again from step 0",
                        reason, run_dir / "checkpoints")
        elif found is not None:
            log.warning("%s: resuming from the newest complete checkpoint %s (step %d)",
                        f"RESTART ({reason})" if reason else "run.resume=last", found.path, found.step)
    return str(found.path) if found is not None else None


def _is_rank_zero(env: Mapping[str, str] | None) -> bool:
    env = os.environ if env is None else env
    return env.get("RANK", "0") == "0"


def process_start_wall() -> float:
    """``time.time()`` at which this process started (from /proc; the import time of this module elsewhere)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # since boot
        booted_at = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return booted_at + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()
