"""A user's own Lightning script made elastic: a small GPT, a plain ``DataLoader``, one ``trainer.fit``.

Everything model- and data-specific is defined here, as a user would write it; the only lightning-emig parts are the
strategy (``Trainer(strategy=ElasticMigrationStrategy(...))``), two helpers in ``configure_model`` and the launcher:

    lightning-emig-run --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 \\
        --local-addr=127.0.0.2 -m lightning_emig.examples.gpt --max-steps 200 --out outputs/gpt
    # a second node joins later with the same command (--local-addr=127.0.0.3): the run goes on live

It also runs without the launcher (``python -m lightning_emig.examples.gpt``: one process) and under plain
``torchrun`` (membership changes then take torchrun's restart path). At the end the last rank 0 writes
``<out>/summary.json`` (per-step loss, the ``tokens_seen`` buffer, its process id), and every process its
:class:`SmoothedLoss` callback's state (``<out>/callbacks/<pid>.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, Dataset

from lightning_emig import HybridLayout, LayoutError
from lightning_emig.parallelize import materialize_and_init, materialize_empty, parallelize_model
from lightning_emig.strategy import ElasticMigrationStrategy, LayoutSchedule


# ----------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 128


class Attention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.head_dim = c.d_model // c.n_heads
        self.q, self.k, self.v = (nn.Linear(c.d_model, c.d_model, bias=False) for _ in range(3))
        self.proj = nn.Linear(c.d_model, c.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Under tensor parallelism q/k/v hold this rank's heads only: count them from the local width.
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.d_model), nn.LayerNorm(c.d_model)
        self.attn = Attention(c)
        self.fc, self.out = nn.Linear(c.d_model, c.d_ff), nn.Linear(c.d_ff, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Embeddings(nn.Module):
    """Token and position embeddings: what the first pipeline stage holds before its blocks."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.seq_len, c.d_model)
        # Not persistent: rebuilt by init_buffers whenever configure_model builds the model.
        self.register_buffer("positions", torch.arange(c.seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos(self.positions[: tokens.shape[1]])


class GPT(nn.Module):
    """Pipeline stages declared by ``blocks()``, ``first_stage_modules()`` and ``keep_stage``: the kept modules keep
    their names under every layout, so each tensor has one key wherever it moves."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.embeddings: Embeddings | None = Embeddings(c)
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.n_layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(c.d_model)
        self.head: nn.Linear | None = nn.Linear(c.d_model, c.vocab_size, bias=False)
        # Persistent: part of the state dict, so it moves with every change (and is checked by the tests). A buffer
        # of the root: every pipeline stage keeps (and updates) it.
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Whole, it maps tokens to logits; cut to a pipeline stage, it runs the parts it kept (a later stage gets
        # the previous stage's activations, an earlier one returns its own).
        if self.embeddings is not None:
            x = self.embeddings(x)
        for block in self.layers.values():
            x = block(x)
        if self.head is None:
            return x
        return self.head(self.ln_f(x))

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks: one FSDP2 unit each, and what pipeline stages are made of."""
        return list(self.layers.values())

    def first_stage_modules(self) -> list[nn.Module]:
        """What a pipeline's first stage holds besides its blocks: the embeddings (``keep_stage`` keeps them there)."""
        return [self.embeddings]

    def keep_stage(self, blocks: range, *, first: bool, last: bool) -> None:
        """Cut down, in place, to one pipeline stage: ``blocks``, the embeddings if ``first``, the head if ``last``."""
        for name in list(self.layers):
            if int(name) not in blocks:
                del self.layers[name]
        if not first:
            self.embeddings = None
        if not last:
            self.ln_f = self.head = None

    def init_full_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """The full value of each parameter, from its own generator: the same weights under every layout."""
        if name.endswith("bias"):
            full.zero_()
        elif full.dim() == 1:  # LayerNorm weights
            full.fill_(1.0)
        else:
            full.normal_(0.0, 0.02, generator=generator)

    def init_buffers(self) -> None:
        self.tokens_seen.zero_()
        if self.embeddings is not None:
            self.embeddings.positions.copy_(torch.arange(self.config.seq_len))


#: Megatron-style tensor parallelism in torch's own ``parallelize_module`` form: q/k/v and the first FFN layer split
#: by output columns, the projections after them by input rows (one all-reduce each); the rest is replicated.
TP_PLAN = {
    "layers.*.attn.q": ColwiseParallel(), "layers.*.attn.k": ColwiseParallel(), "layers.*.attn.v": ColwiseParallel(),
    "layers.*.attn.proj": RowwiseParallel(), "layers.*.fc": ColwiseParallel(), "layers.*.out": RowwiseParallel(),
}


# ------------------------------------------------------------------------------------------------ the data
class CountingSequences(Dataset):
    """Sequences that count up from a start token (mod the vocabulary): easy to learn, so the loss falls fast."""

    def __init__(self, size: int, seq_len: int, vocab_size: int) -> None:
        self.size, self.seq_len, self.vocab_size = size, seq_len, vocab_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (index * 7919) % self.vocab_size
        tokens = (start + torch.arange(self.seq_len + 1)) % self.vocab_size
        return tokens[:-1], tokens[1:]


# ---------------------------------------------------------------------------------------- the Lightning module
class GPTModule(pl.LightningModule):
    def __init__(self, model_config: GPTConfig, *, lr: float = 3e-3, max_steps: int = 100, seed: int = 0) -> None:
        super().__init__()
        self.model_config = model_config  # any name works: the strategy never guesses attributes
        self.lr, self.max_steps, self.seed = lr, max_steps, seed
        self.model: GPT | None = None
        self.step_losses: dict[int, float] = {}
        self._micro_losses: list[torch.Tensor] = []

    def validate_layout(self, layout: HybridLayout) -> None:
        """Asked by the strategy before any layout is used (at start and at every change)."""
        for what, size in (("heads", self.model_config.n_heads), ("FFN width", self.model_config.d_ff)):
            if size % layout.tp:
                raise LayoutError(f"tp={layout.tp} does not divide the model's {what} ({size})")
        if layout.stages > self.model_config.n_layers:
            raise LayoutError(f"{layout.describe_stages()} is more stages than the model's "
                              f"{self.model_config.n_layers} blocks")

    def configure_model(self) -> None:
        if self.model is not None:  # the strategy sets it to None whenever the layout changes
            return
        strategy = self.trainer.strategy
        with torch.device("meta"):
            model = GPT(self.model_config)
        # Under pp > 1 this cuts the model to this process's stage first (its keep_stage), then TP and FSDP2.
        parallelize_model(model, strategy.layout_mesh, tp_plan=TP_PLAN)
        if strategy.migrating:  # a change fills every parameter and persistent buffer: don't initialise
            materialize_empty(model, strategy.root_device)
        else:
            materialize_and_init(model, strategy.root_device, seed=self.seed)
        self.model = model

    def on_train_start(self) -> None:
        self._micro_losses.clear()  # a step cut short by a peer's failure left a partial one

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self._micro_losses.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The global batch's mean loss, on every rank. Under pipeline stages only the last stage ran training_step:
        # elsewhere there is no loss of our own (None), and the strategy hands out the last stage's.
        local = torch.stack(self._micro_losses).mean() if self._micro_losses else None
        mean = self.trainer.strategy.step_loss(local)
        self._micro_losses.clear()
        self.step_losses[self.trainer.global_step] = float(mean)
        self.log("train/loss", float(mean), prog_bar=True, rank_zero_only=True)
        plan = self.trainer.strategy.batch_plan
        self.model.tokens_seen += plan.global_batch_size * self.model_config.seq_len

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
    add_run_arguments(parser, out=Path("outputs/gpt"))
    parser.add_argument("--dp-replicate", type=int, default=1, help="2: HSDP, each replica a whole copy")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (kept when the world allows)")
    parser.add_argument("--pp-virtual", type=int, default=1,
                        help="stages a pipeline process holds (> 1: --pipeline-schedule interleaved_1f1b)")
    parser.add_argument("--pipeline-schedule", choices=("gpipe", "1f1b", "interleaved_1f1b"), default="gpipe")
    parser.add_argument("--n-layers", type=int, default=GPTConfig.n_layers, help="transformer blocks")
    return parser.parse_args(argv)


def add_run_arguments(parser: argparse.ArgumentParser, *, out: Path) -> None:
    """The options of a run that every worked example takes (the HF example too)."""
    parser.add_argument("--out", type=Path, default=out, help="run directory (shared by all ranks)")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (kept when the world allows)")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--checkpoint-every", type=int, default=10, help="periodic checkpoint interval (steps)")
    parser.add_argument("--ledger", action="store_true", help="record every sample trained on (data ledger)")
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0, help="seconds before a silent peer is dead")
    parser.add_argument("--layout-change", type=_layout_change, action="append", default=[],
                        metavar="STEP:AXIS=N[,AXIS=N]",
                        help="switch live to this layout after optimizer step STEP, prepared in the background a "
                             "step before (LayoutSchedule), e.g. 40:tp=2; repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--consistency-every", type=int, default=100,
                        help="steps between proofs that the ranks hold one state (0: only at changes and saves)")


