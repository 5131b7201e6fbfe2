"""``python -m lightning_emig.pick model=llama_1b world=24 devices_per_node=8 device_memory_gb=80 [...] [--out FILE]``

Prints the layout picker's table of candidates for one or more world sizes, without training. Arguments are
Hydra-style ``key=value`` overrides (parsed by OmegaConf; a full Hydra config group comes later):

* ``model``: a name of :data:`~lightning_emig.models.llama.MODEL_SIZES` (default ``llama_1b``);
* ``world``: an int, a list ``[8,24,64]`` or an inclusive range ``1-64``;
* ``global_batch_size`` (default 512, the 1B recipe's), ``seq_len`` (default: the model's ``max_seq_len``, 2048 for
  the 1B recipe), ``micro_batch_size=N`` (shorthand for ``micro_batch_sizes=[N]``);
* ``current.dp_shard=8 current.tp=1 ...``: the layout the state is in now (adds migration bytes);
* ``profile=PATH``: a :class:`~lightning_emig.picker.HardwareProfile` JSON; ``rows=N``: feasible rows to print
  (``rows=null``: all);
* every field of :class:`~lightning_emig.picker.PickerConstraints` (``tp=[1,2,4,8]``, ``table.24.tp=2``, ...).

An unknown key is an error naming the valid ones. ``--out FILE`` writes the JSON record (a list of records for
several worlds); a world where nothing fits is recorded with its ``error``. Exit status: 0, 1 when some world has
no feasible layout, 2 for bad arguments.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lightning_emig.layout import HybridLayout
from lightning_emig.models.llama import MODEL_SIZES, LlamaConfig
from lightning_emig.picker import (
    HardwareProfile,
    NoFeasibleLayoutError,
    PickerConstraints,
    PickerError,
    PickResult,
    load_profile,
    pick_layout,
)
from lightning_emig.picker.constraints import AXES

#: CLI keys that are not picker constraints, with their defaults.
RUN_KEYS: dict[str, Any] = {"model": "llama_1b", "world": None, "global_batch_size": 512, "seq_len": None,
                            "micro_batch_size": None, "current": None, "profile": None, "rows": 12}
CONSTRAINT_KEYS = tuple(f.name for f in fields(PickerConstraints))


class UsageError(ValueError):
    """Bad command-line arguments."""


def parse(argv: list[str]) -> tuple[dict[str, Any], str | None]:
    """``(overrides, out path)`` from ``key=value`` arguments and ``--out FILE``."""
    out: str | None = None
    dotlist: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--out":
            out = next(args, None)
            if out is None:
                raise UsageError("--out needs a file name")
        elif arg.startswith("--out="):
            out = arg.split("=", 1)[1]
        elif "=" in arg and not arg.startswith("-"):
            dotlist.append(arg)
        else:
            raise UsageError(f"unexpected argument {arg!r}; use key=value overrides and --out FILE")
    overrides = OmegaConf.to_container(OmegaConf.from_dotlist(dotlist), resolve=True)
    assert isinstance(overrides, dict)
    valid = [*RUN_KEYS, *CONSTRAINT_KEYS]
    unknown = sorted(str(k) for k in overrides if k not in valid)
    if unknown:
        raise UsageError(f"unknown key(s) {unknown}; valid keys: {', '.join(valid)}")
    return {**RUN_KEYS, **overrides}, out


def worlds(value: Any) -> list[int]:
    """``8`` -> [8]; ``[8, 24]`` -> [8, 24]; ``"1-64"`` or ``"1..64"`` -> 1..64."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    if isinstance(value, str):
        low, sep, high = value.replace("..", "-").partition("-")
        if sep and low.strip().isdigit() and high.strip().isdigit() and int(low) <= int(high):
            return list(range(int(low), int(high) + 1))
    raise UsageError(f"world must be an int, a list of ints or a range such as 1-64, got {value!r}")


def model_config(name: Any) -> LlamaConfig:
    if name not in MODEL_SIZES:
        raise UsageError(f"unknown model {name!r}; valid models: {', '.join(MODEL_SIZES)}")
    return MODEL_SIZES[name]


def constraints_from(overrides: dict[str, Any]) -> PickerConstraints:
    values = {k: overrides[k] for k in CONSTRAINT_KEYS if k in overrides}
    if overrides["micro_batch_size"] is not None:
        if "micro_batch_sizes" in values:
            raise UsageError("give micro_batch_size or micro_batch_sizes, not both")
        values["micro_batch_sizes"] = [overrides["micro_batch_size"]]
    return PickerConstraints.from_mapping(values)


def _current(value: Any) -> HybridLayout | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise UsageError(f"current must be a layout such as current.dp_shard=8 current.tp=1, got {value!r}")
    unknown = sorted(str(k) for k in value if k not in AXES)
    if unknown:
        raise UsageError(f"unknown current layout key(s) {unknown}; valid keys: {', '.join(AXES)}")
    layout = HybridLayout(**value)
    if not layout.is_resolved:
        raise UsageError(f"current must be resolved (no -1), got {layout.describe()}")
    return layout


def run(argv: list[str]) -> int:
    overrides, out = parse(argv)
    if overrides["world"] is None:
        raise UsageError("world is required, e.g. world=8, world=[8,24,64] or world=1-64")
    model = model_config(overrides["model"])
    constraints = constraints_from(overrides)
    profile = load_profile(overrides["profile"]) if overrides["profile"] else HardwareProfile()
    seq_len = overrides["seq_len"] or model.max_seq_len
    current = _current(overrides["current"])
    records: list[dict[str, Any]] = []
    failed = False
    for world in worlds(overrides["world"]):
        try:
            result: PickResult = pick_layout(world, model, global_batch_size=overrides["global_batch_size"],
                                             seq_len=seq_len, constraints=constraints, profile=profile,
                                             current=current)
        except NoFeasibleLayoutError as error:
            print(f"world {world}: {error}\n")
            records.append({"world": world, "error": str(error)})
            failed = True
            continue
        print(result.table(overrides["rows"]) + "\n")
        records.append(result.to_record())
    if out is not None:
        Path(out).write_text(json.dumps(records[0] if len(records) == 1 else records, indent=2) + "\n")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        return run(argv)
    except (UsageError, PickerError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head`: stop quietly, and keep the exit-time flush quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
