"""A Llama-style decoder used as the reference model of every test, benchmark and recipe.

Invariants:

* blocks live in ``self.layers``, an ``nn.ModuleDict`` keyed ``"0", "1", ...``: parameter names such as
  ``layers.3.attention.wq.weight`` stay the same when pipeline stages drop blocks or TP/FSDP2 wrap them;
* attention never reads a head count from the config at run time: the number of (local) heads comes from the
  projection output via ``view(..., -1, head_dim)``, so the same code runs with heads sharded by TP;
* the RoPE tables are non-persistent buffers recomputed by :meth:`Llama.init_buffers`, so a model built on the
  meta device and materialized with ``to_empty`` gets correct tables (they are never checkpointed or migrated);
* :meth:`Llama.init_full_parameter` defines initialization on the *full* tensor, so weights do not depend on how
  a layout shards them;
* the forward returns full logits ``[B, T, V]`` as a plain tensor under every layout (TP gathers the vocab dim).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from lightning_emig.models.base import TensorParallelPlan

if TYPE_CHECKING:
    from lightning_emig.layout import HybridLayout

#: Smallest vocabulary: the corpus is byte level.
BYTE_VOCAB_SIZE = 256


@dataclass(kw_only=True, frozen=True, slots=True)
class LlamaConfig:
    """Shape of a :class:`Llama` model."""

    dim: int
    """Width of the residual stream."""
    n_layers: int
    """Number of decoder blocks."""
    n_heads: int
    """Query heads; ``dim // n_heads`` is the head dimension."""
    n_kv_heads: int
    """Key/value heads (grouped-query attention); must divide ``n_heads``."""
    ffn_hidden: int
    """Hidden width of the SwiGLU feed-forward network."""
    vocab_size: int = BYTE_VOCAB_SIZE
    """Vocabulary size; at least 256 because the corpus is byte level."""
    max_seq_len: int
    """Longest sequence the RoPE tables cover."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""

    def validate_layout(self, layout: HybridLayout) -> None:
        """Raise :class:`~lightning_emig.layout.LayoutError` for a layout a model of this shape cannot be split by."""
        layout.validate_for_model(n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, ffn_hidden=self.ffn_hidden,
                                  n_layers=self.n_layers)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"LlamaConfig.{f.name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(
                f"head dimension dim/n_heads = {self.head_dim} must be even for rotary embeddings"
            )
        if self.vocab_size < BYTE_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size ({self.vocab_size}) must be >= {BYTE_VOCAB_SIZE}: the corpus is byte level"
            )
        if not (self.norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(
                f"norm_eps and rope_theta must be positive, got {self.norm_eps}, {self.rope_theta}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count computed from the shape alone (equals ``Llama(config).num_params()``)."""
        attention = 2 * self.dim * self.dim + 2 * self.dim * self.n_kv_heads * self.head_dim
        block = attention + 3 * self.dim * self.ffn_hidden + 2 * self.dim
        return self.n_layers * block + 2 * self.vocab_size * self.dim + self.dim


# Every TP-splittable width (heads, kv heads, FFN) is divisible by 4 (tiny runs tp=4 in a world of 4), and by 8
# from llama_350m up.
MODEL_SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=176, max_seq_len=256),
    # tiny with 4 blocks: enough for 2 pipeline processes of 2 stages each (pp=2, pp_virtual=2)
    "tiny_deep": LlamaConfig(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=176, max_seq_len=256),
    "llama_25m": LlamaConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536, max_seq_len=512),
    "llama_125m": LlamaConfig(
        dim=768, n_layers=16, n_heads=12, n_kv_heads=4, ffn_hidden=2688, max_seq_len=2048
    ),
    "llama_350m": LlamaConfig(
        dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_hidden=3712, max_seq_len=2048
    ),
    "llama_1b": LlamaConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192, max_seq_len=2048
    ),
}


def get_model_config(name: str) -> LlamaConfig:
    """The config registered under ``name`` in :data:`MODEL_SIZES`."""
    try:
        return MODEL_SIZES[name]
    except KeyError:
        raise ValueError(f"unknown model size {name!r}; valid names: {', '.join(MODEL_SIZES)}") from None