def _layout_change(text: str) -> tuple[int, HybridLayout]:
    """``40:tp=2,dp_shard=1`` -> (40, HybridLayout(tp=2, dp_shard=1))."""
    step, _, axes = text.partition(":")
    try:
        degrees = {axis: int(degree) for axis, degree in (part.split("=") for part in axes.split(","))}
        return int(step), HybridLayout(**degrees)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected STEP:AXIS=N[,AXIS=N], e.g. 40:tp=2 ({exc})") from None


class SmoothedLoss(pl.Callback):
    """A callback with state, as users' scripts have: a running mean of the loss, shown on the progress bar. Its
    ``state_dict`` goes into checkpoints and, at a live join, to the joining processes (through ``load_state_dict``,
    as Lightning restores it from a checkpoint), so every process goes on from the same value."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.value: float | None = None
        self.steps = 0
        """Optimizer steps averaged in: the job's step count on every process, joiners included."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step - 1  # the step this batch ended, once its optimizer step ran
        loss = getattr(pl_module, "step_losses", {}).get(step)
        if loss is None or step < self.steps:  # not a step boundary (a micro-batch), or a step already counted
            return
        self.value = loss if self.value is None else self.decay * self.value + (1 - self.decay) * loss
        self.steps = step + 1
        pl_module.log("train/loss_smoothed", self.value, prog_bar=True, rank_zero_only=True)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value, self.steps = state_dict["value"], state_dict["steps"]


