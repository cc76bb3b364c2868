"""KVCache: cached decoding equals the uncached forward; per-sequence lengths; bytes; overflow; compile."""

from __future__ import annotations

import pytest
import torch

from multihead import AttentionConfig, KVCache, MultiHeadAttention, MultiheadError
from multihead.sizing import cost
from tests_support import aten_ops


def _layer(window: int | None = None) -> MultiHeadAttention:
    return MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2, rope=10000.0, window=window, bias=False).eval()


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_cached_decoding_equals_the_uncached_forward_at_every_step(window: int | None, backend: str) -> None:
    layer = _layer(window)
    x = torch.randn(2, 11, 32)
    full = layer(x, causal=True, backend=backend)
    cache = KVCache(batch=2, n_kv_heads=2, head_dim=8, max_len=16)
    prompt = 5
    y = layer(x[:, :prompt], causal=True, cache=cache.layer(0), backend=backend)
    cache.advance(prompt)
    torch.testing.assert_close(y, full[:, :prompt], atol=1e-5, rtol=1e-5)
    for i in range(prompt, 11):
        y = layer(x[:, i:i + 1], causal=True, cache=cache.layer(0), backend=backend)
        cache.advance(1)
        torch.testing.assert_close(y, full[:, i:i + 1], atol=1e-5, rtol=1e-5)
    assert cache.used == 11 and cache.lengths.tolist() == [11, 11]


def test_sequences_of_different_lengths_decode_together() -> None:
    layer = _layer()
    lengths = [3, 6]
    a, b = torch.randn(1, 3 + 4, 32), torch.randn(1, 6 + 4, 32)
    alone = [layer(a, causal=True), layer(b, causal=True)]
    cache = KVCache(batch=2, n_kv_heads=2, head_dim=8, max_len=12)
    padded = torch.zeros(2, 6, 32)
    padded[0, :3], padded[1] = a[0, :3], b[0, :6]
    y = layer(padded, causal=True, cache=cache.layer(0))
    cache.advance(6, lengths=lengths)
    torch.testing.assert_close(y[0, :3], alone[0][0, :3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y[1], alone[1][0, :6], atol=1e-5, rtol=1e-5)
    for step in range(4):
        x = torch.stack([a[0, 3 + step], b[0, 6 + step]])[:, None]  # (2, 1, 32): each sequence's next token
        y = layer(x, causal=True, cache=cache.layer(0))
        cache.advance(1)
        torch.testing.assert_close(y[0, 0], alone[0][0, 3 + step], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y[1, 0], alone[1][0, 6 + step], atol=1e-5, rtol=1e-5)
    assert cache.lengths.tolist() == [7, 10]


def test_cache_bytes_equal_the_cost_prediction_and_stay_kv_heads_wide() -> None:
    config = AttentionConfig(d_model=576, n_heads=9, n_kv_heads=3, bias=False)
    cache = KVCache(batch=4, n_kv_heads=3, head_dim=64, max_len=1024, n_layers=30, dtype=torch.bfloat16)
    assert cache.k.shape == (30, 4, 3, 1024, 64)
    assert cache.bytes == cost.kv_cache_bytes(config, context=1024, batch=4, n_layers=30, dtype="bf16")


def test_overflow_raises_and_reset_reuses_the_buffers() -> None:
    layer = _layer()
    cache = KVCache(batch=1, n_kv_heads=2, head_dim=8, max_len=4)
    layer(torch.randn(1, 3, 32), causal=True, cache=cache.layer(0))
    cache.advance(3)
    with pytest.raises(MultiheadError, match=r"KV cache overflow: 2 more token\(s\) after 3 .* max_len is 4"):
        layer(torch.randn(1, 2, 32), causal=True, cache=cache.layer(0))
    assert cache.used == 3  # nothing was lost: the failed call wrote nothing
    buffer = cache.k.data_ptr()
    cache.reset()
    assert cache.used == 0 and cache.lengths.tolist() == [0] and cache.k.data_ptr() == buffer


@pytest.mark.parametrize(("call", "message"), [
    (lambda layer, c: layer(torch.randn(1, 2, 32), cache=c.layer(0)), "needs|causal=True"),
    (lambda layer, c: layer(torch.randn(1, 2, 32), causal=True, cache=c), "one layer of a cache"),
    (lambda layer, c: layer(torch.randn(1, 2, 32), causal=True, cache=c.layer(0),
                            key_padding_mask=torch.ones(1, 2, dtype=torch.bool)), "cannot be combined"),
    (lambda layer, c: layer(torch.randn(2, 2, 32), causal=True, cache=c.layer(0)), r"do not fit this cache"),
    (lambda layer, c: c.layer(3), r"layer 3 is out of range for a cache of 1 layer"),
    (lambda layer, c: c.advance(2, lengths=[5]), r"lengths \[5\] must lie between 0 and the 2 positions"),
    (lambda layer, c: KVCache(batch=0, n_kv_heads=2, head_dim=8, max_len=4), r"KVCache batch \(0\) must be"),
])
def test_bad_cache_use_raises(call, message: str) -> None:  # type: ignore[no-untyped-def]
    layer = _layer()
    cache = KVCache(batch=1, n_kv_heads=2, head_dim=8, max_len=8)
    with pytest.raises(MultiheadError, match=message):
        call(layer, cache)


def test_cache_of_the_wrong_width_is_refused() -> None:
    cache = KVCache(batch=1, n_kv_heads=4, head_dim=8, max_len=8)
    with pytest.raises(MultiheadError, match=r"cache holds n_kv_heads 4 of head_dim 8 but this layer has n_kv_heads 2"):
        _layer()(torch.randn(1, 2, 32), causal=True, cache=cache.layer(0))


def test_next_positions_follow_every_change_of_the_lengths() -> None:
    cache = KVCache(batch=2, n_kv_heads=1, head_dim=4, max_len=16)
    cache.advance(3, lengths=[3, 1])
    assert cache.next_positions(1).tolist() == [[3], [1]]
    assert cache.reserve(1).start is None  # lengths differ: writes go by positions
    assert cache.reserve(1).positions.tolist() == [[3], [1]]  # type: ignore[union-attr]
    cache.advance(1)
    assert cache.next_positions(2).tolist() == [[4, 5], [2, 3]]
    cache.reset()
    assert cache.next_positions(1).tolist() == [[0], [0]] and cache.reserve(1).start == 0


def test_the_slice_write_of_equal_lengths_equals_the_indexed_write() -> None:
    """Sequences of one length take a slice copy; any other positions the indexed write: same slots either way."""
    torch.manual_seed(0)
    fast, slow = (KVCache(batch=2, n_kv_heads=2, head_dim=4, max_len=8) for _ in range(2))
    for step in range(3):
        k, v = torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4)
        slots = fast.reserve(2)
        assert slots.start == 2 * step
        fast.update(0, k, v, slots)  # one slice
        slow.update(0, k, v, slow.reserve(2, slow.next_positions(2)))  # by positions
        fast.advance(2)
        slow.advance(2)
        assert torch.equal(fast.k, slow.k) and torch.equal(fast.v, slow.v), step
    stale = fast.next_positions(1)
    fast.advance(1)  # positions taken before the advance still name their own slots
    k = torch.randn(2, 2, 1, 4)
    fast.update(0, k, k, fast.reserve(1, stale))
    assert torch.equal(fast.k[0, :, :, 6], k[:, :, 0])


