"""Hook points at the attention core: named places where a tensor passes, to read it or to replace it.

Every attention layer has six, named as its module path plus the point (``layers.3.attn.hook_z``)::

    hook_q        (b, h, s, d)   queries, after RoPE
    hook_k        (b, g, t, d)   keys, after RoPE and the KV cache: g = n_kv_heads, never repeated to h heads
    hook_v        (b, g, t, d)   values, after the KV cache
    hook_pattern  (b, h, s, t)   softmax weights per query head, made only when something hooks this point
    hook_z        (b, h, s, d)   each head's output before W_O
    hook_out      (b, s, d_model)  the layer's output, after W_O

A KV head is shared by h / g query heads (query head i reads KV head i // (h / g)): editing KV head j of ``hook_k``
changes what all of its query heads see.

A hook is ``fn(tensor, point) -> Tensor | None``: it returns None to leave the tensor as it is, or a replacement of
the same shape and dtype. Points with no hook cost one attribute test (``point.active``: a plain attribute that
adding or removing a hook keeps; a point a layer holds cannot be replaced). A hook on ``hook_pattern`` that only
reads keeps the fused kernel for the output (the pattern is recomputed exactly from the same q, k and mask); one that
returns a replacement makes that call's output ``pattern @ v`` (the math path), and ``explain`` says so.

The verbs::

    with hooks(model, {"layers.*.attn.hook_z": zero_heads(3)}):      # run with hooks (glob names)
        logits = model(tokens)
    logits, cache = run_with_cache(model, tokens, names="*.hook_pattern")  # keep named activations
    patch = patch_heads(5, source=cache["layers.2.attn.hook_z"])     # patch head 5 from another run

**The residual stream.** Each block of our ports (and each decoder layer of a transformers model of the families
:func:`multihead.hf.enable` names) has five more points, named as the block's path plus the point
(``layers.3.hook_resid_post``), all (b, s, d_model), in the order they run::

    hook_resid_pre    the stream the block reads (for block 0: the embeddings)
    hook_attn_out     what attention adds (after W_O and its bias; the value of ``attn.hook_out``, after it)
    hook_resid_mid    the stream between the sublayers, hook_resid_pre + hook_attn_out
    hook_mlp_out      what the MLP adds
    hook_resid_post   the block's output, hook_resid_mid + hook_mlp_out (block l's is block l + 1's resid_pre)

In a post-norm model (BERT) the points sit as TransformerLens puts them: ``hook_resid_mid`` is the sum before the
attention LayerNorm and ``hook_resid_post`` the sum before the output LayerNorm, so the block's output is
``LayerNorm(hook_resid_post)`` (the next block's ``hook_resid_pre``). A replacement at a point is what everything
after it reads. Points with no hook cost one list test each.

The same points serve any module that runs its attention through :func:`multihead.kernels.attend` with
``hooks=call_hooks(module)`` (our layer, and other models whose attention calls multihead's core). Hooks only see
and replace tensors: which kernel runs, also with a hooked pattern, is :func:`multihead.kernels.resolve_backend`'s
rule, and the weighted sum of a replaced pattern is the math path's (:func:`multihead.kernels.weighted_sum`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from multihead.errors import MultiheadError
from multihead.kernels import CallHooks

HookFn = Callable[[Tensor, "HookPoint"], "Tensor | None"]

POINTS = {  # point -> its shape legend
    "hook_q": "(b, h, s, d)",
    "hook_k": "(b, g, t, d)",
    "hook_v": "(b, g, t, d)",
    "hook_pattern": "(b, h, s, t)",
    "hook_z": "(b, h, s, d)",
    "hook_out": "(b, s, d_model)",
}
RESID_POINTS = {  # the block's points, in the order they run
    "hook_resid_pre": "(b, s, d_model)",
    "hook_attn_out": "(b, s, d_model)",
    "hook_resid_mid": "(b, s, d_model)",
    "hook_mlp_out": "(b, s, d_model)",
    "hook_resid_post": "(b, s, d_model)",
}
KV_POINTS = ("hook_k", "hook_v")  # the points whose dimension 1 counts KV heads (g), not query heads


class HookPoint(nn.Module):
    """One named place in the attention core. ``point.add(fn)`` attaches a hook and returns a handle whose
    ``remove()`` (or ``with``) detaches it. A module without parameters or buffers: state dicts are unchanged.
    ``legend`` is the shape as people read it; ``role`` which of the six points this is (``"hook_k"``), what code
    reads (``point.kv_heads``)."""

    def __init__(self, legend: str = "", *, role: str = "") -> None:
        super().__init__()
        if role and role not in POINTS and role not in RESID_POINTS:
            raise MultiheadError(f"role {role!r} is not a hook point: choose one of "
                                 f"{', '.join([*POINTS, *RESID_POINTS])}")
        self.legend = legend
        self.role = role
        self.name = ""  # the full module path, set when the point is found by name (hook_points)
        self._fns: tuple[HookFn, ...] = ()
        # whether any hook is attached: a plain attribute, read on every call of the hot path (a property would be a
        # Python call per point per step); _set, the one writer of _fns, keeps it equal to bool(_fns)
        self.active = False

    def _set(self, fns: tuple[HookFn, ...]) -> None:
        state = self.__dict__  # neither is a parameter, buffer or module: nn.Module.__setattr__'s checks are not needed
        state["_fns"] = fns
        state["active"] = bool(fns)

    @property
    def kv_heads(self) -> bool:
        """Whether dimension 1 of what passes here counts KV heads (hook_k, hook_v), shared by h / g query heads."""
        return self.role in KV_POINTS

    def add(self, fn: HookFn) -> HookHandle:
        if not callable(fn):
            raise MultiheadError(f"a hook must be callable as fn(tensor, point), got {type(fn).__name__}")
        self._set((*self._fns, fn))
        return HookHandle(self, fn)

    def clear(self) -> None:
        """Detach every hook of this point."""
        self._set(())

    def forward(self, x: Tensor) -> Tensor:
        for fn in self._fns:  # a tuple: a hook that adds or removes hooks changes the next call, not this one
            out = fn(x, self)
            if out is None:
                continue
            if not isinstance(out, Tensor) or out.shape != x.shape or out.dtype != x.dtype:
                got = f"shape {tuple(out.shape)} {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
                raise MultiheadError(
                    f"a hook on {self.name or 'a hook point'} {self.legend} returned {got}: a replacement must have "
                    f"the shape {tuple(x.shape)} and dtype {x.dtype} of what it received (or return None)"
                )
            x = out
        return x

    def extra_repr(self) -> str:
        return f"{self.legend}, hooks={len(self._fns)}"


class HookHandle:
    """Detaches one hook: ``handle.remove()``, or use it as a context manager."""

    def __init__(self, point: HookPoint, fn: HookFn) -> None:
        self.point, self.fn = point, fn

    def remove(self) -> None:
        """Detach the hook (a no-op when it is detached already, e.g. by ``clear``)."""
        fns = self.point._fns
        if self.fn in fns:
            i = fns.index(self.fn)
            self.point._set(fns[:i] + fns[i + 1:])

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class HookedAttention(Protocol):
    """What the hooked core needs of the module it runs for: its six hook points."""

    hook_q: HookPoint
    hook_k: HookPoint
    hook_v: HookPoint
    hook_pattern: HookPoint
    hook_z: HookPoint
    hook_out: HookPoint


def add_hook_points(module: nn.Module) -> None:
    """Give ``module`` the six hook points (a no-op for those it has): our layer does this, and so can any module
    whose attention runs through :func:`multihead.kernels.attend` with ``hooks=call_hooks(module)``."""
    for name, legend in POINTS.items():
        point = getattr(module, name, None)
        if not isinstance(point, HookPoint):
            module.add_module(name, HookPoint(legend, role=name))
        elif not point.role:
            point.role = name  # a point made without its role takes the name it sits at
    # the same six modules as a plain tuple in the instance dict: read on every call without nn.Module.__getattr__
    module.__dict__["_hook_points"] = tuple(getattr(module, name) for name in POINTS)


def add_resid_points(module: nn.Module) -> tuple[HookPoint, ...]:
    """Give a block the five residual-stream points (a no-op for those it has) and return them in
    :data:`RESID_POINTS` order; the tuple is also kept in the instance dict (``_resid_points``), read on every call
    without nn.Module.__getattr__."""
    for name, legend in RESID_POINTS.items():
        point = getattr(module, name, None)
        if not isinstance(point, HookPoint):
            module.add_module(name, HookPoint(legend, role=name))
        elif not point.role:
            point.role = name
    found = tuple(getattr(module, name) for name in RESID_POINTS)
    module.__dict__["_resid_points"] = found
    return found


def resid_block(points: tuple[HookPoint, ...], h: Tensor, attention: Callable[..., Tensor],
                mlp: Callable[[Tensor], Tensor], *, attn_norm: Callable[[Tensor], Tensor] | None = None,
                mid_norm: Callable[[Tensor], Tensor] | None = None, **attn_kwargs: Any) -> Tensor:
    """One block's residual stream through its five points (:func:`add_resid_points`'s tuple), each applied only
    when hooked. Pre-norm (Llama): ``attn_norm`` before attention, ``mlp`` brings its own norm. Post-norm (BERT):
    ``mid_norm`` (the attention LayerNorm) after hook_resid_mid, and the caller norms the result::

        h = resid_pre(h);  h = resid_mid(h + attn_out(attention(attn_norm(h), **attn_kwargs)))
        h = mid_norm(h);   return resid_post(h + mlp_out(mlp(h)))
    """
    pre, attn_out, mid, mlp_out, post = points
    if pre.active:
        h = pre(h)
    a = attention(h if attn_norm is None else attn_norm(h), **attn_kwargs)
    if attn_out.active:
        a = attn_out(a)
    h = h + a
    if mid.active:
        h = mid(h)
    if mid_norm is not None:
        h = mid_norm(h)
    m = mlp(h)
    if mlp_out.active:
        m = mlp_out(m)
    h = h + m
    return post(h) if post.active else h


def _refuse_replacing_points(module: nn.Module, name: str, value: nn.Module) -> None:
    """torch's global module-registration hook (every ``module.name = submodule`` and ``add_module``): a layer or
    block that has its points reads them from the tuple add_hook_points / add_resid_points kept, so a point put in
    one's place would never run its hooks. Such a replacement is refused; anything else passes untouched."""
    if name in POINTS:
        held, index = module.__dict__.get("_hook_points"), list(POINTS).index(name)
    elif name in RESID_POINTS:
        held, index = module.__dict__.get("_resid_points"), list(RESID_POINTS).index(name)
    else:
        return
    if held is None or held[index] is value:
        return
    raise MultiheadError(f"{held[index].name or name} of this {type(module).__name__} cannot be replaced (the module "
                         "reads the point it was built with): attach hooks with .add(fn), detach them with the "
                         "handle's remove() or the point's clear()")


