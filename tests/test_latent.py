"""Multi-head latent attention: the absorbed path equals the expanded one, cached equals uncached, the latent cache
holds what multihead.sizing.cost predicts, and our layer in a transformers DeepSeek model gives transformers'
outputs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from multihead import KVCache, MultiHeadAttention, MultiheadError
from multihead.cache import LatentCache
from multihead.config import MLAConfig
from multihead.layers.hooks import hooks, run_with_cache, zero_heads
from multihead.layers.latent import MultiHeadLatentAttention
from multihead.sizing import cost

SHAPES = {  # small (4 heads), and DeepSeek-V3's proportions scaled down (16 heads, latent 128, nope 32, rope 16)
    "small": {"d_model": 64, "n_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
              "v_head_dim": 12, "q_lora_rank": 24},
    "v3-like": {"d_model": 256, "n_heads": 16, "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                "v_head_dim": 32},
}


def _layer(shape: str, seed: int = 0) -> MultiHeadLatentAttention:
    torch.manual_seed(seed)
    layer = MultiHeadLatentAttention(**SHAPES[shape]).eval()  # type: ignore[arg-type]
    for p in layer.parameters():
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=p.shape[1] ** -0.5)
    return layer


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_absorbed_path_equals_the_expanded_path_within_float32_rounding(shape: str) -> None:
    layer = _layer(shape)
    x = torch.randn(2, 24, layer.config.d_model)
    reference = layer.double()(x.double(), causal=True, path="expanded").detach()  # float64: rounding-free
    layer.float()
    expanded = layer(x, causal=True, path="expanded")
    absorbed = layer(x, causal=True, path="absorbed")
    scale = reference.abs().max()
    err_expanded = float((expanded.detach().double() - reference).abs().max() / scale)
    err_absorbed = float((absorbed.detach().double() - reference).abs().max() / scale)
    assert err_expanded < 1e-5 and err_absorbed < 1e-5
    assert err_absorbed <= 4 * err_expanded + 1e-7  # the absorbed path adds no more than float32 rounding


@pytest.mark.parametrize("shape", list(SHAPES))
def test_cached_absorbed_decoding_equals_the_uncached_expanded_forward(shape: str) -> None:
    layer = _layer(shape)
    x = torch.randn(2, 14, layer.config.d_model)
    full = layer(x, causal=True, path="expanded")
    cache = LatentCache(batch=2, kv_lora_rank=layer.config.kv_lora_rank, rope_dim=layer.config.qk_rope_head_dim,
                        max_len=16)
    outs = [layer(x[:, :5], causal=True, cache=cache.layer(0))]
    cache.advance(5)
    for i in range(5, 14):
        step_x = x[:, i:i + 1]
        assert "absorbed" in layer.explain(step_x, causal=True, cache=cache.layer(0)).reason
        outs.append(layer(step_x, causal=True, cache=cache.layer(0)))
        cache.advance(1)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=2e-5, rtol=2e-5)
    assert cache.used == 14


def test_explain_names_the_path_and_leaves_the_cache_unchanged() -> None:
    layer = _layer("v3-like")
    cache = LatentCache(batch=1, kv_lora_rank=128, rope_dim=16, max_len=600)
    layer(torch.randn(1, 512, 256), causal=True, cache=cache.layer(0))
    cache.advance(512)
    before = cache.latent.clone()
    decode = layer.explain(torch.randn(1, 1, 256), causal=True, cache=cache.layer(0))
    assert decode.reason.startswith("MLA absorbed path") and "one latent KV head of width 144" in decode.reason
    assert torch.equal(cache.latent, before)
    prefill = layer.explain(torch.randn(1, 512, 256), causal=True)
    assert prefill.reason.startswith("MLA expanded path")
    assert layer.choose_path(1, 4096) == "absorbed" and layer.choose_path(4096, 4096) == "expanded"


def test_hook_points_mean_the_same_on_both_paths() -> None:
    layer = _layer("small")
    x = torch.randn(1, 10, 64)
    got = {}
    for path in ("expanded", "absorbed"):
        _, acts = run_with_cache(layer, x, causal=True, path=path, names=["hook_z", "hook_pattern"])
        got[path] = acts
        with hooks(layer, {"hook_z": zero_heads([1, 3])}):
            got[path + "-ablated"] = layer(x, causal=True, path=path)  # type: ignore[assignment]
    torch.testing.assert_close(got["expanded"]["hook_z"], got["absorbed"]["hook_z"], atol=1e-5, rtol=1e-5)
    assert got["absorbed"]["hook_z"].shape == (1, 4, 10, 12)
    torch.testing.assert_close(got["expanded"]["hook_pattern"], got["absorbed"]["hook_pattern"], atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(got["expanded-ablated"], got["absorbed-ablated"], atol=1e-5, rtol=1e-5)


def test_parameters_flops_and_cache_bytes_match_the_real_tensors() -> None:
    for shape in SHAPES:
        layer = _layer(shape)
        assert cost.mla_parameters(layer.config).total == sum(p.numel() for p in layer.parameters())
        x = torch.randn(2, 8, layer.config.d_model)
        with FlopCounterMode(display=False) as counter:
            layer(x, path="expanded", backend="math")  # no mask: every pair counted; math: the counter sees it
        assert counter.get_total_flops() == cost.mla_flops(layer.config, s=8, batch=2).forward
    config = MLAConfig(**SHAPES["v3-like"])  # type: ignore[arg-type]
    cache = LatentCache(batch=3, kv_lora_rank=128, rope_dim=16, max_len=100, n_layers=4, dtype=torch.bfloat16)
    assert cache.bytes == cost.mla_cache_bytes(config, context=100, batch=3, n_layers=4, dtype="bf16")
    v3 = MLAConfig(d_model=7168, n_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                   v_head_dim=128, q_lora_rank=1536)
    assert v3.latent_dim == 576  # against 2 * 128 * 128 = 32,768 values per token per layer for MHA
    assert cost.mla_cache_bytes(v3, context=1, dtype="bf16") == 576 * 2


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"qk_rope_head_dim": 5}, r"qk_rope_head_dim \(5\) must be even"),
    ({"head_dim": 20}, r"head_dim \(20\) must equal qk_nope_head_dim \+ qk_rope_head_dim \(8 \+ 4 = 12\)"),
    ({"kv_lora_rank": 80}, r"kv_lora_rank \(80\) must be smaller than .* = 80"),
    ({"q_lora_rank": 0}, r"q_lora_rank \(0\) must be a positive int"),
])
def test_bad_mla_configs_name_the_values(kwargs: dict, message: str) -> None:
    with pytest.raises(MultiheadError, match=message):
        MLAConfig(**{**SHAPES["small"], **kwargs})


def test_a_latent_cache_and_a_plain_cache_are_not_interchangeable() -> None:
    mla = _layer("small")
    with pytest.raises(MultiheadError, match="give it a LatentCache layer"):
        mla(torch.randn(1, 2, 64), causal=True, cache=KVCache(batch=1, n_kv_heads=1, head_dim=28, max_len=4).layer(0))
    plain = MultiHeadAttention(d_model=64, n_heads=4, n_kv_heads=1, head_dim=20)
    latent = LatentCache(batch=1, kv_lora_rank=16, rope_dim=4, max_len=4)
    with pytest.raises(MultiheadError, match="a LatentCache holds the latents of multi-head latent attention"):
        plain(torch.randn(1, 2, 64), causal=True, cache=latent.layer(0))
    with pytest.raises(MultiheadError, match=r"kv_lora_rank 8 \+ rope 4 but this layer has 16 \+ 4"):
        mla(torch.randn(1, 2, 64), causal=True,
            cache=LatentCache(batch=1, kv_lora_rank=8, rope_dim=4, max_len=4).layer(0))
    with pytest.raises(MultiheadError, match="path 'fast' is unknown"):
        mla(torch.randn(1, 2, 64), path="fast")
    with pytest.raises(MultiheadError, match=r"one layer of the LatentCache \(cache.layer\(i\)\), not the whole"):
        mla(torch.randn(1, 2, 64), causal=True, cache=latent)  # type: ignore[arg-type]


def _deepseek(version: int):  # type: ignore[no-untyped-def]
    """A tiny random DeepSeek-V3 (q_lora, MoE, interleaved RoPE) or V2 (no q_lora, like V2-Lite) from
    transformers' config classes."""
    import transformers

    common = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
              "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 16,
              "qk_rope_head_dim": 8, "v_head_dim": 12, "qk_nope_head_dim": 16, "max_position_embeddings": 600,
              "attn_implementation": "eager"}
    torch.manual_seed(version)
    if version == 3:
        cfg = transformers.DeepseekV3Config(q_lora_rank=24, n_group=1, topk_group=1, **common)
        return transformers.DeepseekV3ForCausalLM(cfg).eval()
    cfg = transformers.DeepseekV2Config(q_lora_rank=None, **common)
    return transformers.DeepseekV2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("version", [3, 2])
