"""Pins of the private Lightning 2.6 names :mod:`lightning_emig.strategy.elastic_fit` relies on, and the strategy's
wiring of its launcher: these fail when an upgrade of Lightning moves them, before an elastic run would."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_emig import HybridLayout
from lightning_emig.change.boundary import treat_step_as_saved
from lightning_emig.launcher.generation import ENV_CONTROL_STORE, ENV_NODE_ID
from lightning_emig.strategy import ElasticMigrationStrategy
from lightning_emig.strategy.elastic_fit import ElasticFitLauncher, is_fit


def test_fit_is_told_from_the_other_entry_points() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert is_fit(trainer._fit_impl)
    assert not is_fit(trainer._validate_impl) and not is_fit(trainer._test_impl) and not is_fit(print)
    assert "ckpt_path" in inspect.signature(trainer._fit_impl).parameters


def test_lightnings_interrupt_handling_is_where_the_launcher_calls_it() -> None:
    from lightning.pytorch.trainer.call import _interrupt

    assert callable(_interrupt) and callable(pl.Trainer._teardown)
    assert list(inspect.signature(_interrupt).parameters) == ["trainer", "exception"]


def test_every_checkpoint_callback_skips_the_step_a_live_fit_resumed_at() -> None:
    from lightning.pytorch.trainer.states import TrainerFn

    callback = ModelCheckpoint(every_n_train_steps=10)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, callbacks=[callback])
    trainer.state.fn = TrainerFn.FITTING
    trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = 20
    assert trainer.global_step == 20
    assert not callback._should_skip_saving_checkpoint(trainer)
    treat_step_as_saved(trainer, 20)
    assert callback._should_skip_saving_checkpoint(trainer)


def _strategy_in_a_worker(monkeypatch: pytest.MonkeyPatch, *, under_launcher: bool) -> ElasticMigrationStrategy:
    """A strategy built in a torchrun worker's environment, under ``lightning-emig-run`` or plain torchrun."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "pin")
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    if under_launcher:
        monkeypatch.setenv(ENV_NODE_ID, "127.0.0.1_1")
        monkeypatch.setenv(ENV_CONTROL_STORE, "127.0.0.1:1")
    else:
        monkeypatch.delenv(ENV_NODE_ID, raising=False)
        monkeypatch.delenv(ENV_CONTROL_STORE, raising=False)
    return ElasticMigrationStrategy(global_batch_size=4, micro_batch_size=2)


@pytest.mark.parametrize("under_launcher", [True, False])
def test_the_strategy_brings_its_launcher_only_under_lightning_emig_run(
    monkeypatch: pytest.MonkeyPatch, under_launcher: bool
) -> None:
    strategy = _strategy_in_a_worker(monkeypatch, under_launcher=under_launcher)
    pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False)
    assert isinstance(strategy.launcher, ElasticFitLauncher) == under_launcher


