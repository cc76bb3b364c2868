"""from_torch: a layer built from torch.nn.MultiheadAttention computes the same function, weights per head included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from multihead import MultiHeadAttention, MultiheadError


@st.composite
def torch_cases(draw: st.DrawFn) -> dict:
    num_heads = draw(st.integers(1, 6))
    embed_dim = num_heads * draw(st.integers(1, 8))
    separate = draw(st.booleans())
    kdim = draw(st.integers(1, 12)) if separate else None
    vdim = draw(st.integers(1, 12)) if separate else None
    return dict(
        num_heads=num_heads, embed_dim=embed_dim, kdim=kdim, vdim=vdim, bias=draw(st.booleans()),
        batch_first=draw(st.booleans()), b=draw(st.integers(1, 3)), s=draw(st.integers(1, 12)),
        t=draw(st.integers(1, 12)) if separate else None,
        mask=draw(st.sampled_from(["none", "bool", "float", "padding", "bool3d"])), seed=draw(st.integers(0, 9999)),
    )


@given(c=torch_cases())
def test_from_torch_matches_output_and_per_head_weights(c: dict) -> None:
    torch.manual_seed(c["seed"])
    m = nn.MultiheadAttention(c["embed_dim"], c["num_heads"], bias=c["bias"], kdim=c["kdim"], vdim=c["vdim"],
                              batch_first=c["batch_first"]).eval()
    if c["bias"]:  # torch initialises biases to zero: make them count
        with torch.no_grad():
            for p in (m.in_proj_bias, m.out_proj.bias):
                p.normal_()
    ours = MultiHeadAttention.from_torch(m)
    b, s, h = c["b"], c["s"], c["num_heads"]
    t = c["t"] or s
    x = torch.randn(b, s, c["embed_dim"])
    key = torch.randn(b, t, c["kdim"]) if c["kdim"] else x
    value = torch.randn(b, t, c["vdim"]) if c["vdim"] else key

    # torch's masks: True = masked. Keep key 0 open so no row is empty (torch gives NaN there, we give zeros).
    torch_mask = torch_kpm = None
    our_kwargs: dict = {}
    if c["mask"] in ("bool", "bool3d"):
        shape = (b * h, s, t) if c["mask"] == "bool3d" else (s, t)
        torch_mask = torch.rand(shape) < 0.4
        torch_mask[..., 0] = False
        ours_mask = ~torch_mask
        our_kwargs["mask"] = ours_mask.view(b, h, s, t) if c["mask"] == "bool3d" else ours_mask
    elif c["mask"] == "float":
        torch_mask = torch.randn(s, t)
        our_kwargs["mask"] = torch_mask
    elif c["mask"] == "padding":
        torch_kpm = torch.rand(b, t) < 0.4
        torch_kpm[:, 0] = False
        our_kwargs["key_padding_mask"] = ~torch_kpm

    def tf(z: torch.Tensor) -> torch.Tensor:
        return z if c["batch_first"] else z.transpose(0, 1)

    want, want_w = m(tf(x), tf(key), tf(value), attn_mask=torch_mask, key_padding_mask=torch_kpm,
                     need_weights=True, average_attn_weights=False)
    if c["kdim"]:
        got, got_w = ours(x, key, value=value, return_weights=True, **our_kwargs)
    else:
        got, got_w = ours(x, return_weights=True, **our_kwargs)
    torch.testing.assert_close(got, tf(want), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got_w, want_w, atol=2e-6, rtol=1e-5)
    fused = ours(x, key, value=value, **our_kwargs) if c["kdim"] else ours(x, **our_kwargs)
    torch.testing.assert_close(fused, tf(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("option", ["add_bias_kv", "add_zero_attn"])
def test_from_torch_refuses_what_it_cannot_express(option: str) -> None:
    m = nn.MultiheadAttention(8, 2, **{option: True})
    with pytest.raises(MultiheadError, match=option):
        MultiHeadAttention.from_torch(m)


def test_from_torch_refuses_other_modules() -> None:
    with pytest.raises(MultiheadError, match="Linear"):
        MultiHeadAttention.from_torch(nn.Linear(4, 4))  # type: ignore[arg-type]
