"""What a cache layer's ``update`` returns: a view of the keys and values one call attends to, in the form the store
holds them. A view is data: it says what the kernel needs and nothing about how to compute
(:func:`multihead.kernels.attend` decides that, and :func:`multihead.kernels.explain` says so).

::

    DenseKV(keys, values)                 (b, g, t, d), (b, g, t, dv): every key a tensor row (full, sink, uncached)
    QuantizedKV(codes.., tail_k, tail_v)  n quantized tokens as codes + scales + minimums, then m full-precision
                                          ones (the residual and the step's own): t = n + m
    GroupedKV(groups, order)              a head-wise layer: each group of KV heads its own DenseKV and mask;
                                          ``order`` puts [group 0's heads, group 1's, ..] back in head order
    LatentKV(latents, up, nope, path)     multi-head latent attention's (b, t, kv_lora_rank + rope_dim), with the
                                          layer's up-projection (the cache gives the latents, the layer the rest)

Query head i reads KV head i // (h / g) of the layer, in every kind. Views are made once a layer a step and only
read (plain slotted dataclasses: a frozen one costs ~1 us more to make, on every layer of every step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.layers.masks import MaskSpec


@dataclass(slots=True)
class DenseKV:
    """Keys (b, g, t, d) and values (b, g, t, dv), one row a key: what every kernel takes as it is."""

    keys: Tensor
    values: Tensor

    @property
    def t(self) -> int:
        return int(self.keys.shape[2])

    @property
    def n_kv_heads(self) -> int:
        return int(self.keys.shape[1])


@dataclass(slots=True)
class QuantizedKV:
    """A low-bit store (:mod:`multihead.quant`) and its full-precision tail, as one layer holds them.

    The first ``n`` tokens are codes (a multiple of ``group``): ``codes_k``, ``codes_v`` (b, g, >= n, d * bits / 8)
    uint8; ``scale_k``, ``min_k`` (b, g, >= n / group, d) float16, keys per channel over groups of ``group``
    tokens; ``scale_v``, ``min_v`` (b, g, >= n, d / group) float16, values per token over groups of ``group``
    channels. Then ``tail_k``, ``tail_v`` (b, g, m, d): the residual tokens and the step's own, t = n + m keys in
    all, in the cache's ``dtype`` (a decode step's: a view of the store's residual buffer, rows contiguous). The
    code buffers are the store's own (rows contiguous), never copies.
    """

    bits: int
    group: int
    n: int
    codes_k: Tensor
    scale_k: Tensor
    min_k: Tensor
    codes_v: Tensor
    scale_v: Tensor
    min_v: Tensor
    tail_k: Tensor
    tail_v: Tensor
    dtype: torch.dtype

    @property
    def t(self) -> int:
        return self.n + int(self.tail_k.shape[2])

    @property
    def n_kv_heads(self) -> int:
        return int(self.tail_k.shape[1])


@dataclass(slots=True)
class KVGroup:
    """One group of a head-wise layer's KV heads: its keys and values, which KV heads they are ((n,) long, in
    order; None when the group is the whole layer) and ``mask``, which of its keys each query sees (full heads:
    causal by position; streaming heads: their sinks and window), made once a step by the cache and shared by every
    layer's group of that kind. ``first``: the first of ``heads`` when they are a run of consecutive KV heads (the
    kernels then take the group's queries as a view, not a copy), else None."""

    kv: DenseKV
    heads: Tensor | None
    mask: MaskSpec
    first: int | None = None


@dataclass(slots=True)
class GroupedKV:
    """A layer whose KV heads hold different numbers of keys (:class:`~multihead.cache.HeadwiseCache`): one
    :class:`KVGroup` per kind of KV head present, and ``order``, the permutation that puts the groups' heads
    ([group 0's, group 1's, ..], by KV head) back in head order (None for one group)."""

    groups: tuple[KVGroup, ...]
    order: Tensor | None
    n_kv_heads: int


@dataclass(slots=True)
class LatentKV:
    """Multi-head latent attention's keys and values as one layer holds them: ``latents`` (b, t, kv_lora_rank +
    rope_dim), the compressed keys and values and the one RoPE key all heads share
    (:class:`~multihead.cache.LatentCache`'s update gives these alone); for the kernels, the layer adds ``up`` (h,
    nope + dv, kv_lora_rank), its per-head up-projection [W_UK^i; W_UV^i] (a view of kv_b_proj's weight), ``nope``
    (the rows of W_UK in it, the query's non-RoPE width) and ``path`` ("auto", "expanded" or "absorbed": which of
    the two equal computations runs, :func:`multihead.kernels.attend` deciding "auto")."""

    latents: Tensor
    up: Tensor | None = None
    nope: int = 0
    path: str = "auto"

    @property
    def t(self) -> int:
        return int(self.latents.shape[1])

    @property
    def n_kv_heads(self) -> int:
        """One: every query head reads the one latent (the expanded path makes a key head per query head of it)."""
        return 1


KVView = DenseKV | QuantizedKV | GroupedKV | LatentKV
