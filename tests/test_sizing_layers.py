"""Per-layer attention kinds (issue 29): the KV bytes multihead.sizing sums layer by layer against transformers' own
caches, built from the same config classes (tiny random-weight models, a real forward, the bytes of the real
cache tensors), for every family whose layers differ: Gemma 2's alternation, Gemma 3's
``sliding_window_pattern``, an explicit ``layer_types``, Mistral's window on every layer, gpt-oss, Qwen2's
``max_window_layers`` / ``use_sliding_window``, Cohere 2, Llama 4's chunked layers (from layer_types, and from
its own rule without them); and MLA's latent layers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from multihead import MultiheadError
from multihead.cli import main
from multihead.sizing import kv_bytes
from multihead.sizing.cost import LayerAttention
from multihead.sizing.presets import from_hf_dict, preset

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64}
W = 4  # the sliding window


def _families():  # type: ignore[no-untyped-def]
    t = transformers
    yield "gemma2", t.Gemma2Config(**TINY, sliding_window=W), t.Gemma2ForCausalLM
    yield "gemma3", t.Gemma3TextConfig(**TINY, sliding_window=W, sliding_window_pattern=3), t.Gemma3ForCausalLM
    yield "layer_types", t.Gemma2Config(**TINY, sliding_window=W, layer_types=[
        "full_attention", "full_attention", "sliding_attention", "full_attention"]), t.Gemma2ForCausalLM
    yield "mistral", t.MistralConfig(**TINY, sliding_window=W), t.MistralForCausalLM
    yield "gpt-oss", t.GptOssConfig(**TINY, sliding_window=W, num_local_experts=2, num_experts_per_tok=1),\
        t.GptOssForCausalLM
    yield "qwen2", t.Qwen2Config(**TINY, sliding_window=W, use_sliding_window=True, max_window_layers=1),\
        t.Qwen2ForCausalLM
    yield "qwen2 (no sliding)", t.Qwen2Config(**TINY, sliding_window=W, use_sliding_window=False),\
        t.Qwen2ForCausalLM
    yield "cohere2", t.Cohere2Config(**TINY, sliding_window=W), t.Cohere2ForCausalLM
    yield "llama4 (chunked)", t.Llama4TextConfig(**TINY, attention_chunk_size=W, num_local_experts=2,
                                                 num_experts_per_tok=1, intermediate_size_mlp=48), \
        t.Llama4ForCausalLM
    yield "llama4 (chunked, layer_types dropped)", _Dropped(t.Llama4TextConfig(
        **TINY, attention_chunk_size=W, num_local_experts=2, num_experts_per_tok=1, intermediate_size_mlp=48,
        no_rope_layer_interval=2)), t.Llama4ForCausalLM
    yield "llama (full)", t.LlamaConfig(**TINY), t.LlamaForCausalLM


class _Dropped:
    """A config whose to_dict() leaves out layer_types (and the derived no_rope_layers), as published Llama 4
    files have them: the layer kinds then come from the family's own rule."""

    def __init__(self, config) -> None:  # type: ignore[no-untyped-def]
        self.config = config

    def to_dict(self) -> dict[str, object]:
        d = self.config.to_dict()
        for key in ("layer_types", "no_rope_layers"):
            d.pop(key, None)
        return d


def _cache_bytes(cache) -> int:  # type: ignore[no-untyped-def]
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@pytest.mark.parametrize(("name", "config", "cls"), list(_families()), ids=[n for n, *_ in _families()])
def test_kv_bytes_equal_transformers_own_cache(name: str, config, cls) -> None:  # type: ignore[no-untyped-def]
    """At 8 tokens (a prefill) and 16 (8 more through the cache), each past the window of 4."""
    torch.manual_seed(0)
    model = cls(getattr(config, "config", config)).eval()
    ours = from_hf_dict(config.to_dict(), name=name)
    ids = torch.randint(0, TINY["vocab_size"], (1, 16))
    with torch.no_grad():
        out = model(input_ids=ids[:, :8], use_cache=True)
        cache = out["cache"]  # (transformers 5.24 names it cache; past_key_values is deprecated)
        assert kv_bytes(ours, context=8, batch=1, dtype="fp32") == _cache_bytes(cache), ours.layers()
        cache = model(input_ids=ids[:, 8:], cache=cache, use_cache=True)["cache"]
        assert cache.get_seq_length() == 16
        assert kv_bytes(ours, context=16, batch=1, dtype="fp32") == _cache_bytes(cache), ours.layers()


