"""Caches that store what a sliding layer can see (issue 49): every kind on tiny random Gemma 2, Gemma 3, Mistral and
gpt-oss models in transformers, against transformers' own DynamicCache (its bytes after the same prefill) and the
uncached model (its logits), the quantized ring against the store that keeps every code under the same mask, and
the sizing figures (``multihead.sizing.cost``, ``sizing.kv_bytes``) against the real tensors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import transformers
from torch import Tensor
from transformers import DynamicCache

from multihead import AttentionConfig, MultiHeadAttention, hf, sizing
from multihead.cache import HybridCache, KVCache, QuantizedKVCache, SinkCache
from multihead.errors import MultiheadError
from multihead.hf.cache import MultiheadCache, layer_windows
from multihead.sizing import cost
from multihead.sizing.presets import PRESET_NAMES, from_hf_dict, preset

W = 16  # the tiny models' sliding window
P, N = 60, 72  # prompt tokens; tokens in all (the rest decoded one a step)
GEMMA_TYPES = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]


def _config(family: str) -> Any:
    common: dict[str, Any] = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
                              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
                              "max_position_embeddings": 256, "sliding_window": W}
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**common, layer_types=GEMMA_TYPES)
    if family == "gemma2":
        return transformers.Gemma2Config(**common, layer_types=GEMMA_TYPES)
    if family == "mistral":  # every layer slides
        return transformers.MistralConfig(**common)
    if family == "gpt_oss":
        common.update(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)
        return transformers.GptOssConfig(**common, layer_types=GEMMA_TYPES)
    raise AssertionError(family)


FAMILIES = ("gemma3", "gemma2", "mistral", "gpt_oss")


def _model(family: str) -> Any:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(family)).eval()


def _transformers_bytes(model: Any, tokens: Tensor) -> int:
    """The bytes of transformers' own DynamicCache after ``tokens`` (made with the model's config, as generate makes
    it: sliding layers keep their window), on the model's own attention."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(tokens, cache=cache)
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def _decode(model: Any, tokens: Tensor, cache: Any) -> tuple[Tensor, int]:
    """Logits of a prompt of P tokens through the cache, then one token a step; and the cache's bytes after the
    prompt."""
    with torch.no_grad():
        out = [model(tokens[:, :P], cache=cache).logits]
        after_prompt = cache.bytes
        for i in range(P, tokens.shape[1]):
            out.append(model(tokens[:, i:i + 1], cache=cache).logits)
    return torch.cat(out, 1), after_prompt


