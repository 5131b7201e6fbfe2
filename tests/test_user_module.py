"""A user's LightningModule and plain ``DataLoader`` (the GPT example's) under live layout changes, in-process.

* the plain ``DataLoader`` (shuffled, Lightning's ``DistributedSampler`` injected) is read through the global-offset
  sampler: across a change from ``dp_shard=2`` to ``tp=2`` (data-parallel degree 2 -> 1) every step trains on the same
  samples as the uninterrupted run, and the loss follows it;
* the module keeps its config under the ordinary name ``model_config`` (no ``n_heads`` there): nothing guesses it;
* the schedule prepares the change while the old layout trains: the user's ``configure_model`` runs on a stand-in
  in the background, and the pause builds nothing;
* persistent buffers move bit for bit: the example's unsharded ``tokens_seen`` and a buffer sharded over the data-
  parallel axis (``Shard(0)`` DTensor) whose every element is distinct;
* what cannot be adopted (an ``IterableDataset``, a custom sampler, a batch size that is not the micro batch) is
  refused with a message that says what to use.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from lightning_emig import HybridLayout
from lightning_emig.data.adopt import DataLoaderNotElasticError, adopt_dataloader
from lightning_emig.examples.gpt import CountingSequences, GPTConfig, GPTModule
from lightning_emig.strategy import ElasticMigrationStrategy
from lightning_emig.strategy.schedule import LayoutSchedule
from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.runs import quiet_lightning
from lightning_emig.training.ledger import DataLedger

STEPS = 8
CHANGE_AT = 4
BUFFER = 8


class ShardedBufferModule(GPTModule):
    """The example's module plus a persistent buffer sharded over the data-parallel axis (plain when dp is 1)."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        from torch.distributed.tensor import Shard, distribute_tensor

        strategy: Any = self.trainer.strategy
        full = torch.arange(BUFFER, dtype=torch.float32)  # distinct elements: a misplaced piece shows
        value = distribute_tensor(full, strategy.layout_mesh["dp_shard"], [Shard(0)]) if strategy.layout.dp_shard > 1 \
            else full
        self.model.register_buffer("sharded_stat", value)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        super().on_before_optimizer_step(optimizer)
        self.model.sharded_stat.add_(1.0)


def _fit(rank: int, world: int, root: str, change: bool) -> dict[str, Any]:
    quiet_lightning()
    config = GPTConfig()
    run_dir = Path(root)
    callbacks: list[Any] = [DataLedger(run_dir)]
    if change:
        callbacks.append(LayoutSchedule([(CHANGE_AT, HybridLayout(dp_shard=1, tp=2))], prepare_ahead_steps=1))
    strategy = ElasticMigrationStrategy(layout=HybridLayout(dp_shard=2), global_batch_size=8, micro_batch_size=2,
                                        timeout=timedelta(seconds=60))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, callbacks=callbacks,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root)
    module = ShardedBufferModule(config, max_steps=STEPS)
    pl.seed_everything(0)
    trainer.fit(module, DataLoader(CountingSequences(256, config.seq_len, config.vocab_size), batch_size=2,
                                   shuffle=True))
    stat = module.model.sharded_stat
    full = stat.full_tensor() if hasattr(stat, "full_tensor") else stat
    return {"losses": [module.step_losses[s] for s in range(STEPS)], "tokens_seen": int(module.model.tokens_seen),
            "sharded_stat": full.tolist(), "events": [e.as_dict() for e in strategy.events]}


def _samples_per_step(run_dir: Path) -> dict[int, list[int]]:
    from lightning_emig.testing.ledger import read_ledger

    steps: dict[int, list[int]] = {}
    for record in read_ledger(run_dir):
        steps.setdefault(record["step"], []).extend(record["sample_ids"])
    return {step: sorted(ids) for step, ids in steps.items()}


@pytest.mark.multiprocess
def test_a_plain_dataloader_and_persistent_buffers_survive_a_layout_change(tmp_path: Path) -> None:
    reference = run_distributed(_fit, 2, str(tmp_path / "ref"), False, timeout_s=300)[0]
    live = run_distributed(_fit, 2, str(tmp_path / "live"), True, timeout_s=300)[0]
    assert [(e["kind"], e["step"], e["new_layout"]["tp"]) for e in live["events"]] == [("reconfigure", CHANGE_AT, 2)]
    # the schedule had the new layout built while the old one trained (the user's configure_model, on a stand-in)
    assert set(live["events"][0]["prepared_seconds"]) >= {"build", "plan"}
    assert "build" not in live["events"][0]["seconds"]
    samples, expected = _samples_per_step(tmp_path / "live"), _samples_per_step(tmp_path / "ref")
    assert sorted(samples) == list(range(STEPS)) and samples == expected, "the data order changed with the layout"
    assert all(len(ids) == 8 == len(set(ids)) for ids in samples.values())
    gaps = [abs(a - b) / abs(b) for a, b in zip(live["losses"], reference["losses"], strict=True)]
    assert max(gaps) < 1e-4, f"loss deviates by {max(gaps):.2e} from the uninterrupted run"
    assert live["tokens_seen"] == reference["tokens_seen"] == STEPS * 8 * GPTConfig().seq_len
    assert live["sharded_stat"] == [float(i + STEPS) for i in range(BUFFER)], "the sharded buffer was not moved"


class _Stream(IterableDataset):
    def __iter__(self):  # noqa: ANN204 - a test stub
        yield from range(10)


