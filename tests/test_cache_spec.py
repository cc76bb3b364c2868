"""CacheSpec (issue 51 item 3): one statement of which cache to build, for our port and for transformers models.

What a user relies on: a spec builds the same cache as the keyword options of ``new_cache`` (the options are its
fields), on our Llama port and on a transformers model through ``hf.new_cache``; ``spec.bytes`` is the bytes of the
cache it builds (the real tensors of a built cache are the reference); a bad option or a mix of kinds is refused once,
in one place, naming what to give; a pruned model's layers of several widths get one cache each."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from multihead import hf
from multihead.cache import (
    CacheShape,
    CacheSpec,
    HeadPlan,
    HeadwiseCache,
    HybridCache,
    KVCache,
    LayeredCache,
    QuantizedKVCache,
    SinkCache,
)
from multihead.errors import MultiheadError
from multihead.hf.cache import cache_shape
from multihead.models.llama import LlamaConfig, LlamaModel
from multihead.tradeoff.prune import prune

W = 16
TYPES = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]


def _port() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(vocab_size=50, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                  max_context=256)).eval()


def _gemma3() -> Any:
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           max_position_embeddings=256, sliding_window=W, layer_types=TYPES)
    return hf.enable(transformers.AutoModelForCausalLM.from_config(config).eval())


def _plan(shape: tuple[int, int, int, int], windows: Any = None) -> HeadPlan:
    n_layers, _, g, _ = shape
    scores = [[float((layer * g + j) % 3) for j in range(g)] for layer in range(n_layers)]
    return HeadPlan.from_scores(scores, 0.5, sinks=2, window=8, model="tiny", shape=shape, method="test",
                                windows=windows)


OPTIONS = [
    ({"max_len": 100}, "full"),
    ({"window": 24, "sink_tokens": 2}, "window"),
    ({"max_len": 100, "window": 24, "sink_tokens": 2}, "window"),
    ({"max_len": 100, "bits": 4, "group": 16, "residual": 8}, "quantized"),
    ({"max_len": 100, "bits": 8, "group": 8}, "quantized"),
]


@pytest.mark.parametrize(("options", "kind"), OPTIONS)
def test_a_spec_builds_what_the_port_s_options_build_and_sizes_it(options: dict[str, Any], kind: str) -> None:
    model = _port()
    spec = CacheSpec(**options)
    assert spec.kind == kind and CacheSpec(**spec.options()) == spec
    options = dict(options)
    max_len = options.pop("max_len", None)
    by_options = model.new_cache(2, max_len, **options)
    by_spec = model.new_cache(2, spec=spec)
    assert type(by_spec) is type(by_options) and by_spec.bytes == by_options.bytes
    assert spec.bytes(model.cache_shape(), batch=2, dtype=model.dtype) == by_options.bytes
    assert isinstance(by_spec, {"full": KVCache, "window": SinkCache, "quantized": QuantizedKVCache}[kind])


@pytest.mark.parametrize("layers", ["all", "global"])
@pytest.mark.parametrize(("options", "kind"), OPTIONS)
def test_a_spec_builds_what_hf_new_cache_s_options_build_on_a_hybrid_model(options: dict[str, Any], kind: str,
                                                                        layers: str) -> None:
    model = _gemma3()
    spec = CacheSpec(**options, layers=layers)
    options = dict(options)
    max_len = options.pop("max_len", None)
    by_options = hf.new_cache(model, max_len, layers=layers, **options)
    by_spec = hf.new_cache(model, spec=spec)
    assert isinstance(by_spec.inner, HybridCache) and by_spec.bytes == by_options.bytes
    assert [type(p) for p in by_spec.inner.parts.values()] == [type(p) for p in by_options.inner.parts.values()]
    assert spec.bytes(cache_shape(model), dtype=torch.float32) == by_options.bytes
    ring = by_spec.inner.part(W)  # a sliding layer never holds more than its window
    assert isinstance(ring, (SinkCache, QuantizedKVCache))
    if kind != "window":
        assert ring.bytes < by_spec.inner.part(None).bytes


def test_a_head_plan_spec_builds_a_headwise_cache_on_both_and_sizes_it() -> None:
    model = _port()
    plan = _plan((3, 4, 2, 16))
    spec = CacheSpec(64, plan=plan)
    cache = model.new_cache(1, spec=spec)
    assert spec.kind == "headwise" and isinstance(cache, HeadwiseCache)
    assert cache.bytes == model.new_cache(1, 64, plan=plan).bytes == spec.bytes(model.cache_shape())
    gemma = _gemma3()
    shape = cache_shape(gemma)
    gplan = _plan((6, 4, 2, 16), windows=shape.windows)
    built = hf.new_cache(gemma, spec=CacheSpec(64, plan=gplan))
    assert isinstance(built.inner, HeadwiseCache) and built.bytes == CacheSpec(64, plan=gplan).bytes(shape)


def test_a_pruned_model_gets_a_cache_per_layer_and_no_head_plan() -> None:
    model = prune(_port(), [[0, 1], [0], [1]])
    shape = model.cache_shape()
    assert shape.kv_heads == (2, 1, 1) and not shape.split
    cache = model.new_cache(1, spec=CacheSpec(40, bits=4, group=16))
    assert isinstance(cache, LayeredCache) and cache.bytes == CacheSpec(40, bits=4, group=16).bytes(shape)
    with pytest.raises(MultiheadError, match=r"layers hold different numbers of KV heads \(\[2, 1, 1\]\)"):
        model.new_cache(1, spec=CacheSpec(40, plan=_plan((3, 4, 2, 16))))


@pytest.mark.parametrize(("options", "message"), [
    ({"max_len": 10, "window": 4, "bits": 8}, r"give window= \(with sink_tokens=\) or bits=8, not both"),
    ({}, r"needs max_len \(the tokens it holds\), or window= for a windowed cache"),
    ({"max_len": 10, "sink_tokens": 2}, r"sink_tokens \(2\) go with a window"),
    ({"max_len": 10, "layers": "some"}, r"layers='some' is not a choice"),
    ({"max_len": 10, "plan": "plan.json"}, r"plan must be a HeadPlan \(HeadPlan.load\(path\)\), got str"),
    ({"max_len": 10, "bits": 3}, r"bits \(3\) is not a supported cache width"),
    ({"max_len": 0}, r"max_len \(0\) must be an int of at least 1"),
    ({"window": 8, "sink_tokens": -1}, r"sink_tokens \(-1\) must be an int of at least 0"),
    ({"max_len": 10, "group": 0, "bits": 4}, r"group \(0\) must be an int of at least 1"),
])
def test_a_bad_spec_is_refused_when_made_naming_what_to_give(options: dict[str, Any], message: str) -> None:
    with pytest.raises(MultiheadError, match=message):
        CacheSpec(**options)


def test_plans_windows_and_context_are_checked_when_built() -> None:
    plan = _plan((3, 4, 2, 16))
    with pytest.raises(MultiheadError, match="brings its own sinks and window"):
        CacheSpec(10, plan=plan, window=4)
    with pytest.raises(MultiheadError, match="needs max_len"):
        CacheSpec(plan=plan)
    with pytest.raises(MultiheadError, match="give plan= without layers='global'"):
        CacheSpec(10, plan=plan, layers="global")
    port = _port()
    with pytest.raises(MultiheadError, match=r"max_len \(300\) exceeds the model's context \(256\)"):
        port.new_cache(1, spec=CacheSpec(300))
    with pytest.raises(MultiheadError, match=r"made for tiny of shape .* but the model has shape"):
        port.new_cache(1, spec=CacheSpec(10, plan=_plan((2, 4, 2, 16))))
    sliding = CacheShape.uniform(n_layers=2, n_kv_heads=1, n_heads=2, head_dim=8, windows=(W, W))
    with pytest.raises(MultiheadError, match=r"every layer of this model slides \(windows \[16\]\)"):
        CacheSpec(10, layers="global").build(sliding)
    with pytest.raises(MultiheadError, match=r"give spec= alone or the cache's options, not both \(got spec= with "
                                             r"bits=, max_len\)"):
        port.new_cache(1, 20, bits=4, spec=CacheSpec(10))
    with pytest.raises(MultiheadError, match="gives 2 layers' KV heads but 1 layers' windows"):
        CacheShape(kv_heads=(1, 1), windows=(None,), n_heads=2, head_dim=8)


def test_generate_decodes_with_a_spec_as_with_its_keywords_and_refuses_both() -> None:
    """generate_ids takes the cache as a spec (what the CLI holds): each kind decodes the tokens its keywords
    decode, with a cache of the same type and bytes; a spec beside keywords is refused naming them."""
    from multihead.models.generate import generate_ids

    model = _port()
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    plan = _plan((3, 4, 2, 16))
    for spec, keywords, kind in ((CacheSpec(window=4, sink_tokens=1), {"window": 4, "sink_tokens": 1}, SinkCache),
                                 (CacheSpec(1, bits=4, group=16), {"bits": 4}, QuantizedKVCache),
                                 (CacheSpec(1, plan=plan), {"plan": plan}, HeadwiseCache),
                                 (CacheSpec(1), {}, KVCache)):
        made: dict[str, Any] = {}
        runs = [list(generate_ids(model, prompt, max_new_tokens=6, on_cache=lambda c, k=k, m=made: m.setdefault(k, c),
                                  **options)) for k, options in (("spec", {"spec": spec}), ("keywords", keywords))]
        assert runs[0] == runs[1], spec
        assert type(made["spec"]) is type(made["keywords"]) is kind, spec
        assert made["spec"].bytes == made["keywords"].bytes, spec
    with pytest.raises(MultiheadError, match=r"give spec= alone or the cache's keywords, not both \(got spec= with "
                                             r"bits=\)"):
        next(generate_ids(model, prompt, max_new_tokens=2, spec=CacheSpec(1), bits=8))


def test_a_latent_spec_builds_an_mla_model_s_cache_and_sizes_it_as_the_cost_model_does() -> None:
    """MLA's cache is a kind of the one spec: on an MLA shape CacheSpec(max_len, latent=True) builds a LatentCache
    whose bytes are multihead.sizing.cost.mla_cache_bytes' (the independent formula) and spec.bytes'; a key and value
    kind on an MLA model, a latent spec on a key and value model, and a latent spec with another kind's options are
    refused naming what to give."""
    from multihead.cache import LatentCache
    from multihead.config import MLAConfig
    from multihead.sizing import cost

    config = MLAConfig(d_model=256, n_heads=16, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
                       v_head_dim=32)
    shape = CacheShape.mla(n_layers=3, n_heads=16, kv_lora_rank=128, rope_dim=16, context=4096)
    spec = CacheSpec(1000, latent=True)
    assert spec.kind == "latent"
    cache = spec.build(shape, batch=2, dtype=torch.bfloat16)
    assert isinstance(cache, LatentCache) and (cache.n_layers, cache.batch, cache.max_len, cache.width) == (3, 2, 1000,
                                                                                                          144)
    expected = cost.mla_cache_bytes(config, context=1000, batch=2, n_layers=3, dtype="bf16")
    assert cache.bytes == expected == spec.bytes(shape, batch=2, dtype=torch.bfloat16)
    with pytest.raises(MultiheadError, match=r"an MLA model caches latents: give CacheSpec\(max_len, latent=True\), "
                                             r"not a quantized cache"):
        CacheSpec(1000, bits=8).build(shape)
    with pytest.raises(MultiheadError, match="this model caches keys and values"):
        spec.build(CacheShape.uniform(n_layers=2, n_kv_heads=2, n_heads=4, head_dim=16))
    with pytest.raises(MultiheadError, match=r"without window=, sink_tokens="):
        CacheSpec(1000, latent=True, window=64, sink_tokens=4)
    with pytest.raises(MultiheadError, match="exceeds the model's context"):
        CacheSpec(5000, latent=True).build(shape)
