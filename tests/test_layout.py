"""HybridLayout validation: a table of valid and invalid layouts with the error text each must give."""

from __future__ import annotations

import pytest

from lightning_emig.layout import MESH_AXIS_ORDER, HybridLayout, LayoutError, MeshAxis, degrees_from_short

VALID = [
    # (layout kwargs, world size, resolved degrees (dp_replicate, dp_shard, tp, pp))
    ({}, 4, (1, 4, 1, 1)),
    ({"tp": 2}, 4, (1, 2, 2, 1)),
    ({"dp_replicate": 2, "dp_shard": -1}, 4, (2, 2, 1, 1)),
    ({"dp_shard": 1, "tp": -1}, 4, (1, 1, 4, 1)),
    ({"dp_replicate": -1, "dp_shard": 2, "tp": 2}, 8, (2, 2, 2, 1)),
    ({"dp_shard": 3}, 3, (1, 3, 1, 1)),
    ({}, 1, (1, 1, 1, 1)),
]


@pytest.mark.parametrize(("kwargs", "world", "expected"), VALID)
def test_valid_layouts_resolve(kwargs: dict[str, int], world: int, expected: tuple[int, ...]) -> None:
    layout = HybridLayout(**kwargs).resolve(world)
    assert (layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp) == expected
    assert layout.world_size == world
    assert layout.dp == expected[0] * expected[1]
    assert layout.mesh_shape == (expected[3], expected[0], expected[1], expected[2])


INVALID_CONSTRUCTION = [
    ({"tp": 0}, "tp=0 must be a positive integer or -1"),
    ({"dp_shard": -2}, "dp_shard=-2 must be a positive integer or -1"),
    ({"dp_shard": -1, "tp": -1}, "at most one layout degree may be -1"),
    ({"tp": 1.5}, "tp must be an int"),
    ({"pp": True}, "pp must be an int"),
    ({"pp_virtual": 0, "pp": 2}, "pp_virtual must be a positive integer"),
    ({"pp_virtual": 2}, r"pp_virtual=2 \(stages per pipeline process\) needs pp > 1"),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID_CONSTRUCTION)
def test_invalid_degrees_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        HybridLayout(**kwargs)  # type: ignore[arg-type]


INVALID_FOR_WORLD = [
    ({"dp_shard": 2, "tp": 2}, 8, "multiplies to 4 but the world size is 8"),
    ({"tp": 3}, 4, "the other degrees multiply to 3, which does not divide the world size 4"),
    ({}, 0, "world size must be >= 1"),
]


