"""Structured configuration of a training run (the schema behind ``conf/`` and ``recipes/``).

Every section is a dataclass registered with Hydra's ConfigStore as the base of the primary config, so an
unknown key anywhere (``layout.tpp=2``) is an error, never silently dropped. Values are validated where they
are used (``HybridLayout``, ``BatchPlan``, ``OptimConfig``), each with a message that says what to change.

This module keeps ``typing.Optional`` (not ``X | None``) because OmegaConf reads these annotations at run time.
"""

import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional  # noqa: UP035

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from lightning_emig.training.optim import OptimConfig


@dataclass(kw_only=True)
class ModelSection:
    size: str = "tiny"
    """A name from ``lightning_emig.models.llama.MODEL_SIZES``."""
    dtype: str = "float32"
    """Parameter and optimizer-state dtype: ``float32``, or ``float64`` for long equivalence runs on CPU (data-parallel
    ranks sum gradients in another order than one process; in float64 that drift stays near 1e-12, in float32 it
    grows past 1e-4 within a few hundred steps)."""
    compute_dtype: Optional[str] = None  # noqa: UP045
    """Null: compute in ``dtype``. ``bfloat16``: FSDP2 mixed precision (``MixedPrecisionPolicy``): forward and
    backward in bf16, parameters, gradient reduction and optimizer state in ``dtype`` (the master weights; what
    checkpoints and migrations move)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block in backward (``torch.utils.checkpoint``): activations of one block at a time."""


@dataclass(kw_only=True)
class LayoutSection:
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    pp_virtual: int = 1
    """Pipeline stages on each ``pp`` process (needs ``trainer.pipeline_schedule=interleaved_1f1b`` when > 1)."""
    rank_order: Optional[str] = None  # noqa: UP045
    """Rank numbering, slowest mesh axis first, e.g. ``"dp_replicate>pp>dp_shard>tp"``; None: the default
    (``pp>dp_replicate>dp_shard>tp``), and a live change's choice (see ``lightning_emig.migration.rank_order``)."""


@dataclass(kw_only=True)
class ScheduledLayout:
    step: int
    """Switch after this many optimizer steps have completed."""
    layout: LayoutSection = field(default_factory=LayoutSection)


@dataclass(kw_only=True)
class PickerSection:
    """``elastic.picker``: let the layout picker choose each world's layout (see :mod:`lightning_emig.picker`).

    Off by default: each world then gets the requested ``layout`` where it divides the world, else pure FSDP.
    Training keeps ``trainer.micro_batch_size`` and uses every device (the picker's idle devices and micro batch
    search are for ``python -m lightning_emig.pick``); the precision and activation checkpointing it counts are the
    ones the model trains with (``model.compute_dtype``, ``model.activation_checkpointing``)."""

    enabled: bool = False
    dp_replicate: Optional[List[int]] = None  # noqa: UP006, UP045
    """Allowed HSDP replica degrees (null: any)."""
    dp_shard: Optional[List[int]] = None  # noqa: UP006, UP045
    tp: Optional[List[int]] = None  # noqa: UP006, UP045
    """Allowed tensor-parallel degrees (null: any the model's heads and FFN divide)."""
    pp: Optional[List[int]] = None  # noqa: UP006, UP045
    tp_within_node: bool = True
    """Keep every tensor-parallel group inside one node."""
    devices_per_node: Optional[int] = None  # noqa: UP045
    """Null: the processes per node of this job (``trainer.devices``, or torchrun's ``LOCAL_WORLD_SIZE``)."""
    device_memory_gb: Optional[float] = None  # noqa: UP045
    """Memory of one device; null: unbounded (CPU runs)."""
    usable_memory_fraction: float = 0.9
    allow_pp: bool = False
    tie_tolerance: float = 0.02
    """Estimated step times within this fraction are a near-tie, won by the fewest bytes to migrate."""
    table: Dict[str, Dict[str, int]] = field(default_factory=dict)  # noqa: UP006
    """Pinned layouts by world size, overriding the search: ``{"3": {dp_shard: 3}}``."""
    profile: Optional[str] = None  # noqa: UP045
    """A hardware profile JSON (``lightning_emig.picker.save_profile``); null: the run directory's
    ``hardware_profile.json`` when ``lightning_emig.picker.calibrate`` saved one there, else the H100 defaults."""


