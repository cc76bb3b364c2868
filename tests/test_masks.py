"""Mask semantics: alignment, windows, empty rows (zeros, never NaN, finite gradients), no repeated K/V."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from multihead import MultiHeadAttention
from multihead.layers.masks import causal_keep

BACKENDS = ["sdpa", "math"]


def test_causal_keep_is_bottom_right_aligned() -> None:
    s, t = 3, 5
    keep = causal_keep(s, t)
    for i in range(s):
        for j in range(t):
            assert bool(keep[i, j]) == (j <= t - s + i)
    assert torch.equal(causal_keep(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())


def test_window_sees_at_most_the_last_window_keys() -> None:
    keep = causal_keep(6, 6, window=3)
    assert keep.sum(-1).tolist() == [1, 2, 3, 3, 3, 3]
    assert keep[5].tolist() == [False, False, False, True, True, True]


def _empty_row_inputs(kind: str) -> dict:
    b, h, s, t = 2, 4, 5, 5
    if kind == "bool":
        mask = torch.rand(b, h, s, t) < 0.6
        mask[:, :, 2] = False
        return {"mask": mask}
    if kind == "float":
        mask = torch.randn(b, 1, s, t)
        mask[:, :, 1] = float("-inf")
        return {"mask": mask}
    if kind == "padding":
        valid = torch.ones(b, t, dtype=torch.bool)
        valid[1] = False  # the second sequence has no real key at all
        return {"key_padding_mask": valid}
    raise AssertionError(kind)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bool", "float", "padding"])
def test_rows_with_no_key_give_zeros_and_finite_gradients(backend: str, kind: str) -> None:
    layer = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
    x = torch.randn(2, 5, 16, requires_grad=True)
    kwargs = _empty_row_inputs(kind)
    want_weights = backend == "math"
    result = layer(x, backend=backend, return_weights=want_weights, **kwargs)
    y = result[0] if want_weights else result
    assert torch.isfinite(y).all()
    # A row with no key attends to nothing: its attention output is zero, so y is exactly the output bias there.
    if kind == "bool":
        empty = (slice(None), 2)
    elif kind == "float":
        empty = (slice(None), 1)
    else:
        empty = (1, slice(None))
    torch.testing.assert_close(y[empty], layer.o_proj.bias.expand_as(y[empty]), rtol=0, atol=0)
    if want_weights:
        w = result[1]
        rows = w.sum(-1)
        assert torch.isfinite(w).all()
        assert ((rows - 1).abs() < 1e-5).logical_or(rows == 0).all()
    y.square().sum().backward()
    for p in [x, *layer.parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_with_more_queries_than_keys_zeros_the_top_rows(backend: str) -> None:
    layer = MultiHeadAttention(d_model=8, n_heads=2, kv_dim=8)
    x, ctx = torch.randn(1, 5, 8), torch.randn(1, 3, 8)
    y = layer(x, ctx, causal=True, backend=backend)
    # query i sees keys up to t - s + i = i - 2: queries 0 and 1 see nothing.
    torch.testing.assert_close(y[0, :2], layer.o_proj.bias.expand(2, 8), rtol=0, atol=0)
    assert not torch.allclose(y[0, 2], layer.o_proj.bias)


class _Shapes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                self.shapes.append(tuple(o.shape))
        return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [False, True])
def test_keys_and_values_are_never_repeated_to_n_heads(backend: str, masked: bool) -> None:
    b, s, t, h, g, d = 2, 7, 11, 8, 2, 5
    layer = MultiHeadAttention(d_model=16, n_heads=h, n_kv_heads=g, head_dim=d, kv_dim=12)
    x, ctx = torch.randn(b, s, 16), torch.randn(b, t, 12)
    mask = torch.rand(b, 1, s, t) < 0.5 if masked else None
    with _Shapes() as seen, torch.no_grad():
        layer(x, ctx, mask=mask, backend=backend)
    assert (b, g, t, d) in seen.shapes  # K and V exist at n_kv_heads width...
    repeated = {(b, h, t, d), (b, t, h, d), (b, g, h // g, t, d), (b, h, d, t)}
    assert not repeated & set(seen.shapes)  # ...and never at n_heads width