torch.nn.modules.module.register_module_module_registration_hook(_refuse_replacing_points)


def _points(module: HookedAttention) -> tuple[HookPoint, ...]:
    found = getattr(module, "_hook_points", None)
    return found if found is not None else tuple(getattr(module, name) for name in POINTS)


def call_hooks(module: HookedAttention, *, z: bool = True) -> CallHooks | None:
    """The hooks of ``module``'s points at its attention core, for :class:`~multihead.kernels.AttentionCall`'s
    ``hooks``: None when no point is hooked (the core runs as it is). ``z=False`` leaves hook_z to the module (MLA's
    absorbed path applies it after its up-projection). What the hooks change about the kernel is decided by
    :func:`multihead.kernels.resolve_backend`, not here."""
    hq, hk, hv, hp, hz, ho = _points(module)
    if not (hq.active or hk.active or hv.active or hp.active or hz.active or ho.active):
        return None
    return CallHooks(q=hq if hq.active else None, k=hk if hk.active else None, v=hv if hv.active else None,
                     pattern=hp if hp.active else None, z=hz if z and hz.active else None,
                     names=tuple(name for name, p in zip(POINTS, (hq, hk, hv, hp, hz, ho), strict=True) if p.active))


# ------------------------------------------------------------------------------------------ finding points by name
Names = str | Sequence[str] | Callable[[str], bool] | None


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point in ``model`` by its full name (``layers.3.attn.hook_z``)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, HookPoint):
            module.name = name
            found[name] = module
    return found


