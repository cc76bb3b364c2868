"""Hook points: shapes for MHA, GQA and MQA, identity hooks leave outputs bitwise equal, zero-ablation equals zeroing
W_O's columns, patching from the same run is a no-op, an edited pattern matches the float64 oracle with the same edit,
KV pooling through hooks equals a layer with pooled weights, the verbs, and bad input."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from multihead import KVCache, MultiHeadAttention, MultiheadError
from multihead.heads.convert import pooled_layer
from multihead.layers.hooks import (
    HookPoint,
    hook_points,
    hooks,
    mean_heads,
    patch_heads,
    pool_kv_hook,
    run_with_cache,
    zero_heads,
)
from multihead.models.llama import LlamaConfig, LlamaModel
from multihead.verify.reference import Weights, multihead_attention

VARIANTS = pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
POINTS = ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z", "hook_out")


class Stack(nn.Module):
    """Two layers, each holding its own hook points (names layers.0.hook_z ...)."""

    def __init__(self, n_kv_heads: int = 2, rope: float | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=n_kv_heads, rope=rope)
                                    for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + layer(x, causal=True)
        return x


def _seen(layer: MultiHeadAttention, run: object) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    handles = [getattr(layer, p).add(lambda t, point, p=p: shapes.__setitem__(p, tuple(t.shape))) for p in POINTS]
    try:
        run()  # type: ignore[operator]
    finally:
        for h in handles:
            h.remove()
    return shapes


@VARIANTS
def test_every_hook_point_has_its_documented_shape(n_kv_heads: int) -> None:
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=n_kv_heads)
    x, c = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    shapes = _seen(layer, lambda: layer(x, c))
    assert shapes == {"hook_q": (2, 4, 5, 8), "hook_k": (2, n_kv_heads, 7, 8), "hook_v": (2, n_kv_heads, 7, 8),
                      "hook_pattern": (2, 4, 5, 7), "hook_z": (2, 4, 5, 8), "hook_out": (2, 5, 32)}


@VARIANTS
def test_with_a_cache_k_and_v_are_the_cached_keys_never_repeated(n_kv_heads: int) -> None:
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=n_kv_heads, rope=10000.0).eval()
    cache = KVCache(batch=1, n_kv_heads=n_kv_heads, head_dim=8, max_len=16)
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        layer(x[:, :5], causal=True, cache=cache.layer(0))
        cache.advance(5)
        shapes = _seen(layer, lambda: layer(x[:, 5:], causal=True, cache=cache.layer(0)))
    assert shapes["hook_k"] == shapes["hook_v"] == (1, n_kv_heads, 6, 8)  # 5 cached + the new token
    assert shapes["hook_q"] == (1, 4, 1, 8) and shapes["hook_pattern"] == (1, 4, 1, 6)


@VARIANTS
@pytest.mark.parametrize("point", POINTS)
def test_a_hook_returning_its_input_leaves_the_output_bitwise_equal(n_kv_heads: int, point: str) -> None:
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=n_kv_heads, rope=10000.0)
    x = torch.randn(2, 9, 32)
    plain = layer(x, causal=True)
    with getattr(layer, point).add(lambda t, p: t):
        same = layer(x, causal=True)
    assert torch.equal(plain, same)
    with getattr(layer, point).add(lambda t, p: None):
        assert torch.equal(plain, layer(x, causal=True))


def test_reading_the_pattern_keeps_the_fused_kernel_and_equals_the_math_weights() -> None:
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2)
    x = torch.randn(2, 9, 32)
    kept: list[Tensor] = []
    with layer.hook_pattern.add(lambda t, p: kept.append(t)):
        assert "hook_pattern" in layer.explain(x, causal=True).reason
        assert layer.explain(x, causal=True).backend == "sdpa"
        fused = layer(x, causal=True)
    _, weights = layer(x, causal=True, return_weights=True)
    assert torch.equal(fused, layer(x, causal=True))
    torch.testing.assert_close(kept[0], weights, atol=0, rtol=0)


@VARIANTS
def test_zero_ablation_through_hook_z_equals_zeroing_the_heads_columns_of_w_o(n_kv_heads: int) -> None:
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=n_kv_heads)
    x = torch.randn(2, 5, 32)

    def zero_columns(_m: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:  # the old o_proj pre-hook
        merged = args[0].clone()
        merged[..., 16:24] = 0
        return (merged,)

    handle = layer.o_proj.register_forward_pre_hook(zero_columns)
    reference = layer(x, causal=True)
    handle.remove()
    with layer.hook_z.add(zero_heads(2)):
        ablated = layer(x, causal=True)
    assert torch.equal(ablated, reference)
    assert not torch.allclose(ablated, layer(x, causal=True))  # gone after the block


@VARIANTS
def test_patching_every_head_from_the_same_run_is_a_no_op(n_kv_heads: int) -> None:
    model = Stack(n_kv_heads, rope=10000.0)
    x = torch.randn(2, 6, 32)
    out, cache = run_with_cache(model, x)
    assert set(cache) == {f"layers.{i}.{p}" for i in range(2) for p in POINTS}
    edits = {name: patch_heads(list(range(t.shape[1])), t) for name, t in cache.items() if t.ndim == 4}
    with hooks(model, edits):
        patched = model(x)
    assert torch.equal(patched, out)


def test_patching_every_head_of_a_layer_reproduces_that_layers_clean_output() -> None:
    model = Stack(2)
    clean, corrupt = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    _, cache = run_with_cache(model, clean, names=["layers.0.hook_z", "layers.0.hook_out"])
    assert set(cache) == {"layers.0.hook_z", "layers.0.hook_out"}  # only what was asked for is kept
    seen: dict[str, Tensor] = {}
    with hooks(model, {"layers.0.hook_z": patch_heads([0, 1, 2, 3], cache["layers.0.hook_z"]),
                       "layers.0.hook_out": lambda t, p: seen.__setitem__("out", t)}):
        model(corrupt)
    torch.testing.assert_close(seen["out"], cache["layers.0.hook_out"], atol=1e-6, rtol=0)


@VARIANTS
def test_an_edited_pattern_matches_the_oracle_with_the_same_edit(n_kv_heads: int) -> None:
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=n_kv_heads).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)

    def sharpen(w: Tensor) -> Tensor:  # any edit: square the weights of head 1 and put half of head 3 on key 0
        w = w.clone()
        w[:, 1] = w[:, 1] ** 2
        w[:, 3] = 0.5 * w[:, 3]
        w[:, 3, :, 0] += 0.5
        return w

    def sharpen_np(i: int, w: np.ndarray) -> np.ndarray:
        w = w.copy()
        if i == 1:
            w = w**2
        if i == 3:
            w = 0.5 * w
            w[:, :, 0] += 0.5
        return w

    want, want_w = multihead_attention(layer.config, Weights.of(layer), x.numpy(), causal=True,
                                       edit_pattern=sharpen_np)
    with layer.hook_pattern.add(lambda w, p: sharpen(w)):
        assert "math path" in layer.explain(x, causal=True).reason
        got = layer(x, causal=True)
        got_math, got_w = layer(x, causal=True, return_weights=True)
    np.testing.assert_allclose(got.detach().numpy(), want, atol=1e-12)
    np.testing.assert_allclose(got_math.detach().numpy(), want, atol=1e-12)
    np.testing.assert_allclose(got_w.detach().numpy(), want_w, atol=1e-12)


@pytest.mark.parametrize(("g", "to"), [(6, 2), (6, 3), (6, 1), (2, 1)])
def test_pooling_kv_heads_through_hooks_equals_a_layer_with_pooled_weights(g: int, to: int) -> None:
    layer = MultiHeadAttention(d_model=24, n_heads=6, n_kv_heads=g, head_dim=4, rope=10000.0)
    x = torch.randn(2, 7, 24)
    pool = pool_kv_hook(to)
    with layer.hook_k.add(pool), layer.hook_v.add(pool):
        hooked = layer(x, causal=True)
    torch.testing.assert_close(hooked, pooled_layer(layer, to)(x, causal=True), atol=1e-6, rtol=1e-5)


def test_mean_ablation_and_patching_at_positions() -> None:
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2)
    x, other = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    _, clean = run_with_cache(layer, other, names="hook_z")
    z: dict[str, Tensor] = {}
    with layer.hook_z.add(mean_heads(1)), layer.hook_z.add(lambda t, p: z.__setitem__("z", t)):
        layer(x)
    _, plain = run_with_cache(layer, x, names="hook_z")
    want = plain["hook_z"][:, 1].mean(dim=(0, 1))  # (d,)
    torch.testing.assert_close(z["z"][:, 1], want.expand(2, 5, 8))
    assert torch.equal(z["z"][:, [0, 2, 3]], plain["hook_z"][:, [0, 2, 3]])
    with layer.hook_z.add(patch_heads(3, clean["hook_z"], positions=[4])), \
            layer.hook_z.add(lambda t, p: z.__setitem__("z", t)):
        layer(x)
    assert torch.equal(z["z"][:, 3, 4], clean["hook_z"][:, 3, 4])
    assert torch.equal(z["z"][:, 3, :4], plain["hook_z"][:, 3, :4])


def test_names_globs_and_the_activation_cache() -> None:
    model = Stack(2)
    names = list(hook_points(model))
    assert names == [f"layers.{i}.{p}" for i in range(2) for p in POINTS]
    _, cache = run_with_cache(model, torch.randn(1, 4, 32), names="*.hook_k")
    assert list(cache) == ["layers.0.hook_k", "layers.1.hook_k"]
    assert cache.layer(1, "hook_k").shape == (1, 2, 4, 8)
    _, cache = run_with_cache(model, torch.randn(1, 4, 32), names=lambda n: n.endswith("pattern"))
    assert list(cache) == ["layers.0.hook_pattern", "layers.1.hook_pattern"]
    assert all(not p.active for p in hook_points(model).values())  # every hook removed afterwards


def test_bad_hooks_and_names_raise_clearly() -> None:
    model = Stack(2)
    x = torch.randn(1, 4, 32)
    with pytest.raises(MultiheadError, match=r"no hook point matches 'layers.9.hook_z'; 12 exist, e.g. layers.0"):
        run_with_cache(model, x, names="layers.9.hook_z")
    bad = [
        ({"layers.0.hook_k": lambda t, p: t.repeat_interleave(2, 1)},
         r"a hook on layers.0.hook_k \(b, g, t, d\) returned shape \(1, 4, 4, 8\) torch.float32: a replacement "
         r"must have the shape \(1, 2, 4, 8\)"),
        ({"layers.0.hook_v": zero_heads(2)}, r"head\(s\) \[2\] out of range at layers.0.hook_v: it has 2 KV heads"),
        ({"layers.1.hook_out": zero_heads(0)}, r"layers.1.hook_out \(b, s, d_model\) has no head dimension"),
        ({"layers.0.hook_z": patch_heads(0, torch.zeros(1, 4, 3, 8))}, "runs must have equal lengths"),
    ]
    for edits, message in bad:
        with pytest.raises(MultiheadError, match=message), hooks(model, edits):
            model(x)
    with pytest.raises(MultiheadError, match="must be callable"):
        HookPoint().add(3)  # type: ignore[arg-type]
    with pytest.raises(MultiheadError, match="has no hook points"):
        run_with_cache(nn.Linear(2, 2), torch.zeros(1, 2))
    assert all(not p.active for p in hook_points(model).values())  # nothing left behind by the failures


def test_hook_points_hold_no_state_and_compile_without_hooks() -> None:
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2)
    assert all("hook" not in k for k in layer.state_dict())
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    x = torch.randn(1, 4, 32)
    assert torch.equal(compiled(x, causal=True), layer(x, causal=True))


def _probe(points: dict[str, HookPoint]) -> dict[str, tuple[bool, bool]]:
    """Per point: (its active flag, whether running it calls a hook). The hooks a test attaches all record in
    CALLED, so the second is seen, not read from the point's state."""
    out = {}
    for name, point in points.items():
        CALLED.clear()
        point(torch.zeros(1))
        out[name] = (point.active, bool(CALLED))
    return out


