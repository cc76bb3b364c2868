"""KV caches that save memory: attention sinks + window and quantized keys/values.

Each kind is checked against the uncached model with the same compression applied (an independent reference), its
bytes against multihead.sizing.cost, and its bad inputs against clear errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from multihead import AttentionConfig, MultiHeadAttention, MultiheadError
from multihead.cache import (
    QuantizedKVCache,
    SinkCache,
    dequantize,
    fake_quantize_keys,
    fake_quantize_values,
    pack,
    quantize,
    quantized_tokens,
    sink_keep,
    unpack,
)
from multihead.layers.hooks import hooks
from multihead.models.llama import LlamaConfig, LlamaModel
from multihead.sizing import cost


def _model(seed: int = 0, d_model: int = 64) -> LlamaModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=50, d_model=d_model, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      max_context=128)
    model = LlamaModel(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)  # large weights: attention patterns far from uniform
    return model


def _decode(model: LlamaModel, cache, tokens: torch.Tensor, chunks: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Logits of tokens fed through the cache in chunks of the given sizes (then one at a time)."""
    outs, i = [], 0
    for size in chunks + [1] * tokens.shape[1]:
        if i >= tokens.shape[1]:
            break
        outs.append(model(tokens[:, i:i + size], cache=cache))
        cache.advance(outs[-1].shape[1])
        i += outs[-1].shape[1]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize(("window", "sinks"), [(6, 0), (6, 1), (6, 4), (1, 0), (3, 3), (40, 4)])
def test_a_sink_cache_equals_the_uncached_model_under_the_sink_mask(window: int, sinks: int) -> None:
    model, n = _model(), 31
    tokens = torch.randint(0, 50, (2, n))
    positions = torch.arange(n)
    reference = model(tokens, mask=sink_keep(positions, positions, window=window, sink_tokens=sinks))
    cache = model.new_cache(2, window=window, sink_tokens=sinks)
    out = _decode(model, cache, tokens, [9, 1, 1, 7])  # chunks longer than the window, and single tokens
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=2e-5)
    assert cache.used == n and cache.bytes == cost.sink_cache_bytes(
        model.config.attention(), window=window, sink_tokens=sinks, batch=2, n_layers=2, dtype="fp32")
    # held positions: the sinks and the window - 1 before the next token, nothing else
    held = sorted(p for p in cache.slot_positions.tolist() if p >= 0)
    assert held == sorted(set(range(min(sinks, n))) | set(range(max(0, n - (window - 1)), n)))


def test_the_sink_mask_is_what_streaming_llm_describes() -> None:
    keep = sink_keep(torch.arange(8), torch.arange(8), window=3, sink_tokens=2)
    for p in range(8):
        assert keep[p].nonzero().flatten().tolist() == sorted({0, 1} & set(range(p + 1)) | set(range(max(0, p - 2),
                                                                                                       p + 1)))


def test_without_sinks_the_window_cache_forgets_and_the_sinks_change_the_output() -> None:
    model = _model()
    tokens = torch.randint(0, 50, (1, 30))
    full = model(tokens)
    window = _decode(model, model.new_cache(1, window=8, sink_tokens=0), tokens, [8])
    sinks = _decode(model, model.new_cache(1, window=8, sink_tokens=4), tokens, [8])
    torch.testing.assert_close(window[:, :8], full[:, :8], atol=2e-5, rtol=2e-5)  # inside the window: exact
    assert (window[:, 9:] - full[:, 9:]).abs().max() > 1e-3  # the first tokens left: the outputs move
    assert (sinks[:, 12:] - window[:, 12:]).abs().max() > 1e-3


def test_a_sink_cache_keeps_constant_memory_past_the_models_context() -> None:
    model = _model()
    cache = model.new_cache(1, window=5, sink_tokens=2)
    before = cache.bytes
    tokens = torch.randint(0, 50, (1, 1))
    with torch.no_grad():
        for _ in range(model.config.max_context + 20):
            model(tokens, cache=cache)
            cache.advance(1)
    assert cache.used == model.config.max_context + 20 and cache.bytes == before


