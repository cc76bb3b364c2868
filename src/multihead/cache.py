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

from collections.abc import Mapping, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from multihead import cpu
from multihead.errors import MultiheadError


class Cache(nn.Module):
    """What every cache kind shares: per-sequence lengths, the host-known longest length, overflow checks, layers.

    A kind stores keys and values its own way (:class:`KVCache` in full, :class:`SinkCache` as attention sinks plus
    a sliding window, :class:`QuantizedKVCache` as low-bit codes); a layer reads and writes any of them through
    :meth:`write` and :meth:`peek`. ``positional`` is True when slot j holds position j of every sequence (the
    causal mask by positions is right); a kind that evicts tokens says which keys each query sees (:meth:`keep`).
    """

    lengths: Tensor
    positional = True

    def __init__(self, *, batch: int, n_kv_heads: int, head_dim: int, n_layers: int, max_len: int | None,
                 device: torch.device | str | None) -> None:
        super().__init__()
        for name, value in (("batch", batch), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                            ("n_layers", n_layers)) + ((("max_len", max_len),) if max_len is not None else ()):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MultiheadError(f"{type(self).__name__} {name} ({value!r}) must be a positive int")
        self.register_buffer("lengths", torch.zeros(batch, dtype=torch.long, device=device), persistent=False)
        self.max_len = max_len
        self.n_layers = n_layers
        self._batch, self._n_kv_heads, self._head_dim = batch, n_kv_heads, head_dim
        self._used = 0  # the longest sequence, known on the host: overflow is checked without a device sync
        self._uniform = True  # every sequence holds _used tokens (known on the host)

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def n_kv_heads(self) -> int:
        return self._n_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def used(self) -> int:
        """Tokens held by the longest sequence."""
        return self._used

    @property
    def bytes(self) -> int:
        """Bytes of the tensors that hold keys and values (what :mod:`multihead.cost` predicts for this kind)."""
        raise NotImplementedError

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
        if self.max_len is not None and self._used + s > self.max_len:
            raise MultiheadError(
                f"KV cache overflow: {s} more token(s) after {self._used} would need {self._used + s} positions "
                f"but max_len is {self.max_len}: make a cache with a larger max_len, or reset() it"
            )

    def span(self, s: int) -> int:
        """How many keys a layer attends to after writing s more tokens."""
        raise NotImplementedError

    def slice_start(self) -> int | None:
        """The slot where every sequence continues, when they all hold the same host-known length and the slice
        write is on (:func:`multihead.cpu.slice_cache_write`); else None (writes go by positions)."""
        return self._used if cpu.slice_cache_write(self._uniform) else None

    def keep(self, q_positions: Tensor, s: int, *, window: int | None = None) -> Tensor | None:
        """For a kind that is not positional: which of the :meth:`span` keys each query (b|1, s) may see, as a
        (b|1, 1, s, t) bool mask, or None when every query sees every key."""
        raise NotImplementedError

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
              t: int | None = None) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def peek(self, layer: int, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
             t: int | None = None) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        """Record that s tokens were written for every sequence, or set the real lengths of a padded prefill."""
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise MultiheadError(f"advance takes a non-negative number of tokens, got {s!r}")
        if lengths is None:
            self.check_room(s)
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

    def layer_kv_heads(self, index: int) -> int:
        """KV heads of one layer (the same for every layer except in a :class:`LayeredCache`)."""
        return self.n_kv_heads

    def _check_keys(self, layer: int, k: Tensor) -> None:
        b, g, _, d = k.shape
        if (b, g, d) != (self.batch, self.n_kv_heads, self.head_dim):
            raise MultiheadError(
                f"keys of shape {tuple(k.shape)} do not fit this cache: it holds (b, n_kv_heads, *, head_dim) = "
                f"{(self.batch, self.n_kv_heads, '*', self.head_dim)}"
            )
        if not 0 <= layer < self.n_layers:
            raise MultiheadError(f"layer {layer} is out of range for a cache of {self.n_layers} layer(s)")


