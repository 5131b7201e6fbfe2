"""Lightning parity: shapes of real Lightning code behave under ``ElasticMigrationStrategy`` as under Lightning's own
``ModelParallelStrategy``, with and without a live layout change.

One table of user shapes (:data:`SHAPES`), one runner: the same small LightningModule, written the way a user writes
one, is fitted on 2 processes three times (every shape in one launch each):

* ``reference``: Lightning's ``ModelParallelStrategy`` (FSDP2 over both processes, built with torch's own
  ``fully_shard``);
* ``elastic``: ``ElasticMigrationStrategy(layout=dp_shard=2)``;
* ``changed``: the same, with ``LayoutSchedule`` changes to ``tp=2`` after step 4 (data-parallel degree 2 -> 1,
  accumulation 2 -> 4), in the middle of the first epoch, and back to ``dp_shard=2`` after step 8, the first epoch's
  last step (the change falls on the epoch boundary: between the last batch and the epoch's end and validation).

The processes of the runs may start their own (the ``workers`` shape's ``DataLoader`` workers): the harness ends them
with the run.

Each shape is checked against the reference: the loss of every step, the learning rate of every step (epoch-interval
schedulers), epochs completed and epoch-end hooks, validation runs and which validation samples each process read
(every sample once per evaluation; tensor-parallel peers read the same ones), frozen parameters, and the final
parameters. The dataset is read in order (``shuffle=False``): Lightning's ``DistributedSampler`` and the elastic
global-offset sampler then put the same samples in every global batch.
"""

from __future__ import annotations

import random
import re
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, Dataset, get_worker_info

from lightning_emig import HybridLayout
from lightning_emig.parallelize import materialize_and_init, materialize_empty, parallelize_model
from lightning_emig.strategy import ElasticMigrationStrategy, LayoutSchedule
from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.runs import quiet_lightning

pytestmark = [pytest.mark.multiprocess]

SAMPLES, VAL_SAMPLES, GLOBAL_BATCH, MICRO_BATCH = 64, 16, 8, 2
STEPS = 12  # one and a half epochs of 8 steps
EPOCHS = 2  # the max_epochs shape's limit (no max_steps): 16 steps
CHANGES = [(4, HybridLayout(dp_shard=1, tp=2)), (8, HybridLayout(dp_shard=2))]  # mid-epoch, then at the epoch's end
SHAPES = ("plain", "epoch_scheduler", "validation", "frozen_in_hook", "blocks_container", "clip_partial_tp",
          "param_groups", "root_buffer", "init_children", "workers", "tied", "max_epochs")
"""The user shapes: what each row's module does differently from ``plain`` is in :class:`UserModule`, or, for
``workers``, in its training ``DataLoader``: :data:`WORKERS` persistent worker processes seeded by Lightning
(``seed_everything(workers=True)``); ``max_epochs`` stops by ``Trainer(max_epochs=...)`` alone."""
WORKERS = 2
REFUSED = {
    # Lightning's own refusal (several optimizers need manual optimization, which is refused here):
    "two_optimizers": r"^RuntimeError: Training with multiple optimizers is only supported with manual optimization",
    "manual_optimization": r"manual optimization \(automatic_optimization = False\) is not supported",
    "weight_averaging": r"the EMAWeightAveraging callback keeps its own copy of the model",
    "root_parameter": r"trainable parameter\(s\) \['scale'\] are not in the model configure_model builds",
    "model_built_in_init": r"net\.inp\.weight was made a DTensor by configure_model, but net was built before it",
    "unsupported_optimizer": r"Adafactor cannot be migrated: optimizer state .*row_var has shape",
    "limit_train_batches": r"Trainer\(limit_train_batches=0\.5\) \(or overfit_batches\) counts each process's batches",
    # a LayoutSchedule going to pp=2 later, for a model that declares no stages:
    "stages_later_undeclared": r"a later layout has pipeline stages \(pp > 1\), but no model in the module declares",
    # Lightning's own (ModelParallelStrategy's) refusal:
    "no_configure_model": r"^TypeError: When using the ElasticMigrationStrategy, you are required to override the "
                          r"`configure_model\(\)` hook",
}
"""Shapes refused when ``fit`` starts (before any step), with the message each gets."""
REFUSED_AT_REQUEST = {
    # strategy.reconfigure(pp=2) from a callback, for a model that declares no stages: refused in the call
    "reconfigure_to_stages_undeclared": r"a later layout has pipeline stages \(pp > 1\), but no model in the module",
}
"""Requests refused when they are made, before anything changes (what ``fit`` cannot know when it starts)."""