CALLED: list[str] = []


def _note(x: Tensor, point: HookPoint) -> None:
    CALLED.append(point.name)


def test_active_is_kept_by_every_path_that_adds_or_removes_a_hook() -> None:
    torch.manual_seed(0)
    model = Stack()
    points = hook_points(model)

    def check(expect: set[str]) -> None:
        probed = _probe(points)
        stale = {n: v for n, v in probed.items() if v[0] != v[1]}
        assert not stale, f"active disagrees with the hooks that run: {stale}"
        assert {n for n, (a, _) in probed.items() if a} == expect

    z0, k1 = points["layers.0.hook_z"], points["layers.1.hook_k"]
    check(set())
    h1, h2 = z0.add(_note), z0.add(_note)  # the same function twice: two hooks
    check({"layers.0.hook_z"})
    h1.remove()
    check({"layers.0.hook_z"})
    h2.remove()
    h2.remove()  # a second remove is a no-op
    check(set())
    with z0.add(_note), k1.add(_note):
        check({"layers.0.hook_z", "layers.1.hook_k"})
    check(set())
    with pytest.raises(RuntimeError), z0.add(_note):
        raise RuntimeError
    check(set())
    stale = z0.add(_note)
    z0.add(_note)
    z0.clear()
    check(set())
    stale.remove()  # after clear: a no-op, and nothing comes back
    check(set())
    with hooks(model, {"*.hook_pattern": _note}):
        check({"layers.0.hook_pattern", "layers.1.hook_pattern"})
    check(set())
    with pytest.raises(MultiheadError), hooks(model, [("layers.0.hook_q", _note), ("nothing.here", _note)]):
        pass  # the second name fails after the first was attached
    check(set())
    run_with_cache(model, torch.randn(1, 3, 32), names="*.hook_z")
    check(set())

    def once(x: Tensor, point: HookPoint) -> None:  # a hook that removes itself and adds another while running
        handle.remove()
        point.add(_note)
    handle = z0.add(once)
    model(torch.randn(1, 3, 32))
    check({"layers.0.hook_z"})
    z0.clear()
    with z0.add(_note):
        copied = copy.deepcopy(model)
    check(set())
    assert {n for n, p in hook_points(copied).items() if p.active} == {"layers.0.hook_z"}
    hook_points(copied)["layers.0.hook_z"].clear()
    assert not any(p.active for p in hook_points(copied).values())


def test_a_point_a_layer_holds_cannot_be_replaced() -> None:
    """A layer reads its points from the tuple it was built with: a point put in one's place would never run its
    hooks (it did not, before this was refused), so replacing one is an error, for the layer's and a block's."""
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2)
    with pytest.raises(MultiheadError, match=r"hook_z of this MultiHeadAttention cannot be replaced.*\.add\(fn\)"):
        layer.hook_z = HookPoint("(b, h, s, d)", role="hook_z")
    with pytest.raises(MultiheadError, match="cannot be replaced"):
        layer.add_module("hook_q", nn.Identity())
    del layer.hook_k
    with pytest.raises(MultiheadError, match="cannot be replaced"):
        layer.hook_k = HookPoint("(b, g, t, d)", role="hook_k")
    block = LlamaModel(LlamaConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                   max_context=8)).layers[0]
    with pytest.raises(MultiheadError, match=r"hook_resid_post of this .* cannot be replaced"):
        block.hook_resid_post = HookPoint("(b, s, d_model)", role="hook_resid_post")
    layer.hook_z = layer.hook_z  # the same point again is no replacement
    other = nn.Module()
    other.hook_z = nn.Identity()  # a module without hook points names its children as it likes
