"""KVCache: static key/value buffers shaped like GQA, written in place at each sequence's own positions.

::

    k, v buffers   (n_layers, b, g, max_len, d)     g = n_kv_heads: the cache is n_kv_heads wide, never n_heads
    lengths        (b,)                              tokens held by each sequence (they may differ)

Sequences of a batch keep their own lengths, so prompts of different lengths decode together without left padding:
a right-padded prompt is written whole and ``advance(s, lengths=...)`` records the real lengths, so the next token of
each sequence overwrites its first pad slot. The buffers keep their shapes whatever the lengths, so a compiled decode
step sees the same shapes every time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.cache.base import Cache, Slots, write_slots
from multihead.cache.view import DenseKV


class KVCache(Cache):
    """Keys and values of past tokens for ``n_layers`` attention layers, in full, at their positions.

    :meth:`update` writes a step's tokens into their slots at once (from each sequence's length on: room the lengths
    do not count until :meth:`advance`) and returns the layer's first t slots (a :class:`~.view.DenseKV`).
    """

    k: Tensor
    v: Tensor

    def __init__(
        self,
        *,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        n_layers: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(batch=batch, n_kv_heads=n_kv_heads, head_dim=head_dim, n_layers=n_layers, max_len=max_len,
                         device=device)
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)  # (L, b, g, max_len, d)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.max_len: int = max_len

    @property
    def bytes(self) -> int:
        """Bytes of the key and value buffers: 2 * n_layers * b * g * max_len * d * element size."""
        return self.k.nbytes + self.v.nbytes

    def update(self, layer: int, k: Tensor, v: Tensor, slots: Slots, *, read_only: bool = False) -> DenseKV:
        """Store k and v (b, g, s, d) of one layer in the slots reserved; return the layer's first ``slots.t``
        slots (b, g, t, d). ``read_only``: into a copy of the layer's buffers."""
        self._check_keys(layer, k)
        keys, values = self.k.select(0, layer), self.v.select(0, layer)  # (b, g, max_len, d)
        if read_only:
            keys, values = keys.clone(), values.clone()
        write_slots(slots, 2, (keys, k), (values, v))
        return DenseKV(keys.narrow(2, 0, slots.t), values.narrow(2, 0, slots.t))  # (b, g, t, d)

    def extra_repr(self) -> str:
        return (f"n_layers={self.n_layers}, batch={self.batch}, n_kv_heads={self.n_kv_heads}, "
                f"max_len={self.max_len}, head_dim={self.head_dim}, dtype={self.k.dtype}, bytes={self.bytes:,}")
