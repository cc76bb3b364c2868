"""Bad values inside tensors: NaN and +inf in float masks are refused by name (validate=True, the default), masks on
another device than the inputs are refused, and NaN inputs give the same documented result on every backend."""

from __future__ import annotations

import pytest
import torch

from multihead import MultiHeadAttention, MultiheadError

BACKENDS = ["sdpa", "math"]


def _layer(**kw) -> MultiHeadAttention:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2, bias=False, **kw).eval()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_or_plus_inf_in_a_float_mask_is_refused_and_named(bad: float, backend: str) -> None:
    x = torch.randn(2, 5, 32)
    mask = torch.zeros(2, 1, 5, 5)
    mask[1, 0, 3, 2] = bad
    with pytest.raises(MultiheadError, match=r"holds NaN or \+inf \(1 entries, the first at \(1, 0, 3, 2\)"):
        _layer()(x, mask=mask, backend=backend)
    mask[1, 0, 3, 2] = float("-inf")  # -inf forbids a key: fine
    assert torch.isfinite(_layer()(x, mask=mask, backend=backend)).all()


def test_validate_false_skips_the_check_and_the_nan_row_is_the_same_on_every_backend() -> None:
    x = torch.randn(1, 4, 32)
    mask = torch.zeros(4, 4)
    mask[2, 1] = float("nan")
    layer = _layer(validate=False)
    outs = [layer(x, mask=mask, backend=b) for b in BACKENDS]
    for out in outs:  # documented: the row whose mask holds NaN is NaN, the others are untouched
        assert torch.isnan(out[0, 2]).all() and torch.isfinite(out[0, [0, 1, 3]]).all()
    torch.testing.assert_close(outs[0][0, [0, 1, 3]], outs[1][0, [0, 1, 3]], atol=1e-5, rtol=1e-5)
    with pytest.raises(MultiheadError, match=r"validate \('no'\) must be True or False"):
        _layer(validate="no")


def test_masks_on_another_device_are_refused() -> None:
    x = torch.randn(1, 3, 32)
    for name, kwargs in (("mask", {"mask": torch.ones(3, 3, dtype=torch.bool, device="meta")}),
                         ("key_padding_mask", {"key_padding_mask": torch.ones(1, 3, dtype=torch.bool,
                                                                              device="meta")})):
        with pytest.raises(MultiheadError, match=f"{name} is on meta but the inputs are on cpu"):
            _layer()(x, **kwargs)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32])
def test_integer_masks_are_refused(dtype: torch.dtype) -> None:
    with pytest.raises(MultiheadError, match=f"mask has dtype {dtype}"):
        _layer()(torch.randn(1, 3, 32), mask=torch.ones(3, 3, dtype=dtype))


def test_nan_in_the_inputs_reaches_the_same_outputs_on_every_backend() -> None:
    """Documented: NaN in one (unpadded) token of x makes every row of that sequence NaN on every backend, also rows
    whose mask hides that token (a zero weight times a NaN value is NaN, as in PyTorch's own kernels); the other
    sequences of the batch are untouched. (A key that key_padding_mask pads out is the exception: see below.)"""
    x = torch.randn(2, 6, 32)
    x[0, 3, 5] = float("nan")
    for backend in BACKENDS:
        out = _layer()(x, causal=True, backend=backend)
        assert torch.isnan(out[0]).any(dim=-1).all() and torch.isfinite(out[1]).all()


def test_two_threads_on_one_layer_with_different_masks_get_what_each_gets_alone() -> None:
    """Nothing a call derives (masks, block masks, RoPE tables) is kept on the layer between calls: two threads
    sharing a layer get the results of running alone."""
    import threading

    torch.manual_seed(0)
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2, rope=10000.0, bias=False).eval()
    inputs = [(torch.randn(2, 9, 32), torch.rand(2, 1, 9, 9) > 0.3), (torch.randn(2, 7, 32), None)]
    alone = [layer(x, mask=m, causal=m is None) for x, m in inputs]
    results: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def work(i: int) -> None:
        x, m = inputs[i]
        for _ in range(50):
            results[i].append(layer(x, mask=m, causal=m is None))

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        assert len(results[i]) == 50
        for out in results[i]:
            torch.testing.assert_close(out, alone[i], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "math", "flex"])
def test_a_nan_in_a_padded_key_never_reaches_the_real_rows(backend: str) -> None:
    """Keys the key_padding_mask pads out have their K and V zeroed before attention, so whatever they hold (NaN from
    an uninitialised buffer) cannot reach a real row; the real rows equal those of the sequence without the padding."""
    layer = _layer()
    context = torch.randn(2, 7, 32)
    real = context[:, :5].clone()
    context[0, 5:] = float("nan")
    context[1, 6] = float("inf")
    padding = torch.ones(2, 7, dtype=torch.bool)
    padding[:, 5:] = False
    x = torch.randn(2, 4, 32)
    with torch.no_grad():
        out = layer(x, context=context, key_padding_mask=padding, backend=backend)
        alone = layer(x, context=real, backend=backend)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)


def test_positions_and_empty_inputs_are_checked() -> None:
    from multihead import AttentionConfig, KVCache, RopeConfig

    layer = MultiHeadAttention(AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, rope=RopeConfig(10000.0)))
    x = torch.randn(2, 3, 32)
    with pytest.raises(MultiheadError, match="positions is on meta but the inputs are on cpu"):
        layer(x, causal=True, positions=torch.arange(3, device="meta"))
    cache = KVCache(batch=2, max_len=8, n_layers=1, n_kv_heads=2, head_dim=8)
    for bad in (8, -1):  # past the slots, and negative (which would silently write the last slot)
        with pytest.raises(MultiheadError, match=r"fall outside the cache's slots: with max_len 8 they must lie in "
                                                 r"0 \.\. 7"):
            layer(x[:, :1], causal=True, cache=cache.layer(0), positions=torch.full((2, 1), bad))
    with pytest.raises(MultiheadError, match="positions into a KV cache index its slots: they must be integers"):
        layer(x[:, :1], causal=True, cache=cache.layer(0), positions=torch.full((2, 1), 1.0))
    for empty in (torch.randn(2, 0, 32), torch.randn(0, 3, 32)):
        for backend in ("sdpa", "math", "flex"):
            with pytest.raises(MultiheadError, match=r"is empty: attention needs at least one sequence"):
                layer(empty, causal=True, backend=backend)
    with pytest.raises(MultiheadError, match=r"context of shape \(2, 0, 32\) is empty"):
        _layer()(x, context=torch.randn(2, 0, 32))