@pytest.mark.parametrize("path", ["expanded", "absorbed"])
def test_our_mla_layer_in_a_transformers_deepseek_model_gives_its_outputs(version: int, path: str) -> None:
    from multihead import hf

    theirs = _deepseek(version)
    ours = _deepseek(version)
    ours.load_state_dict(theirs.state_dict())
    hf.use_mla_layers(ours, path=path)
    assert sum(isinstance(m, hf.MLAInTransformers) for m in ours.modules()) == 2
    x = torch.randint(0, 96, (2, 20))
    with torch.no_grad():
        want, got = theirs(x).logits, ours(x).logits
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5
        for prompt in (x[:1, :6], torch.randint(0, 96, (1, 250))):  # the second grows the latent cache past 256
            want_tokens = theirs.generate(prompt, max_new_tokens=12, do_sample=False)
            got_tokens = ours.generate(prompt, max_new_tokens=12, do_sample=False)
            assert got_tokens.tolist() == want_tokens.tolist()


def test_masks_and_sequences_of_different_lengths_in_the_latent_cache() -> None:
    """A padding mask means the same on both paths, and prompts of different lengths decode together (each
    sequence from its own length, as with KVCache)."""
    layer = _layer("small")
    x = torch.randn(2, 9, 64)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 6:] = False
    a = layer(x, key_padding_mask=valid, path="expanded")
    b = layer(x, key_padding_mask=valid, path="absorbed")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    lengths = [3, 6]
    alone = [layer(x[i:i + 1, :lengths[i] + 3], causal=True) for i in range(2)]
    cache = LatentCache(batch=2, kv_lora_rank=16, rope_dim=4, max_len=12)
    layer(x[:, :6], causal=True, cache=cache.layer(0))
    cache.advance(6, lengths=lengths)
    for k in range(3):
        step = torch.stack([x[0, 3 + k], x[1, 6 + k]])[:, None]  # each sequence's next token
        y = layer(step, causal=True, cache=cache.layer(0))
        cache.advance(1)
        torch.testing.assert_close(y[0, 0], alone[0][0, 3 + k], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y[1, 0], alone[1][0, 6 + k], atol=1e-5, rtol=1e-5)
    with pytest.raises(MultiheadError, match="KV cache overflow"):
        layer(torch.randn(2, 4, 64), causal=True, cache=cache.layer(0))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_kernels_path_rule_is_the_one_with_fewer_flops_by_the_cost_model(shape: str) -> None:
    """path="auto" is decided in the kernels from the view's shapes (issue 51 item 2): over a grid of query and key
    counts it takes the path multihead.sizing.cost.mla_flops counts fewer FLOPs for (the independent reference)."""
    layer = _layer(shape)
    config = MLAConfig(**SHAPES[shape])  # type: ignore[arg-type]
    for s in (1, 2, 7, 64, 512):
        for t in (s, 2 * s, 100, 4096):
            if t < s:
                continue
            flops = {p: cost.mla_flops(config, s=s, t=t, path=p).forward for p in ("expanded", "absorbed")}
            expected = "absorbed" if flops["absorbed"] < flops["expanded"] else "expanded"
            assert layer.choose_path(s, t) == expected, (s, t, flops)


