"""What planning a change costs one process of the live path, for a model's real state (issue #11: the pause's
fixed costs).

A process plans from the state's specs: every parameter and its AdamW moments and step, sharded by FSDP2 as
``parallelize_model`` lays the model out (specs taken from a real parallelized meta model on 2 gloo processes, so
placements and mesh names are the ones a run has). Timed on process 0, each repeat from cold geometry caches (a
process plans a change once): ``tensor_migrations`` + ``plan_for_rank``, for the changes the live path makes at
``tools/bench_elastic.py``'s events:

* ``join``: world 1 -> 2, the survivor (old rank 0 -> new rank 0, the joiner new rank 1);
* ``preempt``: world 2 -> 1, the survivor (rank 1 leaves).

    .venv/bin/python tools/bench_plan.py --models llama_125m llama_350m --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from lightning_emig.layout import HybridLayout, build_mesh
from lightning_emig.migration import geometry
from lightning_emig.migration import state as state_module
from lightning_emig.migration.engine import tensor_migrations
from lightning_emig.migration.identity import IdentityMap, ProcessInfo
from lightning_emig.migration.planner import PlanOptions, plan_for_rank
from lightning_emig.migration.state import ShardingSpec, spec_of
from lightning_emig.models.llama import Llama, get_model_config
from lightning_emig.parallelize import parallelize_model
from lightning_emig.testing.distributed import run_distributed

CHANGES = {
    "join": (1, 2, (ProcessInfo(0, "a", 0, 0), ProcessInfo(1, "b", None, 1))),
    "preempt": (2, 1, (ProcessInfo(0, "a", 0, 0), ProcessInfo(1, "b", 1, None))),
}


def _state_specs(model_name: str) -> dict[str, ShardingSpec]:
    """Every state tensor's spec, as ``training_state`` names them (a collective: both processes build the mesh)."""
    with torch.device("meta"):
        model = Llama(get_model_config(model_name))
    parallelize_model(model, build_mesh(HybridLayout().resolve(2), "cpu"))
    specs = {}
    for name, param in model.named_parameters():
        for key in (f"param/{name}", f"optim/{name}/exp_avg", f"optim/{name}/exp_avg_sq"):
            specs[key] = spec_of(param)
        specs[f"optim/{name}/step"] = ShardingSpec((), torch.float32, (), ())
    return specs


def _cold_caches() -> None:
    geometry._holding.cache_clear()  # noqa: SLF001 - a process plans a change once: from cold caches
    geometry._sources.cache_clear()  # noqa: SLF001
    state_module._sharding_on.cache_clear()  # noqa: SLF001


def _worker(rank: int, world: int, models: list[str], repeats: int) -> list[dict[str, Any]] | None:
    records = []
    for model_name in models:
        specs = _state_specs(model_name)
        if rank != 0:
            continue
        for change, (old_world, new_world, processes) in CHANGES.items():
            old, new = HybridLayout().resolve(old_world), HybridLayout().resolve(new_world)
            identity = IdentityMap(processes, old_world, new_world)
            samples, transfers = [], 0
            for _ in range(repeats):
                _cold_caches()
                start = time.perf_counter()
                plan = plan_for_rank(tensor_migrations(specs, specs, old, new), identity, 0, PlanOptions())
                samples.append(time.perf_counter() - start)
                transfers = len(plan.copies) + len(plan.sends) + len(plan.recvs)
            records.append({"model": model_name, "change": change, "tensors": len(specs), "transfers": transfers,
                            "median_seconds": statistics.median(samples), "seconds": samples})
    return records if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["llama_125m", "llama_350m"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="write the records as JSON here")
    args = parser.parse_args()
    records = run_distributed(_worker, 2, args.models, args.repeats, timeout_s=600)[0]
    for r in records:
        print(f"{r['model']:>12} {r['change']:<8} {r['tensors']} tensors, {r['transfers']} transfers: "
              f"planning {r['median_seconds'] * 1e3:.1f} ms (median of {args.repeats}, cold caches)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "tools/bench_plan.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()
                                                                    if k != "out"), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
