"""A process that already holds its new shards (a drain or a rebuild from replicas left them in plain buffers) gives
the new optimizer that state without a copy, and training goes on from it exactly as from the original."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_emig.layout import HybridLayout, build_mesh
from lightning_emig.migration.engine import migrate
from lightning_emig.migration.identity import IdentityMap, ProcessInfo
from lightning_emig.migration.state import (
    StateTensor,
    adopt_optimizer_state,
    allocate_optimizer_state,
    training_state,
)
from lightning_emig.models.llama import Llama, LlamaConfig
from lightning_emig.testing.distributed import run_distributed
from lightning_emig.testing.llama import laid_out_llama, train_steps
from lightning_emig.testing.state import assert_states_equal, full_training_state

pytestmark = pytest.mark.multiprocess

#: Widths no shard count divides evenly: the two ranks' shards differ in shape.
CONFIG = LlamaConfig(dim=40, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=100, vocab_size=259, max_seq_len=32)


def _model(mesh: Any, *, init: bool) -> tuple[Llama, torch.optim.Optimizer]:
    model = laid_out_llama(CONFIG, mesh, seed=3 if init else None)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: Llama, optimizer: torch.optim.Optimizer, seed: int) -> None:
    train_steps(model, optimizer, [torch.randint(0, CONFIG.vocab_size, (2, 17),
                                                 generator=torch.Generator().manual_seed(seed))])


def _adopt_worker(rank: int, world: int) -> dict[str, Any]:
    mesh = build_mesh(HybridLayout(dp_shard=world).resolve(world), "cpu", ranks=tuple(range(world)))
    model, optimizer = _model(mesh, init=True)
    for step in range(2):
        _step(model, optimizer, 100 * rank + step)
    # What a drain leaves: the process's shards under the same layout, in plain buffers of its own.
    held = {k: StateTensor(k, t.spec, t.local.clone()) for k, t in training_state(model, optimizer).items()}

    new_model, new_optimizer = _model(mesh, init=False)
    adopted = adopt_optimizer_state(new_model, new_optimizer, held)
    params = dict(new_model.named_parameters())
    in_place = all(
        new_optimizer.state[params[k.split("/")[1]]][k.rsplit("/", 1)[1]].to_local().data_ptr()
        == held[k].local.data_ptr() for k in adopted
    )
    # The rest (parameters, AdamW's step counts) moves as a live join moves it.
    template = {k: t.spec for k, t in held.items() if k.startswith("optim/") and k not in adopted}
    new_state = training_state(new_model, None)
    new_state.update(allocate_optimizer_state(new_model, new_optimizer, template))
    identity = IdentityMap(tuple(ProcessInfo(r, 0, r, r) for r in range(world)), world, world)
    layout = mesh.layout
    migrate(old_state={k: t for k, t in held.items() if k not in adopted}, new_state=new_state, old_layout=layout,
            new_layout=layout, identity=identity, pid=rank)
    # Both go on training: the adopted state must behave exactly as the original.
    _step(model, optimizer, 999 + rank)
    _step(new_model, new_optimizer, 999 + rank)
    mismatch = None
    try:
        assert_states_equal(full_training_state(model, optimizer), full_training_state(new_model, new_optimizer))
    except AssertionError as exc:
        mismatch = str(exc)

    wrong = dict(held)
    key = next(iter(adopted))
    wrong[key] = StateTensor(key, held[key].spec, torch.zeros(held[key].local.numel() + 1))
    try:
        adopt_optimizer_state(*_model(mesh, init=False), wrong)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    # Under pipeline stages a process holds another stage's state empty: settled here, adopted by that stage.
    other_key = "optim/another.stage.weight/exp_avg"
    other = adopt_optimizer_state(*_model(mesh, init=False), {other_key: StateTensor(other_key, held[key].spec,
                                                                                     torch.empty(0))})
    return {"adopted": sorted(adopted), "held": sorted(held), "in_place": in_place, "mismatch": mismatch,
            "refused": refused, "other_stage": sorted(other) == [other_key]}


@pytest.mark.timeout(180)
def test_held_optimizer_state_is_adopted_in_place_and_trains_on_exactly() -> None:
    for result in run_distributed(_adopt_worker, 2, timeout_s=150):
        tensor_states = [k for k in result["held"] if k.startswith("optim/") and not k.endswith("/step")]
        assert result["adopted"] == tensor_states  # every parameter-shaped state; the step counts move
        assert result["in_place"], "an adopted state was copied"
        assert result["mismatch"] is None, result["mismatch"]
        assert result["refused"] is not None and "cannot be adopted" in result["refused"]
        assert result["other_stage"]


class _WithScalar(torch.nn.Module):
    """A 0-dim parameter (a temperature, CLIP's ``logit_scale``) beside a matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))
        self.weight = torch.nn.Parameter(torch.ones(3, 4))


def test_a_scalar_parameters_moments_live_with_it_and_only_step_counts_on_the_cpu() -> None:
    """Adam's moments of a 0-dim parameter are scalars, like its ``step``, but belong with the parameter (its device,
    its mesh). The new model is on ``meta`` here, so a moment put on the CPU by its shape alone shows."""
    model = _WithScalar()
    optimizer = torch.optim.AdamW(model.parameters())
    (model.scale * model.weight).sum().backward()
    optimizer.step()
    template = {k: t.spec for k, t in training_state(model, optimizer).items() if k.startswith("optim/")}
    with torch.device("meta"):
        new_model = _WithScalar()
    new_optimizer = torch.optim.AdamW(new_model.parameters())
    allocated = allocate_optimizer_state(new_model, new_optimizer, template)
    devices = {key: t.local.device.type for key, t in allocated.items()}
    assert devices == {
        "optim/scale/step": "cpu", "optim/scale/exp_avg": "meta", "optim/scale/exp_avg_sq": "meta",
        "optim/weight/step": "cpu", "optim/weight/exp_avg": "meta", "optim/weight/exp_avg_sq": "meta",
    }
    assert new_optimizer.state[new_model.scale]["exp_avg"].device.type == "meta"


def _kept_shards_worker(rank: int, world: int) -> dict[str, Any]:
    """16 row-sharded tensors keep their boxes, one goes from row to column shards: a drain or a rebuild's
    buffers (:func:`allocate_shards` with ``held``) take the 16 as they are and copy nothing of them."""
    from torch.distributed.tensor import Shard

    from lightning_emig.migration.change import HeldShards, adopted_storages, allocate_shards
    from lightning_emig.migration.state import ShardingSpec, release_storage

    layout = HybridLayout(dp_shard=world).resolve(world)
    rows = ShardingSpec((8, 6), torch.float32, ("dp_shard",), (Shard(0),))
    columns = ShardingSpec((8, 6), torch.float32, ("dp_shard",), (Shard(1),))
    old_specs = {**{f"param/kept{i}": rows for i in range(16)}, "param/moved": rows}
    new_specs = {**old_specs, "param/moved": columns}
    old = allocate_shards(old_specs, layout, rank)
    for i, t in enumerate(old.values()):
        t.local.copy_(torch.arange(t.local.numel(), dtype=torch.float32).view_as(t.local) + 100 * rank + i)
    expected = {k: t.local.clone() for k, t in old.items()}
    new = allocate_shards(new_specs, layout, rank, held=HeldShards(old, layout, rank))
    report = migrate(old_state=old, new_state=new, old_layout=layout, new_layout=layout,
                     identity=IdentityMap.same_processes(world), pid=rank)
    adopted = sorted(k for k in new if new[k].local.data_ptr() == old[k].local.data_ptr())
    release_storage(old, keep=adopted_storages(new))  # what a drain does next: the adopted shards must survive it
    kept_exact = all(torch.equal(new[k].local, expected[k]) for k in adopted)
    # The moved tensor's column half: its rows from both old holders (rank r held rows 4r..4r+3).
    moved = new["param/moved"].local
    whole = torch.cat([torch.arange(24, dtype=torch.float32).view(4, 6) + 100 * r + 16 for r in range(world)])
    moved_exact = torch.equal(moved, whole[:, 3 * rank:3 * rank + 3])
    return {"adopted": adopted, "kept_exact": kept_exact, "moved_exact": moved_exact,
            "copied": report.total_bytes_copied, "received": report.total_bytes_received}


@pytest.mark.timeout(180)
def test_shards_a_change_keeps_in_place_are_adopted_not_copied() -> None:
    results = run_distributed(_kept_shards_worker, 2, timeout_s=150)
    for result in results:
        assert result["adopted"] == sorted(f"param/kept{i}" for i in range(16))
        assert result["kept_exact"] and result["moved_exact"]
        # Only the moved tensor is written: a quarter of it copied locally on each process, a quarter received.
        assert result["copied"] == 2 * 12 * 4 and result["received"] == 2 * 12 * 4
