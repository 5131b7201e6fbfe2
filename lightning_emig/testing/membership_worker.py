"""A tiny worker for launcher tests: follows generations published by ``lightning-emig-run``.

Every start appends the worker's pid to ``<out>/<node>-<local rank>.starts``. The worker forms the group of
the generation it starts in (on the generation's TCPStore under ``PrefixStore("gen<N>")``, global rank 0
hosting it); while that world is smaller than ``--world-size`` it polls ``latest_generation`` every 0.2 s
and, when a newer generation appears, re-forms its group for it (destroy, then init). In the full world it
does one ``all_reduce`` of ``rank + 1``, writes ``<out>/<node>-<local rank>.json`` and exits 0.
``--fail-node``/``--fail-generation`` make chosen workers exit 1 at start, to drive torchrun's restart path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_emig.launcher.generation import (
    GenerationInfo,
    control_client_from_env,
    current_identity_from_env,
    read_generation,
    wait_for_generation,
)
from lightning_emig.membership.group import form_generation_group


def form_group(info: GenerationInfo, rank: int, timeout_s: float) -> None:
    form_generation_group(info, rank, "gloo", timedelta(seconds=timeout_s))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--world-size", type=int, default=2, help="follow generations until the world is this big")
    parser.add_argument("--fail-node", default="", help="workers of nodes whose id starts with this ...")
    parser.add_argument("--fail-generation", type=int, default=-1, help="... exit 1 when started in this generation")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    me = current_identity_from_env()
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{me.node_id}-{me.local_rank}")
    with open(args.out / f"{tag}.starts", "a") as f:
        f.write(f"{os.getpid()}\n")
    if args.fail_node and me.node_id.startswith(args.fail_node) and me.generation == args.fail_generation:
        raise SystemExit(f"{me.node_id} fails on purpose in generation {me.generation}")
    client = control_client_from_env(timeout_s=args.timeout_s)
    info = read_generation(client, me.generation)
    form_group(info, info.rank_of(me.node_id, me.local_rank), args.timeout_s)
    switch_s = None
    while info.world_size < args.world_size:
        dist.barrier()  # stands in for training steps in the current world
        newer = wait_for_generation(client, info.generation, timeout_s=args.timeout_s)
        seen = time.monotonic()
        dist.destroy_process_group()
        info = read_generation(client, newer)
        form_group(info, info.rank_of(me.node_id, me.local_rank), args.timeout_s)
        switch_s = time.monotonic() - seen

    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    result = {
        "pid": os.getpid(), "node_id": me.node_id, "start_generation": me.generation, "join_live": me.join_live,
        "generation": info.generation, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
        "all_reduce": value.item(), "switch_seconds": switch_s, "rendezvous_seconds": info.rendezvous_seconds,
    }
    dist.destroy_process_group()
    (args.out / f"{tag}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
