"""What the consistency guard costs (issue #34): one proof of the state against one training step, side by side.

A Llama laid out by ``parallelize_model`` on 2 gloo processes (``dp_shard=2``), AdamW state allocated by one real
step; timed on process 0, alternating so both see the same machine load: a training step (forward, backward, AdamW)
and a proof (:func:`lightning_emig.consistency.prove_state`: the digest of every local shard and two all-reduces).
Prints the ratio proof / step and what a proof every ``N`` steps adds per step.

    .venv/bin/python tools/bench_consistency.py --models llama_25m llama_125m --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from lightning_emig.consistency import prove_state
from lightning_emig.layout import HybridLayout, build_mesh
from lightning_emig.migration.state import training_state
from lightning_emig.models.llama import causal_lm_loss, get_model_config
from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.llama import laid_out_llama

SEQ_LEN, MICRO_BATCH = 256, 2


def _measure(rank: int, world: int, model_name: str, repeats: int) -> dict[str, Any]:
    layout = HybridLayout(dp_shard=world).resolve(world)
    config = get_model_config(model_name)
    model = laid_out_llama(config, build_mesh(layout, "cpu"), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (MICRO_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    def proof() -> None:
        prove_state(training_state(model, optimizer), layout, rank=rank, step=0, data_offset=0, generation=0,
                    device=torch.device("cpu"), when="in the benchmark")

    step()  # optimizer state exists from here on
    proof()
    steps, proofs = [], []
    for _ in range(repeats):
        for timings, run in ((steps, step), (proofs, proof)):
            torch.distributed.barrier()
            started = time.perf_counter()
            run()
            timings.append(time.perf_counter() - started)
    state_bytes = sum(t.local.numel() * t.local.element_size() for t in training_state(model, optimizer).values())
    return {"model": model_name, "world": world, "state_bytes_per_rank": state_bytes,
            "step_s": statistics.median(steps), "proof_s": statistics.median(proofs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama_25m"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--every", type=int, default=100, help="steps between periodic proofs")
    args = parser.parse_args()
    for name in args.models:
        result = run_distributed(_measure, 2, name, args.repeats, timeout_s=1800)[0]
        result["proof_over_step"] = result["proof_s"] / result["step_s"]
        result[f"added_per_step_every_{args.every}"] = result["proof_over_step"] / args.every
        result["proof_gb_per_s"] = result["state_bytes_per_rank"] / result["proof_s"] / 1e9
        print(json.dumps(result))


if __name__ == "__main__":
    main()
