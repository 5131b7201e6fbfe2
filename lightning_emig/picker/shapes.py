"""The model's parameters as plain shapes: what the memory, throughput and migration models count.

Pure: no tensors, no process group. Invariants (pinned by the tests against ``Llama(config)`` on the meta device):

* :func:`param_tensors` lists every parameter of :class:`~lightning_emig.models.llama.Llama` with its name and
  global shape, and sums to ``LlamaConfig.num_params()``;
* ``tp_dim`` is the dim the model's tensor-parallel plan shards (0 for column-wise linears and the vocab-sharded
  embedding and output, 1 for the row-wise ``wo``/``w2``), ``None`` for the norms, which TP replicates;
* :class:`ParamCounts` splits elements into block/root and TP-sharded/TP-replicated, the two splits every
  per-device estimate needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from lightning_emig.migration.stages import split_stages

if TYPE_CHECKING:
    from lightning_emig.models.llama import LlamaConfig


@dataclass(frozen=True, slots=True)
class ParamTensor:
    """One parameter by name, global shape and the dim tensor parallelism shards."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    """Dim split by TP; ``None``: replicated over the TP axis."""
    block: int | None
    """Decoder block index, ``None`` for the root (embedding, final norm, output)."""
    first_stage: bool = False
    """Outside the blocks and on a pipeline's first stage (the embedding; the rest of the root is on the last)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@lru_cache(maxsize=64)
def param_tensors(model: LlamaConfig) -> tuple[ParamTensor, ...]:
    """Every parameter of the Llama of this shape, in the model's registration order."""
    h, kv, f, v = model.dim, model.n_kv_heads * model.head_dim, model.ffn_hidden, model.vocab_size
    q = model.n_heads * model.head_dim
    out = [ParamTensor("tok_embeddings.weight", (v, h), 0, None, first_stage=True)]
    for i in range(model.n_layers):
        p = f"layers.{i}."
        out += [
            ParamTensor(p + "attention_norm.weight", (h,), None, i),
            ParamTensor(p + "attention.wq.weight", (q, h), 0, i),
            ParamTensor(p + "attention.wk.weight", (kv, h), 0, i),
            ParamTensor(p + "attention.wv.weight", (kv, h), 0, i),
            ParamTensor(p + "attention.wo.weight", (h, q), 1, i),
            ParamTensor(p + "ffn_norm.weight", (h,), None, i),
            ParamTensor(p + "feed_forward.w1.weight", (f, h), 0, i),
            ParamTensor(p + "feed_forward.w2.weight", (h, f), 1, i),
            ParamTensor(p + "feed_forward.w3.weight", (f, h), 0, i),
        ]
    out += [ParamTensor("norm.weight", (h,), None, None), ParamTensor("output.weight", (v, h), 0, None)]
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Parameter elements of one block and of the root, split by whether TP shards them."""

    block_sharded: int
    block_replicated: int
    root_sharded: int
    root_replicated: int
    embedding: int
    """Elements of the embedding table (a lookup, not a matmul: no FLOPs)."""
    n_layers: int

    @property
    def total(self) -> int:
        return self.n_layers * (self.block_sharded + self.block_replicated) + self.root_sharded + self.root_replicated

    def block_local(self, tp: int) -> int:
        """Elements of one block on one TP rank (before FSDP sharding)."""
        return -(-self.block_sharded // tp) + self.block_replicated

    def root_local(self, tp: int) -> int:
        return -(-self.root_sharded // tp) + self.root_replicated

    def stage_local(self, tp: int, pp: int) -> int:
        """Elements one TP rank of the largest pipeline stage holds (the whole model when ``pp == 1``), with the
        stages the project's one split rule makes (the embedding on the first stage, norm and output on the last)."""
        return _stage_local(self, tp, pp)

    def stage_blocks(self, pp: int) -> int:
        """Blocks on the pipeline stage with the most (the slowest stage: blocks are the FLOPs)."""
        return max(len(blocks) for blocks in self.stages(pp))

    def stages(self, pp: int) -> tuple[range, ...]:
        """The blocks of every stage (:func:`~lightning_emig.migration.stages.split_stages`)."""
        return _stages(self, pp)


# Cached: the picker asks for the stages of the same model for every candidate layout (hundreds of thousands of
# times over a large world's candidates).
@lru_cache(maxsize=4096)
def _stages(counts: ParamCounts, pp: int) -> tuple[range, ...]:
    block = counts.block_sharded + counts.block_replicated
    root = counts.root_sharded + counts.root_replicated
    return split_stages([block] * counts.n_layers, pp, first_extra=counts.embedding, last_extra=root - counts.embedding)


@lru_cache(maxsize=4096)
def _stage_local(counts: ParamCounts, tp: int, pp: int) -> int:
    embedding = -(-counts.embedding // tp)
    rest = counts.root_local(tp) - embedding
    ranges = counts.stages(pp)
    return max(len(blocks) * counts.block_local(tp) + (embedding if stage == 0 else 0)
               + (rest if stage == pp - 1 else 0) for stage, blocks in enumerate(ranges))


@lru_cache(maxsize=64)
def param_counts(model: LlamaConfig) -> ParamCounts:
    tensors = param_tensors(model)
    block = [t for t in tensors if t.block == 0]
    root = [t for t in tensors if t.block is None]
    return ParamCounts(
        block_sharded=sum(t.numel for t in block if t.tp_dim is not None),
        block_replicated=sum(t.numel for t in block if t.tp_dim is None),
        root_sharded=sum(t.numel for t in root if t.tp_dim is not None),
        root_replicated=sum(t.numel for t in root if t.tp_dim is None),
        embedding=model.vocab_size * model.dim,
        n_layers=model.n_layers,
    )
