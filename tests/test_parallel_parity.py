"""A parallelized model is the same model: same initial weights, same loss, same full gradients.

Every layout below runs in spawned gloo processes and is compared with a single-process reference computed in
the same worker from the same seed. Each data-parallel rank takes its own slice of one global batch and averages
the loss over it; FSDP2 averages gradients over the data-parallel ranks, so the result must equal the gradient
of the mean loss over the whole batch.

Tolerances (fp32): initial weights must be bit-identical (same generator, pure slicing). Loss and gradients
differ from the reference only by reduction order (TP splits matmul reductions, FSDP2 averages over ranks), so
we allow ``rtol=1e-5, atol=1e-7``. Measured on torch 2.13 CPU/gloo, max absolute gradient error per layout:
tp=2 4.7e-9, dp_shard=2 9.3e-10, tp=2 x dp_shard=2 4.7e-9, HSDP 2x2 9.3e-9, tp=4 7.5e-9, dp_shard=4 7.5e-9; loss
error 0 or one fp32 ulp (4.8e-7 at loss 5.54). The smallest gradients (attention ``wq``) reach ~1.3e-4, and
exchanging two shards of any gradient changes it by >= 2e-4, over 100x the tolerance
(``test_tolerance_catches_a_swapped_shard``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_emig.layout import HybridLayout, LayoutError, LayoutMesh, build_mesh
from lightning_emig.models.llama import Llama, causal_lm_loss, get_model_config
from lightning_emig.parallelize import materialize_and_init, parallelize_model
from lightning_emig.testing.distributed import run_distributed

pytestmark = pytest.mark.multiprocess

SEED = 1234
GLOBAL_BATCH = 8
SEQ_LEN = 32  # divisible by every TP degree used here (sequence parallelism shards it)
RTOL, ATOL = 1e-5, 1e-7


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _reference() -> tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
    """Single-process initial weights, loss and gradients of the mean loss over the global batch."""
    with torch.device("meta"):
        model = Llama(get_model_config("tiny"))
    materialize_and_init(model, "cpu", SEED)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    inputs, targets = _global_batch()
    loss = causal_lm_loss(model(inputs), targets)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return weights, loss.item(), grads


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _describe_placement(param: torch.Tensor) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(mesh axis names, placement reprs)``; ``((), ())`` for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return (), ()
    return tuple(param.device_mesh.mesh_dim_names or ()), tuple(repr(p) for p in param.placements)


def _param_kind(name: str) -> str:
    if name.endswith("norm.weight"):
        return "norm"
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        return "rowwise"
    return "dim0"  # column-wise linears (wq wk wv w1 w3 output) and the vocab-sharded embedding


S0, S1, REP, SS0 = "Shard(dim=0)", "Shard(dim=1)", "Replicate()", "_StridedShard(dim=0, sf=2)"
#: What migration/geometry code will meet: (mesh axes, placements) of each parameter kind per layout.
EXPECTED_PLACEMENTS: dict[tuple[tuple[str, int], ...], dict[str, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    (("dp_shard", 1), ("tp", 2)): {
        "dim0": (("tp",), (S0,)),
        "rowwise": (("tp",), (S1,)),
        "norm": (("tp",), (REP,)),
    },
    (("dp_shard", 2),): {kind: (("dp_shard",), (S0,)) for kind in ("dim0", "rowwise", "norm")},
    # FSDP2 shards dim 0 after TP did: on a TP-sharded dim 0 its shard is strided (split_factor = tp).
    (("dp_shard", 2), ("tp", 2)): {
        "dim0": (("dp_shard", "tp"), (SS0, S0)),
        "rowwise": (("dp_shard", "tp"), (S0, S1)),
        "norm": (("dp_shard", "tp"), (S0, REP)),
    },
    (("dp_shard", 1), ("tp", 4)): {
        "dim0": (("tp",), (S0,)),
        "rowwise": (("tp",), (S1,)),
        "norm": (("tp",), (REP,)),
    },
    (("dp_shard", 4),): {kind: (("dp_shard",), (S0,)) for kind in ("dim0", "rowwise", "norm")},
    (("dp_replicate", 2), ("dp_shard", 2)): {
        kind: (("dp_replicate", "dp_shard"), (REP, S0)) for kind in ("dim0", "rowwise", "norm")
    },
}


def _assert_placements(layouts: list[dict[str, int]], results: list[list[dict[str, Any]]]) -> None:
    for index, kwargs in enumerate(layouts):
        expected = EXPECTED_PLACEMENTS[tuple(sorted(kwargs.items()))]
        for rank_results in results:
            for name, actual in rank_results[index]["placements"].items():
                assert actual == expected[_param_kind(name)], f"{kwargs} {name}: {actual}"


def _check_local_box(name: str, param: torch.Tensor, full: torch.Tensor) -> None:
    """Pin the private geometry helper: under our layouts every local shard is one box of the full tensor.

    That holds for FSDP2-over-TP's ``_StridedShard(0, sf=tp)`` on the dp_shard axis followed by ``Shard(0)`` on the
    tp axis because tp is the innermost mesh axis; geometry code relies on both facts.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return
    mesh = param.device_mesh
    shape, offset = _compute_local_shape_and_global_offset(
        param.shape, mesh.shape, mesh.get_coordinate(), param.placements
    )
    box = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    assert torch.equal(param.to_local(), full[box]), (
        f"{name}: local shard is not box {box} of the full tensor"
    )


