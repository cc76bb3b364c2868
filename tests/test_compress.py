"""multihead.cache.compress: a full cache's context put into another kind after the prefill (the shared-prefill
protocol), against the uncached model whose question rows see what the kind keeps and whose context rows see every
earlier key."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from multihead.cache import HeadPlan, HeadwiseCache, KVCache, QuantizedKVCache, SinkCache, compress, sink_keep
from multihead.errors import MultiheadError
from multihead.layers.linear import linear
from multihead.models import LlamaConfig, LlamaModel

N, Q = 40, 9  # context and question tokens


def _model() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                                  max_context=128)).eval()


def _shared_prefill(model: LlamaModel, tokens: Tensor, make: object) -> Tensor:
    """The question's logits after compress(full prefill of the context, make()), one token a step."""
    full = model.new_cache(tokens.shape[0], N + Q)
    with torch.no_grad():
        model(tokens[:, :N], cache=full)
        full.advance(N)
        small = compress(full, make())  # type: ignore[operator]
        assert full.used == N  # left as it was
        out = []
        for i in range(N, N + Q):
            out.append(model(tokens[:, i:i + 1], cache=small)[:, -1])
            small.advance(1)
    return torch.stack(out, 1)


def _reference(model: LlamaModel, tokens: Tensor, question_keep: Tensor) -> Tensor:
    """The uncached model: context rows causal over the context, question rows ``question_keep`` (per layer and query
    head, (L, h, Q, N + Q)), logits of the question rows."""
    n = N + Q
    pos = torch.arange(n)
    causal = pos[None] <= pos[:, None]
    h = model.embed(tokens)
    with torch.no_grad():
        for i, block in enumerate(model.layers):
            mask = causal[None].expand(question_keep.shape[1], n, n).clone()  # (h, n, n)
            mask[:, N:] = question_keep[i]
            h = block(h, step=block.attn.step(h, mask=mask[None]))
        return linear(model.norm(h), model.embed.weight)[:, N:N + Q]


def test_a_full_cache_compressed_into_a_full_cache_decodes_as_the_streaming_prefill() -> None:
    model, tokens = _model(), torch.randint(0, 64, (2, N + Q))
    got = _shared_prefill(model, tokens, lambda: model.new_cache(2, N + Q))
    with torch.no_grad():
        want = model(tokens)[:, N:N + Q]  # every key kept: the protocols agree
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_a_sink_cache_keeps_the_sinks_and_the_last_keys_of_the_full_prefill() -> None:
    model, tokens = _model(), torch.randint(0, 64, (1, N + Q))
    got = _shared_prefill(model, tokens, lambda: model.new_cache(1, window=8, sink_tokens=2))
    pos = torch.arange(N + Q)
    keep = sink_keep(pos[N:], pos, window=8, sink_tokens=2)  # (Q, N + Q): the question's queries
    want = _reference(model, tokens, keep[None, None].expand(2, 4, Q, N + Q))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_a_head_wise_cache_keeps_every_key_for_its_full_heads_and_sinks_and_window_for_the_rest() -> None:
    model, tokens = _model(), torch.randint(0, 64, (1, N + Q))
    plan = HeadPlan(full=[[True, False], [False, True]], sinks=2, window=8, model="tiny", shape=(2, 4, 2, 16))
    got = _shared_prefill(model, tokens, lambda: HeadwiseCache(plan, batch=1, max_len=N + Q))
    masks = plan.mask(N + Q)[:, :, N:]  # (L, h, Q, N + Q): the question's queries
    want = _reference(model, tokens, masks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_a_quantized_cache_holds_the_full_prefills_keys_quantized_as_its_own_commit_does() -> None:
    """compress is the kind's own reserve / update / advance over the context as one chunk: the same store as a
    streaming prefill whose keys were the full prefill's."""
    model, tokens = _model(), torch.randint(0, 64, (1, N + Q))
    full = model.new_cache(1, N + Q)
    with torch.no_grad():
        model(tokens[:, :N], cache=full)
        full.advance(N)
    small = compress(full, QuantizedKVCache(batch=1, n_kv_heads=2, head_dim=16, max_len=N + Q, bits=4, group=8,
                                            residual=8, n_layers=2))
    direct = QuantizedKVCache(batch=1, n_kv_heads=2, head_dim=16, max_len=N + Q, bits=4, group=8, residual=8,
                              n_layers=2)
    slots = direct.reserve(N)
    for layer in range(2):
        direct.update(layer, full.k[layer, :, :, :N].clone(), full.v[layer, :, :, :N].clone(), slots)
    direct.advance(N)
    assert small.quantized == direct.quantized == 32 and small.used == N
    for name in ("codes_k", "codes_v", "scale_k", "min_k", "scale_v", "min_v", "res_k", "res_v"):
        assert torch.equal(getattr(small, name), getattr(direct, name)), name


def test_bad_caches_are_refused_by_name() -> None:
    model = _model()
    full = model.new_cache(1, 16)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), cache=full)
    full.advance(4)
    with pytest.raises(MultiheadError, match=r"reads a full cache \(a KVCache, or a HybridCache .*\), not a SinkCache"):
        compress(SinkCache(batch=1, n_kv_heads=2, head_dim=16, window=4, n_layers=2), full)
    busy = model.new_cache(1, window=4)
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long), cache=busy)
    busy.advance(2)
    with pytest.raises(MultiheadError, match="writes into an empty cache: this SinkCache holds 2"):
        compress(full, busy)
    with pytest.raises(MultiheadError, match=r"holds \(batch, layers, n_kv_heads, head_dim\) \(1, 2, 2, 16\)"):
        compress(full, KVCache(batch=1, n_kv_heads=2, head_dim=16, max_len=16, n_layers=3))
    with pytest.raises(MultiheadError, match="not the cache itself"):
        compress(full, full)
    ragged = KVCache(batch=2, n_kv_heads=2, head_dim=16, max_len=8, n_layers=2)
    ragged.advance(6, lengths=[6, 3])
    with pytest.raises(MultiheadError, match=r"one length: the full cache holds lengths \[6, 3\]"):
        compress(ragged, KVCache(batch=2, n_kv_heads=2, head_dim=16, max_len=8, n_layers=2))
