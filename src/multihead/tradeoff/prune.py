"""Head pruning by importance (Michel et al. 2019), in whole KV groups so that the cache shrinks too.

The unit is a KV group: one KV head and the query heads that read it (for MHA, one head). A group's importance is
the sum of its query heads' one-backward importance (:func:`multihead.heads.patching.head_importance`, each layer
scaled to unit norm as Michel et al. do for pruning across layers). The least important groups of the whole model
go first; every layer keeps at least one. The result is a smaller :class:`LlamaModel` whose layers may hold
different head counts (``LlamaConfig.layer_heads``), with the same function as the original with those heads'
outputs set to zero (their W_O columns and W_Q rows removed, their K/V rows gone from the cache).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from multihead.errors import MultiheadError
from multihead.models.llama import LlamaBlock, LlamaModel


def check_fraction(fraction: float) -> float:
    if not isinstance(fraction, int | float) or isinstance(fraction, bool) or not 0 <= fraction < 1:
        raise MultiheadError(f"pruning fraction ({fraction!r}) must lie in [0, 1): the share of KV groups removed")
    return float(fraction)


def group_importance(model: LlamaModel, ids: Tensor) -> np.ndarray:
    """(n_layers, n_kv_heads) importance of each KV group on the token batch ``ids`` (b, s)."""
    from multihead.heads.patching import head_importance

    layers = [block.attn for block in model.layers if isinstance(block, LlamaBlock)]
    needs = [p for p in model.parameters() if not p.requires_grad]
    for p in needs:
        p.requires_grad_(True)
    try:
        heads = head_importance(model, layers, ids)  # (L, h)
    finally:
        for p in needs:
            p.requires_grad_(False)
    n_layers, h = heads.shape
    g = model.config.n_kv_heads
    grouped: np.ndarray = heads.reshape(n_layers, g, h // g).sum(-1)
    return grouped


def groups_to_keep(importance: np.ndarray, fraction: float) -> list[list[int]]:
    """For each layer, the KV groups kept when the least important ``fraction`` of all groups go (at least one
    group stays in every layer)."""
    check_fraction(fraction)
    n_layers, g = importance.shape
    drop = math.floor(fraction * n_layers * g + 1e-9)
    kept = [set(range(g)) for _ in range(n_layers)]
    order = sorted((float(importance[i, j]), i, j) for i in range(n_layers) for j in range(g))
    for _, i, j in order:
        if drop == 0:
            break
        if len(kept[i]) > 1:
            kept[i].discard(j)
            drop -= 1
    return [sorted(k) for k in kept]


def prune(model: LlamaModel, keep: Sequence[Sequence[int]]) -> LlamaModel:
    """A copy of ``model`` holding, in layer l, only the KV groups in ``keep[l]`` (and their query heads)."""
    cfg = model.config
    if len(keep) != cfg.n_layers:
        raise MultiheadError(f"keep has {len(keep)} layers but the model has {cfg.n_layers}")
    if cfg.layer_heads is not None:
        raise MultiheadError("this model was pruned already: prune the original")
    g, per = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
    for layer, groups in enumerate(keep):
        if not groups or len(set(groups)) != len(groups) or not all(0 <= j < g for j in groups):
            raise MultiheadError(f"layer {layer}: groups to keep {list(groups)} must be distinct, in 0..{g - 1}, "
                                 "and at least one")
    layer_heads = tuple((len(groups) * per, len(groups)) for groups in keep)
    config = dataclasses.replace(cfg, layer_heads=layer_heads)
    small = LlamaModel(config, device=model.device, dtype=model.dtype)
    d = cfg.head_dim if cfg.head_dim is not None else cfg.d_model // cfg.n_heads
    source = model.state_dict()
    target = dict(source)
    for layer, groups in enumerate(keep):
        kv_rows = torch.cat([torch.arange(j * d, (j + 1) * d) for j in groups])
        q_heads = [j * per + i for j in groups for i in range(per)]
        q_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in q_heads])
        prefix = f"layers.{layer}.attn."
        target[prefix + "q_proj.weight"] = source[prefix + "q_proj.weight"][q_rows]
        target[prefix + "k_proj.weight"] = source[prefix + "k_proj.weight"][kv_rows]
        target[prefix + "v_proj.weight"] = source[prefix + "v_proj.weight"][kv_rows]
        target[prefix + "o_proj.weight"] = source[prefix + "o_proj.weight"][:, q_rows]
    small.load_state_dict(target)
    return small.eval()


def dropped_heads(model: LlamaModel, keep: Sequence[Sequence[int]]) -> list[list[int]]:
    """The query heads of each layer that pruning to ``keep`` removes (for checking against zeroed heads)."""
    g, per = model.config.n_kv_heads, model.config.n_heads // model.config.n_kv_heads
    return [[j * per + i for j in range(g) if j not in groups for i in range(per)] for groups in keep]


def parameters(model: LlamaModel) -> int:
    return sum(p.numel() for p in model.parameters())


def kv_heads(model: LlamaModel) -> list[int]:
    return [block.attn.n_kv_heads for block in model.layers if isinstance(block, LlamaBlock)]
