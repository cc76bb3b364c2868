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

``explain`` says which backend (and which SDPA kernel) will run for given inputs and why not a faster one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead import cpu, flex
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


@dataclass(frozen=True)
class AttentionCall:
    """One call of the attention core, as :func:`attend` runs it and :func:`explain` describes it.

    q (b, h, s, d); k (b, g, t, d) and v (b, g, t, dv) with g dividing h (query head i reads KV head i // (h / g));
    ``mask`` the call's :class:`~multihead.masks.MaskSpec`; ``dropout_p`` the dropout on the weights (0 outside
    training); ``backend`` one of BACKENDS; ``need_weights`` whether the (b, h, s, t) weights are returned;
    ``softcap`` caps the scaled scores as ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2); ``sinks``
    (h,) are learned sink logits, one per query head, that take part in each row's softmax denominator and add
    nothing to the output (gpt-oss).
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

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and (self.q.requires_grad or self.k.requires_grad or self.v.requires_grad)


def resolve_backend(call: AttentionCall, *, device: torch.device | None = None) -> tuple[str, str]:
    """The backend that runs for ``call`` (on ``device``, default q's: a what-if for another device), and why."""
    backend, spec, dropout_p = call.backend, call.mask, call.dropout_p
    device = call.q.device if device is None else device
    check_backend(backend)
    if call.need_weights:
        if backend in ("sdpa", "flex"):
            raise MultiheadError(
                f"backend {backend!r} cannot return attention weights (fused kernels never materialise them): "
                "use backend='math' or 'auto' with return_weights=True"
            )
        return "math", "weights requested: only the math path materialises the (b, h, s, t) weights"
    if backend == "math":
        return "math", "math path asked for explicitly"
    if call.sinks is not None:
        if backend in ("sdpa", "flex"):
            raise MultiheadError(
                f"backend {backend!r} cannot take sink logits (s_aux): a sink needs each row's log-sum-exp, which "
                "SDPA does not return and PyTorch's CPU flex attention cannot (return_lse); use 'math' or 'auto'"
            )
        return "math", "sink logits (s_aux) join each row's softmax: the math path takes them"
    if backend == "sdpa" and call.softcap is not None:
        raise MultiheadError("backend 'sdpa' cannot cap scores (softcap): use 'auto', 'math' or 'flex'")
    if backend == "flex":
        if dropout_p > 0.0:
            raise MultiheadError(f"backend 'flex' has no dropout (dropout_p {dropout_p}): use 'sdpa', or eval()")
        if not flex.available():
            raise MultiheadError(f"backend 'flex' needs torch >= 2.5 with flex attention (this is {torch.__version__})")
        if call.needs_grad and device.type == "cpu":
            raise MultiheadError("backend 'flex' has no backward on the CPU (PyTorch's flex attention): run under "
                                 "torch.no_grad() or choose backend 'sdpa' for training on the CPU")
        return "flex", "flex attention asked for explicitly"
    if backend == "sdpa":
        return "sdpa", "SDPA asked for explicitly"
    if call.softcap is not None:
        if device.type == "cuda" and flex.available() and dropout_p == 0.0:
            return "flex", "scores are capped (softcap): flex attention applies it in its score_mod"
        return "math", "scores are capped (softcap), which SDPA cannot do; the math path applies it"
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
    softcap: float | None = None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The readable path: (out (b, h, s, dv), weights (b, h, s, t))."""
    weights = attention_weights(q, k, spec, scale=scale, softcap=softcap, sinks=sinks)  # (b, h, s, t)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    return weighted_values(weights, v), weights


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, *, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """PyTorch's fused kernel with native GQA: out (b, h, s, d).

    A GQA decode step on the CPU (one query per head) can run with the query heads of each group folded into the
    query dimension, (b, h, 1, d) -> (b, g, h/g, d): the kernel then reads each KV head once instead of once per
    query head (FlashAttention does the same swap on the GPU), but has b * g work items to share among the threads
    instead of b * h. :func:`multihead.cpu.fold_gqa_decode` decides when. Same result.
    """
    b, h, s, d = q.shape
    g = k.shape[1]
    fold = _folds(q, k, spec)
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


def _folds(q: Tensor, k: Tensor, spec: MaskSpec) -> bool:
    return cpu.fold_gqa_decode(q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.device, spec.is_plain_causal)


def _fold_mask(mask: Tensor, h: int, g: int) -> Tensor:
    """A mask broadcastable to (b, h, 1, t), made to broadcast to the folded (b, g, h/g, t)."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    if mask.shape[1] == 1:
        return mask  # the same for every head: its single query row broadcasts over the folded rows
    return mask.reshape(mask.shape[0], g, h // g, mask.shape[3])  # head i = group i // (h/g), member i % (h/g)


def attend(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """softmax(q k^T * scale + mask) v for q (b, h, s, d) and k, v (b, g, t, d).

    Returns (out (b, h, s, d), weights (b, h, s, t) or None). Weights are those multiplied into v, after dropout.
    """
    chosen, _ = resolve_backend(call)
    q, k, v, spec = call.q, call.k, call.v, call.mask
    if chosen == "math":
        out, weights = math_attention(q, k, v, spec, scale=call.scale, dropout_p=call.dropout_p,
                                      softcap=call.softcap, sinks=call.sinks)
        return out, (weights if call.need_weights else None)
    if chosen == "flex":
        return flex.flex_attention(q, k, v, spec, scale=call.scale, softcap=call.softcap), None
    return sdpa_attention(q, k, v, spec, scale=call.scale, dropout_p=call.dropout_p), None


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
    if spec.documents is not None:
        parts.append("packed documents")
    return "; ".join(parts)


def explain(call: AttentionCall) -> KernelChoice:
    """Which kernel :func:`attend` runs for this call, and why, without running it."""
    q, k, v, spec = call.q, call.k, call.v, call.mask
    dropout_p, scale, need_weights = call.dropout_p, call.scale, call.need_weights
    chosen, reason = resolve_backend(call)
    mask_text = _describe_mask(spec)
    if chosen == "flex":
        skipped = flex.sparsity(spec, q.device)
        return KernelChoice("flex", "flex_attention", reason + f"; {skipped:.0%} of the 128 x 128 blocks skipped",
                            mask_text)
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
    if _folds(q, k, spec):
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
        if dropout_p > 0.0 and q.device.type == "cpu":
            reason += ": its CPU fused kernel takes no dropout (eval() or dropout 0 gives the fused kernel)"
        elif structure(spec) is not None and dropout_p == 0.0:
            reason += ": backend='flex' avoids it"
        else:
            reason += ": no fused kernel takes these inputs here"
    return KernelChoice("sdpa", kernel, reason, mask_text)