class _EveryOther(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # noqa: ANN204 - a test stub
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return self.n // 2


DATASET = CountingSequences(64, 8, 16)


@pytest.mark.parametrize(
    ("loader", "message"),
    [
        (DataLoader(_Stream(), batch_size=2), "IterableDataset .* cannot be re-positioned"),
        (DataLoader(DATASET, batch_size=2, sampler=_EveryOther(64)), "custom sampler \\(_EveryOther\\)"),
        (DataLoader(DATASET, batch_size=4), "batch_size=4 but the strategy's micro_batch_size is 2"),
    ],
    ids=["iterable", "custom_sampler", "batch_size"],
)
def test_a_dataloader_that_cannot_follow_a_change_is_refused(loader: DataLoader, message: str) -> None:
    with pytest.raises(DataLoaderNotElasticError, match=message) as error:
        adopt_dataloader(loader, global_batch_size=8, micro_batch_size=2, seed=0)
    assert "DataLoader(dataset, batch_size=micro_batch_size" in str(error.value) or "batch_size" in message


@pytest.mark.parametrize(("shuffle", "permuted"), [(False, False), (True, True)])
def test_an_adopted_dataloader_keeps_its_dataset_collation_and_shuffle(shuffle: bool, permuted: bool) -> None:
    loader = adopt_dataloader(DataLoader(DATASET, batch_size=2, shuffle=shuffle), global_batch_size=8,
                              micro_batch_size=2, seed=0)
    loader.stream.set_topology(dp_degree=2, dp_rank=1)
    inputs, targets = next(iter(loader))  # the user's collation: a (inputs, targets) pair, batch of 2
    assert inputs.shape == targets.shape == (2, 8)
    produced = loader.stream.take_produced()
    assert produced is not None and produced.micro_step == 0
    ids = list(produced.sample_ids)
    assert (ids != [4, 5]) == permuted  # rank 1 of 2 reads the second half of the first global batch
    assert torch.equal(inputs, torch.stack([DATASET[i][0] for i in ids]))


def test_the_record_of_produced_micro_batches_never_outgrows_a_step() -> None:
    loader = adopt_dataloader(DataLoader(DATASET, batch_size=2), global_batch_size=8, micro_batch_size=2, seed=0)
    stream = loader.stream
    stream.set_topology(dp_degree=1, dp_rank=0)
    steps = 0
    while steps < 50:  # nobody takes the records (no ledger): each commit drops the step's
        for i, _ in enumerate(loader):  # an adopted loader ends with its epoch: a new iterator each epoch
            if i % 4 == 3:
                stream.commit_step()
                steps += 1
    assert stream.take_produced() is None


def test_an_adopted_loader_has_lightnings_epochs() -> None:
    """A finite map-style loader keeps its epochs: an iterator ends with the epoch (the tail that fills no global batch
    dropped), ``len()`` is this rank's micro-batches per epoch under the current accumulation, and the next iterator
    reads the next epoch."""
    dataset = CountingSequences(36, 4, 16)  # 4 steps of 8, 4 samples dropped
    loader = adopt_dataloader(DataLoader(dataset, batch_size=2, drop_last=True), global_batch_size=8,
                              micro_batch_size=2, seed=0)
    stream = loader.stream
    stream.set_topology(dp_degree=2, dp_rank=1)
    assert len(loader) == 4 * 2
    stream.set_topology(dp_degree=1, dp_rank=0)
    assert len(loader) == 4 * 4
    for epoch in range(2):
        batches = list(loader)
        assert len(batches) == len(loader)
        for _ in range(4):
            stream.commit_step()
        assert stream.sampler.epoch_of() == epoch + 1
    stream.set_topology(dp_degree=2, dp_rank=0)
    stream.commit_step()  # one step into the third epoch: the iterator reads the rest of it
    assert len(list(loader)) == 3 * 2


def test_an_epoch_tail_is_dropped_only_when_the_loader_says_so() -> None:
    with pytest.raises(DataLoaderNotElasticError, match="drop_last=True"):
        adopt_dataloader(DataLoader(CountingSequences(36, 4, 16), batch_size=2), global_batch_size=8,
                         micro_batch_size=2, seed=0)


def test_random_sampler_keeps_its_num_samples_where_adopt_reads_it() -> None:
    # adopt_dataloader refuses RandomSampler(num_samples=...) by this private attribute (no public one in torch 2.13).
    from torch.utils.data import RandomSampler

    assert RandomSampler(range(4))._num_samples is None
    assert RandomSampler(range(4), num_samples=2)._num_samples == 2
    with pytest.raises(DataLoaderNotElasticError, match="RandomSampler"):
        adopt_dataloader(DataLoader(DATASET, batch_size=2, sampler=RandomSampler(DATASET, num_samples=8)),
                         global_batch_size=8, micro_batch_size=2, seed=0)


def test_a_models_blocks_come_from_its_blocks_method_only() -> None:
    """A ``blocks`` container is the user's own attribute, not a declaration (timm, many GPT codes): nothing is
    guessed from its name, and the model is neither cut into stages nor split into FSDP2 units by it."""
    from torch import nn

    from lightning_emig.examples.gpt import GPT
    from lightning_emig.migration.state import stage_split_of
    from lightning_emig.models.base import blocks_of
    from lightning_emig.models.llama import Llama, get_model_config

    class Container(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))  # callable, but not a method to call

    with torch.device("meta"):
        llama = Llama(get_model_config("tiny"))
        gpt = GPT(GPTConfig())
    container = Container()
    assert blocks_of(container) == []
    assert stage_split_of(container) is None
    assert blocks_of(gpt) == gpt.blocks() and len(gpt.blocks()) == GPTConfig().n_layers
    assert blocks_of(llama) == llama.blocks()
    assert blocks_of(nn.Linear(2, 2)) == []