def _check_layout(layout: HybridLayout, reference: tuple[Any, float, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    ref_weights, ref_loss, ref_grads = reference
    layout_mesh = build_mesh(layout, "cpu")
    with torch.device("meta"):
        model = Llama(get_model_config("tiny"))
    parallelize_model(model, layout_mesh)
    materialize_and_init(model, "cpu", SEED)

    placements = {name: _describe_placement(p) for name, p in model.named_parameters()}
    for name, param in model.named_parameters():
        # Initialization is pure slicing of the same generated tensor: bit-identical, no tolerance.
        assert torch.equal(_full(param.detach()), ref_weights[name]), f"{layout.describe()}: init of {name}"
        _check_local_box(name, param.detach(), ref_weights[name])

    inputs, targets = _global_batch()
    micro = GLOBAL_BATCH // layout.dp
    rows = slice(layout_mesh.dp_rank * micro, (layout_mesh.dp_rank + 1) * micro)
    loss = causal_lm_loss(model(inputs[rows]), targets[rows])
    loss.backward()

    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=layout_mesh.dp.get_group())
    mean_loss /= layout.dp
    loss_error = abs(mean_loss.item() - ref_loss)
    assert loss_error <= ATOL + RTOL * abs(ref_loss), (
        f"{layout.describe()}: loss {mean_loss.item()} vs {ref_loss}"
    )

    grad_error = 0.0
    for name, param in model.named_parameters():
        grad = _full(param.grad)
        torch.testing.assert_close(
            grad, ref_grads[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
        grad_error = max(grad_error, (grad - ref_grads[name]).abs().max().item())
    if layout.tp > 1:
        # Last: a forward that raises leaves FSDP2's iteration state undefined.
        with pytest.raises(ValueError, match="sequence length 31 is not divisible by the tensor-parallel"):
            model(inputs[:, :31])
    return {"loss_error": loss_error, "grad_error": grad_error, "placements": placements}


def _parity_worker(rank: int, world_size: int, layouts: list[dict[str, int]]) -> list[dict[str, Any]]:
    torch.manual_seed(rank)  # any hidden dependence on the global RNG would make ranks disagree
    reference = _reference()
    return [_check_layout(HybridLayout(**kwargs).resolve(world_size), reference) for kwargs in layouts]


def test_two_rank_layouts_match_single_process() -> None:
    layouts = [{"dp_shard": 1, "tp": 2}, {"dp_shard": 2}]
    results = run_distributed(_parity_worker, 2, layouts, timeout_s=90)
    _assert_placements(layouts, results)


def test_four_rank_layouts_match_single_process() -> None:
    layouts = [
        {"dp_shard": 2, "tp": 2},
        {"dp_replicate": 2, "dp_shard": 2},
        {"dp_shard": 1, "tp": 4},
        {"dp_shard": 4},
    ]
    results = run_distributed(_parity_worker, 4, layouts, timeout_s=120)
    _assert_placements(layouts, results)


def _unbuilt_mesh(layout: HybridLayout) -> LayoutMesh:
    """Only ``.layout``: the refusals below must happen before any mesh or process group is touched."""
    return SimpleNamespace(layout=layout)  # type: ignore[return-value]


def test_pipeline_stages_need_a_model_that_can_be_cut() -> None:
    class NoStages(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2), "1": torch.nn.Linear(2, 2)})

    layout = HybridLayout(dp_shard=1, pp=2).resolve(2)
    with pytest.raises(ValueError, match="pp=2 needs a model that can be cut into stages"):
        parallelize_model(NoStages(), _unbuilt_mesh(layout))


def test_layout_that_does_not_fit_the_model_is_refused() -> None:
    layout = HybridLayout(dp_shard=1, tp=8).resolve(8)
    with pytest.raises(LayoutError, match="tp=8 does not divide"):
        parallelize_model(Llama(get_model_config("tiny")), _unbuilt_mesh(layout))


def test_tolerance_catches_a_swapped_shard() -> None:
    """The tolerance is far below what exchanging two shards of any gradient changes."""
    _, _, grads = _reference()
    for name, grad in grads.items():
        half = grad.shape[0] // 2
        swapped = torch.cat((grad[half:], grad[:half]))
        assert not torch.allclose(swapped, grad, rtol=RTOL, atol=100 * ATOL), name
