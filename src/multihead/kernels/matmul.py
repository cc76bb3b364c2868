"""The math backend: the attention written with matmul and softmax, the one path that makes the per-head weights
(b, h, s, t); query heads grouped over their KV head, never repeated."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.kernels.call import TensorFn
from multihead.layers.masks import MaskSpec


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