class Features(Dataset):
    """``(x, y, index)``: the index says which samples a process read."""

    def __init__(self, size: int, offset: int = 0) -> None:
        g = torch.Generator().manual_seed(offset)
        self.x = torch.randn(size, 8, generator=g)
        self.y = self.x.sum(-1) + 0.1 * torch.randn(size, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class ReadByWorkers(Features):
    """``Features`` plus how the worker that read a sample was seeded: its id, its seed from torch, its torch seed after
    its ``worker_init_fn`` (64 bits: as text) and a draw from its ``random``."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int, str]:
        info = get_worker_info()
        assert info is not None, "read in the training process"
        return *super().__getitem__(i), f"{info.id} {info.seed} {torch.initial_seed()} {random.random()!r}"


def train_loader(shape: str) -> DataLoader:
    if shape == "workers":
        return DataLoader(ReadByWorkers(SAMPLES), batch_size=MICRO_BATCH, num_workers=WORKERS, persistent_workers=True)
    return DataLoader(Features(SAMPLES), batch_size=MICRO_BATCH)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(x)))


class Net(nn.Module):
    """Blocks under ``layers`` (or, for the ``blocks_container`` shape, under timm's and GPT codes' ``blocks``)."""

    def __init__(self, container: str, tied: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.container = container
        setattr(self, container, nn.ModuleList(Block() for _ in range(2)))
        self.head = nn.Linear(16, 1)
        self.tied = tied
        if tied:  # one weight under two names (as an embedding tied to its output head), outside the blocks
            self.mix_in, self.mix_out = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)
            self.mix_out.weight = self.mix_in.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        if self.tied:
            x = x + self.mix_out(torch.tanh(self.mix_in(x)))
        for block in getattr(self, self.container):
            x = block(x)
        return self.head(x).squeeze(-1)

    def init_full_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        full.zero_() if name.endswith("bias") else full.normal_(0.0, 0.2, generator=generator)


#: A tensor-parallel plan that covers part of the model (the blocks' MLPs), as the README's own example does.
TP_PLAN = {"*.*.fc": ColwiseParallel(), "*.*.out": RowwiseParallel()}


class UserModule(pl.LightningModule):
    def __init__(self, shape: str) -> None:
        super().__init__()
        self.shape = shape
        self.net: Net | None = None
        self.step_losses: dict[int, float] = {}
        self.lrs: dict[int, list[float]] = {}
        self.epoch_ends = 0
        self.val_runs = 0
        self.val_samples: list[list[int]] = []
        self.val_data_parallel: list[int] = []  # the data-parallel degree of each evaluation
        self.worker_seeding: dict[int, tuple[int, int, float]] = {}
        self._micro: list[torch.Tensor] = []
        if shape == "root_buffer":  # state on the LightningModule itself (a temperature, CLIP's logit scale)
            self.register_buffer("temperature", torch.ones(()))
        if shape == "init_children":  # built in __init__, not in configure_model: a weighted loss, a frozen teacher
            self.criterion = WeightedMSE(torch.tensor([0.5, 1.5]))
            self.teacher = nn.Linear(8, 1).requires_grad_(False)
        if shape == "root_parameter":  # a trainable temperature on the module itself: no layout reduces its grad
            self.scale = nn.Parameter(torch.ones(()))
        if shape == "model_built_in_init":  # as Lightning's docs build it, sharded later in configure_model
            self.net = Net("layers")
        if shape == "manual_optimization":
            self.automatic_optimization = False

    def configure_model(self) -> None:
        if self.net is not None and self.shape == "model_built_in_init":
            net = self.net  # to be refused: a model built before configure_model cannot be built again
        elif self.net is not None:
            return
        else:
            with torch.device("meta"):
                net = Net("blocks" if self.shape == "blocks_container" else "layers", tied=self.shape == "tied")
        strategy: Any = self.trainer.strategy
        if isinstance(strategy, ElasticMigrationStrategy):
            parallelize_model(net, strategy.layout_mesh, tp_plan=TP_PLAN)
        else:  # Lightning's ModelParallelStrategy: FSDP2 as its docs show it
            from torch.distributed.fsdp import fully_shard

            for block in getattr(net, net.container):
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(net, mesh=self.device_mesh["data_parallel"])
        if self.shape == "model_built_in_init":
            pass
        elif getattr(strategy, "migrating", False):
            materialize_empty(net, strategy.root_device)
        else:
            materialize_and_init(net, strategy.root_device, seed=0)
        self.net = net

    def on_fit_start(self) -> None:
        if self.shape == "frozen_in_hook":  # frozen after building, where finetuning code does it
            self.net.inp.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch[0], batch[1]
        if self.shape == "workers":  # each worker's first sample: its first draw
            for seeding in batch[3]:
                worker, worker_seed, seed, draw = seeding.split()
                self.worker_seeding.setdefault(int(worker), (int(worker_seed), int(seed), float(draw)))
        out = self.net(x)
        if self.shape == "init_children":
            loss = self.criterion(out, y + 0.1 * self.teacher(x).squeeze(-1))
        else:
            loss = F.mse_loss(out * self.temperature if self.shape == "root_buffer" else out, y)
        self._micro.append(loss.detach())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The mean over every process's micro-batches is the global batch's mean under any layout (tensor-parallel
        # peers hold the same micro-batches, so their duplicates do not move the mean).
        local = torch.stack(self._micro).mean()
        self._micro.clear()
        self.step_losses[self.trainer.global_step] = float(self.trainer.strategy.reduce(local, reduce_op="mean"))
        self.lrs[self.trainer.global_step] = [group["lr"] for group in optimizer.param_groups]
        if self.shape == "root_buffer":
            self.temperature.mul_(1.01)

    def on_train_epoch_end(self) -> None:
        self.epoch_ends += 1

    def on_validation_epoch_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.val_runs += 1
            self.val_samples.append([])
            layout = getattr(self.trainer.strategy, "layout", None)  # the reference's: FSDP over both processes
            self.val_data_parallel.append(self.trainer.world_size // (layout.tp if layout is not None else 1))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not self.trainer.sanity_checking:
            self.val_samples[-1].extend(int(i) for i in batch[2])

    def configure_optimizers(self) -> Any:
        trainable = [p for p in self.parameters() if p.requires_grad]
        if self.shape == "param_groups":
            heads = [p for n, p in self.named_parameters() if n.startswith("net.head") and p.requires_grad]
            rest = [p for p in trainable if all(p is not h for h in heads)]
            optimizer = torch.optim.AdamW([{"params": rest}, {"params": heads, "lr": 3e-3, "weight_decay": 0.0}],
                                          lr=1e-2)
        else:
            optimizer = torch.optim.AdamW(trainable, lr=1e-2)
        if self.shape == "epoch_scheduler":  # Lightning's default interval is the epoch
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]
        if self.shape == "two_optimizers":  # a GAN's, or a separate one for the head
            head = list(self.net.head.parameters())
            body = [p for p in trainable if all(p is not h for h in head)]
            return [torch.optim.AdamW(body, lr=1e-2), torch.optim.SGD(head, lr=1e-2)]
        if self.shape == "unsupported_optimizer":  # factored second moments: not shaped like the parameters
            return torch.optim.Adafactor(trainable, lr=1e-2)
        return optimizer


class NoConfigureModel(pl.LightningModule):
    """Lightning code from before configure_model: the model built in ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return F.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ReconfigureAfterStep(pl.Callback):
    """A user's own change, asked of the strategy after ``step`` (unknown when ``fit`` starts)."""

    def __init__(self, step: int, layout: HybridLayout) -> None:
        self.step, self.layout = step, layout

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.strategy.reconfigure(self.layout)


class WeightedMSE(nn.Module):
    """A loss with state of its own (a weight per class of target: below or above zero), built in ``__init__`` as
    users build losses."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2 * self.weight[(target > 0).long()]).mean()


def _full(t: torch.Tensor) -> list[Any]:
    """The whole value, as plain lists (torch tensors would cross the process boundary through shared memory)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().tolist()


def _fit_every_shape(rank: int, world: int, mode: str, root: str) -> dict[str, Any]:
    quiet_lightning()
    results = {}
    for shape in SHAPES:
        if mode == "reference":
            from lightning.pytorch.strategies import ModelParallelStrategy

            strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                  timeout=timedelta(seconds=60))
            accumulate = GLOBAL_BATCH // (MICRO_BATCH * 2)
        else:
            strategy = ElasticMigrationStrategy(layout=HybridLayout(dp_shard=2), global_batch_size=GLOBAL_BATCH,
                                                micro_batch_size=MICRO_BATCH, timeout=timedelta(seconds=60))
            accumulate = 1  # derived by the strategy
        callbacks: list[Any] = []
        if mode == "changed":
            callbacks.append(LayoutSchedule(CHANGES))
        by_epochs = shape == "max_epochs"
        trainer = pl.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, max_steps=-1 if by_epochs else STEPS,
            max_epochs=EPOCHS if by_epochs else None, callbacks=callbacks, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            accumulate_grad_batches=accumulate, num_sanity_val_steps=0, val_check_interval=0.5,
            gradient_clip_val=0.5 if shape == "clip_partial_tp" else None, default_root_dir=f"{root}/{mode}/{shape}",
        )
        # Before the module: a child built in __init__ draws its initial values.
        pl.seed_everything(0, workers=shape == "workers")
        module = UserModule(shape)
        val = DataLoader(Features(VAL_SAMPLES, offset=1), batch_size=MICRO_BATCH) if shape == "validation" else None
        trainer.fit(module, train_loader(shape), val)
        results[shape] = {
            "losses": module.step_losses, "lrs": module.lrs, "epoch": trainer.current_epoch,
            "epoch_ends": module.epoch_ends, "val_runs": module.val_runs, "val_samples": module.val_samples,
            "val_data_parallel": module.val_data_parallel,
            "tie_kept": shape != "tied" or module.net.mix_out.weight is module.net.mix_in.weight,
            "worker_seeding": module.worker_seeding,
            "params": {n: _full(p) for n, p in module.named_parameters()} | {
                n: _full(b) for n, b in module.named_buffers() if n == "temperature"},
        }
    if mode == "elastic":
        results["refused"] = {shape: _refusal(shape, world, f"{root}/refused/{shape}")
                              for shape in (*REFUSED, *REFUSED_AT_REQUEST)}
    return results


