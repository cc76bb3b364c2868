"""MHA -> GQA conversion by mean-pooling key and value heads within groups (Ainslie et al., 2023)."""

from __future__ import annotations

import dataclasses

import torch

from multihead.divisors import divisors
from multihead.errors import MultiheadError
from multihead.layers.attention import MultiHeadAttention


def pooled_layer(layer: MultiHeadAttention, n_kv_heads: int) -> MultiHeadAttention:
    """A copy of ``layer`` with n_kv_heads KV heads, each the mean of the group of current KV heads it replaces.

    With g current KV heads and g' new ones, new head j is the mean of the W_K (and W_V, and their biases) rows of
    heads j*g/g' .. (j+1)*g/g' - 1; query and output projections are copied unchanged. Query head i then reads new
    KV head i // (n_heads / g'), the group that held its old KV head. (:func:`multihead.layers.hooks.pool_kv_hook`
    computes the same model without a new layer, pooling the keys and values as they pass hook_k and hook_v.)
    """
    g = layer.n_kv_heads
    if n_kv_heads > g or g % n_kv_heads != 0:
        raise MultiheadError(f"n_kv_heads ({n_kv_heads}) must divide the layer's current n_kv_heads ({g}): choose "
                             f"one of {', '.join(map(str, divisors(g)))}")
    config = dataclasses.replace(layer.config, n_kv_heads=n_kv_heads)
    ref = layer.q_proj.weight
    new = MultiHeadAttention(config, backend=layer.backend, device=ref.device, dtype=ref.dtype)
    d, group = layer.head_dim, g // n_kv_heads
    with torch.no_grad():
        new.q_proj.load_state_dict(layer.q_proj.state_dict())
        new.o_proj.load_state_dict(layer.o_proj.state_dict())
        for name in ("k_proj", "v_proj"):
            old, fresh = getattr(layer, name), getattr(new, name)
            fresh.weight.copy_(old.weight.view(n_kv_heads, group, d, -1).mean(1).reshape(n_kv_heads * d, -1))
            if old.bias is not None:
                fresh.bias.copy_(old.bias.view(n_kv_heads, group, d).mean(1).reshape(-1))
    return new.train(layer.training)
