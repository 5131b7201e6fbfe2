"""Step time of a layout: the picker's ranking. A model, not a measurement: its constants are a
:class:`HardwareProfile` that a short profile measured in the run directory can replace (:func:`load_profile`).

Pure arithmetic. Invariants:

* compute is the whole step's FLOPs spread evenly over the devices used: ``flops_per_token * tokens / (devices *
  flops * efficiency)``; idle devices add nothing;
* the global batch fixes the tokens per step, so the layout changes only how they are split and what is
  communicated: one optimizer step = ``grad_accumulation`` micro-batches, each with its own FSDP2 all-gathers;
  the reduce-scatters and HSDP all-reduces run per micro-batch or once per step as training defers them
  (``defer_grad_sync``; under ``pp > 1`` torch's schedule defers both);
* tensor-parallel collectives sit on the critical path (no async TP); FSDP2 / HSDP traffic overlaps a micro-batch's
  compute up to ``comm_overlap``, never hiding the first block's all-gather;
* a group whose ranks all sit in one node uses ``intra_node_bandwidth``, any other ``inter_node_bandwidth``;
* pipeline stages: the slowest stage (most blocks, by the project's one split rule) sets the pace, and a step adds
  ``pp - 1`` of its micro-batch times of fill and drain (GPipe's and 1F1B's bubble alike: they differ in memory),
  divided by ``pp_virtual`` (the interleaved schedule's shorter fill: each of a process's stages is that much
  smaller); the point-to-point traffic between stages is not modelled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_emig.layout import deferred_grad_sync
from lightning_emig.picker.memory import COMPUTE_BYTES, FP32
from lightning_emig.picker.shapes import ParamCounts, param_counts

if TYPE_CHECKING:
    from lightning_emig.layout import HybridLayout
    from lightning_emig.models.llama import LlamaConfig

#: AdamW (foreach) reads parameter, gradient and both moments and writes parameter and moments: 7 fp32 streams.
ADAMW_BYTES_PER_ELEMENT = 7 * FP32


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """Throughput constants of one device and its links. Defaults: an H100 SXM 80 GB node (8 GPUs, NVLink 4,
    one 400 Gb/s NIC per GPU); bandwidths are what one rank moves per second in a ring collective."""

    name: str = "h100-sxm-default"
    """Where the numbers come from (a datasheet default, or the run directory of a measured profile)."""
    flops_bf16: float = 989e12
    """Dense bf16 tensor-core peak FLOP/s (NVIDIA H100 SXM datasheet; 1979e12 is with 2:4 sparsity)."""
    flops_fp32: float = 67e12
    """fp32 peak FLOP/s without TF32 (torch's default matmul precision "highest" does not use TF32)."""
    compute_efficiency: float = 0.45
    """Achieved share of the peak in a dense decoder step (tuned runs report 40-55% MFU)."""
    intra_node_bandwidth: float = 360e9
    """Bytes/s per rank inside a node: NVLink 4 is 450 GB/s each way; NCCL reaches ~80% of it."""
    inter_node_bandwidth: float = 45e9
    """Bytes/s per rank across nodes: one 400 Gb/s (50 GB/s) NIC per GPU at ~90%."""
    collective_latency: float = 20e-6
    """Seconds of fixed cost per collective (launch and small-message latency)."""
    hbm_bandwidth: float = 3.35e12
    """Device memory bytes/s (HBM3), which bounds the optimizer step."""
    comm_overlap: float = 0.9
    """Share of a micro-batch's compute behind which FSDP2 prefetching can hide its communication."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"HardwareProfile.{f.name} must be a positive number, got {value!r}")
        if self.compute_efficiency > 1 or self.comm_overlap > 1:
            raise ValueError("HardwareProfile.compute_efficiency and comm_overlap are fractions in (0, 1]")

    def flops(self, mixed_precision: str) -> float:
        """Achieved FLOP/s of one device in this precision."""
        peak = self.flops_bf16 if mixed_precision == "bf16" else self.flops_fp32
        return peak * self.compute_efficiency

    def bandwidth(self, within_node: bool) -> float:
        return self.intra_node_bandwidth if within_node else self.inter_node_bandwidth


def load_profile(path: str | Path) -> HardwareProfile:
    """Read a profile saved by :func:`save_profile`; a key that is not a field is an error naming the valid ones."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    valid = [f.name for f in fields(HardwareProfile)]
    unknown = sorted(k for k in data if k not in valid)
    if unknown:
        raise ValueError(f"{path}: unknown hardware profile key(s) {unknown}; valid keys: {', '.join(valid)}")
    return HardwareProfile(**data)


def save_profile(profile: HardwareProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(asdict(profile), indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """Seconds of one optimizer step, by component (``total`` is what the picker ranks by)."""

    compute: float
    tensor_parallel: float
    """TP all-gathers and reduce-scatters of activations (exposed)."""
    data_parallel: float
    """FSDP2 all-gathers / reduce-scatters and HSDP all-reduces, on the wire."""
    data_parallel_exposed: float
    """The part of ``data_parallel`` not hidden behind compute."""
    optimizer: float
    pipeline_bubble: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.tensor_parallel + self.data_parallel_exposed + self.optimizer + self.pipeline_bubble


def within_node(span: int, devices_per_node: int) -> bool:
    """Whether every group of ``span`` consecutive ranks (groups tile the ranks from 0) lies in one node."""
    return devices_per_node % span == 0


def flops_per_token(model: LlamaConfig, seq_len: int, checkpointing: bool) -> float:
    """Training FLOPs per token: ``6 N`` for the matmul weights (forward 2N, backward 4N; the embedding is a
    lookup) plus ``12 * layers * seq_len * dim`` for attention scores and values (Kaplan et al. 2020; causal
    kernels skip about half of it, so this is an upper bound). Checkpointing recomputes the forward: x 4/3."""
    counts = param_counts(model)
    dense = 6 * (counts.total - counts.embedding) + 12 * model.n_layers * seq_len * model.dim
    return dense * (4 / 3 if checkpointing else 1)


def estimate_step_time(
    model: LlamaConfig,
    layout: HybridLayout,
    *,
    seq_len: int,
    micro_batch_size: int,
    grad_accumulation: int,
    devices_per_node: int,
    profile: HardwareProfile | None = None,
    mixed_precision: str = "bf16",
    activation_checkpointing: bool = False,
    defer_grad_sync: str = "replicas",
) -> StepEstimate:
    """Seconds per optimizer step of a resolved ``layout`` that runs ``grad_accumulation`` micro-batches per rank."""
    profile = profile or HardwareProfile()
    counts = param_counts(model)
    tokens = micro_batch_size * seq_len
    compute = (flops_per_token(model, seq_len, activation_checkpointing) * tokens
               / (layout.tp * layout.pp * profile.flops(mixed_precision)))
    tp = _tensor_parallel(model, layout, tokens, devices_per_node, profile, mixed_precision, activation_checkpointing)
    traffic = _data_parallel(counts, layout, devices_per_node, profile, mixed_precision)
    deferred = deferred_grad_sync(layout, defer_grad_sync)
    scatters = 1 if deferred == "all" else grad_accumulation
    all_reduces = grad_accumulation if deferred == "none" else 1
    dp = (grad_accumulation * traffic.gather + scatters * traffic.reduce_scatter
          + all_reduces * traffic.all_reduce)
    units = counts.stage_blocks(layout.pp) + 1
    step_compute = grad_accumulation * compute
    exposed = max(dp - profile.comm_overlap * step_compute, dp / units) if dp else 0.0
    local = -(-counts.stage_local(layout.tp, layout.pp) // layout.dp_shard)
    bubble = (layout.pp - 1) * (compute + tp) / layout.pp_virtual  # pp - 1 micro-batch times of fill and drain
    return StepEstimate(
        compute=step_compute,
        tensor_parallel=grad_accumulation * tp,
        data_parallel=dp,
        data_parallel_exposed=exposed,
        optimizer=local * ADAMW_BYTES_PER_ELEMENT / profile.hbm_bandwidth,
        pipeline_bubble=bubble,
    )


def _tensor_parallel(model: LlamaConfig, layout: HybridLayout, tokens: int, devices_per_node: int,
                     profile: HardwareProfile, mixed_precision: str, checkpointing: bool) -> float:
    """Seconds of TP collectives per micro-batch on one rank.

    Sequence parallelism: per block, forward all-gathers the sequence before attention and the FFN and
    reduce-scatters after ``wo`` and ``w2``; backward does the transposes (8 collectives of a ``tokens x dim``
    activation), recomputation 4 more. The root adds the embedding's reduce-scatter and the output's gathers
    (4 of ``tokens x dim``) and the all-gather of the logits over the vocabulary.
    """
    t = layout.tp
    if t == 1:
        return 0.0
    element = COMPUTE_BYTES[mixed_precision]
    per_block = 8 + (4 if checkpointing else 0)
    count = param_counts(model).stage_blocks(layout.pp) * per_block + 4
    volume = count * tokens * model.dim * element + tokens * model.vocab_size * element
    wire = (t - 1) / t * volume / profile.bandwidth(within_node(t, devices_per_node))
    return wire + (count + 1) * profile.collective_latency


@dataclass(frozen=True)
class _DataParallelTraffic:
    """Seconds of each kind of FSDP2 / HSDP collective for one micro-batch on one rank (before overlap)."""

    gather: float = 0.0
    reduce_scatter: float = 0.0
    all_reduce: float = 0.0


def _data_parallel(counts: ParamCounts, layout: HybridLayout, devices_per_node: int, profile: HardwareProfile,
                   mixed_precision: str) -> _DataParallelTraffic:
    """Each block is all-gathered in forward and again in backward (resharded after forward), the root once (kept);
    gradients are reduce-scattered in fp32 over ``dp_shard`` and the resulting shard all-reduced over
    ``dp_replicate``. A ring moves ``(n - 1)/n`` of an all-gather's output per rank, twice that for an all-reduce.
    """
    blocks = counts.stage_blocks(layout.pp)
    block, root = counts.block_local(layout.tp), counts.root_local(layout.tp)
    gather = reduce_scatter = all_reduce = 0.0
    s = layout.dp_shard
    if s > 1:
        bandwidth = profile.bandwidth(within_node(layout.tp * s, devices_per_node))
        gathered = (2 * blocks * block + root) * COMPUTE_BYTES[mixed_precision]
        gather = (s - 1) / s * gathered / bandwidth + 2 * (blocks + 1) * profile.collective_latency
        scattered = (blocks * block + root) * FP32
        reduce_scatter = (s - 1) / s * scattered / bandwidth + (blocks + 1) * profile.collective_latency
    r = layout.dp_replicate
    if r > 1:
        shard = -(-(blocks * block + root) // s) * FP32
        bandwidth = profile.bandwidth(within_node(layout.tp * s * r, devices_per_node))
        all_reduce = 2 * (r - 1) / r * shard / bandwidth + (blocks + 1) * profile.collective_latency
    return _DataParallelTraffic(gather, reduce_scatter, all_reduce)
