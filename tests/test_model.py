"""The reference Llama: config validation, sizes, forward contract and deterministic initialization."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lightning_emig.models import MODEL_SIZES, Llama, LlamaConfig, ParallelizableModel, get_model_config
from lightning_emig.models.llama import Attention, causal_lm_loss, rotary_tables
from lightning_emig.parallelize import materialize_and_init

TINY = get_model_config("tiny")


def _tiny_model(seed: int = 0) -> Llama:
    with torch.device("meta"):
        model = Llama(TINY)
    materialize_and_init(model, "cpu", seed)
    return model


INVALID_CONFIGS = [
    ({"dim": 60, "n_heads": 8}, r"dim \(60\) must be divisible by n_heads \(8\)"),
    ({"n_heads": 4, "n_kv_heads": 3}, r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"),
    ({"dim": 12, "n_heads": 4, "n_kv_heads": 4}, "head dimension dim/n_heads = 3 must be even"),
    ({"vocab_size": 100}, r"vocab_size \(100\) must be >= 256"),
    ({"n_layers": 0}, "n_layers must be a positive int"),
    ({"ffn_hidden": True}, "ffn_hidden must be a positive int"),
    ({"norm_eps": 0.0}, "norm_eps and rope_theta must be positive"),
]


@pytest.mark.parametrize(("overrides", "message"), INVALID_CONFIGS)
def test_invalid_configs_are_rejected(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(TINY, **overrides)


def test_config_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        LlamaConfig(64, 2, 4, 2, 176, 256, 64)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        TINY.dim = 128  # type: ignore[misc]


def test_unknown_size_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown model size 'llama_7b'; valid names: tiny, tiny_deep, llama_25m"):
        get_model_config("llama_7b")


def test_tiny_is_small() -> None:
    assert _tiny_model().num_params() == TINY.num_params() < 1_000_000


NOMINAL_SIZES = {"llama_25m": 25e6, "llama_125m": 125e6, "llama_350m": 350e6, "llama_1b": 1e9}


@pytest.mark.parametrize("name", list(NOMINAL_SIZES))
def test_sizes_match_their_names(name: str) -> None:
    config = get_model_config(name)
    with torch.device("meta"):  # no allocation, even for 1B
        model = Llama(config)
    assert model.num_params() == config.num_params()
    assert abs(config.num_params() / NOMINAL_SIZES[name] - 1) < 0.1, f"{name}: {config.num_params():,}"


def test_every_size_fits_tp_4() -> None:
    for name, config in MODEL_SIZES.items():
        for width in (config.n_heads, config.n_kv_heads, config.ffn_hidden):
            assert width % 4 == 0, name


def test_forward_shape_and_initial_loss() -> None:
    model = _tiny_model()
    tokens = torch.randint(0, 256, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, 256)
    # Small initial weights give near-uniform predictions.
    assert causal_lm_loss(logits, tokens).item() == pytest.approx(math.log(256), rel=0.02)


def test_sequence_longer_than_rope_tables_is_rejected() -> None:
    limit = MODEL_SIZES["tiny"].max_seq_len
    with pytest.raises(ValueError, match=f"exceeds max_seq_len={limit}"):
        _tiny_model()(torch.zeros(1, limit + 1, dtype=torch.long))


def test_attention_is_causal() -> None:
    model = _tiny_model()
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        assert torch.equal(model(tokens)[:, :10], model(changed)[:, :10])


def test_grouped_query_attention_shares_kv_heads_by_block() -> None:
    """Query head i reads kv head i // (n_heads / n_kv_heads); TP relies on this block grouping."""
    torch.manual_seed(0)
    attention = Attention(TINY)
    x = torch.randn(2, 8, TINY.dim)
    cos, sin = (t[:8] for t in rotary_tables(TINY))
    from lightning_emig.models.llama import apply_rotary

    q = apply_rotary(attention.wq(x).view(2, 8, TINY.n_heads, -1), cos, sin).transpose(1, 2)
    k = apply_rotary(attention.wk(x).view(2, 8, TINY.n_kv_heads, -1), cos, sin).transpose(1, 2)
    v = attention.wv(x).view(2, 8, TINY.n_kv_heads, -1).transpose(1, 2)
    repeat = TINY.n_heads // TINY.n_kv_heads
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    expected = attention.wo(
        F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
    )
    torch.testing.assert_close(attention(x, cos, sin), expected)


def test_parameter_names_are_stable_block_keys() -> None:
    model = _tiny_model()
    assert list(model.layers.keys()) == ["0", "1"]
    assert model.blocks() == list(model.layers.values())
    assert "layers.1.attention.wq.weight" in dict(model.named_parameters())
    assert isinstance(model, ParallelizableModel)


def test_tensor_parallel_plan_names_real_submodules() -> None:
    model = _tiny_model()
    plan = model.tensor_parallel_plan()
    root_names = dict(model.named_modules())
    block_names = dict(model.blocks()[0].named_modules())
    assert set(plan.root) <= set(root_names)
    assert set(plan.block) <= set(block_names)


def test_same_seed_gives_same_weights_and_different_seed_does_not() -> None:
    first, again, other = (
        _tiny_model(7).state_dict(),
        _tiny_model(7).state_dict(),
        _tiny_model(8).state_dict(),
    )
    for name, value in first.items():
        assert torch.equal(value, again[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(value, other[name]), name


def test_initialization_does_not_depend_on_global_rng_or_starting_device() -> None:
    torch.manual_seed(123)
    from_meta = _tiny_model(3).state_dict()
    torch.manual_seed(456)
    on_cpu = Llama(TINY)  # allocated and default-initialized, then re-initialized
    materialize_and_init(on_cpu, "cpu", 3)
    for name, value in on_cpu.state_dict().items():
        assert torch.equal(value, from_meta[name]), name


def test_rope_buffers_are_rebuilt_after_materialization() -> None:
    model = _tiny_model()
    cos, sin = rotary_tables(TINY)
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)
    assert "rope_cos" not in model.state_dict()  # derived, never saved or migrated


def test_initial_statistics() -> None:
    params = dict(_tiny_model().named_parameters())
    assert torch.equal(params["norm.weight"], torch.ones(TINY.dim))
    assert params["output.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * TINY.n_layers)
    assert params["layers.0.feed_forward.w2.weight"].std().item() == pytest.approx(residual_std, rel=0.05)


def test_materializing_keeps_tied_weights_one_parameter() -> None:
    """``to_empty`` replaces each module's parameters on its own: a weight tied under two names would come back as
    two tensors, trained apart. Both materializers keep it one."""
    from torch import nn

    from lightning_emig.parallelize.init import materialize_and_init, materialize_empty

    for materialize in (lambda m: materialize_and_init(m, "cpu", seed=0, init_parameter=lambda n, full, g: full.zero_()),
                        lambda m: materialize_empty(m, "cpu")):
        with torch.device("meta"):
            model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
        model[1].weight = model[0].weight
        materialize(model)
        assert model[1].weight is model[0].weight and not model[0].weight.is_meta