def select(model: nn.Module, names: Names) -> dict[str, HookPoint]:
    """The hook points of ``model`` that ``names`` picks: None (all), a name or glob (``*.hook_z``), a list of
    those, or a predicate on the name. A name or pattern that picks nothing is an error naming some valid ones."""
    points = hook_points(model)
    if not points:
        raise MultiheadError(f"{type(model).__name__} has no hook points: it runs no multihead attention layer")
    if names is None:
        return points
    if callable(names) and not isinstance(names, str):
        return {n: p for n, p in points.items() if names(n)}
    patterns = [names] if isinstance(names, str) else list(names)
    chosen: dict[str, HookPoint] = {}
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise MultiheadError(f"hook point names must be strings, got {type(pattern).__name__}")
        hits = {n: p for n, p in points.items() if fnmatch.fnmatchcase(n, pattern)}
        if not hits:
            sample = ", ".join(list(points)[:6])
            raise MultiheadError(f"no hook point matches {pattern!r}; {len(points)} exist, e.g. {sample}")
        chosen.update(hits)
    return chosen


@contextmanager
def hooks(model: nn.Module, spec: Mapping[str, HookFn] | Sequence[tuple[str, HookFn]]) -> Iterator[None]:
    """Run with hooks: attach ``fn`` to every point each name (or glob) picks while the block runs."""
    pairs = list(spec.items()) if isinstance(spec, Mapping) else list(spec)
    handles: list[HookHandle] = []
    try:
        for names, fn in pairs:
            for point in select(model, names).values():
                handles.append(point.add(fn))
        yield
    finally:
        for handle in handles:
            handle.remove()


