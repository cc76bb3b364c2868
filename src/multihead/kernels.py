"""The attention core, ``softmax(q k^T * scale + mask) v``, and the backends that compute it.

Shapes follow the package legend: q (b, h, s, d); k and v (b, g, t, d) with g = n_kv_heads dividing h. Keys and
values stay g heads wide: query head i reads KV head i // (h / g). No backend repeats K/V in memory.

Backends:

- ``"sdpa"``: PyTorch's fused ``scaled_dot_product_attention`` with GQA passed natively (``enable_gqa``); it picks
  flash / memory-efficient / cuDNN / math kernels underneath. The default.
- ``"math"``: the readable path written with matmul and softmax; it returns the per-head weights (b, h, s, t).
- ``"flex"``: PyTorch's flex attention with a block mask made from the mask's structure (causal with s != t,
  sliding windows, key padding, packed documents, a cache's positions): masked blocks are skipped and no dense mask
  is made (:mod:`multihead.flex`). Compiled on first use for each shape.
- ``"auto"``: chosen per call from the inputs: ``"math"`` when weights are requested (only it materialises them);
  ``"flex"`` on a GPU when the mask has structure that SDPA could only take as a dense tensor (long enough for blocks
  to be skipped, no dropout); ``"sdpa"`` otherwise. On the CPU ``"auto"`` keeps SDPA, whose CPU flash kernel takes
  the mask without materialising scores, because flex attention must be compiled for each new shape there.

  MLA's absorbed decode step (its query heads folded into the rows of one latent head) runs ``"math"``.

One policy: :func:`resolve_backend` holds every rule of which kernel runs (what the call requires, what was asked,
the fastest for ``"auto"``, the CPU decisions it consults in :mod:`multihead.cpu`, what a hooked pattern needs) and
returns a :class:`Plan`; :func:`attend` runs that plan with the call's hooks (:class:`CallHooks`: they see and
replace tensors, nothing more), and :func:`explain` says which backend (and which SDPA kernel) the plan runs and why
not a faster one. Both take the same :class:`AttentionCall`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead import cpu, flex, native
from multihead.errors import MultiheadError
from multihead.masks import MaskSpec

BACKENDS = ("auto", "sdpa", "math", "flex")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise MultiheadError(f"backend {backend!r} is unknown: choose one of {', '.join(map(repr, BACKENDS))}")
    return backend


def structure(spec: MaskSpec) -> str | None:
    """What in the mask a block-sparse kernel can use and SDPA cannot take as a flag, or None."""
    if spec.is_empty or spec.is_plain_causal:
        return None
    parts = []
    if spec.causal:
        if spec.window is not None:
            parts.append(f"sliding window {spec.window}")
        if spec.q_positions is not None:
            parts.append("causal by cache positions")
        elif spec.s != spec.t:
            parts.append("causal with s != t")
    if spec.documents is not None:
        parts.append("packed documents")
    if spec.keep is not None and spec.keep.ndim == 4 and spec.keep.shape[1:3] == (1, 1):
        parts.append("key padding")
    if (spec.keep is not None and spec.keep.shape[-2] != 1) or spec.bias is not None:
        return None  # a dense (s, t) mask of the user's: it is one tensor for every kernel
    return ", ".join(parts) if parts else None


TensorFn = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class CallHooks:
    """The hooks at one call's core, made from a module's hook points by :func:`multihead.hooks.call_hooks`.

    Each is a function tensor -> tensor that returns its input (to read it) or a replacement of the same shape, or
    None where nothing is hooked: ``q`` (b, h, s, d), ``k`` and ``v`` (b, g, t, d) as they enter the kernel,
    ``pattern`` the weights (b, h, s, t), ``z`` the output (b, h, s, dv). ``names`` are the module's hooked points,
    as :func:`explain` lists them. Hooks only see and replace tensors: what a hooked pattern means for the kernel is
    :func:`resolve_backend`'s rule, and the weighted sum of a replaced pattern is the math path's.
    """

    q: TensorFn | None = None
    k: TensorFn | None = None
    v: TensorFn | None = None
    pattern: TensorFn | None = None
    z: TensorFn | None = None
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class AttentionCall:
    """One call of the attention core, as :func:`attend` runs it and :func:`explain` describes it.

    q (b, h, s, d); k (b, g, t, d) and v (b, g, t, dv) with g dividing h (query head i reads KV head i // (h / g));
    ``mask`` the call's :class:`~multihead.masks.MaskSpec`; ``dropout_p`` the dropout on the weights (0 outside
    training); ``backend`` one of BACKENDS; ``need_weights`` whether the (b, h, s, t) weights are returned;
    ``softcap`` caps the scaled scores as ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2); ``sinks``
    (h,) are learned sink logits, one per query head, that take part in each row's softmax denominator and add
    nothing to the output (gpt-oss); ``hooks`` the hook points at this core (:class:`CallHooks`, None when nothing
    is hooked); ``rows_are_heads`` marks a call whose query rows are one decode step's query heads folded onto
    their single KV head (MLA's absorbed decode: q (b, 1, h, .) over k (b, 1, t, .)).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    mask: MaskSpec
    scale: float
    dropout_p: float = 0.0
    backend: str = "auto"
    need_weights: bool = False
    softcap: float | None = None
    sinks: Tensor | None = None
    hooks: CallHooks | None = None
    rows_are_heads: bool = False

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and (self.q.requires_grad or self.k.requires_grad or self.v.requires_grad)


class Plan(NamedTuple):
    """What :func:`attend` runs for a call, as :func:`resolve_backend` decides it.

    ``backend`` is the kernel that computes the output ("math", "sdpa" or "flex"); ``reason`` why this one and what
    keeps a faster one out; ``fold`` that SDPA runs a GQA decode step with each KV head's query heads as its rows
    (:func:`multihead.cpu.fold_gqa_decode`); ``pattern_beside`` that a hooked pattern is made by the math path beside
    the fused kernel (a hook that returns a replacement makes the output its weighted sum, the math path's);
    ``native`` that the SDPA backend's CPU decode step runs in :func:`multihead.native.attend_dense` (each KV head
    read once for its query heads; :func:`multihead.cpu.native_decode_attention`).
    """

    backend: str
    reason: str
    fold: bool = False
    pattern_beside: bool = False
    fold_timing: tuple[object, ...] | None = None  # time the SDPA call under this key (multihead.cpu.record_time)
    native: bool = False  # the "sdpa" backend's decode step runs in multihead.native.attend_dense
    native_timing: tuple[object, ...] | None = None  # time the call under this key, as "native" or "sdpa"


PATTERN_BESIDE = ("; the pattern (b, h, s, t) is made from the same q, k and mask for the pattern hook, and a hook "
                  "that returns a replacement makes this call's output pattern @ v (the math path)")


NATIVE_DECODE = ("; this CPU decode step runs in multihead.native.attend_dense (each KV head read once for its query "
                 "heads; measured faster than SDPA's CPU kernel for this shape and length)")


def resolve_backend(call: AttentionCall, *, device: torch.device | None = None) -> Plan:
    """The one backend policy: what runs for ``call`` (on ``device``, default q's: a what-if for another device).

    Every rule of which kernel runs is here: what the inputs require or forbid (weights, sink logits, softcap,
    dropout, gradients, an explicit backend), what is fastest for them ('auto': the mask's structure, the device,
    MLA's folded decode), what the hooks need (a hooked pattern beside a fused kernel) and the CPU decisions it
    consults in :mod:`multihead.cpu`. :func:`attend` runs the plan and :func:`explain` describes it.
    """
    device = call.q.device if device is None else device
    backend, reason = _backend(call, device)
    fold, timing = _folds(call, device) if backend == "sdpa" else (False, None)
    native, native_timing = False, None
    if backend == "sdpa" and timing is None and device.type == "cpu":  # after the fold is decided
        native, native_timing = cpu.native_decode_attention(call.q, call.k, call.v, call.mask, call.needs_grad,
                                                            call.dropout_p)
        if native:
            fold, reason = False, reason + NATIVE_DECODE
    beside = call.hooks is not None and call.hooks.pattern is not None and backend != "math"
    return Plan(backend, reason + PATTERN_BESIDE if beside else reason, fold, beside, timing, native, native_timing)


def _backend(call: AttentionCall, device: torch.device) -> tuple[str, str]:
    """The kernel for the output, and why: what the call requires first, then what was asked, then 'auto'."""
    backend = check_backend(call.backend)
    if call.need_weights:
        if backend in ("sdpa", "flex"):
            raise MultiheadError(
                f"backend {backend!r} cannot return attention weights (fused kernels never materialise them): "
                "use backend='math' or 'auto' with return_weights=True"
            )
        return "math", ("weights requested: only the math path materialises the (b, h, s, t) weights; without "
                        "return_weights the fused SDPA path runs")
    if backend == "math":
        return "math", "math path asked for explicitly; the fused SDPA path ('auto') is faster"
    if call.sinks is not None:
        if backend in ("sdpa", "flex"):
            raise MultiheadError(
                f"backend {backend!r} cannot take sink logits (s_aux): a sink needs each row's log-sum-exp, which "
                "SDPA does not return and PyTorch's CPU flex attention cannot (return_lse); use 'math' or 'auto'"
            )
        return "math", ("sink logits (s_aux) join each row's softmax: the math path takes them (no fused kernel here "
                        "returns the log-sum-exp they need)")
    if backend == "sdpa":
        if call.softcap is not None:
            raise MultiheadError("backend 'sdpa' cannot cap scores (softcap): use 'auto', 'math' or 'flex'")
        return "sdpa", "SDPA asked for explicitly"
    if backend == "flex":
        _check_flex(call, device)
        return "flex", "flex attention asked for explicitly"
    return _auto(call, device)


def _check_flex(call: AttentionCall, device: torch.device) -> None:
    if call.dropout_p > 0.0:
        raise MultiheadError(f"backend 'flex' has no dropout (dropout_p {call.dropout_p}): use 'sdpa', or eval()")
    if not flex.available():
        raise MultiheadError(f"backend 'flex' needs torch >= 2.5 with flex attention (this is {torch.__version__})")
    if call.needs_grad and device.type == "cpu":
        raise MultiheadError("backend 'flex' has no backward on the CPU (PyTorch's flex attention): run under "
                             "torch.no_grad() or choose backend 'sdpa' for training on the CPU")


def _auto(call: AttentionCall, device: torch.device) -> tuple[str, str]:
    """'auto': the fastest kernel that takes the call's inputs on ``device``."""
    spec, dropout_p = call.mask, call.dropout_p
    if call.rows_are_heads:
        return "math", (f"the {spec.s} query heads of one decode step run as the rows of their one KV head: two "
                        "matrix products (the math path) beat the fused kernels there, 1.2-3x on an H200 and a 2-core "
                        "CPU (benchmarks/mla_decode.py)")
    if call.softcap is not None:
        if device.type == "cuda" and flex.available() and dropout_p == 0.0:
            return "flex", "scores are capped (softcap): flex attention applies it in its score_mod"
        return "math", ("scores are capped (softcap), which SDPA cannot do; the math path applies it (flex attention "
                        "would, on a GPU without dropout)")
    found = structure(spec)
    if found is None:
        return "sdpa", "fused SDPA is the default"
    if dropout_p > 0.0:
        return "sdpa", f"the mask has structure ({found}) but flex attention has no dropout"
    if device.type != "cuda":
        return "sdpa", (f"the mask has structure ({found}); on the CPU flex attention compiles for each new shape, "
                        "so SDPA's CPU kernel takes the mask (backend='flex' for the block-sparse kernel)")
    if spec.s < flex.BLOCK:
        return "sdpa", f"the mask has structure ({found}) but {spec.s} queries are fewer than one block"
    if not flex.available():
        return "sdpa", f"the mask has structure ({found}) but this torch has no flex attention"
    return "flex", f"the mask has structure ({found}): flex attention skips the masked blocks, no dense mask"


def _folds(call: AttentionCall, device: torch.device) -> tuple[bool, tuple[object, ...] | None]:
    """SDPA's GQA decode fold, as :mod:`multihead.cpu` decides it for this device (and the key to time the call
    under while it is measured)."""
    q, k = call.q, call.k
    return cpu.fold_gqa_decode(q.shape[0], q.shape[1], k.shape[1], q.shape[2], device, call.mask.is_plain_causal,
                               k.shape[2], q.dtype)


def attention_weights(q: Tensor, k: Tensor, spec: MaskSpec, *, scale: float, softcap: float | None = None,
                      sinks: Tensor | None = None) -> Tensor:
    """softmax(cap(q k^T * scale) + mask) per query head: (b, h, s, t), rows with no allowed key all zero.

    ``softcap`` caps the scores as softcap * tanh(scores / softcap); ``sinks`` (h,) joins each row's softmax as one
    more logit whose weight is dropped (the row's weights then sum to less than one).

    Query heads are viewed as g groups of r = h / g heads, so each group multiplies its own KV head without copying
    it. Low-precision inputs are scored, masked and normalised in float32, as fused kernels do.
    """
    b, h, s, d = q.shape
    g, t = k.shape[1], k.shape[2]
    r = h // g
    keep, bias, has_key = spec.dense(q.device, q.dtype)
    work = torch.promote_types(q.dtype, torch.float32)  # half and bfloat16 score and normalise in float32
    qg = q.reshape(b, g, r * s, d).to(work)  # (b, g, r*s, d): query head i = group i // r, member i % r
    scores = (qg @ k.to(work).transpose(-2, -1)).view(b, h, s, t) * scale  # (b, h, s, t)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1).to(q.dtype)  # (b, h, s, t)
    else:
        sink = sinks.to(device=q.device, dtype=work).view(1, h, 1, 1).expand(b, h, s, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :t].to(q.dtype)  # the sink dropped
    if has_key is not None:
        weights = weights * has_key
    return weights


def weighted_values(weights: Tensor, v: Tensor) -> Tensor:
    """weights (b, h, s, t) @ v (b, g, t, d) -> (b, h, s, d), each group of h / g query heads on its own KV head."""
    b, h, s, t = weights.shape
    g, d = v.shape[1], v.shape[3]
    return (weights.reshape(b, g, (h // g) * s, t) @ v).view(b, h, s, d)  # (b, h, s, dv)


def math_attention(
    q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, *, scale: float, dropout_p: float = 0.0,
    softcap: float | None = None, sinks: Tensor | None = None, pattern: TensorFn | None = None,
) -> tuple[Tensor, Tensor]:
    """The readable path: (out (b, h, s, dv), weights (b, h, s, t)); ``pattern`` (a hook) sees the weights and may
    replace them before dropout and the weighted sum."""
    weights = attention_weights(q, k, spec, scale=scale, softcap=softcap, sinks=sinks)  # (b, h, s, t)
    if pattern is not None:
        weights = pattern(weights)
    return weighted_sum(weights, v, dropout_p)


def weighted_sum(weights: Tensor, v: Tensor, dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """The math path after the softmax: dropout on the weights (b, h, s, t), then their product with v (b, g, t, dv).
    Returns (out (b, h, s, dv), the weights multiplied into v)."""
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    return weighted_values(weights, v), weights


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, *, scale: float, dropout_p: float = 0.0, fold: bool = False
) -> Tensor:
    """PyTorch's fused kernel with native GQA: out (b, h, s, d).

    ``fold`` runs a GQA decode step (one query per head) with the query heads of each group folded into the query
    dimension, (b, h, 1, d) -> (b, g, h/g, d): the kernel then reads each KV head once instead of once per query
    head (FlashAttention does the same swap on the GPU), but has b * g work items to share among the threads instead
    of b * h. :func:`resolve_backend` decides when, from :func:`multihead.cpu.fold_gqa_decode`. Same result.
    """
    b, h, s, d = q.shape
    g = k.shape[1]
    run_q = q.reshape(b, g, h // g, d) if fold else q
    gqa = g != h and not fold
    if spec.is_empty or spec.is_plain_causal:
        out = F.scaled_dot_product_attention(
            run_q, k, v, dropout_p=dropout_p, is_causal=spec.is_plain_causal, scale=scale, enable_gqa=gqa
        )
        return out.view(b, h, s, v.shape[-1]) if fold else out
    keep, bias, has_key = spec.dense(q.device, q.dtype)
    attn_mask: Tensor | None
    if bias is None:
        attn_mask = keep
    elif keep is None:
        attn_mask = bias
    else:
        attn_mask = bias.masked_fill(~keep, float("-inf"))
    if fold and attn_mask is not None:
        attn_mask = _fold_mask(attn_mask, h, g)
    out = F.scaled_dot_product_attention(
        run_q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )  # (b, h, s, dv), or (b, g, h/g, dv) folded
    if fold:
        out = out.view(b, h, s, v.shape[-1])
    if has_key is not None:
        out = out * has_key
    return out


def _fold_mask(mask: Tensor, h: int, g: int) -> Tensor:
    """A mask broadcastable to (b, h, 1, t), made to broadcast to the folded (b, g, h/g, t)."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    if mask.shape[1] == 1:
        return mask  # the same for every head: its single query row broadcasts over the folded rows
    return mask.reshape(mask.shape[0], g, h // g, mask.shape[3])  # head i = group i // (h/g), member i % (h/g)


def attend(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """softmax(q k^T * scale + mask) v for q (b, h, s, d) and k, v (b, g, t, d), with the call's hooks.

    Returns (out (b, h, s, d), weights (b, h, s, t) or None). Weights are those multiplied into v, after dropout.
    q, k and v pass their hooks first, the kernel :func:`resolve_backend` plans runs (a hooked pattern inside the
    math path, or made beside a fused kernel), and the output passes the z hook.
    """
    hooks = call.hooks
    if hooks is not None:
        call = _hooked_inputs(call, hooks)
    plan = resolve_backend(call)
    q, k, v, spec = call.q, call.k, call.v, call.mask
    pattern = None if hooks is None else hooks.pattern
    weights: Tensor | None = None
    if plan.backend == "math":
        out, weights = math_attention(q, k, v, spec, scale=call.scale, dropout_p=call.dropout_p,
                                      softcap=call.softcap, sinks=call.sinks, pattern=pattern)
        weights = weights if call.need_weights else None
    elif plan.backend == "flex":
        out = flex.flex_attention(q, k, v, spec, scale=call.scale, softcap=call.softcap)
    elif plan.native and plan.native_timing is None:  # (dense_fits asked by the plan, of these very tensors)
        out = native.attend_dense(q, k, v, call.scale, check=False)
    elif plan.native_timing is not None:  # the native kernel is being measured against SDPA on the real calls
        began = time.perf_counter()
        if plan.native:
            out = native.attend_dense(q, k, v, call.scale, check=False)
        else:
            out = sdpa_attention(q, k, v, spec, scale=call.scale, dropout_p=call.dropout_p, fold=plan.fold)
        cpu.record_time(plan.native_timing, "native" if plan.native else "sdpa", time.perf_counter() - began)
    elif plan.fold_timing is None:
        out = sdpa_attention(q, k, v, spec, scale=call.scale, dropout_p=call.dropout_p, fold=plan.fold)
    else:  # the fold is being measured on the real calls
        began = time.perf_counter()
        out = sdpa_attention(q, k, v, spec, scale=call.scale, dropout_p=call.dropout_p, fold=plan.fold)
        cpu.record_time(plan.fold_timing, "folded" if plan.fold else "unfolded", time.perf_counter() - began)
    if plan.pattern_beside:
        assert pattern is not None
        out = _pattern_beside(call, out, pattern)
    if hooks is not None and hooks.z is not None:
        out = hooks.z(out)
    return out, weights


def _hooked_inputs(call: AttentionCall, hooks: CallHooks) -> AttentionCall:
    """The call with q, k and v through their hooks."""
    q = call.q if hooks.q is None else hooks.q(call.q)
    k = call.k if hooks.k is None else hooks.k(call.k)
    v = call.v if hooks.v is None else hooks.v(call.v)
    if q is call.q and k is call.k and v is call.v:
        return call
    return dataclasses.replace(call, q=q, k=k, v=v)


def _pattern_beside(call: AttentionCall, out: Tensor, pattern: TensorFn) -> Tensor:
    """A fused kernel's output with the pattern hooked: the pattern made exactly as the math path makes it (same q, k
    and mask) for the hook; a replacement makes the output its weighted sum (the math path's), else ``out`` stays."""
    made = attention_weights(call.q, call.k, call.mask, scale=call.scale, softcap=call.softcap, sinks=call.sinks)
    edited = pattern(made)
    if edited is made:
        return out
    return weighted_sum(edited, call.v, call.dropout_p)[0]


@dataclass(frozen=True)
class KernelChoice:
    """Which attention kernel runs for a call, and why.

    ``backend`` is the multihead backend ("sdpa", "math" or "flex", or "cache" where the cache attends over its own
    store, :meth:`multihead.cache.Cache.attend`); ``kernel`` the implementation underneath
    (for SDPA the one PyTorch selects: "flash", "efficient", "cudnn", "math", ...); ``reason`` says why this one
    and, when it is not the fastest available, what keeps the faster one out.
    """

    backend: str
    kernel: str
    reason: str
    mask: str

    def __str__(self) -> str:
        return f"{self.backend} ({self.kernel}), mask: {self.mask}: {self.reason}"


def _describe_mask(spec: MaskSpec) -> str:
    if spec.is_empty:
        return "none"
    parts = []
    if spec.causal:
        parts.append("causal" + (f", window {spec.window}" if spec.window is not None else ""))
        if spec.s != spec.t:
            parts.append(f"bottom-right aligned (s {spec.s}, t {spec.t})")
    if spec.keep is not None:
        parts.append(f"bool {tuple(spec.keep.shape)}")
    if spec.bias is not None:
        parts.append(f"float {tuple(spec.bias.shape)}")
    if spec.documents is not None:
        parts.append("packed documents")
    return "; ".join(parts)


def explain(call: AttentionCall) -> KernelChoice:
    """Which kernel :func:`attend` runs for this call, and why, without running it (nor its hooks): the plan of
    :func:`resolve_backend`, the kernel underneath (for SDPA the one PyTorch selects), and the hooked points."""
    plan = resolve_backend(call)
    if plan.backend == "flex":
        kernel = "flex_attention"
        reason = plan.reason + f"; {flex.sparsity(call.mask, call.q.device):.0%} of the 128 x 128 blocks skipped"
    elif plan.backend == "math":
        kernel, reason = "matmul+softmax", plan.reason
    elif plan.native:
        kernel, reason = "multihead.native.attend_dense", plan.reason
    else:
        kernel = _sdpa_kernel(call)
        reason = plan.reason + _sdpa_details(call, plan, kernel)
    if call.hooks is not None and call.hooks.names:
        reason += f"; hooked: {', '.join(call.hooks.names)}"
    return KernelChoice(plan.backend, kernel, reason, _describe_mask(call.mask))


def _sdpa_kernel(call: AttentionCall) -> str:
    """The kernel PyTorch's SDPA selects for the call (its private chooser), or "unknown"."""
    choice_fn = getattr(torch, "_fused_sdp_choice", None)
    if choice_fn is None:
        return "unknown"
    from torch.nn.attention import SDPBackend

    q, k, v, spec = call.q, call.k, call.v, call.mask
    dense: Tensor | None = None
    if not (spec.is_empty or spec.is_plain_causal):
        keep, bias, _ = spec.dense(q.device, q.dtype)
        dense = bias if bias is not None else keep
    try:
        code = choice_fn(q, k, v, dense, call.dropout_p, spec.is_plain_causal, scale=call.scale,
                         enable_gqa=k.shape[1] != q.shape[1])
        return str(SDPBackend(code).name.lower().removesuffix("_attention"))
    except (RuntimeError, ValueError, TypeError):  # private API: report it as unknown rather than fail
        return "unknown"


def _sdpa_details(call: AttentionCall, plan: Plan, kernel: str) -> str:
    """What the SDPA call does with the inputs, and what keeps a faster kernel out."""
    q, k, spec = call.q, call.k, call.mask
    reason = ""
    if plan.fold:
        reason += f"; one query per head: the {q.shape[1] // k.shape[1]} query heads of each KV head run as its rows"
    if spec.is_empty or spec.is_plain_causal:
        reason += "; no dense mask is made" + (" (the kernel's own causal path)" if spec.causal else "")
    else:
        reason += (
            "; the mask is passed as a dense tensor, which keeps some fused kernels out"
            + (" (causal with s != t or a window has no flag in SDPA)" if spec.causal else "")
        )
        if structure(spec) is not None and flex.available() and spec.s >= flex.BLOCK:
            reason += (f"; flex attention would skip {flex.sparsity(spec, q.device):.0%} of the 128 x 128 blocks "
                       "(see benchmarks/RESULTS.md for when that pays on the CPU)")
    if kernel == "math":
        reason += "; PyTorch's math kernel runs, materialising the (s, t) scores"
        if call.dropout_p > 0.0 and q.device.type == "cpu":
            reason += ": its CPU fused kernel takes no dropout (eval() or dropout 0 gives the fused kernel)"
        elif structure(spec) is not None and call.dropout_p == 0.0:
            reason += ": backend='flex' avoids it"
        else:
            reason += ": no fused kernel takes these inputs here"
    return reason
