"""KVCache: static key/value buffers shaped like GQA, written in place at each sequence's own positions.

::

    k, v buffers   (n_layers, b, g, max_len, d)     g = n_kv_heads: the cache is n_kv_heads wide, never n_heads
    lengths        (b,)                              tokens held by each sequence (they may differ)

A decoding step is: ``positions = cache.next_positions(s)`` (raises if s more tokens would overflow), made once by
the model, every layer writes its keys and values at those positions (``cache.write``) and attends to the cache, then
``cache.advance(s)``. Sequences of a batch keep their own lengths, so prompts of different lengths decode together
without left padding: a right-padded prompt is written whole and ``advance(s, lengths=...)`` records the real lengths,
so the next token of each sequence overwrites its first pad slot.

The buffers keep their shapes whatever the lengths, so a compiled decode step sees the same shapes every time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from multihead import cpu
from multihead.errors import MultiheadError


class KVCache(nn.Module):
    """Keys and values of past tokens for ``n_layers`` attention layers."""

    k: Tensor
    v: Tensor
    lengths: Tensor

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
        super().__init__()
        for name, value in (("batch", batch), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                            ("max_len", max_len), ("n_layers", n_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MultiheadError(f"KVCache {name} ({value!r}) must be a positive int")
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)  # (L, b, g, max_len, d)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lengths", torch.zeros(batch, dtype=torch.long, device=device), persistent=False)
        self.max_len = max_len
        self.n_layers = n_layers
        self._used = 0  # the longest sequence, known on the host: overflow is checked without a device sync
        self._uniform = True  # every sequence holds _used tokens (known on the host)

    @property
    def batch(self) -> int:
        return int(self.k.shape[1])

    @property
    def n_kv_heads(self) -> int:
        return int(self.k.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[4])

    @property
    def used(self) -> int:
        """Tokens held by the longest sequence."""
        return self._used

    @property
    def bytes(self) -> int:
        """Bytes of the key and value buffers: 2 * n_layers * b * g * max_len * d * element size."""
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        """Forget every sequence (the buffers are reused, not reallocated)."""
        self.lengths.zero_()
        self._used = 0
        self._uniform = True

    def next_positions(self, s: int) -> Tensor:
        """Positions (b, s) of the next s tokens of each sequence; raises if they would not fit.

        A model calls this once per step and passes the result to every layer (:class:`multihead.attention.Step`).
        """
        self.check_room(s)
        return self.lengths[:, None] + torch.arange(s, device=self.lengths.device)  # (b, s)

    def check_room(self, s: int) -> None:
        """Raise if s more tokens would not fit."""
        if self._used + s > self.max_len:
            raise MultiheadError(
                f"KV cache overflow: {s} more token(s) after {self._used} would need {self._used + s} positions "
                f"but max_len is {self.max_len}: make a cache with a larger max_len, or reset() it"
            )

    def span(self, s: int) -> int:
        """How many slots a layer attends to after writing s more tokens: max_len under torch.compile (fixed
        shapes), else the slots in use (less work for short sequences)."""
        return self.max_len if torch.compiler.is_compiling() else min(self.max_len, self._used + s)

    def slice_start(self) -> int | None:
        """The slot where every sequence continues, when they all hold the same host-known length and the slice
        write is on (:func:`multihead.cpu.slice_cache_write`); else None (writes go by positions)."""
        return self._used if cpu.slice_cache_write(self._uniform) else None

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
              t: int | None = None) -> tuple[Tensor, Tensor]:
        """Store k and v (b, g, s, d) of one layer at positions (b, s); return that layer's keys and values
        (b, g, t, d), t = :meth:`span` unless given.

        ``start`` (from :meth:`slice_start`, for new tokens that continue every sequence at the same length) writes
        them as one slice from that slot instead of by positions.
        """
        b, g, s, d = k.shape
        if (b, g, d) != (self.batch, self.n_kv_heads, self.head_dim):
            raise MultiheadError(
                f"keys of shape {tuple(k.shape)} do not fit this cache: it holds (b, n_kv_heads, *, head_dim) = "
                f"{(self.batch, self.n_kv_heads, '*', self.head_dim)}"
            )
        if not 0 <= layer < self.n_layers:
            raise MultiheadError(f"layer {layer} is out of range for a cache of {self.n_layers} layer(s)")
        t = self.span(s) if t is None else t
        keys, values = self.k.select(0, layer), self.v.select(0, layer)  # (b, g, max_len, d)
        if start is not None:  # one slice of slots, no index arithmetic
            keys.narrow(2, start, s).copy_(k)
            values.narrow(2, start, s).copy_(v)
        elif positions is None:
            raise MultiheadError("a cache write needs the new tokens' positions, or the slot where all continue")
        else:
            _scatter(keys, values, k, v, positions)
        return keys.narrow(2, 0, t), values.narrow(2, 0, t)  # (b, g, t, d)

    def peek(self, layer: int, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
             t: int | None = None) -> tuple[Tensor, Tensor]:
        """What :meth:`write` would return, from copies: the cache itself is left unchanged (for ``explain``)."""
        b, _, s, _ = k.shape
        t = self.span(s) if t is None else t
        if positions is None:
            if start is None:
                raise MultiheadError("a cache read needs the new tokens' positions, or the slot where all continue")
            positions = torch.arange(start, start + s, device=self.k.device).expand(b, s)  # (b, s)
        keys, values = self.k[layer, :, :, :t].clone(), self.v[layer, :, :, :t].clone()  # (b, g, t, d)
        _scatter(keys, values, k, v, positions)
        return keys, values

    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        """Record that s tokens were written for every sequence, or set the real lengths of a padded prefill."""
        if lengths is None:
            self.lengths += s
            self._used += s
            return
        new = torch.as_tensor(lengths, dtype=torch.long)
        if new.shape != (self.batch,):
            raise MultiheadError(f"lengths of shape {tuple(new.shape)} must be (b,) = ({self.batch},)")
        longest = int(new.max())
        if longest > self._used + s or int(new.min()) < 0:
            raise MultiheadError(
                f"lengths {new.tolist()} must lie between 0 and the {self._used + s} positions written"
            )
        self.lengths.copy_(new.to(self.lengths.device))
        self._used = longest
        self._uniform = int(new.min()) == longest

    def layer(self, index: int) -> LayerCache:
        """A view of one layer of this cache, to pass to ``MultiHeadAttention(..., cache=...)``."""
        if not 0 <= index < self.n_layers:
            raise MultiheadError(f"layer {index} is out of range for a cache of {self.n_layers} layer(s)")
        return LayerCache(self, index)

    def extra_repr(self) -> str:
        return (f"n_layers={self.n_layers}, batch={self.batch}, n_kv_heads={self.n_kv_heads}, "
                f"max_len={self.max_len}, head_dim={self.head_dim}, dtype={self.k.dtype}, bytes={self.bytes:,}")


def _scatter(keys: Tensor, values: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> None:
    """Write k and v (b, g, s, d) into keys and values (b, g, T, d) at each sequence's positions (b, s)."""
    rows = torch.arange(k.shape[0], device=positions.device)[:, None]  # (b, 1)
    keys.transpose(1, 2)[rows, positions] = k.transpose(1, 2).to(keys.dtype)  # (b, s, g, d) slots
    values.transpose(1, 2)[rows, positions] = v.transpose(1, 2).to(values.dtype)


class LayerCache:
    """One layer of a :class:`KVCache`."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache = cache
        self.index = index

    def write(self, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
              t: int | None = None) -> tuple[Tensor, Tensor]:
        return self.cache.write(self.index, k, v, positions, start=start, t=t)

    def peek(self, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
             t: int | None = None) -> tuple[Tensor, Tensor]:
        return self.cache.peek(self.index, k, v, positions, start=start, t=t)