class ActivationCache(dict[str, Tensor]):
    """Named activations of one run, by hook point name."""

    def layer(self, index: int, point: str = "hook_z") -> Tensor:
        """The activation of ``point`` in the index-th attention layer that has it (in module order)."""
        found = [name for name in self if name.endswith("." + point) or name == point]
        if not 0 <= index < len(found):
            raise MultiheadError(f"{point}: the cache holds {len(found)} layer(s), not index {index}")
        return self[found[index]]


def run_with_cache(model: nn.Module, *args: Any, names: Names = None, detach: bool = True,
                   device: torch.device | str | None = None, **kwargs: Any) -> tuple[Any, ActivationCache]:
    """``model(*args, **kwargs)``, keeping the activations of the hook points ``names`` picks (default all).

    The pattern is made only when ``hook_pattern`` points are picked, so choose names to keep memory low. Tensors
    are detached unless ``detach=False`` (then gradients flow to them), and moved to ``device`` when given.
    """
    cache = ActivationCache()

    def keep(x: Tensor, point: HookPoint) -> None:
        kept = x.detach() if detach else x
        cache[point.name] = kept.to(device) if device is not None else kept

    chosen = select(model, names)
    with hooks(model, [(name, keep) for name in chosen]):
        out = model(*args, **kwargs)
    return out, cache