@pytest.mark.parametrize("family", FAMILIES)
def test_a_full_cache_holds_transformers_bytes_and_decodes_as_the_uncached_model(family: str) -> None:
    model = _model(family)
    tokens = torch.randint(0, 97, (1, N))
    expected = _transformers_bytes(model, tokens[:, :P])
    with torch.no_grad():
        plain = model(tokens).logits
    hf.enable(model)
    cache = hf.new_cache(model, P)
    with torch.no_grad():
        model(tokens[:, :P], cache=cache)
        assert cache.bytes == expected  # sliding layers: a ring of W - 1 keys, as transformers keeps them
        with pytest.raises(MultiheadError, match="overflow"):  # P tokens of room: one more does not fit
            model(tokens[:, P:P + 1], cache=cache)
    got, _ = _decode(model, tokens, hf.new_cache(model, N))
    torch.testing.assert_close(got, plain, atol=2e-5, rtol=2e-5)
    sized = sizing.kv_bytes(from_hf_dict(model.config.to_dict()), context=P, batch=1, dtype="fp32")
    assert sized == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_a_quantized_cache_keeps_a_sliding_layer_in_a_ring_and_reads_as_the_store_that_keeps_every_code(
        family: str) -> None:
    model = hf.enable(_model(family))
    tokens = torch.randint(0, 97, (1, N))
    kinds = {"bits": 4, "group": 4, "residual": 0}  # codes from the first group on: a ring of 4 groups for W = 16
    cache = hf.new_cache(model, N, **kinds)
    inner = cache.inner
    assert isinstance(inner, HybridCache)
    ring = inner.part(W)
    assert isinstance(ring, QuantizedKVCache) and ring.window == W
    text = model.config
    windows = layer_windows(text, text.num_hidden_layers)
    every = QuantizedKVCache(bits=4, group=4, residual=0, max_len=N, n_layers=text.num_hidden_layers, batch=1,
                             n_kv_heads=text.num_key_value_heads, head_dim=32)  # every code, masked by the step
    reference = MultiheadCache(every, n_heads=4, windows=windows)
    got, _ = _decode(model, tokens, cache)
    want, _ = _decode(model, tokens, reference)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert ring.held_codes < every.quantized  # the ring dropped the codes past the window
    full = hf.new_cache(model, N)
    assert cache.bytes < full.bytes
    config = from_hf_dict(text.to_dict())
    a = config.attention
    predicted = sum(cost.quantized_cache_bytes(dataclasses.replace(a, window=w), context=N,
                                               bits=4, group=4, residual=0, dtype="fp32") for w in windows)
    assert cache.bytes == predicted


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_ring_decodes_in_the_native_kernel_with_the_steps_mask(monkeypatch: pytest.MonkeyPatch,
                                                                          bits: int) -> None:
    """Issue 50: a sliding layer's ring hides the slots out of the window, so its decode steps once read the codes
    back and ran SDPA with a mask. Now every layer of every decode step runs in the native kernel over the codes
    (the sliding layers with the step's (b, t) key mask), and the logits equal the dequantise-then-SDPA path's
    (multihead.kernels.cpu off) within float32 rounding."""
    from multihead.kernels import cpu

    model = hf.enable(_model("gemma3"))
    tokens = torch.randint(0, 97, (1, N))
    kinds = {"bits": bits, "group": 4, "residual": 0}
    real = torch.ops.multihead.attend_quantized  # the operator the dispatcher calls (bits, q, ..., scale, keep)
    masked: list[bool] = []

    def counted(*args: Any, **kw: Any) -> Tensor:
        assert args[0] == bits
        masked.append((args[13] if len(args) > 13 else kw.get("keep")) is not None)
        out: Tensor = real(*args, **kw)
        return out

    monkeypatch.setattr(torch.ops.multihead, "attend_quantized", counted)
    got, _ = _decode(model, tokens, hf.new_cache(model, N, **kinds))
    steps, layers = N - P, model.config.num_hidden_layers
    assert len(masked) == steps * layers  # every layer of every decode step, in the kernel
    assert sum(masked) >= steps * 4  # the four sliding layers with the step's mask (once the ring wraps, always)
    with cpu.disabled():
        want, _ = _decode(model, tokens, hf.new_cache(model, N, **kinds))
    assert len(masked) == steps * layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_quantized_ring_equals_the_store_of_every_code_under_the_sliding_mask() -> None:
    """One layer of window W, chunks and single steps: the ring (a few groups, overwritten in turn) against the store
    that keeps every code, the layer's window applied by its mask; several windows, groups and residuals, including
    a window within the residual (no codes at all)."""
    for window, group, residual, bits in [(40, 4, 8, 8), (40, 4, 8, 4), (9, 4, 16, 8), (33, 8, 0, 4)]:
        torch.manual_seed(0)
        attn = MultiHeadAttention(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, window=window))
        n = 140
        x = torch.randn(1, n, 32)
        shape: dict[str, Any] = {"batch": 1, "n_kv_heads": 2, "head_dim": 8, "max_len": n, "bits": bits,
                                 "group": group, "residual": residual}
        ring, every = QuantizedKVCache(**shape, window=window), QuantizedKVCache(**shape)
        outs: list[list[Tensor]] = [[], []]
        start = 0
        for size in [17, 1, 1, 30, 1, 1, 50] + [1] * 39:
            for out, cache in zip(outs, (ring, every), strict=True):
                out.append(attn(x[:, start:start + size], causal=True, cache=cache.layer(0)))
                cache.advance(size)
            start += size
        torch.testing.assert_close(torch.cat(outs[0], 1), torch.cat(outs[1], 1), atol=1e-6, rtol=1e-6)
        assert ring.bytes < every.bytes
        predicted = cost.quantized_cache_bytes(attn.config, context=n, bits=bits, group=group, residual=residual,
                                               dtype="fp32")
        assert min(ring.bytes, 2 * 2 * min(n, window - 1) * 8 * 4) == predicted


