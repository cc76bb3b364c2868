"""Cost accounting against counted modules, torch's FLOP counter, real checkpoint files and brute force."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from torch.utils.flop_counter import FlopCounterMode

from multihead import AttentionConfig, MultiHeadAttention, MultiheadError
from multihead.divisors import divisors
from multihead.sizing import cost
from multihead.sizing.presets import PRESET_NAMES, from_hf_config, from_hf_dict, preset
from tests_support import minilm_dir, smollm2_gguf


@st.composite
def configs(draw: st.DrawFn) -> AttentionConfig:
    n_heads = draw(st.integers(1, 12))
    bias = draw(st.booleans())
    return AttentionConfig(
        d_model=draw(st.integers(1, 64)), n_heads=n_heads, n_kv_heads=draw(st.sampled_from(divisors(n_heads))),
        head_dim=draw(st.integers(1, 16)), kv_dim=draw(st.one_of(st.none(), st.integers(1, 48))),
        bias=bias, out_bias=draw(st.sampled_from([None, not bias])),
    )


@given(config=configs())
def test_parameter_count_equals_the_layers_numel(config: AttentionConfig) -> None:
    layer = MultiHeadAttention(config, device="meta")
    counted = cost.parameters(config)
    assert counted.total == sum(p.numel() for p in layer.parameters())
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert getattr(counted, name) == sum(p.numel() for p in getattr(layer, name).parameters())


def test_the_seeds_check_yourself_answers() -> None:
    assert AttentionConfig(d_model=768, n_heads=12).head_dim == 64  # GPT-2 small
    assert AttentionConfig(d_model=768, n_heads=24).head_dim == 32  # doubling the heads halves d_k
    llama = AttentionConfig(d_model=4096, n_heads=32, bias=False)
    assert llama.head_dim == 128
    assert cost.parameters(llama).total == 4 * 4096**2 == 67_108_864  # the width is split, not multiplied
    assert cost.parameters(AttentionConfig(d_model=4096, n_heads=64, bias=False)).total == 67_108_864  # any h


def brute_force_pairs(s: int, t: int, causal: bool, window: int | None) -> int:
    n = 0
    for i in range(s):
        p = t - s + i
        for j in range(t):
            if causal and j > p:
                continue
            if window is not None and j <= p - window:
                continue
            n += 1
    return n


@given(s=st.integers(0, 50), t=st.integers(0, 50), causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 60)))
def test_attended_pairs_counts_causal_and_windows_exactly(s: int, t: int, causal: bool, window: int | None) -> None:
    window = window if causal else None
    assert cost.attended_pairs(s, t, causal=causal, window=window) == brute_force_pairs(s, t, causal, window)


def test_causal_is_not_half() -> None:
    assert cost.attended_pairs(1024, 1024, causal=True) == 1024 * 1025 // 2  # 524,800, not 524,288


def _counted_flops(layer: MultiHeadAttention, x: torch.Tensor, ctx: torch.Tensor | None, causal: bool,
                   backward: bool) -> tuple[int, int]:
    with FlopCounterMode(display=False) as forward_counter:
        y = layer(x, ctx, causal=causal, backend="math")
    with FlopCounterMode(display=False) as backward_counter:
        if backward:
            y.sum().backward()
    return forward_counter.get_total_flops(), backward_counter.get_total_flops()


@pytest.mark.parametrize("n_kv_heads", [6, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_flops_agree_with_torch_flop_counter_on_the_math_path(n_kv_heads: int, cross: bool, causal: bool) -> None:
    config = AttentionConfig(d_model=48, n_heads=6, n_kv_heads=n_kv_heads, head_dim=10, kv_dim=20 if cross else None)
    layer = MultiHeadAttention(config)
    b, s, t = 3, 17, 23 if cross else 17
    x = torch.randn(b, s, 48, requires_grad=True)
    ctx = torch.randn(b, t, 20, requires_grad=True) if cross else None
    forward, backward = _counted_flops(layer, x, ctx, causal, backward=True)
    ours = cost.flops(config, s=s, t=t, batch=b, causal=causal)
    dense = cost.flops(config, s=s, t=t, batch=b, causal=causal, exact_mask=False)
    # FlopCounterMode counts the dense matmuls a kernel runs; it does not see masks. So it equals our dense count
    # always, and our exact count only without a causal mask; with one, the exact count is smaller.
    assert forward == dense.forward
    assert backward == dense.backward
    if causal:
        assert ours.attention < dense.attention
        assert ours.projections == dense.projections
    else:
        assert forward == ours.forward


def test_kv_cache_bytes_equal_the_bytes_of_real_k_and_v() -> None:
    config = AttentionConfig(d_model=64, n_heads=8, n_kv_heads=2, bias=False)
    layer = MultiHeadAttention(config, dtype=torch.bfloat16)
    tokens = 37
    x = torch.randn(3, tokens, 64, dtype=torch.bfloat16)
    k, v = layer.k_proj(x), layer.v_proj(x)
    real = k.numel() * k.element_size() + v.numel() * v.element_size()
    assert cost.kv_cache_bytes(config, context=tokens, batch=3, dtype="bf16") == real
    assert cost.kv_cache_bytes_per_token_per_layer(config, "bf16") * tokens * 3 == real


def test_kv_cache_follows_kv_heads_dtype_window_and_layers() -> None:
    llama2 = preset("llama-2-7b")  # MHA: 2 * 32 heads * 128 * 2 bytes * 32 layers = 0.5 MiB per token
    assert cost.kv_cache_bytes_per_token_per_layer(llama2.attention, "fp16") * llama2.n_layers == 2**19
    llama3 = preset("llama-3-8b")  # GQA 8 of 32: a quarter of that
    assert cost.kv_cache_bytes_per_token_per_layer(llama3.attention, "bf16") * 32 == 2**17
    a = llama3.attention
    assert cost.kv_cache_bytes_per_token_per_layer(a, "fp32") == 2 * cost.kv_cache_bytes_per_token_per_layer(a, "bf16")
    assert cost.kv_cache_bytes_per_token_per_layer(a, "int8") == cost.kv_cache_bytes_per_token_per_layer(a, "fp8")
    mistral = preset("mistral-7b").attention
    # a window of 4096 keeps 4095 tokens between steps (the next token joins them), as transformers'
    # DynamicSlidingWindowLayer and multihead's SinkCache do: test_sizing_layers holds it against transformers
    assert cost.cached_tokens(mistral, 32768) == 4095
    assert cost.kv_cache_bytes(mistral, context=32768) == cost.kv_cache_bytes(mistral, context=4096)
    assert cost.max_context(mistral, memory_bytes=2**40) is None  # the window caps it: any context fits
    per_token = cost.kv_cache_bytes_per_token_per_layer(a, "bf16") * 32
    assert cost.max_context(a, memory_bytes=per_token * 1000 + 5, n_layers=32) == 1000


def test_attention_matrix_grows_with_the_square_of_the_context() -> None:
    a = preset("gpt2").attention
    one = cost.attention_matrix_bytes(a, s=1024, dtype="fp32")
    assert one == 12 * 1024 * 1024 * 4
    assert cost.attention_matrix_bytes(a, s=2048, dtype="fp32") == 4 * one
    assert cost.fused_attention_bytes(a, s=2048) == 2 * cost.fused_attention_bytes(a, s=1024)


@pytest.mark.slow
def test_minilm_safetensors_tensors_have_the_sizes_the_preset_predicts() -> None:
    folder = minilm_dir()
    model = preset("all-minilm-l6-v2")
    assert from_hf_config(folder / "config.json").attention == model.attention
    predicted = cost.parameters(model.attention)
    names = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "output.dense": "o_proj"}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        layers = {k.split(".")[2] for k in f.keys() if k.startswith("encoder.layer.")}  # noqa: SIM118
        assert len(layers) == model.n_layers
        for i in range(model.n_layers):
            for file_name, ours in names.items():
                prefix = f"encoder.layer.{i}.attention." + ("self." if file_name != "output.dense" else "")
                numel = 0
                for part in ("weight", "bias"):
                    shape = f.get_slice(prefix + file_name + "." + part).get_shape()
                    numel += int(torch.tensor(shape).prod())
                assert numel == getattr(predicted, ours), (i, file_name)


@pytest.mark.slow
def test_smollm2_gguf_tensors_have_the_sizes_the_preset_predicts() -> None:
    reader = GGUFReader(smollm2_gguf())
    model = preset("smollm2-135m")
    a = model.attention
    meta = {k: reader.fields[k].contents() for k in (
        "llama.embedding_length", "llama.attention.head_count", "llama.attention.head_count_kv", "llama.block_count")}
    assert (meta["llama.embedding_length"], meta["llama.attention.head_count"],
            meta["llama.attention.head_count_kv"], meta["llama.block_count"]) == (
        a.d_model, a.n_heads, a.n_kv_heads, model.n_layers)
    predicted = cost.parameters(a)
    tensors = {t.name: t for t in reader.tensors}
    assert not any(name.endswith(".bias") and ".attn_" in name for name in tensors)  # no biases, as the preset says
    for i in range(model.n_layers):
        for file_name, ours in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                                ("attn_output", "o_proj")):
            assert int(tensors[f"blk.{i}.{file_name}.weight"].n_elements) == getattr(predicted, ours)
    assert int(tensors["blk.0.attn_k.weight"].shape[1]) == a.n_kv_heads * a.head_dim  # 3 KV heads of 64: 192


def test_presets_are_exact_and_list_the_known_names() -> None:
    assert len(PRESET_NAMES) >= 15
    for name in PRESET_NAMES:
        preset(name)
    with pytest.raises(MultiheadError, match=r"unknown preset 'llama-3'.*llama-3-8b, llama-3-70b"):
        preset("llama-3")
    with pytest.raises(MultiheadError, match="unknown preset 'GPT2'"):
        preset("GPT2")
    falcon, gemma, qwen = preset("falcon-7b").attention, preset("gemma-7b").attention, preset("qwen2.5-7b").attention
    assert (falcon.n_heads, falcon.n_kv_heads, falcon.head_dim) == (71, 1, 64)
    assert (gemma.d_model, gemma.n_heads, gemma.head_dim, gemma.q_dim) == (3072, 16, 256, 4096)
    assert (qwen.bias, qwen.out_bias, qwen.n_kv_heads) == (True, False, 4)
    assert preset("bert-base").causal is False and preset("mistral-7b").causal is True


@pytest.mark.parametrize(("cfg", "field"), [
    ({"num_attention_heads": 12, "num_hidden_layers": 2}, "d_model"),
    ({"hidden_size": 768, "num_hidden_layers": 2}, "n_heads"),
    ({"hidden_size": 768, "num_attention_heads": 12}, "n_layers"),
])
def test_a_config_missing_a_field_names_it(tmp_path: Path, cfg: dict, field: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(MultiheadError, match=f"has no {field}: expected one of the fields"):
        from_hf_config(path)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(MultiheadError, match="does not exist"):
        from_hf_config(tmp_path / "nope.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(MultiheadError, match="is not valid JSON"):
        from_hf_config(bad)
    with pytest.raises(MultiheadError, match=r"n_heads \(32\) must be divisible by n_kv_heads \(5\)"):
        from_hf_dict({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 5,
                      "num_hidden_layers": 2})
    with pytest.raises(MultiheadError, match=r"'config': num_hidden_layers = 0: expected an integer from 1 to 4,096"):
        from_hf_dict({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 0})


def test_bad_sizes_and_dtypes() -> None:
    a = AttentionConfig(d_model=64, n_heads=4)
    with pytest.raises(MultiheadError, match=r"dtype 'fp4' is unknown: choose one of fp32"):
        cost.kv_cache_bytes_per_token_per_layer(a, "fp4")
    with pytest.raises(MultiheadError, match=r"context \(-1\) must be a non-negative int"):
        cost.kv_cache_bytes(a, context=-1)
    with pytest.raises(MultiheadError, match=r"batch \(0.5\) must be a non-negative int"):
        cost.flops(a, s=4, batch=0.5)  # type: ignore[arg-type]
    with pytest.raises(MultiheadError, match=r"window \(3\) is a causal sliding window"):
        cost.attended_pairs(4, 4, window=3)


@pytest.mark.parametrize("fn", [
    lambda c: cost.kv_cache_bytes_per_token_per_layer(c), lambda c: cost.parameters(c),
    lambda c: cost.flops(c, s=8), lambda c: cost.kv_cache_bytes(c, context=8), lambda c: cost.cached_tokens(c, 8),
    lambda c: cost.max_context(c, memory_bytes=2**30), lambda c: cost.attention_matrix_bytes(c, s=8),
    lambda c: cost.report(c), lambda c: cost.layers_kv_bytes(c, (cost.LayerAttention(),), context=8),
], ids=["kv_cache_bytes_per_token_per_layer", "parameters", "flops", "kv_cache_bytes", "cached_tokens",
        "max_context", "attention_matrix_bytes", "report", "layers_kv_bytes"])
def test_a_whole_model_config_is_refused_by_name_not_with_an_attribute_error(fn) -> None:  # type: ignore[no-untyped-def]
    """Issue 42 item 9: cost.kv_cache_bytes_per_token_per_layer(preset("llama-3-8b")) raised a bare AttributeError
    ('ModelConfig' object has no attribute 'n_kv_heads'). cost's functions size one layer: the error says so and
    where the layer is."""
    from multihead.sizing.presets import preset

    model = preset("llama-3-8b")
    with pytest.raises(MultiheadError, match=r"takes an AttentionConfig \(one layer's attention\), got ModelConfig; "
                                             r"a ModelConfig's is its \.attention"):
        fn(model)
    assert fn(model.attention) is not None  # what it names works
    mla = preset("deepseek-v3").mla
    with pytest.raises(MultiheadError, match="got MLAConfig; an MLA layer is sized by mla_parameters"):
        fn(mla)
    with pytest.raises(MultiheadError, match=r"cost\.mla_parameters takes an MLAConfig, got AttentionConfig"):
        cost.mla_parameters(model.attention)  # type: ignore[arg-type]