def run_callbacks(args: argparse.Namespace) -> list[Any]:
    """Periodic checkpoints, a :class:`SmoothedLoss`, the ``--layout-change`` schedule and the ``--ledger`` of
    :func:`add_run_arguments`."""
    callbacks: list[Any] = [ModelCheckpoint(dirpath=args.out / "checkpoints", filename="step{step:06d}",
                                            auto_insert_metric_name=False, every_n_train_steps=args.checkpoint_every,
                                            save_top_k=-1), SmoothedLoss()]
    if args.layout_change:
        # The examples' configure_model makes no collective and no global-RNG call: it may run in a background
        # thread, a step ahead, while training goes on (the switch then pauses for the transfer only).
        callbacks.append(LayoutSchedule(args.layout_change, prepare_ahead_steps=1))
    if args.ledger:
        from lightning_emig.training.ledger import DataLedger

        callbacks.append(DataLedger(args.out))
    return callbacks


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from lightning_emig.membership.settings import FailureSettings

    config = GPTConfig(n_layers=args.n_layers)
    pl.seed_everything(args.seed, workers=True)
    strategy = ElasticMigrationStrategy(
        layout=HybridLayout(dp_replicate=args.dp_replicate, dp_shard=-1, tp=args.tp, pp=args.pp,
                            pp_virtual=args.pp_virtual),
        pipeline_schedule=args.pipeline_schedule,
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        timeout=timedelta(seconds=60), seed=args.seed, async_checkpoints=True,
        failure=FailureSettings(heartbeat_interval_s=0.5, heartbeat_timeout_s=args.heartbeat_timeout),
        consistency_every_n_steps=args.consistency_every,
    )
    callbacks = run_callbacks(args)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # processes per node, as torchrun started them
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.max_steps,
                         default_root_dir=args.out, callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = GPTModule(config, max_steps=args.max_steps, seed=args.seed)
    dataset = CountingSequences(args.samples, config.seq_len, config.vocab_size)
    trainer.fit(module, DataLoader(dataset, batch_size=args.micro_batch_size, shuffle=True))
    if trainer.is_global_zero:
        summary = {"step_losses": {str(k): v for k, v in sorted(module.step_losses.items())},
                   "tokens_seen": int(module.model.tokens_seen), "pid": os.getpid(),
                   "events": [e.as_dict() for e in strategy.events], "layout": strategy.layout.as_dict()}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_callback_state(args.out, trainer)


def write_callback_state(out: Path, trainer: pl.Trainer) -> None:
    """Every process that ends the job writes its ``SmoothedLoss`` state (``<out>/callbacks/<pid>.json``): a joiner's
    must equal the others', steps and all."""
    smoothed = next(c for c in trainer.callbacks if isinstance(c, SmoothedLoss))
    (out / "callbacks").mkdir(parents=True, exist_ok=True)
    (out / "callbacks" / f"{os.getpid()}.json").write_text(json.dumps(smoothed.state_dict()))


if __name__ == "__main__":
    main()