def _refusal(shape: str, world: int, root_dir: str) -> str:
    """The error a shape's ``fit`` ends with (none: it trained, and the test fails)."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    strategy = ElasticMigrationStrategy(layout=HybridLayout(dp_shard=2), global_batch_size=GLOBAL_BATCH,
                                        micro_batch_size=MICRO_BATCH, timeout=timedelta(seconds=60))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root_dir,
        callbacks=[EMAWeightAveraging()] if shape == "weight_averaging" else
        [LayoutSchedule([(1, HybridLayout(pp=2))])] if shape == "stages_later_undeclared" else
        [ReconfigureAfterStep(1, HybridLayout(pp=2))] if shape == "reconfigure_to_stages_undeclared" else [],
        limit_train_batches=0.5 if shape == "limit_train_batches" else 1.0,
    )
    module = NoConfigureModel() if shape == "no_configure_model" else UserModule(shape)
    try:
        trainer.fit(module, DataLoader(Features(SAMPLES), batch_size=MICRO_BATCH))
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return f"{type(exc).__name__}: {exc} (steps trained: {trainer.global_step})"
    return f"not refused: trained {trainer.global_step} steps"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("parity"))  # the runs' events go here, not into the working directory
    return {mode: run_distributed(_fit_every_shape, 2, mode, root, timeout_s=420)
            for mode in ("reference", "elastic", "changed")}


@pytest.mark.parametrize("mode", ["elastic", "changed"])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_user_shape_trains_as_under_lightnings_own_strategy(runs: dict[str, Any], shape: str, mode: str) -> None:
    reference, run = runs["reference"][0][shape], runs[mode][0][shape]
    assert run["lrs"] == reference["lrs"], "learning rate per step (epoch-interval schedulers included)"
    assert (run["epoch"], run["epoch_ends"]) == (reference["epoch"], reference["epoch_ends"])
    assert run["tie_kept"] and reference["tie_kept"], "the tied weight became two tensors"
    steps = sorted(reference["losses"])
    assert sorted(run["losses"]) == steps == list(range(EPOCHS * SAMPLES // GLOBAL_BATCH if shape == "max_epochs"
                                                         else STEPS))
    for step in steps:
        assert run["losses"][step] == pytest.approx(reference["losses"][step], rel=1e-4, abs=1e-6), step
    assert run["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        torch.testing.assert_close(torch.tensor(run["params"][name]), torch.tensor(value), rtol=1e-4, atol=1e-5,
                                   msg=name)


@pytest.mark.parametrize("shape", sorted(REFUSED))
def test_a_shape_a_change_could_not_carry_is_refused_when_fit_starts(runs: dict[str, Any], shape: str) -> None:
    for rank_result in runs["elastic"]:
        refusal = rank_result["refused"][shape]
        assert refusal.startswith("NotElasticError: ") or REFUSED[shape].startswith("^"), refusal
        assert "(steps trained: 0)" in refusal
        assert re.search(REFUSED[shape], refusal), refusal


@pytest.mark.parametrize("shape", sorted(REFUSED_AT_REQUEST))
def test_a_change_that_could_not_be_carried_is_refused_when_it_is_asked_for(runs: dict[str, Any], shape: str) -> None:
    for rank_result in runs["elastic"]:
        refusal = rank_result["refused"][shape]
        assert refusal.startswith("NotElasticError: ") and "(steps trained: 1)" in refusal, refusal
        assert re.search(REFUSED_AT_REQUEST[shape], refusal), refusal


def test_a_part_frozen_after_building_stays_frozen_through_a_change(runs: dict[str, Any]) -> None:
    frozen = [torch.tensor(runs[mode][0]["frozen_in_hook"]["params"]["net.inp.weight"])
              for mode in ("reference", "elastic", "changed")]
    trained = torch.tensor(runs["reference"][0]["plain"]["params"]["net.inp.weight"])
    assert torch.equal(frozen[0], frozen[1]) and torch.equal(frozen[0], frozen[2])
    assert not torch.allclose(frozen[0], trained), "the plain run trains the layer the frozen run holds still"


def test_workers_are_seeded_by_lightning_for_their_processs_rank_under_every_layout(runs: dict[str, Any]) -> None:
    """``seed_everything(workers=True)``: Lightning's ``pl_worker_init_function``, bound to the process's global rank,
    seeds the reference's workers and the adopted loader's alike."""
    for mode in ("reference", "elastic", "changed"):
        for rank, result in enumerate(runs[mode]):
            seeding = result["workers"]["worker_seeding"]
            assert sorted(seeding) == list(range(WORKERS)), (mode, rank)
            for worker, (worker_seed, seed, draw) in seeding.items():
                assert (seed, draw) == lightnings_worker_seeding(worker_seed, worker, rank), (mode, rank, worker)


def lightnings_worker_seeding(worker_seed: int, worker_id: int, rank: int) -> tuple[int, float]:
    """What a worker that torch seeded with ``worker_seed`` holds after Lightning's ``worker_init_fn`` for ``rank``:
    its torch seed and its first ``random`` draw (this process's RNGs are left as they were)."""
    states = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(worker_seed)  # as torch seeds a worker
            pl_worker_init_function(worker_id, rank=rank)
            return torch.initial_seed(), random.random()
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])