@pytest.mark.parametrize(("kwargs", "world", "message"), INVALID_FOR_WORLD)
def test_layouts_that_do_not_fit_the_world(kwargs: dict[str, int], world: int, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        HybridLayout(**kwargs).resolve(world)


MODEL = {"n_heads": 8, "n_kv_heads": 2, "ffn_hidden": 96, "n_layers": 4}

INVALID_FOR_MODEL = [
    ({"tp": 16, "dp_shard": 1}, "does not divide the model's attention heads"),
    ({"tp": 4, "dp_shard": 1}, "does not divide the model's kv heads"),
    ({"pp": 8, "dp_shard": 1}, "pp=8 is more stages than the model's 4 blocks"),
    ({"pp": 2, "pp_virtual": 3, "dp_shard": 1}, "pp=2 x pp_virtual=3 is more stages than the model's 4 blocks"),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID_FOR_MODEL)
def test_layouts_the_model_cannot_take(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        HybridLayout(**kwargs).validate_for_model(**MODEL)


def test_ffn_width_must_split_evenly() -> None:
    with pytest.raises(LayoutError, match="FFN width"):
        HybridLayout(tp=2, dp_shard=1).validate_for_model(n_heads=4, n_kv_heads=2, ffn_hidden=97, n_layers=2)


def test_the_short_form_names_every_degree() -> None:
    assert degrees_from_short("p2v2s2") == {"pp": 2, "pp_virtual": 2, "dp_shard": 2}
    assert degrees_from_short("r2t4") == {"dp_replicate": 2, "tp": 4}
    for bad in ("", "x2", "p2s", "p2 s2"):
        with pytest.raises(LayoutError, match="bad layout"):
            degrees_from_short(bad)


def test_unresolved_layout_refuses_derived_sizes() -> None:
    with pytest.raises(LayoutError, match="resolve"):
        _ = HybridLayout().world_size


def test_axis_order_puts_tensor_parallel_innermost() -> None:
    assert MESH_AXIS_ORDER[-1] is MeshAxis.TP
    assert HybridLayout(tp=2, dp_shard=2).degree(MeshAxis.DP) == 2


def _group_timeouts(rank: int, world: int) -> dict[str, float]:
    from datetime import timedelta

    import torch

    from lightning_emig.layout import build_mesh

    def seconds(group: object) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()  # type: ignore[attr-defined]

    mesh = build_mesh(HybridLayout(dp_replicate=1, dp_shard=-1, tp=2).resolve(world), "cpu",
                      timeout=timedelta(seconds=17))
    over = build_mesh(HybridLayout(dp_shard=-1).resolve(world), "cpu", ranks=list(range(world)),
                      timeout=timedelta(seconds=19))
    out = {axis.value: seconds(mesh[axis].get_group()) for axis in MESH_AXIS_ORDER}
    out["dp"] = seconds(mesh.dp.get_group())
    out["over_dp"] = seconds(over.dp.get_group())
    return out


@pytest.mark.multiprocess
def test_every_mesh_group_honours_the_configured_timeout() -> None:
    # torch gives a mesh's sub-groups its 30-minute default unless told: a survivor would wait that long on a dead peer.
    from lightning_emig.testing.distributed import run_distributed

    timeouts = run_distributed(_group_timeouts, 4, timeout_s=120)[0]
    assert timeouts == {**dict.fromkeys([a.value for a in MESH_AXIS_ORDER], 17.0), "dp": 17.0, "over_dp": 19.0}


# ------------------------------------------------------------------------------------------- rank order
def test_a_rank_order_names_every_axis_once_with_replicas_outside_shards() -> None:
    layout = HybridLayout(pp=2, dp_shard=2, rank_order="dp_replicate>dp_shard>pp>tp")
    assert layout.rank_order == ("dp_replicate", "dp_shard", "pp", "tp")
    assert HybridLayout(rank_order=["pp", "dp_replicate", "dp_shard", "tp"]).rank_order is None  # the default
    assert HybridLayout(**layout.resolve(4).as_dict()) == layout.resolve(4)  # survives JSON
    assert "ranks=dp_replicate>dp_shard>pp>tp" in layout.describe()
    with pytest.raises(LayoutError, match="must name each of"):
        HybridLayout(rank_order=["pp", "tp"])
    with pytest.raises(LayoutError, match="dp_replicate must come before dp_shard"):
        HybridLayout(rank_order=["dp_shard", "dp_replicate", "pp", "tp"])


def test_the_rank_grid_is_the_geometrys_rank_of_every_coordinate() -> None:
    import itertools

    from lightning_emig.migration.geometry import rank_to_coordinate
    from lightning_emig.migration.rank_order import candidate_orders

    orders = candidate_orders(HybridLayout(pp=2, dp_replicate=2, dp_shard=3, tp=2).resolve(24))
    assert len(orders) == 12
    for layout in orders:
        coords = itertools.product(*(range(n) for n in layout.mesh_shape))
        grid = layout.rank_grid()
        assert sorted(grid) == list(range(24))
        assert all(rank_to_coordinate(r, layout.mesh_shape, layout.rank_axes) == c
                   for r, c in zip(grid, coords, strict=True))


def _mesh_groups(rank: int, world: int) -> dict[str, list[int]]:
    import torch.distributed as dist

    from lightning_emig.layout import build_mesh

    mesh = build_mesh(HybridLayout(pp=2, dp_shard=2, rank_order="dp_replicate>dp_shard>pp>tp").resolve(world), "cpu")
    axes = {axis.value: dist.get_process_group_ranks(mesh[axis].get_group()) for axis in (MeshAxis.PP,
                                                                                          MeshAxis.DP_SHARD)}
    return {**axes, "coordinate": list(mesh.root.get_coordinate())}


@pytest.mark.multiprocess
def test_a_mesh_numbers_its_ranks_in_the_layouts_rank_order() -> None:
    from lightning_emig.testing.distributed import run_distributed

    results = run_distributed(_mesh_groups, 4, timeout_s=60)
    # dp_shard slowest: ranks 0, 1 are shard 0 of stages 0, 1; ranks 2, 3 shard 1
    assert [r["coordinate"] for r in results] == [[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0], [1, 0, 1, 0]]
    assert [r["pp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_shard"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
