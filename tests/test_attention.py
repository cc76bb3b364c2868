"""Properties of the layer a user relies on beyond the oracle: variants, weights, dropout, explain, config."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from multihead import AttentionConfig, KVCache, MultiHeadAttention, MultiheadError
from multihead.cache import DenseKV
from multihead.kernels import AttentionCall, attend, resolve_backend
from multihead.layers.masks import build_mask


@pytest.mark.parametrize("n_kv_heads", [6, 3, 2, 1], ids=["mha", "gqa3", "gqa2", "mqa"])
def test_gqa_equals_mha_with_each_kv_head_copied_to_its_group(n_kv_heads: int) -> None:
    """head i reads KV head i // (n_heads / n_kv_heads): an MHA layer with the K/V rows copied so computes the same."""
    h, d, d_model = 6, 4, 24
    gqa = MultiHeadAttention(d_model=d_model, n_heads=h, n_kv_heads=n_kv_heads, head_dim=d)
    mha = MultiHeadAttention(d_model=d_model, n_heads=h, head_dim=d)
    group = h // n_kv_heads
    with torch.no_grad():
        for name in ("q_proj", "o_proj"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            copied = src.weight.view(n_kv_heads, d, d_model).repeat_interleave(group, 0)  # (h, d, d_model)
            dst.weight.copy_(copied.reshape(h * d, d_model))
            dst.bias.copy_(src.bias.view(n_kv_heads, d).repeat_interleave(group, 0).reshape(h * d))
    x = torch.randn(2, 7, d_model)
    for backend in ("sdpa", "math"):
        torch.testing.assert_close(gqa(x, causal=True, backend=backend), mha(x, causal=True, backend=backend))


@pytest.mark.usefixtures("two_threads")  # 4 folded work items share evenly among 2 threads: folded
@pytest.mark.parametrize("mask_kind", ["none", "shared", "per_head", "float_per_head", "padding", "positions"])
def test_a_gqa_decode_step_folds_query_heads_and_equals_the_math_path(
    mask_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One query per head: SDPA gets the query heads of a group as rows (b, g, h/g, d); masks fold with them."""
    torch.manual_seed(0)
    b, h, g, t, d = 2, 6, 2, 9, 4
    q = torch.randn(b, h, 1, d, dtype=torch.float64)
    k, v = torch.randn(b, g, t, d, dtype=torch.float64), torch.randn(b, g, t, d, dtype=torch.float64)
    kw: dict = {}
    if mask_kind == "shared":
        kw["mask"] = torch.rand(b, 1, 1, t) < 0.6
    elif mask_kind == "per_head":
        kw["mask"] = torch.rand(b, h, 1, t) < 0.6
        kw["mask"][0, 3] = False  # a head with no key at all: zeros
    elif mask_kind == "float_per_head":
        kw["mask"] = torch.randn(1, h, 1, t, dtype=torch.float64)
    elif mask_kind == "padding":
        kw["key_padding_mask"] = torch.arange(t)[None] < torch.tensor([[4], [9]])
    spec = build_mask(batch=b, n_heads=h, s=1, t=t, causal=mask_kind == "positions", **kw)
    if mask_kind == "positions":
        from dataclasses import replace

        spec = replace(spec, q_positions=torch.tensor([[3], [8]]))  # a cache's sequences at different lengths
    seen: list[tuple[int, ...]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(tuple(query.shape))
        return real(query, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got, _ = attend(AttentionCall(q, DenseKV(k, v), spec, scale=0.5, backend="sdpa"))
    monkeypatch.undo()
    want, _ = attend(AttentionCall(q, DenseKV(k, v), spec, scale=0.5, backend="math"))
    assert seen == [(b, g, h // g, d)]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.usefixtures("two_threads")
def test_decode_steps_fold_where_it_measured_faster() -> None:
    spec = build_mask(batch=1, n_heads=9, s=1, t=64)

    def folds(b: int, h: int, g: int, s: int = 1) -> bool:  # the plan of the one backend policy
        k = torch.zeros(b, g, 64, 8)
        return resolve_backend(AttentionCall(torch.zeros(b, h, s, 8), DenseKV(k, k), spec, scale=1.0)).fold

    assert folds(1, 32, 8) and folds(1, 8, 1) and folds(2, 9, 3)
    assert not folds(1, 8, 8) and not folds(1, 32, 8, s=2)  # MHA; prefill


@pytest.mark.usefixtures("two_threads")
def test_an_uneven_gqa_decode_is_folded_as_the_hosts_table_says_and_never_timed(tuning_table, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """9/3 heads at batch 1 (SmolLM2's decode: 3 work items for 2 threads), where no rule decides: not folded
    without a tuning entry, folded for the power-of-two range of key counts the table says, and the same answer on
    every call (no call reads the clock); the result equals the math path either way."""
    import time

    from multihead.kernels import cpu

    def plan(t: int):  # type: ignore[no-untyped-def]
        k = torch.zeros(1, 3, t, 8)
        return resolve_backend(AttentionCall(torch.zeros(1, 9, 1, 8), DenseKV(k, k),
                                             build_mask(batch=1, n_heads=9, s=1, t=t), scale=1.0))

    assert not plan(100).fold  # the default: SDPA's own GQA
    tuning_table({cpu.attention_key("fold", 1, 9, 3, torch.float32, 100, 2): "folded"})
    assert plan(100).fold and plan(64).fold and plan(127).fold  # the range 64-127
    assert not plan(128).fold and not plan(63).fold
    monkeypatch.setattr(time, "perf_counter", lambda: pytest.fail("a decision read the clock"))
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 9, 1, 8), torch.randn(1, 3, 100, 8), torch.randn(1, 3, 100, 8)
    call = AttentionCall(q, DenseKV(k, v), build_mask(batch=1, n_heads=9, s=1, t=100), scale=8**-0.5)
    want = attend(dataclasses.replace(call, backend="math"))[0]
    for _ in range(3):
        torch.testing.assert_close(attend(call)[0], want, rtol=1e-6, atol=1e-6)


def test_k_and_v_projections_are_n_kv_heads_wide() -> None:
    layer = MultiHeadAttention(d_model=4096, n_heads=32, n_kv_heads=8, device="meta")
    assert layer.q_proj.weight.shape == (4096, 4096)
    assert layer.k_proj.weight.shape == (1024, 4096)
    assert layer.v_proj.weight.shape == (1024, 4096)
    assert layer.o_proj.weight.shape == (4096, 4096)
    assert layer.config.variant == "GQA"


def test_explicit_head_dim_like_gemma() -> None:
    layer = MultiHeadAttention(d_model=3072, n_heads=16, head_dim=256, bias=False, device="meta")
    assert layer.q_proj.weight.shape == (4096, 3072)
    assert layer.o_proj.weight.shape == (3072, 4096)
    assert layer.config.softmax_scale == 256**-0.5


def test_weights_are_per_head_rows_sum_to_one_and_reproduce_the_output() -> None:
    layer = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
    x = torch.randn(3, 6, 16)
    y, w = layer(x, causal=True, return_weights=True)
    assert w.shape == (3, 4, 6, 6)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, 6))
    assert (w.triu(1) == 0).all()
    # y = W_O(concat_i w_i v_g(i)): the weights returned are the ones used
    v = layer.v_proj(x).view(3, 6, 2, 4).transpose(1, 2).repeat_interleave(2, 1)
    merged = (w @ v).transpose(1, 2).reshape(3, 6, 16)
    torch.testing.assert_close(layer.o_proj(merged), y)
    assert not torch.allclose(w[:, 0], w[:, 1])  # heads differ: never averaged


def test_dropout_only_in_training_and_weights_are_those_used() -> None:
    layer = MultiHeadAttention(d_model=16, n_heads=4, dropout=0.5)
    x = torch.randn(2, 8, 16)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    _, w_eval = layer(x, return_weights=True)
    layer.train()
    y, w = layer(x, return_weights=True)
    dropped = w == 0
    assert 0.3 < dropped.float().mean() < 0.7
    torch.testing.assert_close(w[~dropped], 2 * w_eval[~dropped])
    v = layer.v_proj(x).view(2, 8, 4, 4).transpose(1, 2)
    torch.testing.assert_close(layer.o_proj((w @ v).transpose(1, 2).reshape(2, 8, 16)), y)
    assert not torch.allclose(layer(x), layer(x))  # the fused path drops too


def test_config_builds_the_layer_and_fills_defaults_once() -> None:
    config = AttentionConfig(d_model=768, n_heads=12)
    assert (config.head_dim, config.n_kv_heads, config.kv_dim, config.variant) == (64, 12, 768, "MHA")
    layer = config.build()
    assert layer.config == config
    assert AttentionConfig(d_model=768, n_heads=24).head_dim == 32  # doubling the heads halves d_k
    assert AttentionConfig(d_model=64, n_heads=8, n_kv_heads=1).variant == "MQA"


def test_the_config_is_the_constructors_argument_or_its_fields_are_keywords() -> None:
    config = AttentionConfig(d_model=64, n_heads=8, n_kv_heads=2, rope=10000.0, window=16)
    a = MultiHeadAttention(config, backend="math", dtype=torch.float64)
    b = MultiHeadAttention(d_model=64, n_heads=8, n_kv_heads=2, rope=10000.0, window=16, backend="math",
                           dtype=torch.float64)
    assert a.config == b.config == config and a.backend == b.backend == "math"
    assert a.q_proj.weight.dtype == torch.float64
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    assert torch.equal(a(x, causal=True), b(x, causal=True))
    # every derived value is a plain number: nothing downstream needs to ask for None
    assert (config.head_dim, config.kv_dim, config.value_dim, config.out_bias) == (8, 64, 64, True)
    with pytest.raises(MultiheadError, match=r"give a config or its fields as keywords, not both \(got a config and "
                                             r"n_heads\)"):
        MultiHeadAttention(config, n_heads=4)
    with pytest.raises(MultiheadError, match=r"unknown attention option\(s\) 'heads': the options are d_model, "
                                             r"n_heads, n_kv_heads"):
        MultiHeadAttention(d_model=64, heads=8)
    with pytest.raises(MultiheadError, match="config must be an AttentionConfig, got dict"):
        MultiHeadAttention({"d_model": 64})  # type: ignore[arg-type]


def test_explain_never_writes_into_the_kv_cache() -> None:
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2, rope=10000.0).eval()
    cache = KVCache(batch=1, n_kv_heads=2, head_dim=8, max_len=8)
    x = torch.randn(1, 4, 32)
    with torch.no_grad():
        layer(x[:, :3], causal=True, cache=cache.layer(0))
        cache.advance(3)
        k, v = cache.k.clone(), cache.v.clone()
        choice = layer.explain(x[:, 3:], causal=True, cache=cache.layer(0))
        assert torch.equal(cache.k, k) and torch.equal(cache.v, v) and cache.used == 3
        assert "bottom-right" in choice.mask or choice.mask == "none"
        step = layer(x[:, 3:], causal=True, cache=cache.layer(0))
    torch.testing.assert_close(step, layer(x, causal=True)[:, 3:], atol=1e-6, rtol=1e-5)


def test_a_step_is_made_once_and_shared_by_the_layers_of_a_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from multihead.layers.rope import RotaryEmbedding
    from multihead.models import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(vocab_size=50, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64))
    made = []
    real = RotaryEmbedding.tables
    monkeypatch.setattr(RotaryEmbedding, "tables", lambda self, *a: made.append(1) or real(self, *a))
    cache = model.new_cache(1, 16)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        cache.advance(3)
        model(torch.tensor([[4]]), cache=cache)
    assert len(made) == 2  # one RoPE table per step, not one per layer
    layer = MultiHeadAttention(d_model=32, n_heads=4)
    x = torch.randn(1, 3, 32)
    step = layer.step(x, causal=True)
    assert torch.equal(layer(x, step=step), layer(x, causal=True))
    with pytest.raises(MultiheadError, match=r"x has width 16 \(shape \(1, 3, 16\)\) but the layer's d_model is 32"):
        layer.step(torch.randn(1, 3, 16))
    with pytest.raises(MultiheadError, match=r"causal go to layer\.step"):
        layer(x, step=step, causal=True)
    with pytest.raises(MultiheadError, match=r"the step was made for \(b, s\) = \(1, 3\) but x has \(1, 2\)"):
        layer(x[:, :2], step=step)
    cache = KVCache(batch=1, n_kv_heads=4, head_dim=8, max_len=8)
    with pytest.raises(MultiheadError, match="the step was made without one"):
        layer(x, step=step, cache=cache.layer(0))


def test_explain_names_the_kernel_and_why() -> None:
    layer = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
    x = torch.randn(1, 5, 16)
    plain = layer.explain(x, causal=True)
    assert plain.backend == "sdpa" and plain.kernel == "flash"  # PyTorch's CPU flash kernel
    assert "causal" in plain.mask and "no dense mask" in plain.reason
    weights = layer.explain(x, return_weights=True)
    assert weights.backend == "math" and "weights requested" in weights.reason
    dense = layer.explain(x, mask=torch.ones(5, 5, dtype=torch.bool))
    assert dense.backend == "sdpa" and "dense" in dense.reason
    cross = MultiHeadAttention(d_model=16, n_heads=4, kv_dim=16).explain(x, torch.randn(1, 3, 16), causal=True)
    assert "bottom-right" in cross.mask and "s != t" in cross.reason
    asked = layer.explain(x, backend="math")
    assert asked.backend == "math" and "faster" in asked.reason
    training = MultiHeadAttention(d_model=16, n_heads=4, dropout=0.1).train().explain(x, causal=True)
    said = "materialising the (s, t) scores: its CPU fused kernel takes no dropout" in training.reason
    assert said == (training.kernel == "math")  # torch 2.13's CPU flash kernel takes no dropout: the math one runs
