"""What the first optimizer step on a never-seen layout pays to DTensor's sharding propagation, and what warming it
up beforehand saves (issue #11's "first step as fast as a steady one"; findings in docs/results/change_cost.md).

A DTensor op works out its output's sharding the first time it meets a combination of input specs and caches it;
a layout change brings new specs, so the first AdamW step after it misses once per (op, spec). Each variant runs in
a fresh process (the caches are process-wide, and partly per thread), one process, DTensor parameters on a 1-rank
mesh, ``--shapes`` distinct shapes x 4 parameters each:

* ``none``: the first step and the second (steady) one;
* ``thread``: a throwaway AdamW steps over meta twins of the parameters (one per distinct spec) in another thread
  first, as a background warm-up would while training goes on;
* ``main``: the same warm-up on the main thread (the thread that then steps).

    .venv/bin/python tools/bench_sharding_cache.py --repeats 5
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import threading
import time

CHILD_TIMEOUT_S = 300.0
SHAPES = [(64, 64), (176, 64), (64, 176), (64,), (512, 64), (32, 64), (128, 128), (256, 64)]


def _child(mode: str, placement_name: str, shapes: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    placement = Shard(0) if placement_name == "shard" else Replicate()
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(s), mesh, [placement]))
              for s in SHAPES[:shapes] for _ in range(4)]
    for p in params:
        p.grad = distribute_tensor(torch.randn(p.shape), mesh, [placement])
    optimizer = torch.optim.AdamW(params, lr=1e-3)

    def twin(p: DTensor) -> DTensor:
        local = torch.empty(p.to_local().shape, device="meta")
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                  run_check=False)

    def warm() -> None:
        distinct = {(tuple(p.shape), p.stride(), p.placements): p for p in params}.values()
        twins = []
        for p in distinct:
            t = torch.nn.Parameter(twin(p))
            t.grad = twin(p)
            twins.append(t)
        accepted = inspect.signature(type(optimizer)).parameters
        type(optimizer)(twins, **{k: v for k, v in optimizer.defaults.items() if k in accepted}).step()

    started = time.perf_counter()
    if mode == "thread":
        worker = threading.Thread(target=warm)
        worker.start()
        worker.join()
    elif mode == "main":
        warm()
    warm_up = time.perf_counter() - started
    steps = []
    for _ in range(2):
        started = time.perf_counter()
        optimizer.step()
        steps.append(time.perf_counter() - started)
    dist.destroy_process_group()
    return {"warm_up": warm_up, "first": steps[0], "second": steps[1]}


def _run_child(mode: str, placement: str, shapes: int) -> dict[str, float]:
    """One variant in a fresh process (bounded by CHILD_TIMEOUT_S; its output shown if it fails)."""
    from lightning_emig.testing.commands import run_command

    cmd = [sys.executable, __file__, "--shapes", str(shapes), "--child", mode, placement]
    result = run_command(cmd, timeout_s=CHILD_TIMEOUT_S, env={"PYTHONWARNINGS": "ignore"})
    if result.returncode != 0:
        raise SystemExit(f"the {mode} / {placement} run exited {result.returncode}:\n{result.stdout[-2000:]}")
    return json.loads(next(line for line in reversed(result.stdout.splitlines()) if line.startswith("{")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per variant (median reported)")
    parser.add_argument("--shapes", type=int, default=6, choices=range(1, len(SHAPES) + 1))
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PLACEMENT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(*args.child, args.shapes)))
        return
    for placement in ("shard", "replicate"):
        for mode in ("none", "thread", "main"):
            runs = [_run_child(mode, placement, args.shapes) for _ in range(args.repeats)]
            med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            print(f"{placement:9s} {mode:6s} warm-up {med['warm_up']:.4f}s  first step {med['first']:.4f}s  "
                  f"second {med['second']:.4f}s", flush=True)


if __name__ == "__main__":
    main()
