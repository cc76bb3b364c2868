"""float16 and bfloat16 follow FlashAttention's rule: the error to a float64 reference is at most twice the error of
plain PyTorch math (projections, softmax(q k^T * scale + mask) v with repeated K/V) run in the same dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import to_np
from multihead import MultiHeadAttention
from multihead.verify.reference import Weights, multihead_attention


def plain_layer(layer: MultiHeadAttention, x: torch.Tensor, keep: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """The textbook computation in x's dtype, written independently of multihead's kernels."""
    c = layer.config
    b, s, _ = x.shape
    h, g, d = c.n_heads, layer.n_kv_heads, layer.head_dim
    dt = x.dtype
    q = torch.nn.functional.linear(x, layer.q_proj.weight.to(dt), layer.q_proj.bias.to(dt)).view(b, s, h, d)
    k = torch.nn.functional.linear(x, layer.k_proj.weight.to(dt), layer.k_proj.bias.to(dt)).view(b, s, g, d)
    v = torch.nn.functional.linear(x, layer.v_proj.weight.to(dt), layer.v_proj.bias.to(dt)).view(b, s, g, d)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    scores = q @ k.transpose(-2, -1) * c.softmax_scale
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    if keep is not None:
        allowed = allowed & keep
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    out = out.transpose(1, 2).reshape(b, s, h * d)
    return torch.nn.functional.linear(out, layer.o_proj.weight.to(dt), layer.o_proj.bias.to(dt))


def _max_err(a: torch.Tensor, ref: np.ndarray) -> float:
    return float(np.abs(to_np(a) - ref).max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("n_kv_heads", [8, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("masking", ["none", "causal", "bool"])
def test_low_precision_error_at_most_twice_plain_math(
    dtype: torch.dtype, backend: str, n_kv_heads: int, masking: str
) -> None:
    torch.manual_seed(1)
    b, s, d_model = 2, 64, 128
    layer = MultiHeadAttention(d_model=d_model, n_heads=8, n_kv_heads=n_kv_heads, dtype=dtype)
    x = torch.randn(b, s, d_model, dtype=dtype)
    keep = (torch.rand(s, s) < 0.8) | torch.eye(s, dtype=torch.bool) if masking == "bool" else None
    causal = masking == "causal"

    # Output: against the NumPy float64 oracle on the very same (rounded) weights and inputs.
    want, _ = multihead_attention(layer.config, Weights.of(layer), to_np(x),
                                  mask=None if keep is None else keep.numpy(), causal=causal)
    ours = layer(x, mask=keep, causal=causal, backend=backend)
    plain = plain_layer(layer, x, keep, causal)
    assert _max_err(ours, want) <= 2 * _max_err(plain, want) + 1e-6

    # Gradients: against the plain computation in float64 (independent of multihead's kernels).
    grad_out = torch.randn(b, s, d_model, dtype=dtype)
    x64 = x.double().requires_grad_()
    layer64 = MultiHeadAttention(d_model=d_model, n_heads=8, n_kv_heads=n_kv_heads, dtype=torch.float64)
    layer64.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    (plain_layer(layer64, x64, keep, causal) * grad_out.double()).sum().backward()
    assert x64.grad is not None

    def grads(run: str) -> tuple[torch.Tensor, torch.Tensor]:
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = layer(xi, mask=keep, causal=causal, backend=backend) if run == "ours" else plain_layer(
            layer, xi, keep, causal)
        (y * grad_out).sum().backward()
        assert xi.grad is not None and layer.q_proj.weight.grad is not None
        return xi.grad, layer.q_proj.weight.grad.clone()

    ours_dx, ours_dwq = grads("ours")
    plain_dx, plain_dwq = grads("plain")
    ref_dx, ref_dwq = to_np(x64.grad), to_np(layer64.q_proj.weight.grad)
    assert _max_err(ours_dx, ref_dx) <= 2 * _max_err(plain_dx, ref_dx) + 1e-6
    assert _max_err(ours_dwq, ref_dwq) <= 2 * _max_err(plain_dwq, ref_dwq) + 1e-6


def _alibi(n_heads: int, s: int, t: int, offset: float = 0.0) -> torch.Tensor:
    """A float32 ALiBi bias (1, h, s, t) as BLOOM adds it, by key position alone (softmax ignores a row's shift):
    slope_i * j, slopes 2^-(i/2), up to about 150 on the keys that matter most, where bfloat16's steps are 0.5 to 1
    apart; ``offset`` shifts every value."""
    slopes = 2.0 ** (-torch.arange(1, n_heads + 1) / 2)  # 0.71 .. 0.06
    return (slopes[:, None, None] * torch.arange(t)[None, None, :] * (150.0 / t)).expand(n_heads, s, t)[None] \
        + offset


def _plain_with_bias(layer: MultiHeadAttention, x: torch.Tensor, bias: torch.Tensor,
                     keep: torch.Tensor) -> torch.Tensor:
    """Plain math in x's dtype with the float32 bias added to float32 scores, as PyTorch's kernels take it."""
    c = layer.config
    b, s, _ = x.shape
    h, g, d = c.n_heads, layer.n_kv_heads, layer.head_dim
    q = layer.q_proj(x).view(b, s, h, d).transpose(1, 2)
    k = layer.k_proj(x).view(b, s, g, d).transpose(1, 2).repeat_interleave(h // g, dim=1)
    v = layer.v_proj(x).view(b, s, g, d).transpose(1, 2).repeat_interleave(h // g, dim=1)
    scores = (q @ k.transpose(-2, -1) * c.softmax_scale).float() + bias
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).to(x.dtype)
    return layer.o_proj((weights @ v).transpose(1, 2).reshape(b, s, h * d))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("case", ["alibi", "alibi+padding", "alibi+causal", "shifted"])
def test_a_float32_mask_is_never_rounded_to_the_low_precision_dtype(dtype: torch.dtype, backend: str,
                                                                     case: str) -> None:
    """A large float mask in float32 with low-precision inputs (issue 18: it was rounded to the input's dtype, giving
    errors 4-35x PyTorch's own kernel): within 2x plain math that adds it in float32, against the float64 oracle."""
    torch.manual_seed(2)
    b, s, d_model, h = 2, 96, 64, 8
    layer = MultiHeadAttention(d_model=d_model, n_heads=h, n_kv_heads=2, dtype=dtype)
    x = torch.randn(b, s, d_model, dtype=dtype)
    bias = _alibi(h, s, s, offset=-1000.0 if case == "shifted" else 0.0)  # "shifted": an offset softmax ignores
    keep = torch.ones(b, 1, s, s, dtype=torch.bool)
    padding = None
    if case == "alibi+padding":
        padding = torch.arange(s)[None] < torch.tensor([s, s - 30])[:, None]  # (b, t)
        keep = keep & padding[:, None, None, :]
    causal = case == "alibi+causal"
    if causal:
        keep = keep & torch.ones(s, s, dtype=torch.bool).tril()
    want, _ = multihead_attention(layer.config, Weights.of(layer), to_np(x), mask=bias.double().numpy(),
                                  key_padding_mask=None if padding is None else padding.numpy(), causal=causal)
    with torch.no_grad():
        ours = layer(x, mask=bias, key_padding_mask=padding, causal=causal, backend=backend)
        plain = _plain_with_bias(layer, x, bias, keep)
        rounded = _plain_with_bias(layer, x, bias.to(dtype).float(), keep)  # what rounding the mask did
    err, base = _max_err(ours, want), _max_err(plain, want)
    assert err <= 2 * base, f"error {err:.2e} > 2 x plain {base:.2e}"
    if dtype == torch.bfloat16:
        assert _max_err(rounded, want) > 3 * base  # the test can fail: a rounded mask is far off here


def test_a_float32_mask_through_flex_in_bfloat16() -> None:
    torch.manual_seed(2)
    layer = MultiHeadAttention(d_model=64, n_heads=8, n_kv_heads=2, dtype=torch.bfloat16)
    x = torch.randn(1, 128, 64, dtype=torch.bfloat16)
    bias = _alibi(8, 128, 128)
    want, _ = multihead_attention(layer.config, Weights.of(layer), to_np(x), mask=bias.double().numpy(), causal=True)
    with torch.no_grad():
        ours = layer(x, mask=bias, causal=True, backend="flex")
        plain = _plain_with_bias(layer, x, bias, torch.ones(128, 128, dtype=torch.bool).tril())
    assert _max_err(ours, want) <= 2 * _max_err(plain, want)


def test_float32_weights_run_under_autocast_with_low_precision_inputs() -> None:
    """Mixed precision: inputs of another dtype than the weights are an error, except under torch.autocast."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_model=64, n_heads=8, n_kv_heads=2)
    x = torch.randn(2, 16, 64)
    want = layer(x, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x.bfloat16(), causal=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)