def test_a_layer_called_alone_with_a_sink_cache_equals_the_masked_call() -> None:
    torch.manual_seed(1)
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2, rope=10000.0, bias=False).eval()
    x = torch.randn(1, 12, 32)
    positions = torch.arange(12)
    reference = layer(x, mask=sink_keep(positions, positions, window=4, sink_tokens=2))
    cache = SinkCache(batch=1, n_kv_heads=2, head_dim=8, window=4, sink_tokens=2)
    outs = []
    for chunk in (x[:, :5], x[:, 5:6], x[:, 6:12]):
        outs.append(layer(chunk, causal=True, cache=cache.layer(0)))
        cache.advance(chunk.shape[1])
    torch.testing.assert_close(torch.cat(outs, 1), reference, atol=1e-5, rtol=1e-5)


def _quantized_reference(model: LlamaModel, tokens: torch.Tensor, quantized: list[int], bits: int,
                         group: int) -> torch.Tensor:
    """The uncached model in float64 attention where query i reads the first quantized[i] keys and values through
    their quantized copies (what the cache held when query i ran) and the rest in full."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str):  # type: ignore[no-untyped-def]
        def fn(x: torch.Tensor, point: object) -> None:
            seen[name] = x
        return fn

    def attention(z: torch.Tensor, point: object) -> torch.Tensor:
        q, k, v = seen["q"], seen["k"], seen["v"]
        rep = q.shape[1] // k.shape[1]
        out = torch.zeros_like(q, dtype=torch.float64)
        for i in range(q.shape[2]):
            c = quantized[i]
            kk, vv = k[:, :, :i + 1].clone(), v[:, :, :i + 1].clone()
            if c:
                kk[:, :, :c] = fake_quantize_keys(k[:, :, :c], bits, group)
                vv[:, :, :c] = fake_quantize_values(v[:, :, :c], bits, group)
            kk, vv = kk.double().repeat_interleave(rep, 1), vv.double().repeat_interleave(rep, 1)
            w = torch.softmax(q[:, :, i:i + 1].double() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
            out[:, :, i:i + 1] = w @ vv
        return out.to(z.dtype)

    with hooks(model, {"*.hook_q": keep("q"), "*.hook_k": keep("k"), "*.hook_v": keep("v"), "*.hook_z": attention}):
        return model(tokens)


@pytest.mark.parametrize(("bits", "group", "residual", "prompt"), [(8, 4, 6, 9), (4, 4, 6, 9), (2, 8, 0, 20),
                                                                  (4, 16, 4, 25)])
def test_a_quantized_cache_equals_the_uncached_model_with_the_same_quantization(bits: int, group: int,
                                                                               residual: int, prompt: int) -> None:
    model, n = _model(), 40
    tokens = torch.randint(0, 50, (2, n))
    cache = model.new_cache(2, 48, bits=bits, group=group, residual=residual)
    assert isinstance(cache, QuantizedKVCache)
    out = _decode(model, cache, tokens, [prompt])
    held = [0] * prompt + [quantized_tokens(i, group=group, residual=residual) for i in range(prompt, n)]
    reference = _quantized_reference(model, tokens, held, bits, group)
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=2e-5)
    assert cache.quantized == quantized_tokens(n, group=group, residual=residual) > 0
    assert (out - model(tokens)).abs().max() > 1e-4  # and the quantization did change something
    assert cache.bytes == cost.quantized_cache_bytes(model.config.attention(), context=48, bits=bits, group=group,
                                                     residual=residual, batch=2, n_layers=2, dtype="fp32")


def test_quantization_matches_an_independent_min_max_quantizer() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 64)).astype(np.float32) * 7
    for bits in (2, 4, 8):
        codes, scale, lo = quantize(torch.from_numpy(x), bits, dim=-1)
        levels = 2 ** bits - 1
        lo_ref = x.min(-1, keepdims=True).astype(np.float16).astype(np.float32)
        scale_ref = ((x.max(-1, keepdims=True) - lo_ref) / levels).astype(np.float16).astype(np.float32)
        codes_ref = np.clip(np.round((x - lo_ref) / scale_ref), 0, levels)
        np.testing.assert_array_equal(codes.numpy(), codes_ref)
        back = dequantize(codes, scale, lo, torch.float32).numpy()
        assert np.abs(back - x).max() <= scale_ref.max() * 0.5 + 1e-2  # within half a step (+ fp16 rounding)
        assert torch.equal(unpack(pack(codes, bits), bits), codes)
        assert pack(codes, bits).shape[-1] == 64 * bits // 8


def test_cache_bytes_per_token_fall_with_the_bit_width_and_include_the_scales() -> None:
    config = AttentionConfig(d_model=576, n_heads=9, n_kv_heads=3, bias=False)
    full = cost.kv_cache_bytes(config, context=8192, n_layers=30, dtype="bf16")
    q8, q4, q2 = (cost.quantized_cache_bytes(config, context=8192, bits=b, n_layers=30, dtype="bf16")
                  for b in (8, 4, 2))
    assert full > q8 > q4 > q2
    assert 0.5 < q8 / full < 0.6 and 0.25 < q4 / full < 0.35  # codes plus scales plus the residual window


@pytest.mark.parametrize(("make", "message"), [
    (lambda: SinkCache(batch=1, n_kv_heads=2, head_dim=8, window=3, sink_tokens=4), r"sink_tokens \(4\) must not "
     r"exceed the window \(3\)"),
    (lambda: SinkCache(batch=1, n_kv_heads=2, head_dim=8, window=0), r"window \(0\)"),
    (lambda: QuantizedKVCache(batch=1, n_kv_heads=2, head_dim=8, max_len=8, bits=3), r"bits \(3\) is not a "
     r"supported cache width: choose one of 2, 4, 8"),
    (lambda: QuantizedKVCache(batch=1, n_kv_heads=2, head_dim=8, max_len=8, bits=4, group=3), r"group \(3\) must "
     r"divide head_dim \(8\)"),
    (lambda: _model().new_cache(1, 8, window=4, bits=4), r"give window= \(with sink_tokens=\) or bits=4, not both"),
    (lambda: _model().new_cache(1, 8, sink_tokens=2), r"sink_tokens \(2\) go with a window"),
    (lambda: cost.quantized_cache_bytes(AttentionConfig(d_model=32, n_heads=4), context=8, bits=5), r"bits \(5\)"),
])
def test_bad_compressed_caches_are_refused(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MultiheadError, match=message):
        make()


def test_compressed_caches_refuse_what_they_cannot_hold() -> None:
    model = _model()
    tokens = torch.randint(0, 50, (2, 4))
    for cache in (model.new_cache(2, window=4), model.new_cache(2, 8, bits=4, group=4, residual=0)):
        model(tokens, cache=cache)
        with pytest.raises(MultiheadError, match="holds sequences of one length"):
            cache.advance(4, lengths=[2, 4])
        with pytest.raises(MultiheadError, match=r"layer\(s\) \[0, 1\] wrote nothing"):
            cache.reset()
            cache.advance(1)
    with pytest.raises(MultiheadError, match="positions cannot be given"):
        model(tokens, cache=model.new_cache(2, window=4), positions=torch.arange(4))
    cache = model.new_cache(2, 8, bits=8, group=4, residual=0)
    model(tokens, cache=cache)
    cache.advance(4)
    with pytest.raises(MultiheadError, match="KV cache overflow"):
        model(torch.randint(0, 50, (2, 5)), cache=cache)


def test_windowed_generation_is_greedy_decoding_of_the_sink_masked_model_past_the_context() -> None:
    from multihead.models.generate import generate_ids

    model = _model()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    n = model.config.max_context + 40  # past the model's context: the cache stays at sinks + window
    got = [step[0] for step in generate_ids(model, [prompt], max_new_tokens=n, window=16, sink_tokens=2)]
    # reference: the uncached model under the sink mask, one argmax at a time, on the first 60 tokens
    seq = list(prompt)
    for _ in range(60):
        x = torch.tensor([seq])
        positions = torch.arange(len(seq))
        with torch.no_grad():
            logits = model(x, mask=sink_keep(positions, positions, window=16, sink_tokens=2))
        seq.append(int(logits[0, -1].argmax()))
    assert got[:60] == seq[len(prompt):] and len(got) == n
    with pytest.raises(MultiheadError, match="sequences of one length"):
        next(generate_ids(model, [[1, 2], [3]], max_new_tokens=2, window=4))
    with pytest.raises(MultiheadError, match="decodes eagerly"):
        next(generate_ids(model, [[1, 2]], max_new_tokens=2, window=4, compile=True))


def test_a_long_windowed_generation_keeps_resident_memory_flat() -> None:
    import os

    from multihead.models.generate import generate_ids

    def rss() -> int:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    model = _model()
    samples = []
    for i, _ in enumerate(generate_ids(model, [[1, 2, 3]], max_new_tokens=2000, window=32, sink_tokens=4)):
        if i % 400 == 399:
            samples.append(rss())
    assert samples[-1] <= samples[0] * 1.05, [s // 2**20 for s in samples]


def _kinds(model: LlamaModel, batch: int):  # type: ignore[no-untyped-def]
    """One cache of every kind a LlamaModel makes, each with room for 40 tokens."""
    return {"full": model.new_cache(batch, 40), "sink": model.new_cache(batch, window=6, sink_tokens=2),
            "quantized": model.new_cache(batch, 40, bits=4, group=4, residual=4)}


@pytest.mark.parametrize("kind", ["full", "sink", "quantized"])
def test_every_kind_holds_a_steps_tokens_only_once_advance_commits_them(kind: str) -> None:
    """The protocol's one rule: update places, advance commits. A step that is never advanced (here: run, then
    dropped) leaves the cache holding what it held, and the next step replaces what it placed; explain (a
    read-only update) places nothing."""
    model = _model()
    tokens, junk = torch.randint(0, 50, (2, 12)), torch.randint(0, 50, (2, 3))
    reference = _decode(model, _kinds(model, 2)[kind], tokens, [5])
    cache = _kinds(model, 2)[kind]
    with torch.no_grad():
        first = model(tokens[:, :5], cache=cache)
        cache.advance(5)
        before = {name: buf.clone() for name, buf in cache.named_buffers()}
        model(junk, cache=cache)  # placed, never committed
        assert cache.used == 5 and cache.lengths.tolist() == [5, 5]
        block = model.layers[0]
        h = model.embed(junk[:, :1])
        block.attn.explain(block.attn_norm(h), step=model.step(h, cache=cache), cache=cache.layer(0))
        if kind == "full":  # it placed the junk in slots its lengths do not count: the held ones are unchanged
            assert torch.equal(cache.k[..., :5, :], before["k"][..., :5, :])
        else:  # the others kept it beside their store, which is unchanged
            assert all(torch.equal(buf, before[name]) for name, buf in cache.named_buffers())
        rest = [first]
        for i in range(5, 12):
            rest.append(model(tokens[:, i:i + 1], cache=cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(rest, 1), reference, atol=1e-5, rtol=1e-5)


def test_caches_that_continue_every_sequence_refuse_positions() -> None:
    """A sink or quantized cache appends the new tokens after the held ones: positions given to it would be read by
    RoPE and the mask but not by the write, so they are refused (the quantized cache used to ignore them)."""
    model = _model()
    tokens = torch.randint(0, 50, (1, 4))
    for kind, cache in _kinds(model, 1).items():
        model(tokens, cache=cache)
        cache.advance(4)
        if kind == "full":
            model(tokens, cache=cache, positions=torch.arange(2, 6))  # a slot-addressed cache: positions name slots
            continue
        with pytest.raises(MultiheadError, match=f"a {type(cache).__name__} places new tokens after the cached "
                                                 "ones: positions cannot be given"):
            model(tokens, cache=cache, positions=torch.arange(4))