def test_a_sinks_and_window_cache_stores_no_more_than_a_sliding_layer_sees() -> None:
    model = hf.enable(_model("gemma3"))
    wide = hf.new_cache(model, window=64, sink_tokens=4)
    assert isinstance(wide.inner, HybridCache)
    sliding = wide.inner.part(W)
    assert isinstance(sliding, SinkCache) and (sliding.window, sliding.sink_tokens) == (W, 0)
    narrow = hf.new_cache(model, window=8, sink_tokens=2)
    assert isinstance(narrow.inner, HybridCache)
    assert (narrow.inner.part(W).window, narrow.inner.part(W).sink_tokens) == (8, 2)
    tokens = torch.randint(0, 97, (1, N))
    with torch.no_grad():  # with max_len the windowed cache is for N tokens: the N + 1st raises
        hf.new_cache(model, N, window=64, sink_tokens=4)
        bounded = hf.new_cache(model, N, window=64, sink_tokens=4)
        model(tokens, cache=bounded)
        with pytest.raises(MultiheadError, match="overflow"):
            model(tokens[:, :1], cache=bounded)


def test_a_windowed_cache_with_bits_is_refused_with_what_to_write() -> None:
    model = hf.enable(_model("gemma3"))
    with pytest.raises(MultiheadError, match=r"window= \(with sink_tokens=\) or bits=4, not both"):
        hf.new_cache(model, 64, window=8, bits=4)


def test_a_hybrid_cache_refuses_parts_that_do_not_fit_its_layers() -> None:
    part = KVCache(batch=1, n_kv_heads=1, head_dim=8, max_len=8, n_layers=2)
    ring = SinkCache(batch=1, n_kv_heads=1, head_dim=8, window=4, sink_tokens=0, n_layers=1)
    with pytest.raises(MultiheadError, match="holds 2 layers but 1 layers have that window"):
        HybridCache({None: part, 4: ring}, [None, 4])
    with pytest.raises(MultiheadError, match="give one part per window"):
        HybridCache({None: part}, [None, 4, None])
    cache = HybridCache({None: part, 4: ring}, [None, 4, None])
    with pytest.raises(MultiheadError, match="no layer of window 7"):
        cache.reserve(1, attention_window=7)