def test_a_latent_view_is_refused_without_its_up_projection_or_with_an_unknown_path() -> None:
    """The cache gives the latents alone; the kernels need the layer's up-projection to take either path, and a
    path named in the view is checked there."""
    from multihead.cache import LatentKV
    from multihead.kernels import AttentionCall, attend
    from multihead.layers.masks import MaskSpec

    q, latents = torch.randn(1, 4, 3, 12), torch.randn(1, 3, 20)
    mask = MaskSpec(batch=1, n_heads=4, s=3, t=3, causal=True)
    with pytest.raises(MultiheadError, match="up-projection"):
        attend(AttentionCall(q, LatentKV(latents), mask, scale=1.0))
    up = torch.randn(4, 8 + 12, 16)
    with pytest.raises(MultiheadError, match="'sideways' is unknown"):
        attend(AttentionCall(q, LatentKV(latents, up, 8, "sideways"), mask, scale=1.0))
    with pytest.raises(MultiheadError, match=r"cannot serve queries \(1, 4, 3, 12\)"):
        attend(AttentionCall(q, LatentKV(latents, up[:2], 8), mask, scale=1.0))
    out, _ = attend(AttentionCall(q, LatentKV(latents, up, 8), mask, scale=1.0))
    assert out.shape == (1, 4, 3, 12)
