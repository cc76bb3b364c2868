"""Odd tensors for the layer (issue 21): hypothesis draws inputs, masks, padding masks, document ids, positions and
caches of wrong or odd shapes, dtypes, devices and values, on every backend. Each call runs in a child process under a
time and memory limit and must return finite-where-defined outputs of the right shape or raise MultiheadError; never
another exception, a hang or a crash."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from isolation import isolated

D_MODEL, HEADS, KV_HEADS = 16, 4, 2


def _tensor(spec: tuple[Any, ...]) -> Any:
    """A tensor from a drawn spec: (shape, dtype, device, fill)."""
    if spec is None:
        return None
    shape, dtype, device, fill = spec
    if dtype == "list":
        return [[1.0] * (shape[-1] if shape else 1)]
    t = torch.zeros(shape, dtype=getattr(torch, dtype))
    if dtype == "bool":
        t = torch.ones(shape, dtype=torch.bool) if fill != "zeros" else t
    elif fill == "nan" and t.is_floating_point():
        t = t.fill_(float("nan"))
    elif fill == "inf" and t.is_floating_point():
        t = t.fill_(float("inf"))
    elif fill == "negative":
        t = t - 3
    elif fill == "huge":
        t = t + 10**6 if not t.is_floating_point() else t + 1e30
    elif fill == "random" and t.is_floating_point():
        t = torch.randn(shape).to(t.dtype)
    return t.to(device) if device == "meta" else t


def call_layer(case: dict[str, Any]) -> str:
    """Build the layer the case asks for and call it; the output's shape and whether it is finite."""
    from multihead import AttentionConfig, KVCache, MultiHeadAttention, RopeConfig

    torch.manual_seed(0)
    config = AttentionConfig(d_model=D_MODEL, n_heads=HEADS, n_kv_heads=KV_HEADS,
                             rope=RopeConfig(10000.0) if case["rope"] else None)
    layer = MultiHeadAttention(config, backend=case["backend"]).eval()
    x = _tensor(case["x"])
    kwargs: dict[str, Any] = {"causal": case["causal"]}
    for name in ("mask", "key_padding_mask", "documents", "positions", "context"):
        if case[name] is not None:
            kwargs[name] = _tensor(case[name])
    if case["cache"]:
        cache = KVCache(batch=case["x"][0][0] if case["x"][0] else 1, max_len=case["cache"], n_layers=1,
                        n_kv_heads=KV_HEADS, head_dim=D_MODEL // HEADS)
        kwargs["cache"] = cache.layer(0)
    with torch.no_grad():
        out = layer(x, **kwargs)
    return f"{tuple(out.shape)} finite={bool(torch.isfinite(out).all())}"


sizes = st.integers(0, 3)
shapes = st.lists(st.integers(0, 6), min_size=0, max_size=5).map(tuple)
dtypes = st.sampled_from(["float32", "float16", "bfloat16", "float64", "int64", "int32", "bool", "list"])
fills = st.sampled_from(["zeros", "random", "nan", "inf", "negative", "huge"])
devices = st.sampled_from(["cpu", "cpu", "cpu", "meta"])


def _spec(shape: Any, dtype: Any = dtypes) -> Any:
    return st.tuples(shape, dtype, devices, fills)


VALID_X = (2, 5, D_MODEL)
x_shapes = st.one_of(st.just(VALID_X), st.just(VALID_X), st.just((1, 1, D_MODEL)),
                     st.tuples(st.integers(0, 3), st.integers(0, 5), st.sampled_from([D_MODEL, 8])), shapes)
near = st.sampled_from([(5, 5), (2, 5), (2, 1, 5, 5), (1, 5, 5), (2, 4), (5,), (2, 5, 1)])  # right or nearly right
cases = st.fixed_dictionaries({
    "backend": st.sampled_from(["sdpa", "math", "flex", "auto"]),
    "rope": st.booleans(),
    "causal": st.booleans(),
    "x": st.tuples(x_shapes, st.sampled_from(["float32", "float32", "float32", "bfloat16", "int64", "list"]),
                   st.sampled_from(["cpu", "cpu", "cpu", "meta"]), fills),
    "mask": st.none() | st.none() | _spec(near | shapes, st.sampled_from(["bool", "float32", "int64"])),
    "key_padding_mask": st.none() | st.none() | _spec(near | shapes, st.sampled_from(["bool", "bool", "float32"])),
    "documents": st.none() | st.none() | st.none() | _spec(near, st.sampled_from(["int64", "float32"])),
    "positions": st.none() | st.none() | _spec(near | shapes, st.sampled_from(["int64", "int64", "float32"])),
    "context": st.none() | st.none() | st.none() | _spec(x_shapes, st.sampled_from(["float32", "float32", "int64"])),
    "cache": st.sampled_from([0, 0, 0, 8, 2]),
})


@pytest.mark.slow
def test_odd_tensors_for_the_layer_end_in_an_output_or_a_clear_error() -> None:
    seen: Counter[str] = Counter()

    @settings(max_examples=300, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cases)
    def one(case: dict[str, Any]) -> None:
        outcome = isolated(call_layer, case, seconds=30, memory=1 << 30)
        seen[outcome.kind] += 1
        assert outcome.kind in ("ok", "error"), f"{case}\n{outcome}"

    one()
    print(f"\nfuzz cases, layer calls: {sum(seen.values())} ({dict(seen)})")
    assert sum(seen.values()) >= 300 and seen["ok"] >= 5 and seen["error"] > 0, seen
