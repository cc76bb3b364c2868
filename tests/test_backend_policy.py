"""The one backend policy: what explain says is what runs (every backend, mask, hook and decode combination), a
replaced pattern gives the math kernel's numbers, hooks only see and replace tensors, KV heads are known by role."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor

from multihead import KVCache, LatentCache, MultiHeadAttention, MultiheadError, kernels
from multihead.kernels import flex
from multihead.layers.hooks import HookFn, zero_heads
from multihead.layers.latent import MultiHeadLatentAttention

BACKENDS = ("auto", "sdpa", "math", "flex")
HOOKS: dict[str, tuple[str, HookFn] | None] = {
    "none": None,
    "read pattern": ("hook_pattern", lambda w, p: None),
    "replace pattern": ("hook_pattern", lambda w, p: w.clone()),
    "hook_q": ("hook_q", lambda q, p: q * 1.0),
    "hook_z": ("hook_z", lambda z, p: None),
    "hook_out": ("hook_out", lambda y, p: None),
}


@contextmanager
def ran(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, Any]]]:
    """Records the kernels attend runs: ("sdpa", fold), ("math", None), ("flex", None), and ("pattern", None) for
    weights made outside the math path. flex is replaced by the math path's numbers (no compile on the CPU)."""
    seen: list[tuple[str, Any]] = []
    real_sdpa, real_math, real_weights = kernels.sdpa_attention, kernels.math_attention, kernels.attention_weights
    inside_math = [False]

    def sdpa(*args: Any, **kwargs: Any) -> Tensor:
        seen.append(("sdpa", kwargs.get("fold", False)))
        return real_sdpa(*args, **kwargs)

    def math(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        seen.append(("math", None))
        inside_math[0] = True
        try:
            return real_math(*args, **kwargs)
        finally:
            inside_math[0] = False

    def weights(*args: Any, **kwargs: Any) -> Tensor:
        if not inside_math[0]:
            seen.append(("pattern", None))
        return real_weights(*args, **kwargs)

    def flex_stub(q: Tensor, k: Tensor, v: Tensor, spec: Any, *, scale: float, softcap: float | None = None
                  ) -> Tensor:
        seen.append(("flex", None))
        inside_math[0] = True
        try:
            return real_math(q, k, v, spec, scale=scale, softcap=softcap)[0]
        finally:
            inside_math[0] = False

    monkeypatch.setattr(kernels, "sdpa_attention", sdpa)
    monkeypatch.setattr(kernels, "math_attention", math)
    monkeypatch.setattr(kernels, "attention_weights", weights)
    monkeypatch.setattr(flex, "flex_attention", flex_stub)
    monkeypatch.setattr(flex, "available", lambda: True)
    try:
        yield seen
    finally:
        monkeypatch.undo()


def _agree(choice: kernels.KernelChoice, seen: list[tuple[str, Any]], hooked: str) -> None:
    """The kernel explain names is the one that ran, and so are the fold and the pattern made beside it."""
    kernel = [name for name, _ in seen if name != "pattern"]
    assert kernel == [choice.backend], (choice, seen)
    beside = ("pattern", None) in seen
    assert beside == ("pattern (b, h, s, t) is made from the same q, k and mask" in choice.reason), (choice, seen)
    fold = choice.backend == "sdpa" and seen[0][1]
    assert fold == ("query heads of each KV head run as its rows" in choice.reason), (choice, seen)
    if hooked != "none":
        assert f"hooked: {HOOKS[hooked][0]}" in choice.reason  # type: ignore[index]


MASKS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "none": lambda b, s: {},
    "causal": lambda b, s: {"causal": True},
    "padding": lambda b, s: {"key_padding_mask": torch.arange(s)[None].expand(b, s) < s - 1},
    "dense bool": lambda b, s: {"mask": torch.ones(s, s, dtype=torch.bool).tril()},
    "float bias": lambda b, s: {"mask": torch.randn(s, s)},
    "window": lambda b, s: {"causal": True},  # on a layer with window=3
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("training", [False, True], ids=["eval", "dropout"])
@pytest.mark.usefixtures("two_threads")
def test_explain_names_the_kernel_that_runs_for_every_backend_mask_and_hook(
        mask: str, training: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = MultiHeadAttention(d_model=32, n_heads=8, n_kv_heads=2, dropout=0.1 if training else 0.0,
                               window=3 if mask == "window" else None).train(training)
    x = torch.randn(2, 6, 32)
    checked = 0
    for backend, hooked, weights in itertools.product(BACKENDS, HOOKS, (False, True)):
        kwargs = {**MASKS[mask](2, 6), "backend": backend, "return_weights": weights}
        hook = HOOKS[hooked]
        handle = getattr(layer, hook[0]).add(hook[1]) if hook is not None else None
        try:
            with torch.no_grad(), ran(monkeypatch) as seen:
                try:
                    choice = layer.explain(x, **kwargs)
                except MultiheadError as refused:
                    with pytest.raises(MultiheadError, match="^" + re.escape(str(refused)) + "$"):
                        layer(x, **kwargs)
                    continue
                layer(x, **kwargs)
            _agree(choice, seen, hooked)
            checked += 1
        finally:
            if handle is not None:
                handle.remove()
    assert checked >= 24 if training else checked >= 36  # flex refuses dropout, fused kernels refuse weights


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hooked", list(HOOKS))
@pytest.mark.usefixtures("two_threads")
def test_explain_and_a_cached_decode_step_agree_including_the_gqa_fold(
        backend: str, hooked: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = MultiHeadAttention(d_model=32, n_heads=8, n_kv_heads=2, rope=10000.0).eval()
    cache = KVCache(batch=2, n_kv_heads=2, head_dim=4, max_len=16)
    with torch.no_grad():
        layer(torch.randn(2, 5, 32), causal=True, cache=cache.layer(0))
    cache.advance(5)
    x = torch.randn(2, 1, 32)
    hook = HOOKS[hooked]
    handle = getattr(layer, hook[0]).add(hook[1]) if hook is not None else None
    try:
        with torch.no_grad(), ran(monkeypatch) as seen:
            choice = layer.explain(x, causal=True, cache=cache.layer(0), backend=backend)
            layer(x, causal=True, cache=cache.layer(0), backend=backend)
    finally:
        if handle is not None:
            handle.remove()
    _agree(choice, seen, hooked)
    if backend in ("auto", "sdpa") and hooked in ("none", "hook_z", "hook_out"):
        assert seen == [("sdpa", True)]  # 4 query heads per KV head: folded (multihead.kernels.cpu.fold_gqa_decode)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hooked", ["none", "read pattern", "replace pattern", "hook_z"])
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_mla_explain_names_the_path_and_kernel_that_run(backend: str, hooked: str, step: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    layer = MultiHeadLatentAttention(d_model=64, n_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                     v_head_dim=12).eval()
    cache = LatentCache(batch=1, kv_lora_rank=16, rope_dim=4, max_len=40)
    with torch.no_grad():
        layer(torch.randn(1, 30, 64), causal=True, cache=cache.layer(0))
    cache.advance(30)
    x = torch.randn(1, 1 if step == "decode" else 8, 64)
    hook = HOOKS[hooked]
    handle = getattr(layer, hook[0]).add(hook[1]) if hook is not None else None
    try:
        with torch.no_grad(), ran(monkeypatch) as seen:
            choice = layer.explain(x, causal=True, cache=cache.layer(0), backend=backend)
            layer(x, causal=True, cache=cache.layer(0), backend=backend)
    finally:
        if handle is not None:
            handle.remove()
    _agree(choice, seen, hooked)
    path = "absorbed" if step == "decode" else layer.choose_path(8, 38)
    assert choice.reason.startswith(f"MLA {path} path")
    folded = step == "decode" and hooked in ("none", "hook_z")
    assert folded == ("folded into query rows of one head" in choice.reason)
    if folded and backend == "auto":  # the measured rule lives in resolve_backend, and explain gives it
        assert choice.backend == "math" and "beat the fused kernels" in choice.reason


@pytest.mark.parametrize("n_kv_heads", [8, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", ["none", "causal", "padding", "float bias"])
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_a_replaced_pattern_gives_the_math_kernels_numbers(n_kv_heads: int, mask: str, backend: str) -> None:
    """A pattern hook returning an equal replacement runs beside the fused kernel and makes the output the math
    path's weighted sum: bitwise the math backend's output, with its weights."""
    layer = MultiHeadAttention(d_model=32, n_heads=8, n_kv_heads=n_kv_heads, rope=10000.0).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    kwargs = MASKS[mask](2, 7)
    if mask == "float bias":
        kwargs["mask"] = kwargs["mask"].double()
    want, want_w = layer(x, backend="math", return_weights=True, **kwargs)
    seen: list[Tensor] = []
    with layer.hook_pattern.add(lambda w, p: seen.append(w) or w.clone()):  # type: ignore[func-returns-value]
        assert layer.explain(x, backend=backend, **kwargs).backend == "sdpa"
        got = layer(x, backend=backend, **kwargs)
    assert torch.equal(got, want)
    assert torch.equal(seen[0], want_w)
    assert not torch.equal(layer(x, backend=backend, **kwargs), want)  # unhooked: the fused kernel's own rounding


def test_hooks_on_a_call_are_none_until_something_is_hooked_and_list_every_hooked_point() -> None:
    from multihead.layers.hooks import call_hooks

    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2)
    assert call_hooks(layer) is None  # the hot path: nothing to apply
    with layer.hook_out.add(lambda y, p: None), layer.hook_k.add(lambda k, p: None):
        hooked = call_hooks(layer)
        assert hooked is not None and hooked.names == ("hook_k", "hook_out")
        assert hooked.k is layer.hook_k and hooked.q is None and hooked.pattern is None and hooked.z is None
        assert "hooked: hook_k, hook_out" in layer.explain(torch.randn(1, 3, 32)).reason


def test_kv_heads_are_known_by_the_points_role_not_by_its_legend() -> None:
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2)
    assert layer.hook_k.kv_heads and layer.hook_v.kv_heads
    assert not any(getattr(layer, p).kv_heads for p in ("hook_q", "hook_pattern", "hook_z", "hook_out"))
    layer.hook_k.legend = "(batch, kv heads, keys, head_dim)"  # the legend is for people: rewording changes nothing
    layer.hook_z.legend = "(b, g, s, d)"
    x = torch.randn(1, 3, 32)
    with layer.hook_k.add(zero_heads(2)), pytest.raises(MultiheadError, match="it has 2 KV heads"):
        layer(x)
    with layer.hook_z.add(zero_heads(4)), pytest.raises(MultiheadError, match="it has 4 heads"):
        layer(x)
    with pytest.raises(MultiheadError, match="role 'hook_x' is not a hook point"):
        from multihead.layers.hooks import HookPoint

        HookPoint("(b, g, t, d)", role="hook_x")