def test_a_process_that_leaves_the_job_exits_with_its_objects_still_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given back to the collector, they would be walked by the interpreter's exit in several full collections (~1 s
    of a core at 125M, measured), while the survivors on the same host run their first step."""
    import gc

    strategy = _strategy_in_a_worker(monkeypatch, under_launcher=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False)
    launcher = strategy.launcher
    assert isinstance(launcher, ElasticFitLauncher)

    def handed_over_and_leaving(*_: object) -> None:  # what _fit_once does once a drain handed this node's state over
        strategy.left_job = True
        raise SystemExit(0)

    monkeypatch.setattr(launcher, "_fit_once", handed_over_and_leaving)
    gc.freeze()
    try:
        with pytest.raises(SystemExit):
            launcher.launch(trainer._fit_impl, pl.LightningModule(), trainer=trainer)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_a_change_drops_only_the_children_that_hold_state() -> None:
    from torch import nn

    from lightning_emig.change.rebuild import check_rebuilt, drop_model

    module = nn.Module()
    module.model, module.criterion = nn.Linear(2, 2), nn.CrossEntropyLoss()
    module.register_module("stats", nn.BatchNorm1d(2, affine=False))  # buffers only: state all the same
    module.teacher = nn.Linear(2, 2)  # built outside configure_model: kept as it is
    assert drop_model(module, keep=frozenset({"teacher"})) == ["model", "stats"]
    assert module.model is None and isinstance(module.criterion, nn.CrossEntropyLoss)
    assert isinstance(module.teacher, nn.Linear)
    with pytest.raises(RuntimeError, match=r"left \['model', 'stats'\] as None"):
        check_rebuilt(module, ["model", "stats"])


def test_a_dropped_model_leaves_no_gradient_behind_for_the_collector_to_find() -> None:
    # FSDP's modules sit in reference cycles: dropped, they and their gradients wait for a full collection, beside the
    # new model's first step. A hook that refers to its own module stands in for such a cycle.
    import gc
    import weakref

    import torch
    from torch import nn

    from lightning_emig.change.rebuild import drop_model

    module = nn.Module()
    module.model = nn.Linear(4, 4)
    module.model.register_forward_hook(lambda m, args, out, model=module.model: None)
    module.model(torch.ones(2, 4)).sum().backward()
    grad = weakref.ref(module.model.weight.grad)
    gc.disable()
    try:
        drop_model(module, keep=frozenset())
        assert grad() is None
    finally:
        gc.enable()


def test_a_stand_in_cleared_for_a_prepared_change_leaves_the_live_models_gradients_alone() -> None:
    # The preparation builds the new layout on a stand-in that shares the live module's children while it trains on:
    # mid-accumulation, a gradient released there would be lost to the step.
    import torch
    from torch import nn

    from lightning_emig.change.rebuild import clear_children

    module = nn.Module()
    module.model = nn.Linear(4, 4)
    module.model(torch.ones(2, 4)).sum().backward()
    stand_in = object.__new__(type(module))
    stand_in.__dict__.update(module.__dict__)
    stand_in.__dict__["_modules"] = dict(module._modules)
    assert clear_children(stand_in, keep=frozenset()) == ["model"]
    assert stand_in.model is None and module.model is not None and module.model.weight.grad is not None


@pytest.mark.parametrize("cut_short", [False, True])
def test_what_a_step_cut_short_left_behind_is_freed_with_the_dropped_model(cut_short: bool) -> None:
    # A failure interrupts a forward: the error's frames hold the model, whose FSDP cycles hold its unsharded
    # parameters (a tensor on a module in a hook's cycle stands in for them). A change at a step boundary has no error.
    import gc
    import weakref

    import torch
    from torch import nn

    from lightning_emig.change.rebuild import drop_model

    module = nn.Module()
    module.model = nn.Linear(4, 4)
    module.model.register_forward_hook(lambda m, args, out, model=module.model: None)
    module.model.unsharded = torch.ones(8)
    left = weakref.ref(module.model.unsharded)

    def forward_cut_short(model: nn.Module) -> None:
        raise RuntimeError(f"a peer died in the forward of {type(model).__name__}")

    gc.disable()
    try:
        try:
            forward_cut_short(module.model)
        except RuntimeError as error:
            drop_model(module, keep=frozenset(), cut_short_by=error if cut_short else None)
            assert (left() is None) == cut_short
            assert "a peer died in the forward of Linear" in str(error)  # the error itself is left whole
    finally:
        gc.enable()


def test_only_the_first_fit_of_a_restarted_process_is_a_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker torchrun restarted keeps TORCHELASTIC_RESTART_COUNT > 0 for life; its later live fits are no restarts.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    strategy = ElasticMigrationStrategy(global_batch_size=4, micro_batch_size=2)
    assert strategy.start_reason is not None and "restart #1" in strategy.start_reason
    strategy.prepare_next_fit()
    assert strategy.start_reason is None


def test_the_worlds_a_job_may_take_are_checked_at_start() -> None:
    from lightning_emig.launcher.generation import ENV_MAX_NODES, ENV_MIN_NODES, allowed_worlds_from_env
    from lightning_emig.membership.settings import ElasticSettings
    from lightning_emig.migration.transfer import TransferOptions

    worlds = allowed_worlds_from_env({ENV_MIN_NODES: "1", ENV_MAX_NODES: "3", "LOCAL_WORLD_SIZE": "2"})
    assert worlds == [2, 4, 6]

    def settings(global_batch: int) -> ElasticSettings:
        return ElasticSettings(requested_layout=HybridLayout(dp_shard=-1), global_batch_size=global_batch,
                               micro_batch_size=2, transfer=TransferOptions(), validate_layout=lambda layout: None)

    # 8 samples split over 6 data-parallel ranks of 2 cannot work; 2 and 4 can: a warning, not a refusal.
    assert list(settings(8).unworkable_worlds(worlds)) == [6]
    with pytest.raises(ValueError, match=r"no world this job may have can be laid out \(4 processes: .* 8 processes: "):
        settings(6).unworkable_worlds([4, 8])