def test_the_same_configs_as_published_files_name_their_layers() -> None:
    """The families' defaults without a layer_types list (as published config.json files of older releases have
    them): Gemma 2 alternates from a sliding layer 0, Gemma 3 makes every 6th layer full, Qwen2 slides only from
    max_window_layers with use_sliding_window, Mistral slides everywhere."""
    base = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 12, "sliding_window": 16}
    kinds = {family: [k.kind for k in from_hf_dict({**base, "model_type": family, **extra}).layers()]
             for family, extra in [("gemma2", {}), ("gemma3_text", {}), ("mistral", {}),
                                   ("qwen2", {"use_sliding_window": True, "max_window_layers": 10}), ("qwen2", {})]}
    assert kinds["gemma2"] == ["sliding", "full"] * 6
    assert kinds["gemma3_text"] == (["sliding"] * 5 + ["full"]) * 2
    assert kinds["mistral"] == ["sliding"] * 12
    assert kinds["qwen2"] == ["full"] * 12  # (the last one read: no use_sliding_window, transformers' default false)
    qwen = from_hf_dict({**base, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 10})
    assert [k.kind for k in qwen.layers()] == ["full"] * 10 + ["sliding"] * 2
    assert set(preset("deepseek-v3").layers()) == {LayerAttention("latent")}


@pytest.mark.parametrize(("extra", "message"), [
    ({"layer_types": ["full_attention"] * 3}, "layer_types lists 3 layers; the config has 4"),
    ({"layer_types": ["full_attention"] * 3 + ["mamba"]}, r"layer_types\[3\] = 'mamba' is not sized yet"),
    ({"layer_types": "full_attention"}, "layer_types = 'full_attention': expected a list of strings"),
    ({"layer_types": ["sliding_attention"] * 4}, "sliding_attention but the config has no sliding_window"),
])
def test_bad_layer_types_are_refused_by_name(extra: dict[str, object], message: str) -> None:
    with pytest.raises(MultiheadError, match=message):
        from_hf_dict({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 4,
                      **extra})


def test_gemma2_9b_is_sized_layer_by_layer(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """Issue 29's first defect: Gemma-2-9B's 21 global layers hold all 8192 tokens, its 21 local ones 4095; the
    context that fits is finite (it was 'any', as if every layer had the window)."""
    cfg = transformers.Gemma2Config(vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                                    num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                                    head_dim=256, sliding_window=4096, max_position_embeddings=8192).to_dict()
    cfg.pop("layer_types")  # as the published config.json has it: the alternation is Gemma 2's own
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["count", "--config", str(tmp_path), "--seq", "8192", "--device-memory", "80GiB", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    per_token = 2 * 8 * 256 * 2
    assert r["kv_cache_bytes_total"] == 21 * 8192 * per_token + 21 * 4095 * per_token
    assert r["whole_model"]["kv_bytes"] == r["kv_cache_bytes_total"]
    assert r["max_context_in_device_memory"] is not None and r["layer_kinds"] == "21 sliding 4096 + 21 full"
    assert r["by_layer_kind"]["full"]["flops_forward_per_layer"] > r["by_layer_kind"]["sliding 4096"][
        "flops_forward_per_layer"]


@pytest.mark.parametrize(("kind", "window", "message"), [
    ("sliding", None, "a sliding layer needs a window of at least 1 token, got None"),
    ("full", 4, "a full layer has no window"),
    ("local", None, "layer kind 'local' is unknown: choose one of full, sliding, chunked, latent"),
    ("chunked", 0, r"a chunked layer needs a chunk \(window\) of at least 1 token, got 0"),
])
def test_a_layer_kind_validates_itself(kind: str, window: int | None, message: str) -> None:
    with pytest.raises(MultiheadError, match=message):
        LayerAttention(kind, window)


@pytest.mark.parametrize("cache", ["int8", "int4", "window:256"])
def test_an_mla_model_refuses_a_cache_of_keys_and_values_it_does_not_hold(
        cache: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`count --cache int8` on DeepSeek-V2-Lite printed "as int8: 519.8 MiB", the int8 bytes of the MHA-expanded
    keys and values, above its real latent cache of 121.5 MiB: an MLA model caches latents, and multihead builds no
    quantized or windowed latent cache, so the figure counted a cache that does not exist. Its full cache (the
    latent) is still counted."""
    model = preset("deepseek-v2-lite")
    with pytest.raises(MultiheadError, match=rf"deepseek-v2-lite caches MLA latents \(576 values a token and layer\)"
                                             rf".*--cache {cache} sizes a cache of keys and values"):
        kv_bytes(model, context=4096, batch=1, dtype="bf16", cache=cache)
    assert kv_bytes(model, context=4096, batch=1, dtype="bf16") == 27 * 576 * 2 * 4096  # 27 layers' latents, bf16
    assert main(["count", "--preset", "deepseek-v2-lite", "--seq", "4096", "--cache", cache]) == 2
    assert "give --cache full (its latent cache)" in capsys.readouterr().err