class KVCache(Cache):
    """Keys and values of past tokens for ``n_layers`` attention layers, in full, at their positions."""

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

    def span(self, s: int) -> int:
        """How many slots a layer attends to after writing s more tokens: max_len under torch.compile (fixed
        shapes), else the slots in use (less work for short sequences)."""
        return self.max_len if torch.compiler.is_compiling() else min(self.max_len, self._used + s)

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
              t: int | None = None) -> tuple[Tensor, Tensor]:
        """Store k and v (b, g, s, d) of one layer at positions (b, s); return that layer's keys and values
        (b, g, t, d), t = :meth:`span` unless given.

        ``start`` (from :meth:`slice_start`, for new tokens that continue every sequence at the same length) writes
        them as one slice from that slot instead of by positions.
        """
        self._check_keys(layer, k)
        s = k.shape[2]
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

    def extra_repr(self) -> str:
        return (f"n_layers={self.n_layers}, batch={self.batch}, n_kv_heads={self.n_kv_heads}, "
                f"max_len={self.max_len}, head_dim={self.head_dim}, dtype={self.k.dtype}, bytes={self.bytes:,}")


def _scatter(keys: Tensor, values: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> None:
    """Write k and v (b, g, s, d) into keys and values (b, g, T, d) at each sequence's positions (b, s)."""
    rows = torch.arange(k.shape[0], device=positions.device)[:, None]  # (b, 1)
    keys.transpose(1, 2)[rows, positions] = k.transpose(1, 2).to(keys.dtype)  # (b, s, g, d) slots
    values.transpose(1, 2)[rows, positions] = v.transpose(1, 2).to(values.dtype)


class LayerCache:
    """One layer of a cache."""

    def __init__(self, cache: Cache, index: int) -> None:
        self.cache = cache
        self.index = index

    @property
    def n_kv_heads(self) -> int:
        return self.cache.layer_kv_heads(self.index)

    @property
    def head_dim(self) -> int:
        return self.cache.head_dim

    def write(self, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
              t: int | None = None) -> tuple[Tensor, Tensor]:
        return self.cache.write(self.index, k, v, positions, start=start, t=t)

    def peek(self, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
             t: int | None = None) -> tuple[Tensor, Tensor]:
        return self.cache.peek(self.index, k, v, positions, start=start, t=t)


# ---------------------------------------------------------------------------------------------- attention sinks
def _check_count(name: str, value: object, *, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise MultiheadError(f"{name} ({value!r}) must be an int of at least {least}")
    return value


class SinkCache(Cache):
    """Attention sinks plus a sliding window (StreamingLLM, Xiao et al. 2023), at constant memory.

    Each layer keeps the first ``sink_tokens`` tokens of every sequence and the last ``window - 1`` ones, in
    ``sink_tokens + window - 1`` slots; a query at position p sees the sinks and the keys in ``(p - window, p]``
    (itself included)::

        sees(p, j) = j <= p and (j > p - window or j < sink_tokens)

    ``sink_tokens=0`` is a plain sliding window (the cache StreamingLLM shows failing once the first tokens leave
    it). Keys keep the positions they had in the text (RoPE is applied before they are cached), so this equals
    the uncached model under the mask above (:func:`sink_keep`), token for token. The sequences of a batch hold one
    length (prompts of different lengths: one cache each). The new tokens of a step are held beside the slots until
    :meth:`advance`, so a chunk of many tokens attends exactly as one token at a time would.
    """

    positional = False
    k: Tensor
    v: Tensor
    slot_positions: Tensor

    def __init__(self, *, batch: int, n_kv_heads: int, head_dim: int, window: int, sink_tokens: int = 4,
                 n_layers: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__(batch=batch, n_kv_heads=n_kv_heads, head_dim=head_dim, n_layers=n_layers, max_len=None,
                         device=device)
        self.window = _check_count("window", window, least=1)
        self.sink_tokens = _check_count("sink_tokens", sink_tokens, least=0)
        if sink_tokens > window:
            raise MultiheadError(f"sink_tokens ({sink_tokens}) must not exceed the window ({window}): the sinks are "
                                 "a few first tokens kept beside a longer window")
        slots = sink_tokens + window - 1  # a new token joins them: it sees the sinks and the last `window` keys
        shape = (n_layers, batch, n_kv_heads, slots, head_dim)  # (L, b, g, slots, d)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # the text position each slot holds (-1: empty); slots fill in order, so the held ones are a prefix
        self.register_buffer("slot_positions", torch.full((slots,), -1, dtype=torch.long, device=device),
                             persistent=False)
        self._held = 0
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}

    @property
    def slots(self) -> int:
        """Tokens held between steps: the sinks and the ``window - 1`` keys before the next token."""
        return self.sink_tokens + self.window - 1

    @property
    def bytes(self) -> int:
        """Bytes of the key and value slots: 2 * n_layers * b * g * (sink_tokens + window - 1) * d * element size."""
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        super().reset()
        self.slot_positions.fill_(-1)
        self._held = 0
        self._pending.clear()

    def span(self, s: int) -> int:
        return self._held + s

    def slice_start(self) -> int | None:
        return None

    def keep(self, q_positions: Tensor, s: int, *, window: int | None = None) -> Tensor | None:
        w = self.window if window is None else min(window, self.window)
        if s == 1 and w == self.window:
            return None  # one new token sees every held slot: the slots are exactly its sinks and window
        new = q_positions[0]  # (s,): the sequences hold one length
        keys = torch.cat([self.slot_positions[:self._held], new])  # (t,)
        return sink_keep(new, keys, window=w, sink_tokens=self.sink_tokens)[None, None]  # (1, 1, s, t)

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
              t: int | None = None) -> tuple[Tensor, Tensor]:
        keys, values = self.peek(layer, k, v, positions, start=start, t=t)
        self._pending[layer] = (k, v)
        return keys, values

    def peek(self, layer: int, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
             t: int | None = None) -> tuple[Tensor, Tensor]:
        self._check_keys(layer, k)
        held = self._held
        keys = torch.cat([self.k[layer, :, :, :held], k.to(self.k.dtype)], dim=2)  # (b, g, held + s, d)
        values = torch.cat([self.v[layer, :, :, :held], v.to(self.v.dtype)], dim=2)
        return keys, values

    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        """Keep the sinks and the last ``window`` tokens of what the layers wrote this step; evict the rest."""
        _check_step(self, s, lengths, self._pending)
        first, ring = self._used, self.window - 1
        kept = [(i, p) for i, p in enumerate(range(first, first + s))
                if p < self.sink_tokens or (ring and p >= first + s - ring)]
        if kept:
            device = self.k.device
            index = torch.tensor([i for i, _ in kept], device=device)
            slots = torch.tensor([self._slot(p) for _, p in kept], device=device)
            for layer, (k, v) in self._pending.items():
                self.k[layer].index_copy_(2, slots, k.index_select(2, index).to(self.k.dtype))
                self.v[layer].index_copy_(2, slots, v.index_select(2, index).to(self.v.dtype))
            self.slot_positions.index_copy_(0, slots, torch.tensor([p for _, p in kept], device=device))
        self._pending.clear()
        self._held = min(self._used + s, self.slots)
        super().advance(s)

    def _slot(self, p: int) -> int:
        """Slot of position p: the sinks in order, then a ring of ``window - 1`` slots."""
        if p < self.sink_tokens:
            return p
        return self.sink_tokens + (p - self.sink_tokens) % (self.window - 1)

    def extra_repr(self) -> str:
        return (f"n_layers={self.n_layers}, batch={self.batch}, n_kv_heads={self.n_kv_heads}, "
                f"sink_tokens={self.sink_tokens}, window={self.window}, head_dim={self.head_dim}, "
                f"dtype={self.k.dtype}, bytes={self.bytes:,}")


def sink_keep(q_positions: Tensor, k_positions: Tensor, *, window: int, sink_tokens: int) -> Tensor:
    """(s, t) bool: query at position p may see the key at position j iff j <= p and (j > p - window or
    j < sink_tokens). With k_positions = q_positions = 0..n-1 it is the uncached model's mask for a
    :class:`SinkCache`."""
    q = q_positions[:, None]  # (s, 1)
    j = k_positions[None, :]  # (1, t)
    return (j <= q) & ((j > q - window) | (j < sink_tokens)) & (j >= 0)


def _check_step(cache: Cache, s: int, lengths: Sequence[int] | Tensor | None, pending: Mapping[int, object]) -> None:
    """Before a cache that holds a step's writes until advance commits them: one length, every layer written."""
    _check_uniform(cache, s, lengths)
    missing = [i for i in range(cache.n_layers) if i not in pending]
    if s and missing:
        raise MultiheadError(f"advance({s}) but layer(s) {missing} wrote nothing this step: every layer of the "
                             "cache must run before it advances")


def _check_uniform(cache: Cache, s: int, lengths: Sequence[int] | Tensor | None) -> None:
    if lengths is None:
        return
    new = torch.as_tensor(lengths, dtype=torch.long).flatten()
    if new.numel() and bool((new != cache.used + s).any()):
        raise MultiheadError(f"a {type(cache).__name__} holds sequences of one length: lengths {new.tolist()} differ "
                             f"from the {cache.used + s} positions written (decode prompts of other lengths with a "
                             "cache each, or a KVCache)")


# ---------------------------------------------------------------------------------------------- quantization
QUANT_BITS = (2, 4, 8)


def check_bits(bits: object) -> int:
    if bits not in QUANT_BITS or isinstance(bits, bool):
        raise MultiheadError(f"bits ({bits!r}) is not a supported cache width: choose one of "
                             f"{', '.join(map(str, QUANT_BITS))}")
    return int(bits)  # type: ignore[call-overload,unused-ignore]


def quantize(x: Tensor, bits: int, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric min-max quantization of x over ``dim``: codes in [0, 2^bits - 1] (uint8, one per element),
    and the group's scale and minimum (float16, size 1 along ``dim``): x ~ codes * scale + minimum."""
    levels = (1 << check_bits(bits)) - 1
    x32 = x.float()
    lo = x32.amin(dim=dim, keepdim=True).to(torch.float16)
    hi = x32.amax(dim=dim, keepdim=True)
    scale = ((hi - lo.float()) / levels).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: any scale, codes 0
    codes = torch.round((x32 - lo.float()) / scale.float()).clamp_(0, levels).to(torch.uint8)
    return codes, scale, lo


def dequantize(codes: Tensor, scale: Tensor, lo: Tensor, dtype: torch.dtype) -> Tensor:
    return (codes.float() * scale.float() + lo.float()).to(dtype)


def pack(codes: Tensor, bits: int) -> Tensor:
    """Codes (.., n) of ``bits`` bits each -> bytes (.., n * bits / 8), low bits first."""
    per = 8 // bits
    if per == 1:
        return codes
    c = codes.unflatten(-1, (-1, per))  # (.., n / per, per)
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    out: Tensor = (c << shifts).sum(-1, dtype=torch.uint8)
    return out


def unpack(packed: Tensor, bits: int) -> Tensor:
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def fake_quantize_keys(k: Tensor, bits: int, group: int) -> Tensor:
    """Keys (.., n, d) quantized per channel over groups of ``group`` tokens and dequantized (a last partial group
    is quantized on its own)."""
    n = k.shape[-2]
    short = -n % group
    padded = torch.cat([k, k[..., -1:, :].expand(*k.shape[:-2], short, k.shape[-1])], dim=-2) if short else k
    g = padded.unflatten(-2, (-1, group))  # (.., n / group, group, d): the repeated last token moves no min or max
    return dequantize(*quantize(g, bits, dim=-2), k.dtype).flatten(-3, -2)[..., :n, :]


def fake_quantize_values(v: Tensor, bits: int, group: int) -> Tensor:
    """Values (.., n, d) quantized per token over groups of ``group`` channels and dequantized (d % group == 0)."""
    g = v.unflatten(-1, (-1, group))  # (.., n, d / group, group)
    return dequantize(*quantize(g, bits, dim=-1), v.dtype).flatten(-2)


class QuantizedKVCache(Cache):
    """Keys and values stored in ``bits`` (8, 4 or 2) bits, as KIVI (Liu et al. 2024) stores them: keys per
    channel over groups of ``group`` tokens, values per token over groups of ``group`` channels, and the last
    ``residual`` to ``residual + group - 1`` tokens in full precision until a whole group of older tokens can be
    quantized. Read back dequantised, so every kernel runs unchanged.

    ::

        codes          (L, b, g, max_len, d * bits / 8)  uint8, keys and values
        key scales     (L, b, g, max_len / group, d)     float16 scale and minimum per channel per token group
        value scales   (L, b, g, max_len, d / group)     float16 scale and minimum per token per channel group
        residual       (L, b, g, residual + group, d)    the cache's dtype, keys and values

    The sequences of a batch hold one length. A step's own tokens are attended in full precision; they are
    quantized at :meth:`advance` once ``residual + group`` or more wait. This equals the uncached model whose keys
    and values before ``quantized_tokens(p)`` are replaced by their quantized copies (:func:`fake_quantize_keys`).
    """

    codes_k: Tensor
    codes_v: Tensor
    scale_k: Tensor
    min_k: Tensor
    scale_v: Tensor
    min_v: Tensor
    res_k: Tensor
    res_v: Tensor

    def __init__(self, *, batch: int, n_kv_heads: int, head_dim: int, max_len: int, bits: int = 4,
                 group: int = 32, residual: int = 128, n_layers: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__(batch=batch, n_kv_heads=n_kv_heads, head_dim=head_dim, n_layers=n_layers, max_len=max_len,
                         device=device)
        self.bits = check_bits(bits)
        self.group = _check_count("group", group, least=1)
        self.residual = _check_count("residual", residual, least=0)
        if head_dim % group:
            raise MultiheadError(f"group ({group}) must divide head_dim ({head_dim}): values are quantized per token "
                                 "over groups of that many channels")
        if (head_dim * self.bits) % 8:
            raise MultiheadError(f"head_dim ({head_dim}) * bits ({bits}) must fill whole bytes")
        lead = (n_layers, batch, n_kv_heads)
        f16: dict[str, object] = {"dtype": torch.float16, "device": device}
        packed = head_dim * self.bits // 8
        for name, shape, kw in (
            ("codes_k", (*lead, max_len, packed), {"dtype": torch.uint8, "device": device}),
            ("codes_v", (*lead, max_len, packed), {"dtype": torch.uint8, "device": device}),
            ("scale_k", (*lead, -(-max_len // group), head_dim), f16),
            ("min_k", (*lead, -(-max_len // group), head_dim), f16),
            ("scale_v", (*lead, max_len, head_dim // group), f16),
            ("min_v", (*lead, max_len, head_dim // group), f16),
            ("res_k", (*lead, residual + group, head_dim), {"dtype": dtype, "device": device}),
            ("res_v", (*lead, residual + group, head_dim), {"dtype": dtype, "device": device}),
        ):
            self.register_buffer(name, torch.zeros(shape, **kw), persistent=False)  # type: ignore[arg-type,unused-ignore]
        self.max_len: int = max_len
        self._quantized = 0  # tokens of every sequence held as codes (a multiple of group)
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}

    @property
    def quantized(self) -> int:
        return self._quantized

    @property
    def bytes(self) -> int:
        """Bytes of the codes, the scales and minimums and the full-precision residual buffers."""
        return sum(buf.nbytes for _, buf in self.named_buffers() if buf is not self.lengths)

    def reset(self) -> None:
        super().reset()
        self._quantized = 0
        self._pending.clear()

    def span(self, s: int) -> int:
        return self._used + s

    def slice_start(self) -> int | None:
        return None  # the write goes through the residual, never by slot

    def quantized_tokens(self, used: int) -> int:
        """How many of ``used`` held tokens are quantized: whole groups, leaving ``residual`` or more in full."""
        return quantized_tokens(used, group=self.group, residual=self.residual)

    def _read(self, layer: int) -> tuple[Tensor, Tensor]:
        n, dtype = self._quantized, self.res_k.dtype
        if n == 0:
            empty = self.res_k[layer, :, :, :0]
            return empty, empty
        codes_k = unpack(self.codes_k[layer, :, :, :n], self.bits).unflatten(-2, (-1, self.group))  # (b,g,n/G,G,d)
        keys = dequantize(codes_k, self.scale_k[layer, :, :, :n // self.group, None],
                          self.min_k[layer, :, :, :n // self.group, None], dtype).flatten(-3, -2)  # (b, g, n, d)
        codes_v = unpack(self.codes_v[layer, :, :, :n], self.bits).unflatten(-1, (-1, self.group))  # (b,g,n,d/G,G)
        values = dequantize(codes_v, self.scale_v[layer, :, :, :n, :, None], self.min_v[layer, :, :, :n, :, None],
                            dtype).flatten(-2)  # (b, g, n, d)
        return keys, values

    def peek(self, layer: int, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
             t: int | None = None) -> tuple[Tensor, Tensor]:
        self._check_keys(layer, k)
        old_k, old_v = self._read(layer)
        r = self._used - self._quantized
        keys = torch.cat([old_k, self.res_k[layer, :, :, :r], k.to(self.res_k.dtype)], dim=2)  # (b, g, used + s, d)
        values = torch.cat([old_v, self.res_v[layer, :, :, :r], v.to(self.res_v.dtype)], dim=2)
        return keys, values

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
              t: int | None = None) -> tuple[Tensor, Tensor]:
        self.check_room(k.shape[2])
        keys, values = self.peek(layer, k, v, positions, start=start, t=t)
        self._pending[layer] = (keys[:, :, self._quantized:], values[:, :, self._quantized:])  # the full tail
        return keys, values

    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        """Quantize the whole groups that left the residual window; keep the rest in full precision."""
        _check_step(self, s, lengths, self._pending)
        self.check_room(s)
        n0, n1 = self._quantized, self.quantized_tokens(self._used + s)
        g0, g1 = n0 // self.group, n1 // self.group
        for layer, (tail_k, tail_v) in self._pending.items():
            new = n1 - n0
            if new:
                ck, sk, mk = quantize(tail_k[:, :, :new].unflatten(-2, (-1, self.group)), self.bits, dim=-2)
                self.codes_k[layer, :, :, n0:n1] = pack(ck.flatten(-3, -2), self.bits)
                self.scale_k[layer, :, :, g0:g1] = sk.squeeze(-2)
                self.min_k[layer, :, :, g0:g1] = mk.squeeze(-2)
                cv, sv, mv = quantize(tail_v[:, :, :new].unflatten(-1, (-1, self.group)), self.bits, dim=-1)
                self.codes_v[layer, :, :, n0:n1] = pack(cv.flatten(-2), self.bits)
                self.scale_v[layer, :, :, n0:n1] = sv.squeeze(-1)
                self.min_v[layer, :, :, n0:n1] = mv.squeeze(-1)
            rest = tail_k.shape[2] - new
            self.res_k[layer, :, :, :rest] = tail_k[:, :, new:]
            self.res_v[layer, :, :, :rest] = tail_v[:, :, new:]
        self._pending.clear()
        self._quantized = n1
        super().advance(s)

    def extra_repr(self) -> str:
        return (f"n_layers={self.n_layers}, batch={self.batch}, n_kv_heads={self.n_kv_heads}, max_len={self.max_len}, "
                f"head_dim={self.head_dim}, bits={self.bits}, group={self.group}, residual={self.residual}, "
                f"bytes={self.bytes:,}")


def quantized_tokens(used: int, *, group: int, residual: int) -> int:
    """Tokens a :class:`QuantizedKVCache` holds as codes after ``used`` tokens: the most whole groups that leave
    at least ``residual`` tokens in full precision."""
    return max(0, (used - residual) // group) * group


# ---------------------------------------------------------------------------------------------- layers of other widths
class LayeredCache(Cache):
    """One single-layer cache per layer, for models whose layers hold different numbers of KV heads (a pruned model):
    every part is the same kind and advances together, so positions, masks and spans come from the first."""

    def __init__(self, parts: Sequence[Cache]) -> None:
        parts = list(parts)
        if not parts or any(not isinstance(p, Cache) or p.n_layers != 1 for p in parts):
            raise MultiheadError("a LayeredCache takes one single-layer cache per layer")
        first = parts[0]
        if any(type(p) is not type(first) or p.batch != first.batch or p.head_dim != first.head_dim for p in parts):
            raise MultiheadError("the parts of a LayeredCache must be of one kind, batch and head_dim")
        super().__init__(batch=first.batch, n_kv_heads=first.n_kv_heads, head_dim=first.head_dim,
                         n_layers=len(parts), max_len=first.max_len, device=first.lengths.device)
        self.parts = nn.ModuleList(parts)
        self.positional = first.positional

    def _part(self, index: int) -> Cache:
        return cast(Cache, self.parts[index])

    @property
    def bytes(self) -> int:
        return sum(self._part(i).bytes for i in range(self.n_layers))

    def layer_kv_heads(self, index: int) -> int:
        return self._part(index).n_kv_heads

    def reset(self) -> None:
        super().reset()
        for i in range(self.n_layers):
            self._part(i).reset()

    def next_positions(self, s: int) -> Tensor:
        return self._part(0).next_positions(s)

    def check_room(self, s: int) -> None:
        self._part(0).check_room(s)

    def span(self, s: int) -> int:
        return self._part(0).span(s)

    def slice_start(self) -> int | None:
        return self._part(0).slice_start()

    def keep(self, q_positions: Tensor, s: int, *, window: int | None = None) -> Tensor | None:
        return self._part(0).keep(q_positions, s, window=window)

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
              t: int | None = None) -> tuple[Tensor, Tensor]:
        if not 0 <= layer < self.n_layers:
            raise MultiheadError(f"layer {layer} is out of range for a cache of {self.n_layers} layer(s)")
        return self._part(layer).write(0, k, v, positions, start=start, t=t)

    def peek(self, layer: int, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
             t: int | None = None) -> tuple[Tensor, Tensor]:
        return self._part(layer).peek(0, k, v, positions, start=start, t=t)

    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        for i in range(self.n_layers):
            self._part(i).advance(s, lengths=lengths)
        first = self._part(0)
        self.lengths.copy_(first.lengths)
        self._used, self._uniform = first._used, first._uniform


# ---------------------------------------------------------------------------------------------- latents (MLA)
class LatentCache(Cache):
    """The cache of multi-head latent attention (DeepSeek-V2): per token, one compressed latent c_KV (kv_lora_rank
    values) and one RoPE key shared by all heads (rope_dim), in one buffer::

        latent   (n_layers, b, max_len, kv_lora_rank + rope_dim)

    against ``2 * n_heads * head_dim`` values per token for MHA. Per-sequence lengths, overflow and slice writes as
    :class:`KVCache`. Only :class:`multihead.latent.MultiHeadLatentAttention` reads and writes it.
    """

    latent: Tensor

    def __init__(self, *, batch: int, kv_lora_rank: int, rope_dim: int, max_len: int, n_layers: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        _check_count("kv_lora_rank", kv_lora_rank, least=1)
        _check_count("rope_dim", rope_dim, least=0)
        super().__init__(batch=batch, n_kv_heads=1, head_dim=kv_lora_rank + rope_dim, n_layers=n_layers,
                         max_len=max_len, device=device)
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.register_buffer("latent", torch.zeros(n_layers, batch, max_len, kv_lora_rank + rope_dim, dtype=dtype,
                                                   device=device), persistent=False)
        self.max_len: int = max_len

    @property
    def bytes(self) -> int:
        """n_layers * b * max_len * (kv_lora_rank + rope_dim) * element size."""
        return self.latent.nbytes

    def span(self, s: int) -> int:
        return self.max_len if torch.compiler.is_compiling() else min(self.max_len, self._used + s)

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor | None, *, start: int | None = None,
              t: int | None = None) -> tuple[Tensor, Tensor]:
        raise MultiheadError("a LatentCache holds the latents of multi-head latent attention: use it with "
                             "MultiHeadLatentAttention, and a KVCache (model.new_cache) with MultiHeadAttention")

    peek = write

    def write_latent(self, layer: int, c: Tensor, positions: Tensor | None, *, start: int | None = None,
                     t: int | None = None, copy: bool = False) -> Tensor:
        """Store the latents c (b, s, kv_lora_rank + rope_dim) of one layer at positions (b, s) (or from slot
        ``start``); return that layer's latents (b, t, kv_lora_rank + rope_dim). ``copy=True`` leaves the cache
        unchanged (for ``explain``)."""
        b, s, width = c.shape
        if (b, width) != (self.batch, self.head_dim):
            raise MultiheadError(f"latents of shape {tuple(c.shape)} do not fit this cache: it holds (b, *, "
                                 f"kv_lora_rank + rope_dim) = {(self.batch, '*', self.head_dim)}")
        if not 0 <= layer < self.n_layers:
            raise MultiheadError(f"layer {layer} is out of range for a cache of {self.n_layers} layer(s)")
        t = self.span(s) if t is None else t
        store = self.latent[layer]  # (b, max_len, r)
        if copy:
            store = store[:, :max(t, (start or 0) + s)].clone()
        if start is not None:
            store.narrow(1, start, s).copy_(c)
        elif positions is None:
            raise MultiheadError("a cache write needs the new tokens' positions, or the slot where all continue")
        else:
            rows = torch.arange(b, device=positions.device)[:, None]  # (b, 1)
            store[rows, positions] = c.to(store.dtype)
        return store.narrow(1, 0, t)  # (b, t, r)

    def extra_repr(self) -> str:
        return (f"n_layers={self.n_layers}, batch={self.batch}, max_len={self.max_len}, "
                f"kv_lora_rank={self.kv_lora_rank}, rope_dim={self.rope_dim}, dtype={self.latent.dtype}, "
                f"bytes={self.bytes:,}")
