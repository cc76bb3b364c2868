"""Pruning KV groups by importance: the smaller model equals the original with those heads zeroed, decodes through
a cache whose layers differ in width, and survives a save and load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from multihead import MultiheadError
from multihead.cache import LayeredCache
from multihead.layers.hooks import hooks, zero_heads
from multihead.models.llama import LlamaConfig, LlamaModel
from multihead.models.loaders import load_llama_weights, save_llama
from multihead.sizing import cost
from multihead.tradeoff.prune import dropped_heads, group_importance, groups_to_keep, prune


def _model() -> LlamaModel:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, d_model=48, n_layers=3, n_heads=6, n_kv_heads=3, ffn_dim=48, max_context=64)
    model = LlamaModel(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model


def test_groups_to_keep_drops_the_least_important_and_keeps_one_per_layer() -> None:
    importance = np.array([[0.1, 0.9, 0.5], [0.2, 0.3, 0.05], [0.8, 0.7, 0.6]])
    assert groups_to_keep(importance, 0.0) == [[0, 1, 2]] * 3
    assert groups_to_keep(importance, 0.34) == [[1, 2], [1], [0, 1, 2]]  # 3 of 9: 0.05, 0.1, 0.2
    assert all(len(k) >= 1 for k in groups_to_keep(importance, 0.99))
    for bad in (1.0, -0.1, float("nan"), "0.5"):
        with pytest.raises(MultiheadError, match="pruning fraction"):
            groups_to_keep(importance, bad)  # type: ignore[arg-type]


def test_the_pruned_model_equals_the_original_with_the_dropped_heads_zeroed(tmp_path: Path) -> None:
    model = _model()
    x = torch.randint(0, 40, (2, 20))
    keep = groups_to_keep(group_importance(model, x), 0.5)
    small = prune(model, keep)
    assert small.config.layer_heads == tuple((2 * len(k), len(k)) for k in keep)
    zero = {f"layers.{i}.attn.hook_z": zero_heads(d) for i, d in enumerate(dropped_heads(model, keep)) if d}
    with hooks(model, zero), torch.no_grad():
        reference = model(x)
    torch.testing.assert_close(small(x), reference, atol=1e-5, rtol=1e-5)
    # cached decoding through layers of different widths
    cache = small.new_cache(2, 32)
    outs = [small(x[:, :7], cache=cache)]
    cache.advance(7)
    for i in range(7, 20):
        outs.append(small(x[:, i:i + 1], cache=cache))
        cache.advance(1)
    torch.testing.assert_close(torch.cat(outs, 1), reference, atol=1e-5, rtol=1e-5)
    if len({len(k) for k in keep}) > 1:
        assert isinstance(cache, LayeredCache)
    want = sum(cost.kv_cache_bytes(small.config.attention(i), context=32, batch=2, dtype="fp32") for i in range(3))
    assert cache.bytes == want < model.new_cache(2, 32).bytes
    # saved as safetensors and loaded back
    back = load_llama_weights(save_llama(small, tmp_path / "pruned"))
    assert back.config == small.config
    torch.testing.assert_close(back(x), reference, atol=1e-5, rtol=1e-5)


def test_bad_pruning_requests_are_refused() -> None:
    model = _model()
    with pytest.raises(MultiheadError, match=r"layer 1: groups to keep \[\] must be"):
        prune(model, [[0], [], [1]])
    with pytest.raises(MultiheadError, match="keep has 2 layers but the model has 3"):
        prune(model, [[0], [1]])
    with pytest.raises(MultiheadError, match="pruned already"):
        prune(prune(model, [[0], [1], [2]]), [[0], [0], [0]])
    with pytest.raises(MultiheadError, match=r"layer_heads has 2 entries but the model has 3 layers"):
        LlamaConfig(vocab_size=4, d_model=8, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=8,
                    layer_heads=((2, 1), (2, 1)))
