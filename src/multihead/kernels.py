"""The attention core, ``softmax(q k^T * scale + mask) v``, and the backends that compute it.

Shapes follow the package legend: q (b, h, s, d); k and v (b, g, t, d) with g = n_kv_heads dividing h. Keys and
values stay g heads wide: query head i reads KV head i // (h / g). No backend repeats K/V in memory.

Backends:

- ``"sdpa"``: PyTorch's fused ``scaled_dot_product_attention`` with GQA passed natively (``enable_gqa``); it picks
  flash / memory-efficient / cuDNN / math kernels underneath. The default.
- ``"math"``: the readable path written with matmul and softmax; it returns the per-head weights (b, h, s, t).
- ``"auto"``: ``"sdpa"``, except when weights are requested (only ``"math"`` materialises them).

``explain`` says which backend (and which SDPA kernel) will run for given inputs and why not a faster one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.errors import MultiheadError
from multihead.masks import MaskSpec

BACKENDS = ("auto", "sdpa", "math")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise MultiheadError(f"backend {backend!r} is unknown: choose one of {', '.join(map(repr, BACKENDS))}")
    return backend


def resolve_backend(backend: str, *, need_weights: bool) -> tuple[str, str]:
    """The backend that runs, and why."""
    check_backend(backend)
    if need_weights:
        if backend == "sdpa":
            raise MultiheadError(
                "backend 'sdpa' cannot return attention weights (fused kernels never materialise them): "
                "use backend='math' or 'auto' with return_weights=True"
            )
        return "math", "weights requested: only the math path materialises the (b, h, s, t) weights"
    if backend == "math":
        return "math", "math path asked for explicitly"
    return "sdpa", "fused SDPA is the default"


def attention_weights(q: Tensor, k: Tensor, spec: MaskSpec, *, scale: float) -> Tensor:
    """softmax(q k^T * scale + mask) per query head: (b, h, s, t), rows with no allowed key all zero.

    Query heads are viewed as g groups of r = h / g heads, so each group multiplies its own KV head without copying
    it. Low-precision scores are normalised in float32, as fused kernels do.
    """
    b, h, s, d = q.shape
    g, t = k.shape[1], k.shape[2]
    r = h // g
    keep, bias, has_key = spec.dense(q.device, q.dtype)
    qg = q.reshape(b, g, r * s, d)  # (b, g, r*s, d): query head i = group i // r, member i % r
    scores = (qg @ k.transpose(-2, -1)).view(b, h, s, t) * scale  # (b, h, s, t)
    if bias is not None:
        scores = scores + bias
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    work = torch.promote_types(scores.dtype, torch.float32)  # half and bfloat16 normalise in float32
    weights = torch.softmax(scores.to(work), dim=-1).to(q.dtype)  # (b, h, s, t)
    if has_key is not None:
        weights = weights * has_key
    return weights


def math_attention(
    q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, *, scale: float, dropout_p: float = 0.0
) -> tuple[Tensor, Tensor]:
    """The readable path: (out (b, h, s, d), weights (b, h, s, t))."""
    b, h, s, d = q.shape
    g, t = k.shape[1], k.shape[2]
    weights = attention_weights(q, k, spec, scale=scale)  # (b, h, s, t)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    out = (weights.view(b, g, (h // g) * s, t) @ v).view(b, h, s, d)  # (b, h, s, d)
    return out, weights


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, *, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """PyTorch's fused kernel with native GQA: out (b, h, s, d)."""
    gqa = k.shape[1] != q.shape[1]
    if spec.is_empty or spec.is_plain_causal:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=spec.is_plain_causal, scale=scale, enable_gqa=gqa
        )
    keep, bias, has_key = spec.dense(q.device, q.dtype)
    attn_mask: Tensor | None
    if bias is None:
        attn_mask = keep
    elif keep is None:
        attn_mask = bias
    else:
        attn_mask = bias.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )  # (b, h, s, d)
    if has_key is not None:
        out = out * has_key
    return out


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: MaskSpec,
    *,
    scale: float,
    dropout_p: float = 0.0,
    backend: str = "auto",
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """softmax(q k^T * scale + mask) v for q (b, h, s, d) and k, v (b, g, t, d).

    Returns (out (b, h, s, d), weights (b, h, s, t) or None). Weights are those multiplied into v, after dropout.
    """
    chosen, _ = resolve_backend(backend, need_weights=need_weights)
    if chosen == "math":
        out, weights = math_attention(q, k, v, spec, scale=scale, dropout_p=dropout_p)
        return out, (weights if need_weights else None)
    return sdpa_attention(q, k, v, spec, scale=scale, dropout_p=dropout_p), None


@dataclass(frozen=True)
class KernelChoice:
    """Which attention kernel runs for a call, and why.

    ``backend`` is the multihead backend ("sdpa" or "math"); ``kernel`` the implementation underneath
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
    return "; ".join(parts)


def explain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: MaskSpec,
    *,
    scale: float,
    dropout_p: float = 0.0,
    backend: str = "auto",
    need_weights: bool = False,
) -> KernelChoice:
    """Which kernel :func:`attend` runs for these inputs, without running it."""
    chosen, reason = resolve_backend(backend, need_weights=need_weights)
    mask_text = _describe_mask(spec)
    if chosen == "math":
        if need_weights:
            reason += "; without return_weights the fused SDPA path runs"
        else:
            reason += "; the fused SDPA path ('auto') is faster"
        return KernelChoice("math", "matmul+softmax", reason, mask_text)
    kernel = "unknown"
    choice_fn = getattr(torch, "_fused_sdp_choice", None)
    if choice_fn is not None:
        from torch.nn.attention import SDPBackend

        dense: Tensor | None = None
        if not (spec.is_empty or spec.is_plain_causal):
            keep, bias, _ = spec.dense(q.device, q.dtype)
            dense = bias if bias is not None else keep
        try:
            code = choice_fn(
                q, k, v, dense, dropout_p, spec.is_plain_causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )
            kernel = SDPBackend(code).name.lower().removesuffix("_attention")
        except (RuntimeError, ValueError, TypeError):  # private API: report it as unknown rather than fail
            kernel = "unknown"
    if spec.is_empty or spec.is_plain_causal:
        reason += "; no dense mask is made" + (" (the kernel's own causal path)" if spec.causal else "")
    else:
        reason += (
            "; the mask is passed as a dense tensor, which keeps some fused kernels out"
            + (" (causal with s != t or a window has no flag in SDPA)" if spec.causal else "")
        )
    return KernelChoice("sdpa", kernel, reason, mask_text)
