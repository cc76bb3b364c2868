"""The SDPA backend: PyTorch's fused scaled_dot_product_attention with GQA passed natively, or a GQA decode step
folded (each KV head's query heads as its rows)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from multihead.layers.masks import MaskSpec


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, *, scale: float, dropout_p: float = 0.0, fold: bool = False
) -> Tensor:
    """PyTorch's fused kernel with native GQA: out (b, h, s, d).

    ``fold`` runs a GQA decode step (one query per head) with the query heads of each group folded into the query
    dimension, (b, h, 1, d) -> (b, g, h/g, d): the kernel then reads each KV head once instead of once per query
    head (FlashAttention does the same swap on the GPU), but has b * g work items to share among the threads instead
    of b * h. :func:`resolve_backend` decides when, from :func:`multihead.kernels.cpu.fold_gqa_decode`. Same result.
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
