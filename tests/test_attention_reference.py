"""The layer against the NumPy float64 oracle, over random configurations, masks and backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import to_np
from multihead import MultiHeadAttention
from multihead.divisors import divisors
from multihead.verify.reference import Weights, multihead_attention

TOL = {torch.float64: (1e-9, 1e-9), torch.float32: (3e-5, 3e-4)}


@st.composite
def cases(draw: st.DrawFn) -> dict:
    n_heads = draw(st.integers(1, 8))
    n_kv_heads = draw(st.sampled_from(divisors(n_heads)))
    cross = draw(st.booleans())
    rope = (not cross) and draw(st.booleans())
    head_dim = draw(st.integers(1, 16)) * 2 if rope else draw(st.integers(1, 32))
    d_model = draw(st.integers(1, 24))
    b = draw(st.integers(1, 3))
    s = draw(st.integers(1, 40))
    t = draw(st.integers(1, 40)) if cross else s
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 8))) if causal else None
    mask_kind = draw(st.sampled_from(["none", "bool", "float", "padding", "bool+padding"]))
    return dict(
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, d_model=d_model, b=b, s=s, t=t, cross=cross,
        rope=rope, causal=causal, window=window, mask_kind=mask_kind,
        kv_dim=draw(st.integers(1, 24)) if cross else None,
        bias=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        mask_heads=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _make_masks(c: dict, gen: torch.Generator) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    b, h, s, t = c["b"], c["n_heads"], c["s"], c["t"]
    shape = (b, h if c["mask_heads"] else 1, s, t)
    mask = padding = None
    if c["mask_kind"] in ("bool", "bool+padding"):
        mask = torch.rand(shape, generator=gen) < 0.7
        mask[..., 0, :] = False  # at least one fully masked row in every head
    elif c["mask_kind"] == "float":
        mask = torch.randn(shape, generator=gen, dtype=torch.float64)
        mask = mask.masked_fill(torch.rand(shape, generator=gen) < 0.3, float("-inf"))
        mask[..., -1, :] = float("-inf")  # a row with no finite score
    if c["mask_kind"] in ("padding", "bool+padding"):
        lengths = torch.randint(0, t + 1, (b,), generator=gen)  # length 0: every query of that batch has no key
        padding = torch.arange(t)[None] < lengths[:, None]
    return mask, padding


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("backend", ["sdpa", "math"])
@given(c=cases())
def test_layer_equals_oracle(c: dict, backend: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(c["seed"])
    torch.manual_seed(c["seed"])
    layer = MultiHeadAttention(
        d_model=c["d_model"], n_heads=c["n_heads"], n_kv_heads=c["n_kv_heads"], head_dim=c["head_dim"],
        kv_dim=c["kv_dim"], bias=c["bias"], scale=c["scale"], rope=500.0 if c["rope"] else None,
        window=c["window"], dtype=dtype,
    )
    x = torch.randn(c["b"], c["s"], c["d_model"], generator=gen, dtype=dtype)
    context = torch.randn(c["b"], c["t"], c["kv_dim"], generator=gen, dtype=dtype) if c["cross"] else None
    mask, padding = _make_masks(c, gen)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    kwargs = dict(mask=mask, key_padding_mask=padding, causal=c["causal"])

    want_y, want_w = multihead_attention(
        layer.config, Weights.of(layer), to_np(x), None if context is None else to_np(context),
        mask=None if mask is None else mask.numpy(), key_padding_mask=None if padding is None else padding.numpy(),
        causal=c["causal"],
    )
    atol, rtol = TOL[dtype]
    y = layer(x, context, backend=backend, **kwargs)
    assert y.dtype == dtype and y.shape == (c["b"], c["s"], c["d_model"])
    np.testing.assert_allclose(to_np(y), want_y, atol=atol, rtol=rtol)
    if backend == "math":
        y2, w = layer(x, context, backend=backend, return_weights=True, **kwargs)
        assert w.shape == (c["b"], c["n_heads"], c["s"], c["t"])
        np.testing.assert_allclose(to_np(w), want_w, atol=atol, rtol=rtol)
        np.testing.assert_allclose(to_np(y2), want_y, atol=atol, rtol=rtol)