def test_every_validation_sample_is_read_once_per_evaluation_under_every_layout(runs: dict[str, Any]) -> None:
    """Validation every half epoch (steps 4, 8 and 12): in the changed run the first falls right after the change to
    ``tp=2``, the second right after the change back at the epoch's end."""
    reference_runs = runs["reference"][0]["validation"]["val_runs"]
    assert reference_runs == 3
    for mode in ("reference", "elastic", "changed"):
        per_rank = [result["validation"] for result in runs[mode]]
        assert [r["val_runs"] for r in per_rank] == [reference_runs] * len(per_rank), mode
        data_parallel = per_rank[0]["val_data_parallel"]
        assert data_parallel == ([1, 2, 2] if mode == "changed" else [2, 2, 2]), mode
        for evaluation, dp in enumerate(data_parallel):
            samples = [sorted(r["val_samples"][evaluation]) for r in per_rank]
            if dp == 1:  # tensor-parallel peers: both read every sample, the same ones
                assert samples[0] == samples[1] == list(range(VAL_SAMPLES)), (mode, evaluation)
            else:  # two data-parallel ranks: each sample read by one of them
                assert sorted(samples[0] + samples[1]) == list(range(VAL_SAMPLES)), (mode, evaluation)


class CheckpointProbe(pl.Callback):
    """A callback with state, as users write them: what its checkpoint hooks see of a live handoff."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.rank = trainer.global_rank

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.seen["save_keys"] = sorted(checkpoint)
        self.seen["state_dict_keys"] = sorted(checkpoint["state_dict"])
        checkpoint["probe"] = {"saved_at": trainer.global_step}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        from lightning_emig.strategy.rendezvous import capture_handoff, run_save_hooks

        if trainer.global_step == 2 and "handed" not in self.seen:
            handoff = capture_handoff(trainer, new_generation=1, last_step_wall=0.0)
            run_save_hooks(trainer, handoff)
            self.seen["handed"] = {"keys": sorted(handoff.metadata), "probe": handoff.metadata["probe"],
                                   "callbacks": handoff.metadata["callbacks"][self.state_key]}


def _hand_over_at_a_boundary(rank: int, world: int, root: str) -> dict[str, Any]:
    quiet_lightning()
    probe = CheckpointProbe()
    strategy = ElasticMigrationStrategy(layout=HybridLayout(dp_shard=2), global_batch_size=GLOBAL_BATCH,
                                        micro_batch_size=MICRO_BATCH, timeout=timedelta(seconds=60))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=3, callbacks=[probe],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root)
    trainer.fit(UserModule("plain"), DataLoader(Features(SAMPLES), batch_size=MICRO_BATCH))
    return probe.seen


def test_a_handoff_gives_the_save_hooks_a_lightning_shaped_checkpoint(tmp_path: Any) -> None:
    """What a live handoff carries is what the callbacks' ``on_save_checkpoint`` made of a checkpoint that has the
    module's ``state_dict``, as when Lightning saves; the state dict itself does not travel (the state moves on its
    own), each rank's callback state does."""
    for rank, seen in enumerate(run_distributed(_hand_over_at_a_boundary, 2, str(tmp_path), timeout_s=120)):
        assert "state_dict" in seen["save_keys"] and "net.head.weight" in seen["state_dict_keys"]
        handed = seen["handed"]
        assert handed["probe"] == {"saved_at": 2} and "state_dict" not in handed["keys"]
        assert handed["callbacks"] == {"rank": rank}
