"""The HuggingFace example — ``lightning_emig.examples.llama_hf``: ``LlamaForCausalLM`` from a small config, its own
tensor-parallel plan, a plain ``DataLoader``, one ``trainer.fit`` — through a join, a layout change and a preemption
under ``lightning-emig-run``, kept short.

A trains alone; at step 10 B starts and joins (1 -> 2, dp_shard 2); at step 20 the script's ``LayoutSchedule``
(``--layout-change 20:tp=2``) switches to tp 2 over HF's plan; at step 30 B's agent gets SIGTERM and B hands its state
over (2 -> 1). Compared with the same script run uninterrupted in one process: every step's loss within a relative
1e-4 (changed reduction order only), every sample of every global batch trained exactly once, node A's worker the
same process throughout. Test holds stop rank 0 at steps 10 and 30 until the test has acted, so each event lands
where the test says on any machine (``tests/test_user_script.py`` runs this scenario, and others, on the GPT
example).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lightning_emig import HybridLayout, LayoutError
from lightning_emig.change.events import read_events
from lightning_emig.data.sampler import GlobalOffsetSampler
from lightning_emig.parallelize import materialize_and_init
from lightning_emig.testing.commands import descendants, is_alive, python_module_command, run_command
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.ledger import check_ledger
from lightning_emig.testing.nodes import (
    REPO,
    assert_agents_succeed,
    held_at,
    log_tail,
    release,
    start_node,
    stop_agents,
    wait_for,
)

pytest.importorskip("transformers", reason="needs the hf extra: pip install '.[hf]'")

EXAMPLE = "lightning_emig.examples.llama_hf"
MAX_STEPS, JOIN_AT, CHANGE_AT, PREEMPT_AT = 40, 10, 20, 30
GLOBAL_BATCH, SAMPLES = 8, 512
ARGS = ["--max-steps", str(MAX_STEPS), "--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", "2",
        "--checkpoint-every", "20", "--heartbeat-timeout", "3", "--samples", str(SAMPLES)]
REL_TOL = 1e-4


def _run_reference(out: Path) -> dict[str, float]:
    # Its store's port is given, not picked with bind(0), which could take the port an agent has just picked.
    env = {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = run_command(python_module_command(EXAMPLE, *ARGS, "--out", str(out)), timeout_s=180, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    return json.loads((out / "summary.json").read_text())["step_losses"]


def _start(tmp_path: Path, name: str, addr: str, port: int, *, hosts_store: bool, hold_steps: str = ""
           ) -> subprocess.Popen:
    env = {"LIGHTNING_EMIG_TEST_RUN_MODULE": EXAMPLE, "LIGHTNING_EMIG_TEST_HOLD_DIR": str(tmp_path),
           "LIGHTNING_EMIG_TEST_HOLD_STEPS_FOR_JOINERS": "1", "LIGHTNING_EMIG_TEST_HOLD_AT_STEPS": hold_steps}
    return start_node(tmp_path, name, local_addr=addr, port=port, run_dir=tmp_path / "run", rdzv_id="hf-example",
                      train_args=[*ARGS, "--ledger", "--layout-change", f"{CHANGE_AT}:tp=2"], nnodes="1:2", env=env,
                      module="lightning_emig.testing.held_train", run_dir_args=["--out", str(tmp_path / "run")],
                      rdzv_conf=f"is_host={str(hosts_store).lower()}")


def test_the_wrapper_offers_what_a_model_must() -> None:
    """Built on meta and materialised as configure_model does: HF's RoPE tables as HF computes them, the same
    weights from the same seed, a TP plan whose every path names a module, pipeline stages refused."""
    from transformers import LlamaForCausalLM

    from lightning_emig.examples.llama_hf import (
        ElasticCausalLM,
        LlamaHFModule,
        tensor_parallel_plan,
        tiny_llama_config,
    )

    config = tiny_llama_config()
    models = []
    for _ in range(2):
        with torch.device("meta"):
            model = ElasticCausalLM(LlamaForCausalLM(config))
        materialize_and_init(model, "cpu", seed=0)
        models.append(model)
    eager = LlamaForCausalLM(config).model.rotary_emb
    for name, buffer in models[0].llm.model.rotary_emb.named_buffers():
        assert torch.equal(buffer, eager.get_buffer(name)), name
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b), name
    plan = tensor_parallel_plan(models[0].llm)
    assert len(plan) == 7 and all(fqn.startswith("llm.model.layers.*.") for fqn in plan), plan
    for fqn in plan:
        for i in range(config.num_hidden_layers):
            models[0].get_submodule(fqn.replace("*", str(i)))
    assert models[0].blocks() == list(models[0].llm.model.layers)
    logits = models[0](torch.arange(8).unsqueeze(0))
    assert logits.shape == (1, 8, config.vocab_size) and torch.isfinite(logits).all()
    module = LlamaHFModule(config)
    module.validate_layout(HybridLayout(dp_shard=1, tp=2))
    with pytest.raises(LayoutError, match="pipeline"):
        module.validate_layout(HybridLayout(dp_shard=1, pp=2))
    with pytest.raises(LayoutError, match="key/value heads"):
        module.validate_layout(HybridLayout(dp_shard=1, tp=4))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_hf_example_survives_a_join_a_layout_change_and_a_preemption(tmp_path: Path) -> None:
    port = free_port()
    agents: dict[str, subprocess.Popen] = {}
    with ThreadPoolExecutor(max_workers=1) as pool:
        reference = pool.submit(_run_reference, tmp_path / "reference")  # trains while the nodes wait on events
        try:
            agents["a"] = _start(tmp_path, "a", "127.0.0.2", port, hosts_store=True,
                                 hold_steps=f"{JOIN_AT},{PREEMPT_AT}")
            held_at(tmp_path, JOIN_AT, agents)
            agents["b"] = _start(tmp_path, "b", "127.0.0.3", port, hosts_store=False)
            wait_for(lambda: "world 2 on 2 node(s)" in log_tail(tmp_path, "a", 100000), 120,
                     "B's round was not published")
            release(tmp_path, JOIN_AT)  # A waits for B's worker to be ready, then both go into the new generation
            held_at(tmp_path, PREEMPT_AT, agents)
            a_workers = [p for p in descendants(agents["a"].pid) if is_alive(p)]
            b_workers = [p for p in descendants(agents["b"].pid) if is_alive(p)]
            os.kill(agents["b"].pid, signal.SIGTERM)  # the notice
            wait_for(lambda: "preemption notice" in log_tail(tmp_path, "b", 100000) or agents["b"].poll() is not None,
                     60, f"B's agent did not announce its departure:\n{log_tail(tmp_path, 'b')}")
            release(tmp_path, PREEMPT_AT)
            assert_agents_succeed(tmp_path, agents, 120)
            assert not any(is_alive(p) for p in b_workers), "B's worker outlived its agent"
        finally:
            stop_agents(agents)
        uninterrupted = reference.result()

    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["pid"] in a_workers, "node A's worker was restarted: fit did not carry the changes"
    events = read_events(run_dir)
    assert [(e["kind"], e["step"], e["old_world"], e["new_world"]) for e in events] == [
        ("join", JOIN_AT, 1, 2), ("reconfigure", CHANGE_AT, 2, 2), ("preempt", PREEMPT_AT, 2, 1)], events
    assert [(e["new_layout"]["dp_shard"], e["new_layout"]["tp"]) for e in events] == [(2, 1), (1, 2), (1, 1)]
    losses = summary["step_losses"]
    assert sorted(int(k) for k in losses) == list(range(MAX_STEPS))
    worst = max(abs(losses[k] - uninterrupted[k]) / abs(uninterrupted[k]) for k in losses)
    assert worst < REL_TOL, f"loss curve departs from the uninterrupted run by {worst:.2e} (relative)"
    print(f"\nlosses within {worst:.1e} (relative) of the uninterrupted run")
    # The order of the DistributedSampler Lightning injects into the script's shuffled loader (seed_everything(0)).
    sampler = GlobalOffsetSampler(SAMPLES, GLOBAL_BATCH, seed=0, torch_order=True)
    ledger = check_ledger(run_dir, sampler=sampler, max_steps=MAX_STEPS)
    ledger.assert_exactly_once()
    assert ledger.rolled_back_steps == [], ledger.describe()
    assert set(ledger.dp_degrees.values()) == {1, 2}
    for e in events:
        print(f"\n{e['kind']} at step {e['step']}: world {e['old_world']} -> {e['new_world']}, downtime "
              f"{e.get('downtime_seconds', 0):.2f}s, {e['bytes_moved'] / 1e6:.2f} MB moved")