# ------------------------------------------------------------------------------------------ per-head edits
def _heads(heads: int | Sequence[int]) -> list[int]:
    chosen = [heads] if isinstance(heads, int) else list(heads)
    if not chosen or any(isinstance(h, bool) or not isinstance(h, int) for h in chosen):
        raise MultiheadError(f"heads ({heads!r}) must be an int or a list of ints")
    return chosen


def _check_heads(x: Tensor, point: HookPoint, heads: list[int]) -> None:
    if x.ndim != 4:
        raise MultiheadError(f"{point.name or 'this hook point'} {point.legend} has no head dimension: per-head "
                             "edits go on hook_q, hook_k, hook_v, hook_pattern or hook_z")
    n = x.shape[1]
    bad = [h for h in heads if not 0 <= h < n]
    if bad:
        kind = "KV heads" if point.kv_heads else "heads"
        raise MultiheadError(f"head(s) {bad} out of range at {point.name or 'this hook point'}: it has {n} {kind}")


def zero_heads(heads: int | Sequence[int]) -> HookFn:
    """A hook setting the given heads (dimension 1: query heads, or KV heads on hook_k / hook_v) to zero. On hook_z
    this is the ablation of Michel et al. (2019): the head's output never reaches W_O."""
    chosen = _heads(heads)

    def zero(x: Tensor, point: HookPoint) -> Tensor:
        _check_heads(x, point, chosen)
        out = x.clone()
        out[:, chosen] = 0
        return out
    return zero


def mean_heads(heads: int | Sequence[int], means: Tensor | None = None) -> HookFn:
    """A hook replacing the given heads by their mean: ``means`` (one value per head, broadcastable to x[:, heads])
    or, when None, the mean of this run's activation over the batch and the positions."""
    chosen = _heads(heads)

    def mean(x: Tensor, point: HookPoint) -> Tensor:
        _check_heads(x, point, chosen)
        out = x.clone()
        m = x[:, chosen].mean(dim=(0, 2), keepdim=True) if means is None else means.to(x.dtype)
        out[:, chosen] = m.expand_as(out[:, chosen])
        return out
    return mean


def patch_heads(heads: int | Sequence[int], source: Tensor, *, positions: Sequence[int] | None = None) -> HookFn:
    """A hook copying the given heads (at all positions, or the given query positions) from ``source``, the same
    point's activation in another run (from :func:`run_with_cache`) of the same shape."""
    chosen = _heads(heads)

    def patch(x: Tensor, point: HookPoint) -> Tensor:
        _check_heads(x, point, chosen)
        if source.shape != x.shape:
            raise MultiheadError(f"the patch source for {point.name or 'this hook point'} has shape "
                                 f"{tuple(source.shape)} but the run has {tuple(x.shape)}: runs must have equal "
                                 "lengths")
        out = x.clone()
        src = source.to(device=x.device, dtype=x.dtype)
        if positions is None:
            out[:, chosen] = src[:, chosen]
        else:
            pos = list(positions)
            for h in chosen:
                out[:, h, pos] = src[:, h, pos]
        return out
    return patch


def pool_kv_hook(n_kv_heads: int) -> HookFn:
    """A hook on hook_k or hook_v that mean-pools the g KV heads into n_kv_heads groups (Ainslie et al., 2023) and
    gives each head its group's mean: the model then computes what it would with n_kv_heads KV heads whose
    projections are the group means (projection and RoPE are linear and the same for every head)."""

    def pool(x: Tensor, point: HookPoint) -> Tensor:
        g = x.shape[1]
        if x.ndim != 4 or n_kv_heads > g or g % n_kv_heads != 0:
            raise MultiheadError(f"n_kv_heads ({n_kv_heads}) must divide the {g} KV heads at "
                                 f"{point.name or 'this hook point'}")
        b, _, t, d = x.shape
        grouped = x.view(b, n_kv_heads, g // n_kv_heads, t, d)
        return grouped.mean(2, keepdim=True).expand_as(grouped).reshape(b, g, t, d)
    return pool
