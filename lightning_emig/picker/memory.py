"""Peak memory of one device under a layout: what the picker checks against ``device_memory_gb``.

Pure arithmetic on the model's shape. Invariants (the tests hold them):

* the persistent state is sharded exactly as training shards it: TP splits the linear weights, embedding and output
  (norms are replicated over TP), FSDP2 shards everything over ``dp_shard``, HSDP replicates over ``dp_replicate``;
* it is 16 bytes per local parameter element under both precisions: fp32 parameter (the master weight under bf16),
  fp32 gradient, and AdamW's two fp32 moments (``exp_avg``, ``exp_avg_sq``);
* monotone where it matters to the search: with FSDP2 on (``dp > 1``) a larger ``dp_shard`` or ``tp`` never increases
  the estimate, a larger micro batch never decreases it, activation checkpointing never increases it on a stage of two or more blocks;
* under ``pp > 1``: the largest stage's state (the project's one split rule), the activations of the micro-batches
  the schedule keeps in flight (every one under GPipe, ``pp`` under 1F1B), and the stage's receive buffers: torch's
  schedules keep one activation and one gradient buffer per micro-batch of the step (sequence-sharded under TP).

What is not counted (covered by ``usable_memory_fraction``): CUDA context, NCCL buffers, allocator fragmentation,
SDPA's per-head logsumexp, transient gradients of activations during backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_emig.layout import deferred_grad_sync
from lightning_emig.picker.shapes import ParamCounts, param_counts

if TYPE_CHECKING:
    from lightning_emig.layout import HybridLayout
    from lightning_emig.models.llama import LlamaConfig

FP32 = 4
#: Bytes of a compute-dtype element.
COMPUTE_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes per device at the peak of a training step, by component."""

    parameters: int
    """fp32 parameters held by this device (its FSDP shard of its TP shard): the master weights under bf16."""
    gradients: int
    """fp32 sharded gradients (FSDP2 reduce-scatters in fp32); unsharded while reductions wait for a step's end."""
    optimizer: int
    """AdamW ``exp_avg`` and ``exp_avg_sq``, fp32, sharded like the parameters."""
    unsharded: int
    """FSDP2 all-gather buffers (compute dtype) of the block in use and the prefetched one, one block's unsharded
    gradient, the root unit kept unsharded after forward; without FSDP2 under bf16, a bf16 copy of the weights."""
    activations: int
    """Tensors saved for backward by the blocks, for the micro-batches in flight."""
    logits: int
    """Output logits, their fp32 upcast for the loss and the saved log-softmax."""
    pipeline_buffers: int = 0
    """A stage's receive buffers for activations and their gradients, one pair per micro-batch of the step."""

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.unsharded + self.activations
                + self.logits + self.pipeline_buffers)


