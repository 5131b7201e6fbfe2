"""Turn a :class:`TrainConfig` into the Lightning objects of a run: data, module, strategy, loggers, Trainer.

Kept apart from the Hydra entry point so tests and benchmarks build exactly what ``train.py`` builds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger

from lightning_emig.change.events import stable_run_id
from lightning_emig.change.progress import StepProgressBar
from lightning_emig.config import TrainConfig
from lightning_emig.data.corpus import ensure_stdlib_corpus
from lightning_emig.data.datasets import ByteCorpusDataset, SyntheticDataset
from lightning_emig.data.loader import MicroBatchLoader
from lightning_emig.data.sampler import GlobalOffsetSampler
from lightning_emig.data.stream import MicroBatchStream
from lightning_emig.layout import HybridLayout
from lightning_emig.membership.settings import FailureSettings
from lightning_emig.models.llama import get_model_config
from lightning_emig.picker.calibrate import PROFILE_FILE
from lightning_emig.picker.policy import LayoutPicker
from lightning_emig.strategy import ElasticMigrationStrategy
from lightning_emig.strategy.rendezvous import HandoffAwareCheckpoint
from lightning_emig.strategy.resume import resolve_checkpoint
from lightning_emig.strategy.schedule import LayoutSchedule
from lightning_emig.training.csv_log import ContinuedCSVLogger
from lightning_emig.training.module import LlamaLightningModule
from lightning_emig.training.optim import OptimConfig


@dataclass(slots=True)
class RunParts:
    trainer: pl.Trainer
    module: LlamaLightningModule
    loader: MicroBatchLoader
    strategy: ElasticMigrationStrategy
    run_dir: Path


def build_dataset(cfg: TrainConfig) -> Any:
    data = cfg.data
    if data.source == "stdlib":
        path = ensure_stdlib_corpus(cache_dir=data.cache_dir, max_bytes=data.max_bytes)
        return ByteCorpusDataset(path, data.seq_len)
    if data.source == "synthetic":
        return SyntheticDataset(data.synthetic_samples, data.seq_len, seed=data.seed)
    raise ValueError(f"data.source must be 'stdlib' or 'synthetic', got {data.source!r}")


def build_loader(cfg: TrainConfig) -> MicroBatchLoader:
    dataset = build_dataset(cfg)
    sampler = GlobalOffsetSampler(len(dataset), cfg.trainer.global_batch_size, seed=cfg.data.seed)
    return MicroBatchLoader(MicroBatchStream(dataset, sampler, cfg.trainer.micro_batch_size))


def build_strategy(cfg: TrainConfig, run_dir: Path | None = None) -> ElasticMigrationStrategy:
    return ElasticMigrationStrategy(
        layout=HybridLayout(**_section_dict(cfg.layout)),
        global_batch_size=cfg.trainer.global_batch_size,
        micro_batch_size=cfg.trainer.micro_batch_size,
        timeout=timedelta(seconds=cfg.trainer.pg_timeout_s),
        seed=cfg.trainer.seed,
        bucket_bytes=cfg.elastic.bucket_mb << 20,
        checksum=cfg.elastic.checksum,
        failure=failure_settings(cfg),
        async_checkpoints=cfg.trainer.checkpoint_async,
        picker=layout_picker(cfg, run_dir),
        pipeline_schedule=cfg.trainer.pipeline_schedule,
        defer_grad_sync=cfg.trainer.defer_grad_sync,  # type: ignore[arg-type]  # checked by the strategy
    )


def layout_picker(cfg: TrainConfig, run_dir: Path | None = None) -> LayoutPicker | None:
    """The ``elastic.picker`` section as a picker (None when not enabled); a setting that cannot work raises here.
    Without a ``profile``, a hardware profile saved in the run directory (``lightning_emig.picker.calibrate``)
    calibrates it."""
    section = _section_dict(cfg.elastic.picker)
    if section.get("profile") is None and run_dir is not None and (run_dir / PROFILE_FILE).exists():
        section["profile"] = str(run_dir / PROFILE_FILE)
    bf16 = cfg.model.compute_dtype == "bfloat16" or str(cfg.trainer.precision).startswith("bf16")
    return LayoutPicker.from_section(
        section, model=get_model_config(cfg.model.size), seq_len=cfg.data.seq_len,
        mixed_precision="bf16" if bf16 else "fp32", activation_checkpointing=cfg.model.activation_checkpointing,
        local_world_size=_process_topology(cfg)[0], pipeline_schedule=cfg.trainer.pipeline_schedule,
        defer_grad_sync=cfg.trainer.defer_grad_sync,
    )


def failure_settings(cfg: TrainConfig) -> FailureSettings:
    elastic = cfg.elastic
    return FailureSettings(
        heartbeat_interval_s=elastic.heartbeat_interval_s, heartbeat_timeout_s=elastic.heartbeat_timeout_s,
        failure_timeout_s=elastic.failure_timeout_s, below_min_timeout_s=elastic.below_min_timeout_s,
        watch_exits=elastic.watch_exits, unreachable_timeout_s=elastic.unreachable_timeout_s,
    )


def build_schedule(cfg: TrainConfig) -> LayoutSchedule | None:
    if not cfg.elastic.schedule:
        return None
    return LayoutSchedule([(item.step, HybridLayout(**_section_dict(item.layout))) for item in cfg.elastic.schedule],
                          prepare_ahead_steps=cfg.elastic.prepare_ahead_steps)


def build_loggers(cfg: TrainConfig, run_dir: Path) -> list[Logger]:
    # One metrics.csv for the whole job: each generation (a new Trainer) appends to it.
    loggers: list[Logger] = [ContinuedCSVLogger(save_dir=str(run_dir), name="csv", version="")]
    if cfg.logger.kind == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(
            WandbLogger(
                project=cfg.logger.wandb_project,
                save_dir=str(run_dir),
                offline=cfg.logger.wandb_mode == "offline",
                # One id for the whole job: restarts and generations append to the same run.
                id=stable_run_id(run_dir),
                resume="allow",
            )
        )
    elif cfg.logger.kind != "csv":
        raise ValueError(f"logger.kind must be 'csv' or 'wandb', got {cfg.logger.kind!r}")
    return loggers


def build_run(cfg: TrainConfig, run_dir: Path) -> RunParts:
    """The Lightning objects of a run: one ``trainer.fit(module, loader)`` trains it (through every membership
    change under ``lightning-emig-run``)."""
    _check_sequence_fits_model(cfg)
    devices, num_nodes = _process_topology(cfg)
    strategy = build_strategy(cfg, run_dir)
    module = LlamaLightningModule(
        model_size=cfg.model.size,
        optim=OptimConfig(**_section_dict(cfg.optim)),
        max_steps=cfg.trainer.max_steps,
        seed=cfg.trainer.seed,
        dtype=cfg.model.dtype,
        compute_dtype=cfg.model.compute_dtype,
        activation_checkpointing=cfg.model.activation_checkpointing,
    )
    every = cfg.trainer.checkpoint_every_n_steps
    checkpoint = HandoffAwareCheckpoint(
        dirpath=str(run_dir / "checkpoints"),
        filename="step{step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=every if every > 0 else None,
        save_top_k=-1,
        save_last="link",  # last.ckpt links the newest step checkpoint instead of writing the same state twice
    )
    trainer = pl.Trainer(
        accelerator=cfg.trainer.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=cfg.trainer.precision,  # type: ignore[arg-type]
        max_steps=cfg.trainer.max_steps,
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        logger=build_loggers(cfg, run_dir),
        callbacks=_callbacks(cfg, checkpoint, run_dir),
        enable_progress_bar=cfg.trainer.progress_bar,
        log_every_n_steps=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=str(run_dir),
    )
    return RunParts(trainer, module, build_loader(cfg), strategy, run_dir)


def _callbacks(cfg: TrainConfig, checkpoint: HandoffAwareCheckpoint, run_dir: Path) -> list[Any]:
    callbacks: list[Any] = [checkpoint]  # the strategy adds the step times of run_dir (its default_root_dir)
    if cfg.trainer.progress_bar:
        callbacks.append(StepProgressBar())
    schedule = build_schedule(cfg)
    if schedule is not None:
        callbacks.append(schedule)
    if cfg.data.ledger:
        from lightning_emig.training.ledger import DataLedger

        callbacks.append(DataLedger(run_dir))
    return callbacks


def resolve_resume(cfg: TrainConfig, run_dir: Path) -> str | None:
    """``run.resume``: None, ``last`` (newest complete checkpoint of this run directory, if any) or a path.

    After torchrun restarted the workers (the restart path) None means ``last``: see
    :func:`lightning_emig.strategy.resume.resolve_checkpoint`.
    """
    return resolve_checkpoint(cfg.run.resume, run_dir)


def _check_sequence_fits_model(cfg: TrainConfig) -> None:
    from lightning_emig.models.llama import get_model_config

    max_len = get_model_config(cfg.model.size).max_seq_len
    if cfg.data.seq_len > max_len:
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} exceeds model {cfg.model.size!r}'s max_seq_len={max_len}; "
            f"lower data.seq_len"
        )


def _process_topology(cfg: TrainConfig) -> tuple[int, int]:
    """Processes per node and nodes: from torchrun's environment when it launched us, else from the config."""
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    world = os.environ.get("WORLD_SIZE")
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ and local_world and world
    devices = cfg.trainer.devices or (int(local_world) if under_torchrun else 1)
    num_nodes = cfg.trainer.num_nodes or (int(world) // int(local_world) if under_torchrun else 1)
    return devices, num_nodes


def _section_dict(section: Any) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(section, DictConfig):
        return OmegaConf.to_container(section, resolve=True)  # type: ignore[return-value]
    from dataclasses import asdict

    return asdict(section)
