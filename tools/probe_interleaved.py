"""Does torch's interleaved 1F1B schedule run on this backend? A probe, not part of the product.

Two (or more) processes each hold ``--chunks`` virtual stages of a stack of ``Linear + Tanh`` layers (stage ``s`` on
process ``s % world``), run ``--steps`` schedule steps of 4 micro-batches, and compare every chunk's weight gradient
with the whole stack's on one process. Prints ``rank N ok`` or ``rank N MISMATCH``.

    .venv/bin/torchrun --nproc-per-node=2 tools/probe_interleaved.py
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

MICRO_BATCHES = 4


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=2, help="virtual stages per process")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same stack on every process
    total, dim = world * args.chunks, 16
    stack = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Tanh())
                                  for _ in range(total)])
    mine = [rank + c * world for c in range(args.chunks)]
    stages = [PipelineStage(copy.deepcopy(stack[s]), s, total, torch.device("cpu")) for s in mine]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO_BATCHES, loss_fn=_loss)
    inputs, target = torch.randn(2 * MICRO_BATCHES, dim), torch.randn(2 * MICRO_BATCHES, dim)
    for _ in range(args.steps):
        for stage in stages:
            stage.submod.zero_grad()
        if rank == 0:
            schedule.step(inputs)
        elif rank == world - 1:
            schedule.step(target=target)
        else:
            schedule.step()
    stack.zero_grad()
    outputs = stack(inputs)
    sum(_loss(o, t) for o, t in zip(outputs.chunk(MICRO_BATCHES), target.chunk(MICRO_BATCHES), strict=True)).div(
        MICRO_BATCHES).backward()
    same = all(torch.allclose(stage.submod[0].weight.grad, stack[s][0].weight.grad, rtol=1e-4, atol=1e-6)
               for s, stage in zip(mine, stages, strict=True))
    print(f"rank {rank} {'ok' if same else 'MISMATCH'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