def estimate_memory(
    model: LlamaConfig,
    layout: HybridLayout,
    *,
    seq_len: int,
    micro_batch_size: int,
    mixed_precision: str = "bf16",
    activation_checkpointing: bool = False,
    grad_accumulation: int = 1,
    pipeline_schedule: str = "gpipe",
    defer_grad_sync: str = "replicas",
) -> MemoryEstimate:
    """Peak bytes on the busiest device of ``layout`` (a resolved one).

    With ``defer_grad_sync="all"`` and more than one micro-batch a step (or ``pp > 1``, whose schedule defers every
    reduction), FSDP2 keeps each unit's unsharded gradient in fp32 until the step's last micro-batch: the local
    (TP-sharded) model's gradient, not its ``dp_shard`` share.

    ``grad_accumulation`` and ``pipeline_schedule`` matter with ``pp > 1`` only: the first stage keeps the
    activations of every micro-batch whose backward has not run, all ``accumulation`` of them under GPipe,
    ``min(pp, accumulation)`` under 1F1B, and under interleaved 1F1B that times ``1 + (pp - 1) / (pp x pp_virtual)``
    (its longer warm-up, as Megatron-LM's interleaved schedule measures it). (Bounded by the largest stage's state
    plus the first stage's activations, as if one stage had both; with ``pp_virtual > 1`` a process's share is
    taken as the largest of ``pp`` stages'.)
    """
    counts = param_counts(model)
    local = counts.stage_local(layout.tp, layout.pp)
    sharded = -(-local // layout.dp_shard)
    in_flight = 1.0
    if layout.pp > 1:
        in_flight = grad_accumulation if pipeline_schedule == "gpipe" else min(layout.pp, grad_accumulation)
        if pipeline_schedule == "interleaved_1f1b":
            in_flight *= 1 + (layout.pp - 1) / (layout.pp * layout.pp_virtual)
    per_micro = _activations(model, counts, layout, seq_len, micro_batch_size, mixed_precision,
                             activation_checkpointing)
    fsdp = layout.dp_replicate * layout.dp_shard > 1
    held = fsdp and grad_accumulation > 1 and deferred_grad_sync(layout, defer_grad_sync) == "all"
    return MemoryEstimate(
        parameters=FP32 * sharded,
        gradients=FP32 * (local if held else sharded),
        optimizer=2 * FP32 * sharded,
        unsharded=_unsharded_buffers(counts, layout, mixed_precision),
        activations=round(in_flight * per_micro),
        logits=micro_batch_size * seq_len * model.vocab_size * (COMPUTE_BYTES[mixed_precision] + 2 * FP32),
        pipeline_buffers=_pipeline_buffers(model, layout, seq_len, micro_batch_size, mixed_precision,
                                           grad_accumulation),
    )


def _pipeline_buffers(model: LlamaConfig, layout: HybridLayout, seq_len: int, micro: int, mixed_precision: str,
                      micro_batches: int) -> int:
    if layout.pp == 1:
        return 0
    activation = micro * -(-seq_len // layout.tp) * model.dim * COMPUTE_BYTES[mixed_precision]
    return 2 * micro_batches * activation


def _unsharded_buffers(counts: ParamCounts, layout: HybridLayout, mixed_precision: str) -> int:
    compute = COMPUTE_BYTES[mixed_precision]
    if layout.dp_replicate * layout.dp_shard == 1:
        # No FSDP2 (parallelize applies it only when dp > 1): parameters are used in place. Assumption: bf16
        # compute then needs a bf16 copy of the local weights (an autocast-style cast of every weight).
        return compute * counts.stage_local(layout.tp, layout.pp) if compute != FP32 else 0
    block = counts.block_local(layout.tp)
    gathered = 2 * block * compute  # the block computing and the one FSDP2 prefetches
    # One block's unsharded gradient in the compute dtype, plus its fp32 copy for the reduce-scatter under bf16.
    grad = block * (compute + (FP32 if compute != FP32 else 0))
    root = counts.root_local(layout.tp) * compute  # the root unit is not resharded after forward
    return gathered + grad + root


def _activations(model: LlamaConfig, counts: ParamCounts, layout: HybridLayout, seq_len: int, micro: int,
                 mixed_precision: str, checkpointing: bool) -> int:
    """Saved activations of one micro-batch on the largest stage."""
    layers = counts.stage_blocks(layout.pp)
    per_layer = micro * seq_len * block_activation_bytes_per_token(model, layout.tp, mixed_precision)
    if not checkpointing:
        return layers * per_layer
    # torch.utils.checkpoint per block keeps only each block's input (sequence-sharded under TP's sequence
    # parallelism), and recomputes one block at a time in backward, whose activations are then alive.
    block_input = micro * seq_len * -(-model.dim // layout.tp) * COMPUTE_BYTES[mixed_precision]
    return layers * block_input + per_layer


def block_activation_bytes_per_token(model: LlamaConfig, tp: int, mixed_precision: str) -> int:
    """Bytes one decoder block saves for backward per token, on one TP rank.

    Adapted from Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022), whose
    GPT block saves ``s*b*h*(34 + 5*a*s/h)`` bytes at 16 bits, divided by ``t`` with tensor + sequence parallelism.
    For our Llama block, counted tensor by tensor (``e`` = bytes of a compute-dtype element):

    * RMSNorm inputs (2 norms, ``h`` each) - sequence-sharded under TP: ``2h/t``;
    * the normed inputs the q/k/v and w1/w3 projections save (``h`` each) - all-gathered over the sequence, i.e.
      full on every TP rank (DTensor's autograd keeps the gathered input; Megatron re-gathers it instead): ``2h``;
    * q and the k, v heads, the attention output and its reshaped copy wo reads: ``(3h + 2kv)/t``;
    * SwiGLU: w1 x, w3 x, silu(w1 x) and the product w2 reads: ``4f/t``;
    * no ``a*s`` term: SDPA's fused kernels keep no attention matrix (only a per-head logsumexp, not counted);
    * RoPE: ``apply_rotary`` upcasts q and k to fp32 and saves the halves: ``4 bytes * (h + kv)/t``.
    """
    e = COMPUTE_BYTES[mixed_precision]
    h, kv, f = model.dim, model.n_kv_heads * model.head_dim, model.ffn_hidden
    split = -(-(2 * h + 3 * h + 2 * kv + 4 * f) // tp)
    rope = FP32 * -(-(h + kv) // tp)
    return e * (split + 2 * h) + rope