def rotary_tables(
    config: LlamaConfig, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``[max_seq_len, head_dim // 2]`` in float32."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(config.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` upcast to float32 for precision-sensitive math (bf16 -> float32); a float64 model stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[B, T, heads, head_dim]`` by the first ``T`` rows of the tables (rotate-half)."""
    first, second = at_least_float32(x).chunk(2, dim=-1)
    seq = x.shape[1]
    cos, sin = cos[None, :seq, None, :], sin[None, :seq, None, :]
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        kv_width = config.n_kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_width, bias=False)
        self.wv = nn.Linear(config.dim, kv_width, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under TP each rank holds n_heads/tp query and n_kv_heads/tp kv heads, same ratio.
        q = apply_rotary(self.wq(x).view(batch, seq, -1, self.head_dim), cos, sin)
        k = apply_rotary(self.wk(x).view(batch, seq, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm decoder block."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)
        self.recompute_in_backward = False
        """Activation checkpointing (``torch.utils.checkpoint``): keep the block's input, recompute the rest."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute_in_backward and torch.is_grad_enabled():
            # Inside the block's FSDP2 unit (its hooks gather the parameters around this call and again before
            # backward): only ``x`` is kept for backward, the rest is recomputed there.
            return torch.utils.checkpoint.checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only transformer: embedding, blocks, final RMSNorm, untied output projection.

    Build it under ``torch.device("meta")`` for large sizes, then parallelize and call
    :func:`lightning_emig.parallelize.materialize_and_init`.
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig, *, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        for block in self.layers.values():
            block.recompute_in_backward = activation_checkpointing
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config)
        # Non-persistent: derived from the config, so never saved, loaded or migrated.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}")
        # A pipeline stage without the embedding receives the previous stage's hidden states (under sequence
        # parallelism, its slice of the sequence: attention takes the tables' rows for the whole one); one without
        # the head returns its own (see keep_stage).
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin)
        if self.output is None:
            return h
        return self.output(self.norm(h))

    # ------------------------------------------------------------ parallelism hooks
    def validate_layout(self, layout: HybridLayout) -> None:
        """Raise :class:`~lightning_emig.layout.LayoutError` for a layout this model cannot be split by."""
        self.config.validate_layout(layout)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    def first_stage_modules(self) -> list[nn.Module]:
        """What a pipeline's first stage holds besides its blocks (``keep_stage`` keeps it there)."""
        return [self.tok_embeddings]

    def keep_stage(self, blocks: range, *, first: bool, last: bool) -> None:
        """Keep only ``blocks`` (and the embedding if ``first``, the norm and head if ``last``), under their names."""
        for name in list(self.layers):
            if int(name) not in blocks:
                del self.layers[name]
        if not first:
            self.tok_embeddings = None  # type: ignore[assignment]
        if not last:
            self.norm = None  # type: ignore[assignment]
            self.output = None  # type: ignore[assignment]

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        """Megatron-style TP with sequence parallelism (torchtitan's Llama plan).

        Between blocks activations are sharded on the sequence dim (``Shard(1)``), so norms run on a slice of
        the sequence and their weights are ``Replicate`` DTensors on the TP axis. Attention and FFN gather the
        sequence, split heads / FFN width column-wise, and reduce-scatter back after the row-wise projection.
        Sequence lengths must therefore be divisible by the TP degree.
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        root = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        block = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        return TensorParallelPlan(root=root, block=block, sequence_dim=1)

    def init_full_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full value of parameter ``name`` in place.

        Norm gains start at one; every other weight is N(0, 0.02), with the projections that write into the
        residual stream (``wo``, ``w2``) scaled by ``1/sqrt(2 n_layers)`` so the residual variance does not grow
        with depth.
        """
        if name.endswith("norm.weight"):
            full.fill_(1.0)
            return
        std = 0.02
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            std /= math.sqrt(2 * self.config.n_layers)
        full.normal_(0.0, std, generator=generator)

    def init_buffers(self) -> None:
        """Recompute the RoPE tables in place (after ``to_empty`` they hold garbage)."""
        cos, sin = rotary_tables(self.config, device=self.rope_cos.device)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def num_params(self) -> int:
        """Number of parameters of the full model (DTensors count their global size)."""
        return sum(p.numel() for p in self.parameters())


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of ``logits [B, T, V]`` against ``targets [B, T]`` (already shifted by one)."""
    return F.cross_entropy(at_least_float32(logits.reshape(-1, logits.shape[-1])), targets.reshape(-1))
