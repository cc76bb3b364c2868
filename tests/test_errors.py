"""Every bad input raises MultiheadError (a ValueError) with a message that names the values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from multihead import AttentionConfig, MultiHeadAttention, MultiheadError

CONFIG_ERRORS: list[tuple[dict[str, Any], str]] = [
    (dict(d_model=100, n_heads=3), r"d_model \(100\) must be divisible by n_heads \(3\)"),
    (dict(d_model=4096, n_heads=32, n_kv_heads=5), r"n_heads \(32\) must be divisible by n_kv_heads \(5\).*1, 2, 4, 8"),
    (dict(d_model=64, n_heads=4, n_kv_heads=8), r"n_heads \(4\) must be divisible by n_kv_heads \(8\)"),
    (dict(d_model=0, n_heads=1), r"d_model \(0\) must be a positive int"),
    (dict(d_model=-8, n_heads=2), r"d_model \(-8\) must be a positive int"),
    (dict(d_model=8, n_heads=0), r"n_heads \(0\) must be a positive int"),
    (dict(d_model=8, n_heads=-2), r"n_heads \(-2\) must be a positive int"),
    (dict(d_model=8, n_heads=2, n_kv_heads=0), r"n_kv_heads \(0\) must be a positive int"),
    (dict(d_model=8, n_heads=2, head_dim=0), r"head_dim \(0\) must be a positive int"),
    (dict(d_model=8, n_heads=2, kv_dim=-1), r"kv_dim \(-1\) must be a positive int"),
    (dict(d_model=8.0, n_heads=2), r"d_model \(8.0\) must be an int"),
    (dict(d_model=8, n_heads=2, dropout=1.0), r"dropout \(1.0\) must be in \[0, 1\)"),
    (dict(d_model=8, n_heads=2, dropout=-0.1), r"dropout \(-0.1\) must be in \[0, 1\)"),
    (dict(d_model=6, n_heads=2, rope=10000.0), r"rope needs an even head_dim \(got head_dim 3\)"),
    (dict(d_model=8, n_heads=2, rope=0.5), r"rope base \(0.5\) must be a finite number greater than 1"),
    (dict(d_model=8, n_heads=2, window=0), r"window \(0\) must be a positive int"),
    (dict(d_model=8, n_heads=2, scale=0.0), r"scale \(0.0\) must be a positive finite float"),
    (dict(d_model=8, n_heads=2, scale=float("nan")), r"scale \(nan\) must be a positive finite float"),
]


@pytest.mark.parametrize(("kwargs", "message"), CONFIG_ERRORS, ids=[m[:40] for _, m in CONFIG_ERRORS])
def test_bad_configs_raise_with_the_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(MultiheadError, match=message):
        AttentionConfig(**kwargs)
    with pytest.raises(MultiheadError, match=message):
        MultiHeadAttention(**kwargs)


def test_error_type_is_a_value_error() -> None:
    assert issubclass(MultiheadError, ValueError)


def _layer(**kw: Any) -> MultiHeadAttention:
    return MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2, **kw)


X = torch.randn(2, 5, 16)

CALL_ERRORS: list[tuple[Callable[[], Any], str]] = [
    (lambda: _layer()(torch.randn(5, 16)), r"x must have 3 dimensions \(b, length, d_model\), got shape \(5, 16\)"),
    (lambda: _layer()(torch.randn(2, 5, 12)), r"x has width 12 .* the layer's d_model is 16"),
    (lambda: _layer()(torch.ones(2, 5, 16, dtype=torch.long)), r"x has dtype torch.int64"),
    (lambda: _layer()(torch.randn(2, 5, 16, dtype=torch.bfloat16)),
     r"x has dtype torch.bfloat16 but the layer's weights are torch.float32: convert one"),
    (lambda: _layer()(torch.randn(2, 5, 16, device="meta")), r"x is on meta but the layer's weights are on cpu"),
    (lambda: MultiHeadAttention(d_model=16, n_heads=4, kv_dim=8)(torch.randn(2, 5, 16), torch.randn(2, 3, 8).double()),
     r"context has dtype torch.float64 but the layer's weights are torch.float32"),
    (lambda: _layer()([[1.0]]), r"x must be a torch.Tensor, got list"),
    (lambda: _layer(kv_dim=10)(X, torch.randn(2, 7, 9)), r"context has width 9 .* kv_dim is 10"),
    (lambda: _layer(kv_dim=10)(X, torch.randn(3, 7, 10)), r"context has batch 3 but x has batch 2"),
    (lambda: _layer()(X, mask=torch.ones(5, 6, dtype=torch.bool)),
     r"mask of shape \(5, 6\) does not broadcast to \(b, n_heads, s, t\) = \(2, 4, 5, 5\)"),
    (lambda: _layer()(X, mask=torch.ones(2, 3, 5, 5, dtype=torch.bool)), r"mask of shape \(2, 3, 5, 5\) does not"),
    (lambda: _layer()(X, mask=torch.ones(2, 5, 5, dtype=torch.bool)), r"mask of shape \(2, 5, 5\) is ambiguous"),
    (lambda: _layer()(X, mask=torch.ones(5, dtype=torch.bool)), r"mask has 1 dimensions \(shape \(5,\)\)"),
    (lambda: _layer()(X, mask=torch.ones(5, 5, dtype=torch.int64)), r"mask has dtype torch.int64"),
    (lambda: _layer()(X, key_padding_mask=torch.ones(2, 4, dtype=torch.bool)),
     r"key_padding_mask of shape \(2, 4\) must be \(b, t\) = \(2, 5\)"),
    (lambda: _layer()(X, key_padding_mask=torch.ones(2, 5)), r"key_padding_mask has dtype torch.float32"),
    (lambda: _layer(window=3)(X), r"window \(3\) is a causal sliding window.*causal=True"),
    (lambda: _layer()(X, backend="flash3"), r"backend 'flash3' is unknown"),
    (lambda: _layer()(X, backend="sdpa", return_weights=True), r"backend 'sdpa' cannot return attention weights"),
    (lambda: _layer(rope=10000.0, kv_dim=16)(X, X), r"rope is for self-attention"),
    (lambda: _layer()(X, positions=torch.arange(5)), r"positions were given but this layer has no rope or cache"),
    (lambda: _layer(rope=10000.0)(X, positions=torch.arange(4)),
     r"positions of shape \(4,\) must be \(s,\) or \(b, s\) = \(2, 5\)"),
    (lambda: _layer(value_dim=6)(X, X), r"value_dim \(6\) != kv_dim \(16\): pass value="),
    (lambda: _layer()(X, value=X), r"value was given without context"),
    (lambda: _layer(value_dim=6)(X, X, value=torch.randn(2, 4, 6)),
     r"value has \(batch, length\) \(2, 4\) but context has \(2, 5\)"),
    (lambda: _layer()(X, causal="yes"), r"causal \('yes'\) must be True or False"),
    (lambda: MultiHeadAttention(d_model=16, n_heads=4, backend="cuda"), r"backend 'cuda' is unknown"),
]


@pytest.mark.parametrize(("call", "message"), CALL_ERRORS, ids=[m[:40] for _, m in CALL_ERRORS])
def test_bad_calls_raise_with_the_values(call: Callable[[], Any], message: str) -> None:
    with pytest.raises(MultiheadError, match=message):
        call()


def test_there_are_at_least_25_distinct_bad_inputs() -> None:
    assert len(CONFIG_ERRORS) + len(CALL_ERRORS) >= 25


def test_a_huge_width_that_does_not_divide_is_one_line_at_once(capsys) -> None:  # type: ignore[no-untyped-def]
    from multihead.cli import main

    assert main(["count", "--d-model", str(10**12), "--heads", "7"]) == 2
    err = capsys.readouterr().err  # refused by the config reader's bound on widths, before any divisor is sought
    assert "d_model = 1000000000000: expected an integer from 1 to 1,048,576" in err and err.count("\n") == 1
    with pytest.raises(MultiheadError, match=r"must be divisible by n_heads \(7\)"):  # the layer itself, at once
        AttentionConfig(d_model=10**12, n_heads=7)
