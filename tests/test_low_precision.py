"""float16 and bfloat16 follow FlashAttention's rule: the error to a float64 reference is at most twice the error of
plain PyTorch math (projections, softmax(q k^T * scale + mask) v with repeated K/V) run in the same dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import to_np
from multihead import MultiHeadAttention
from multihead.reference import Weights, multihead_attention


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