@dataclass(kw_only=True)
class ElasticSection:
    schedule: List[ScheduledLayout] = field(default_factory=list)  # noqa: UP006
    """Live layout changes at fixed steps, e.g. ``[{step: 50, layout: {tp: 2}}]``."""
    prepare_ahead_steps: int = 1
    """Build a scheduled layout (mesh, model, plan) in the background this many steps before it takes effect, while
    the old layout trains (0: build it in the pause)."""
    bucket_mb: int = 256
    """Memory budget of a migration's transfer buffers per process."""
    checksum: bool = False
    """CRC32 every migrated bucket and fail loudly on a mismatch."""
    heartbeat_interval_s: float = 1.0
    """Under lightning-emig-run every worker writes a heartbeat into the control store this often."""
    heartbeat_timeout_s: float = 10.0
    """A worker whose heartbeat is older than this, after a collective failed, is taken for dead."""
    watch_exits: bool = True
    """Each worker keeps a TCP connection open to another and reads its heartbeat; when the process behind it exits
    (its node killed whole, agent and all) it is taken for dead at once, when its host stops answering on that
    connection after ``unreachable_timeout_s``, and when its heartbeat stops (a frozen process) after
    ``heartbeat_timeout_s`` — before any collective fails, whose waits on it are then ended."""
    unreachable_timeout_s: float = 2.0
    """A watched peer's host that acknowledges nothing on the exit watch's connection for this long (TCP keepalive)
    has vanished (power, kernel, network): its worker is taken for dead."""
    failure_timeout_s: float = 120.0
    """After a collective failed: how long survivors wait to learn who is alive before giving up (exit)."""
    below_min_timeout_s: float = 300.0
    """With fewer nodes than ``--nnodes`` MIN, how long survivors wait (state in memory) for joiners before they
    carry on with the nodes they have."""
    picker: PickerSection = field(default_factory=PickerSection)


@dataclass(kw_only=True)
class DataSection:
    source: str = "stdlib"
    """``stdlib`` (byte-level Python standard library sources, offline) or ``synthetic``."""
    seq_len: int = 128
    max_bytes: Optional[int] = 8_000_000  # noqa: UP045
    """Cap on the corpus size (None = the whole standard library)."""
    synthetic_samples: int = 4096
    seed: int = 0
    """Seed of the per-epoch permutation."""
    cache_dir: Optional[str] = None  # noqa: UP045
    ledger: bool = False
    """Write the sample ids every rank consumes at every step to ``<run_dir>/ledger/`` (exactly-once checks)."""


@dataclass(kw_only=True)
class TrainerSection:
    accelerator: str = "cpu"
    devices: Optional[int] = None  # noqa: UP045
    """Processes per node; None = torchrun's LOCAL_WORLD_SIZE when launched by torchrun, else 1."""
    num_nodes: Optional[int] = None  # noqa: UP045
    """None = derived from torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE, else 1."""
    max_steps: int = 50
    global_batch_size: int = 16
    micro_batch_size: int = 4
    checkpoint_every_n_steps: int = 0
    """Save a sharded DCP checkpoint every N optimizer steps (0 = only at the end)."""
    checkpoint_async: bool = True
    """Periodic checkpoints are written in the background (training goes on while they are written)."""
    precision: str = "32-true"
    seed: int = 0
    pg_timeout_s: int = 600
    """Timeout of every collective; gloo cannot abort, so a dead peer must surface as a timeout."""
    progress_bar: bool = True
    pipeline_schedule: str = "gpipe"
    """Under ``layout.pp > 1``: ``gpipe``, ``1f1b`` (needs at least ``pp`` micro-batches per step) or
    ``interleaved_1f1b`` (for ``layout.pp_virtual > 1``; micro-batches per step fewer than ``pp`` or a multiple)."""
    defer_grad_sync: str = "replicas"
    """Gradient reductions that wait for a step's last micro-batch: ``replicas`` (the all-reduce across HSDP
    replicas; no extra memory), ``all`` (the reduce-scatter too; unsharded gradients held meanwhile) or ``none``."""
    gradient_clip_val: Optional[float] = None  # noqa: UP045
    """Clip gradients to this global L2 norm (over every stage under pp); None: no clipping."""


@dataclass(kw_only=True)
class LoggerSection:
    kind: str = "csv"
    """``csv`` or ``wandb`` (rank 0 only; offline unless ``wandb_mode=online``)."""
    wandb_project: str = "lightning-emig"
    wandb_mode: str = "offline"


@dataclass(kw_only=True)
class RunSection:
    resume: Optional[str] = None  # noqa: UP045
    """``last`` (the newest checkpoint in the run directory) or a checkpoint path."""


@dataclass(kw_only=True)
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    layout: LayoutSection = field(default_factory=LayoutSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    logger: LoggerSection = field(default_factory=LoggerSection)
    run: RunSection = field(default_factory=RunSection)
    elastic: ElasticSection = field(default_factory=ElasticSection)


def run_id() -> str:
    """A run name every rank agrees on without communicating.

    torchrun gives all workers the same ``TORCHELASTIC_RUN_ID``; Lightning's own launcher passes the parent's
    Hydra output dir to its children. Otherwise (one process) a timestamp is unique enough. Each rank calling
    ``now`` separately would give every rank its own directory: the Hydra + multi-process pitfall.
    """
    explicit = os.environ.get("LIGHTNING_EMIG_RUN_ID")
    if explicit:
        return explicit
    torchrun_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if torchrun_id:
        return f"torchrun-{torchrun_id}"
    return time.strftime("%Y%m%d-%H%M%S")


def register_configs() -> None:
    """Register the schema and the run-id resolver (idempotent)."""
    if not OmegaConf.has_resolver("emig_run_id"):
        OmegaConf.register_new_resolver("emig_run_id", run_id, use_cache=True)
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def to_container(cfg: Any) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
