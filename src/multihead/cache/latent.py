"""LatentCache: the cache of multi-head latent attention (DeepSeek-V2), on the same protocol as the KV caches."""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.cache.base import BaseCache, BaseLayerCache, Slots, check_count, write_slots
from multihead.cache.view import LatentKV
from multihead.errors import MultiheadError


class LatentCache(BaseCache):
    """The cache of multi-head latent attention (DeepSeek-V2): per token, one compressed latent c_KV (kv_lora_rank
    values) and one RoPE key shared by all heads (rope_dim), in one buffer::

        latent   (n_layers, b, max_len, kv_lora_rank + rope_dim)

    against ``2 * n_heads * head_dim`` values per token for MHA. It holds latents, not keys and values, so it is not
    a :class:`~multihead.cache.base.Cache`: the same slots, lengths, overflow, slice and indexed writes and commit as
    :class:`~multihead.cache.full.KVCache`, and its layers' verb is ``update(latents, slots)``
    (:class:`LatentLayer`), read by :class:`multihead.layers.latent.MultiHeadLatentAttention`.
    """

    latent: Tensor

    def __init__(self, *, batch: int, kv_lora_rank: int, rope_dim: int, max_len: int, n_layers: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        check_count("kv_lora_rank", kv_lora_rank, least=1)
        check_count("rope_dim", rope_dim, least=0)
        super().__init__(batch=batch, n_layers=n_layers, max_len=max_len, device=device)
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.register_buffer("latent", torch.zeros(n_layers, batch, max_len, kv_lora_rank + rope_dim, dtype=dtype,
                                                   device=device), persistent=False)
        self.max_len: int = max_len

    @property
    def width(self) -> int:
        """Values per token and layer: kv_lora_rank + rope_dim."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def bytes(self) -> int:
        """n_layers * b * max_len * (kv_lora_rank + rope_dim) * element size."""
        return self.latent.nbytes

    def layer(self, index: int) -> LatentLayer:
        """One layer of this cache (its handle), to pass to ``MultiHeadLatentAttention(..., cache=...)``."""
        self._check_layer(index)
        return LatentLayer(self, index)

    def update(self, layer: int, latents: Tensor, slots: Slots, *, read_only: bool = False) -> LatentKV:
        """Store the latents (b, s, kv_lora_rank + rope_dim) of one layer in the slots reserved; return that layer's
        first ``slots.t`` latents (b, t, kv_lora_rank + rope_dim). ``read_only``: into a copy (``explain``)."""
        b, _, width = latents.shape
        if (b, width) != (self.batch, self.width):
            raise MultiheadError(f"latents of shape {tuple(latents.shape)} do not fit this cache: it holds (b, *, "
                                 f"kv_lora_rank + rope_dim) = {(self.batch, '*', self.width)}")
        self._check_layer(layer)
        store = self.latent.select(0, layer)  # (b, max_len, r + rope)
        if read_only:
            store = store.clone()
        write_slots(slots, 1, (store, latents))
        return LatentKV(store.narrow(1, 0, slots.t))  # (b, t, r + rope)

    def extra_repr(self) -> str:
        return (f"n_layers={self.n_layers}, batch={self.batch}, max_len={self.max_len}, "
                f"kv_lora_rank={self.kv_lora_rank}, rope_dim={self.rope_dim}, dtype={self.latent.dtype}, "
                f"bytes={self.bytes:,}")


class LatentLayer(BaseLayerCache):
    """One layer of a :class:`LatentCache`."""

    cache: LatentCache

    def __init__(self, cache: LatentCache, index: int) -> None:
        super().__init__(cache, index)

    def update(self, latents: Tensor, slots: Slots, *, read_only: bool = False) -> LatentKV:
        """:meth:`LatentCache.update` of this layer."""
        return self.cache.update(self.index, latents, slots, read_only=read_only)
