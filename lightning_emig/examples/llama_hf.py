"""A HuggingFace ``transformers`` causal LM made elastic: ``LlamaForCausalLM`` from a small config, a plain
``DataLoader``, one ``trainer.fit``.

The template for HF users. The HF model is used as it is; a small wrapper, :class:`ElasticCausalLM`, adds what
lightning-emig asks of a model (``blocks()``: the decoder layers, each one FSDP2 unit; ``init_full_parameter``: the
same weights under every layout; ``init_buffers``: the RoPE tables HF keeps as non-persistent buffers), and
:func:`tensor_parallel_plan` turns the model's own tensor-parallel plan (``config.base_model_tp_plan``) into torch's
``parallelize_module`` form. Nothing is downloaded: the model is built from a ``LlamaConfig``. Needs the ``hf`` extra
(``pip install 'lightning-emig[hf]'``)::

    python -m lightning_emig.examples.llama_hf --max-steps 100 --out outputs/llama_hf          # one process
    lightning-emig-run --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 \\
        --local-addr=127.0.0.2 -m lightning_emig.examples.llama_hf --max-steps 200 --out outputs/llama_hf
    # a second node joins later with the same command (--local-addr=127.0.0.3): the run goes on live;
    # --layout-change 100:tp=2 then switches the two processes to HF's tensor-parallel plan after step 100

Pipeline stages (``pp > 1``) are refused: cutting an HF model into stages needs a ``keep_stage`` method that this
wrapper does not offer (see ``GPT.keep_stage`` in ``lightning_emig/examples/gpt.py`` for what one does). At the end
the last rank 0 writes ``<out>/summary.json`` (per-step loss, the events, the final layout, its process id).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from lightning_emig import HybridLayout, LayoutError
from lightning_emig.examples.gpt import CountingSequences, add_run_arguments, run_callbacks
from lightning_emig.parallelize import materialize_and_init, materialize_empty, parallelize_model
from lightning_emig.strategy import ElasticMigrationStrategy

SEQ_LEN = 32


def tiny_llama_config() -> LlamaConfig:
    """A Llama small enough for CPU tests: 2 layers, 4 query heads sharing 2 key/value heads (GQA)."""
    return LlamaConfig(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2, intermediate_size=128, max_position_embeddings=64,
                       tie_word_embeddings=False,  # untied: each weight is one parameter with one name
                       use_cache=False,  # training: no KV cache
                       attn_implementation="sdpa")


# ----------------------------------------------------------------------------------------------- the model
class ElasticCausalLM(nn.Module):
    """An HF causal LM (``llm``) plus the hooks lightning-emig uses; its forward maps token ids to logits.

    Parameter names are the HF model's under ``llm.`` (``llm.model.layers.0.self_attn.q_proj.weight``): the same
    under every layout, so each tensor has one key wherever it moves. Written for HF decoders laid out as Llama's
    (``<base_model_prefix>.layers``, a ``rotary_emb`` holding ``inv_freq``), which most are.
    """

    def __init__(self, llm: PreTrainedModel) -> None:
        super().__init__()
        self.llm = llm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.llm(input_ids=input_ids, use_cache=False).logits

    def blocks(self) -> list[nn.Module]:
        """The decoder layers: one FSDP2 unit each (one all-gather per layer); the root takes the rest."""
        return list(self.llm.base_model.layers)

    def init_full_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """The full value of each parameter, from its own generator: HF's own scheme (``_init_weights``: normal
        weights with ``initializer_range``, norms at one, biases at zero), but independent of the layout."""
        if name.endswith("bias"):
            full.zero_()
        elif full.dim() == 1:  # RMSNorm weights
            full.fill_(1.0)
        else:
            full.normal_(0.0, self.llm.config.initializer_range, generator=generator)

    def init_buffers(self) -> None:
        """HF's RoPE tables (``inv_freq``, ``original_inv_freq``) are non-persistent buffers: never migrated, and
        garbage after ``to_empty``. A fresh rotary module built from the config on the CPU computes them again."""
        rotary = self.llm.base_model.rotary_emb
        with torch.device("cpu"):
            fresh = type(rotary)(rotary.config)
        for name, value in fresh.named_buffers():
            rotary.get_buffer(name).copy_(value)
        known = {f"llm.{self.llm.base_model_prefix}.rotary_emb.{name}" for name, _ in fresh.named_buffers()}
        unknown = [name for name, _ in self.named_buffers() if name not in known]
        if unknown:  # fail loudly rather than train on uninitialised memory
            raise ValueError(f"init_buffers does not know how to fill {unknown}: extend ElasticCausalLM.init_buffers")


#: HF's plan entries as torch parallel styles. The others HF knows ("packed_colwise", "sequence_parallel",
#: "moe_tp_experts", ...) need HF's own style classes: a plan that uses them is refused under tp > 1 rather than
#: applied in part (skipping one half of a colwise/rowwise pair would compute the wrong thing).
HF_TP_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def tensor_parallel_plan(llm: PreTrainedModel, prefix: str = "llm") -> dict[str, ParallelStyle]:
    """torch's ``parallelize_module`` plan from the model's own HF plan, ``config.base_model_tp_plan``.

    Its keys are relative to the base model (``layers.*.self_attn.q_proj``): they get the path to it in front
    (``llm.model.``). Megatron-style: q/k/v and gate/up split by output columns, o/down by input rows (one all-reduce
    each); the embedding, norms and the LM head stay replicated. (HF's class-level plan would also split the LM head,
    ``lm_head: colwise_gather_output``; it is a private attribute, and a replicated head is the simpler template.)
    """
    hf_plan = llm.config.base_model_tp_plan or {}
    unsupported = {fqn: style for fqn, style in hf_plan.items() if style not in HF_TP_STYLES}
    if unsupported:
        raise ValueError(f"{type(llm).__name__}'s tensor-parallel plan uses styles this example does not map to "
                         f"torch's: {unsupported}; add them to HF_TP_STYLES or run with tp=1")
    return {f"{prefix}.{llm.base_model_prefix}.{fqn}": HF_TP_STYLES[style]() for fqn, style in hf_plan.items()}


# ---------------------------------------------------------------------------------------- the Lightning module
class LlamaHFModule(pl.LightningModule):
    def __init__(self, llama_config: LlamaConfig, *, lr: float = 3e-3, max_steps: int = 100, seed: int = 0) -> None:
        super().__init__()
        self.llama_config = llama_config  # any name works: the strategy never guesses attributes
        self.lr, self.max_steps, self.seed = lr, max_steps, seed
        self.model: ElasticCausalLM | None = None
        self.step_losses: dict[int, float] = {}
        self._micro_losses: list[torch.Tensor] = []

    def validate_layout(self, layout: HybridLayout) -> None:
        """Asked by the strategy before any layout is used (at start and at every change)."""
        c = self.llama_config
        for what, size in (("query heads", c.num_attention_heads), ("key/value heads", c.num_key_value_heads),
                           ("FFN width", c.intermediate_size)):
            if size % layout.tp:
                raise LayoutError(f"tp={layout.tp} does not divide the model's {what} ({size})")
        if layout.pp > 1:
            raise LayoutError(f"pp={layout.pp}: this example's ElasticCausalLM cannot be cut into pipeline stages "
                              "(it has no keep_stage method); use pp=1")

    def configure_model(self) -> None:
        if self.model is not None:  # the strategy sets it to None whenever the layout changes
            return
        strategy = self.trainer.strategy
        with torch.device("meta"):  # no memory, no init: HF's own weight init runs on meta tensors
            model = ElasticCausalLM(LlamaForCausalLM(self.llama_config))
        layout_mesh = strategy.layout_mesh
        tp_plan = tensor_parallel_plan(model.llm) if layout_mesh.layout.tp > 1 else None
        parallelize_model(model, layout_mesh, tp_plan=tp_plan)
        if strategy.migrating:  # a change fills every parameter: don't initialise (init_buffers still runs)
            materialize_empty(model, strategy.root_device)
        else:
            materialize_and_init(model, strategy.root_device, seed=self.seed)
        self.model = model

    def on_train_start(self) -> None:
        self._micro_losses.clear()  # a step cut short by a peer's failure left a partial one

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch  # targets are the inputs shifted by one already
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self._micro_losses.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        mean = self.trainer.strategy.step_loss(torch.stack(self._micro_losses).mean())  # the global batch's mean
        self._micro_losses.clear()
        self.step_losses[self.trainer.global_step] = float(mean)
        self.log("train/loss", float(mean), prog_bar=True, rank_zero_only=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)
        warmup = 5

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, self.max_steps - warmup))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ------------------------------------------------------------------------------------------------- the script
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser, out=Path("outputs/llama_hf"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from lightning_emig.membership.settings import FailureSettings

    config = tiny_llama_config()
    pl.seed_everything(args.seed, workers=True)
    strategy = ElasticMigrationStrategy(
        layout=HybridLayout(dp_shard=-1, tp=args.tp),
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        timeout=timedelta(seconds=60), seed=args.seed, async_checkpoints=True,
        failure=FailureSettings(heartbeat_interval_s=0.5, heartbeat_timeout_s=args.heartbeat_timeout),
    )
    callbacks = run_callbacks(args)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # processes per node, as torchrun started them
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.max_steps,
                         default_root_dir=args.out, callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = LlamaHFModule(config, max_steps=args.max_steps, seed=args.seed)
    dataset = CountingSequences(args.samples, SEQ_LEN, config.vocab_size)
    trainer.fit(module, DataLoader(dataset, batch_size=args.micro_batch_size, shuffle=True))
    if trainer.is_global_zero:
        summary = {"step_losses": {str(k): v for k, v in sorted(module.step_losses.items())}, "pid": os.getpid(),
                   "events": [e.as_dict() for e in strategy.events], "layout": strategy.layout.as_dict()}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