def test_every_sliding_preset_sizes_a_quantized_cache_below_the_full_one() -> None:
    sliding = [name for name in PRESET_NAMES
               if any(layer.window is not None for layer in preset(name).layers()) and preset(name).mla is None]
    assert {"mistral-7b", "gemma-3-27b", "gpt-oss-20b"} <= set(sliding)
    for name in sliding:
        model = preset(name)
        context = min(32768, sizing.context_limit(model) or 32768)
        full = sizing.kv_bytes(model, context=context, batch=1, dtype="bf16")
        for kind in ("int8", "int4"):
            quantized = sizing.kv_bytes(model, context=context, batch=1, dtype="bf16", cache=kind)
            assert quantized < full, (name, kind, quantized, full)


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_a_full_prefill_compressed_into_quantized_rings_decodes_as_a_prefill_through_them(family: str) -> None:
    """The shared-prefill protocol on a hybrid model: the full cache's sliding rings hold only the last W - 1 keys,
    and compress gives the quantized cache those (the earlier positions, past every later query's window, as copies
    of the first held key). A one-chunk prefill through the quantized cache stores the same keys (a chunk attends to
    its own keys in full precision), so the decode steps after either agree; the prompt ends so that the ring's
    oldest group starts at the first held key."""
    from multihead.cache import compress

    model = hf.enable(_model(family))
    prompt = 44 + W - 1  # 44 is a whole number of groups of 4
    tokens = torch.randint(0, 97, (1, N))
    kinds = {"bits": 4, "group": 4, "residual": 0}
    full, direct, small = hf.new_cache(model, N), hf.new_cache(model, N, **kinds), hf.new_cache(model, N, **kinds)
    with torch.no_grad():
        model(tokens[:, :prompt], cache=full)
        model(tokens[:, :prompt], cache=direct)
        compress(full.inner, small.inner)
        assert small.bytes == direct.bytes and small.used == direct.used == prompt
        got = torch.cat([model(tokens[:, i:i + 1], cache=small).logits for i in range(prompt, N)], 1)
        want = torch.cat([model(tokens[:, i:i + 1], cache=direct).logits for i in range(prompt, N)], 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_kind_on_the_global_layers_only_keeps_every_sliding_window_whole() -> None:
    """layers='global' (a hybrid model's methods that save only where the context grows): the sliding layers keep
    the full kind's ring, so their part's bytes and logits are the full cache's; the global layers take the kind."""
    model = hf.enable(_model("gemma3"))
    tokens = torch.randint(0, 97, (1, N))
    full = hf.new_cache(model, N)
    for kind in ({"window": 8, "sink_tokens": 2}, {"bits": 4, "group": 4, "residual": 0}):
        cache = hf.new_cache(model, N, layers="global", **kind)
        assert isinstance(cache.inner, HybridCache) and isinstance(full.inner, HybridCache)
        ring = cache.inner.part(W)
        assert isinstance(ring, SinkCache) and (ring.window, ring.sink_tokens) == (W, 0)
        assert ring.bytes == full.inner.part(W).bytes
        assert type(cache.inner.part(None)) is type(hf.new_cache(model, N, **kind).inner.part(None))  # type: ignore[union-attr]
    with torch.no_grad():
        plain = model(tokens).logits
    # sinks + a window as wide as the context on the global layers: every key seen, the uncached model's logits
    got, _ = _decode(model, tokens, hf.new_cache(model, N, layers="global", window=N, sink_tokens=0))
    torch.testing.assert_close(got, plain, atol=2e-5, rtol=2e-5)
    with pytest.raises(MultiheadError, match="every layer of this model slides"):
        hf.new_cache(hf.enable(_model("mistral")), N, layers="global", bits=8)
    with pytest.raises(MultiheadError, match="layers='everything' is not a choice"):
        hf.new_cache(model, N, layers="everything")


def test_the_long_context_methods_take_the_global_layers_only_on_a_hybrid_model() -> None:
    """tradeoff --long --layers global: the windowed and quantized methods are made with layers='global' (a hybrid
    model's sliding layers keep their window); the full cache and the plans are as they were; on a model whose
    layers are all global (our Llama port) the caches are the same as with 'all'."""
    from multihead.models import LlamaConfig, LlamaModel
    from multihead.models.decoder import TransformersDecoder
    from multihead.tradeoff import longctx as lc

    settings = lc.Settings(lengths=(64,), tasks=("passkey",), sinks=2, keep=(0.5,), window_keep=(), bits=(4,),
                           group=4, residual=0, mqa=False, prune=(), layers="global")
    methods = {m.name: m for m in settings.methods(1)}
    assert set(methods) == {"full cache", "2 sinks + window 50%, global layers", "int4 (g4, r0), global layers"}
    decoder = TransformersDecoder(hf.enable(_model("gemma3")))
    for name in ("2 sinks + window 50%, global layers", "int4 (g4, r0), global layers"):
        cache = methods[name].cache(decoder, 64, 64)
        assert isinstance(cache.inner, HybridCache)
        ring = cache.inner.part(W)
        assert isinstance(ring, SinkCache) and (ring.window, ring.sink_tokens) == (W, 0)
    port = LlamaModel(LlamaConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                  max_context=128))
    everywhere = {m.name.removesuffix(", global layers"): m for m in lc.Settings(
        lengths=(64,), tasks=("passkey",), sinks=2, keep=(0.5,), window_keep=(), bits=(4,), group=4, residual=0,
        mqa=False, prune=()).methods(2)}
    for name, method in methods.items():
        got, want = method.cache(port, 64, 64), everywhere[name.removesuffix(", global layers")].cache(port, 64, 64)
        assert type(got) is type(want) and got.bytes == want.bytes
    with pytest.raises(MultiheadError, match=r"layers \('some'\) must be 'all'"):
        lc.Settings(lengths=(64,), tasks=("passkey",), layers="some")


def test_a_windowed_cache_takes_max_len_in_the_port_too() -> None:
    """Issue 52 item 9: new_cache(b, n, window=w, sink_tokens=s) is a windowed cache for at most n tokens (it was
    refused with 'a windowed cache has no max_len'), in our port as in hf.new_cache; window with bits is refused
    saying what to write."""
    from multihead.models import LlamaConfig, LlamaModel

    port = LlamaModel(LlamaConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                  max_context=128))
    short = port.new_cache(1, 10, window=256, sink_tokens=4)
    assert isinstance(short, SinkCache) and short.capacity == 10 and short.max_len == 10
    assert port.new_cache(1, window=256, sink_tokens=4).capacity == 4 + 256 - 1
    tokens = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(port(tokens, cache=short), port(tokens), atol=1e-5, rtol=1e-5)
    short.advance(10)
    with pytest.raises(MultiheadError, match="overflow"):
        short.check_room(1)
    with pytest.raises(MultiheadError, match=r"give window= \(with sink_tokens=\) or bits=8, not both"):
        port.new_cache(1, 10, window=8, bits=8)
    with pytest.raises(MultiheadError, match=r"max_len \(200\) exceeds the model's context \(128\)"):
        port.new_cache(1, 200, window=8)