def test_a_decode_step_makes_no_positions_when_nothing_reads_them() -> None:
    """One sequence, no RoPE: the slice write and the plain bottom-right mask need no positions tensor, so the step
    makes none (an arange and an add per call before); explain reads the cache through the slot as well."""

    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2).eval()
    cache = KVCache(batch=1, n_kv_heads=2, head_dim=8, max_len=8)
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        layer(x[:, :4], causal=True, cache=cache.layer(0))
        cache.advance(4)
        assert layer.step(x[:, 4:], causal=True, cache=cache.layer(0)).positions is None
        before = cache.k.clone()
        assert layer.explain(x[:, 4:], causal=True, cache=cache.layer(0)).backend == "sdpa"
        assert torch.equal(cache.k, before)
        with aten_ops() as ops:
            last = layer(x[:, 4:], causal=True, cache=cache.layer(0))
    assert "arange.default" not in ops.names and "add.Tensor" not in ops.names, ops.names
    torch.testing.assert_close(last, layer(x, causal=True)[:, 4:], atol=1e-6, rtol=1e-5)


def test_advance_refuses_negative_counts_and_overflow() -> None:
    cache = KVCache(batch=1, n_kv_heads=2, head_dim=8, max_len=4)
    with pytest.raises(MultiheadError, match="non-negative number of tokens, got -1"):
        cache.advance(-1)
    cache.advance(3)
    with pytest.raises(MultiheadError, match="KV cache overflow: 2 more token"):
        cache.advance(2)
    assert cache.used == 3 and cache.lengths.tolist() == [3]  # nothing recorded by the refused calls
