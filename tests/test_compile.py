"""The layer compiles with fullgraph=True (no graph breaks) on the fused path and gives the eager result."""

from __future__ import annotations

import pytest
import torch

from multihead import MultiHeadAttention


@pytest.mark.slow
def test_fused_path_compiles_fullgraph() -> None:
    torch._dynamo.reset()
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2, rope=10000.0).eval()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(2, 9, 32)
    keep = torch.rand(2, 1, 9, 9) < 0.7
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 6:] = False
    with torch.no_grad():
        for kwargs in [dict(causal=True), dict(mask=keep), dict(key_padding_mask=valid, causal=True)]:
            torch.testing.assert_close(compiled(x, **kwargs), layer(x, **kwargs), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_flex_path_compiles_fullgraph_inside_a_compiled_model() -> None:
    """Inside a compiled region the block mask is built in the graph and flex attention is traced directly."""
    torch._dynamo.reset()
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2, window=40, backend="flex").eval()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(2, 256, 32)
    docs = torch.zeros(2, 256, dtype=torch.long)
    docs[:, 100:] = 1
    with torch.no_grad():
        got = compiled(x, causal=True, documents=docs)
        want = layer(x, causal=True, documents=docs, backend="math")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
