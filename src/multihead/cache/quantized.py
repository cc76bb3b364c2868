"""QuantizedKVCache: keys and values in 8, 4 or 2 bits, as KIVI (Liu et al. 2024) stores them (the codec is
:mod:`multihead.quant`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from multihead.cache.base import Cache, Slots, check_count
from multihead.cache.sink import sink_keep
from multihead.cache.view import QuantizedKV
from multihead.errors import MultiheadError
from multihead.quant import check_bits, quantize_into


class QuantizedKVCache(Cache):
    """Keys and values stored in ``bits`` (8, 4 or 2) bits, as KIVI (Liu et al. 2024) stores them: keys per
    channel over groups of ``group`` tokens, values per token over groups of ``group`` channels, and the last
    ``residual`` to ``residual + group - 1`` tokens in full precision until a whole group of older tokens can be
    quantized. :meth:`update` returns the codes as they are with the full-precision tail
    (:class:`~.view.QuantizedKV`): a kernel reads them there, or dequantises them first (:mod:`multihead.kernels`
    decides).

    ::

        codes          (L, b, g, max_len, d * bits / 8)  uint8, keys and values
        key scales     (L, b, g, max_len / group, d)     float16 scale and minimum per channel per token group
        value scales   (L, b, g, max_len, d / group)     float16 scale and minimum per token per channel group
        residual       (L, b, g, residual + group, d)    the cache's dtype, keys and values

    The sequences of a batch hold one length, and new tokens continue them (no positions). A step's own tokens are
    attended in full precision and kept beside the store until :meth:`advance`, which quantizes them once
    ``residual + group`` or more wait. This equals the uncached model whose keys
    and values before ``quantized_tokens(p)`` are replaced by their quantized copies (:func:`fake_quantize_keys`).

    ``window=W`` (a sliding layer of Gemma 2/3 or Mistral: a query at p sees the keys in (p - W, p]) stores what such
    a layer can see: the codes become a ring of :func:`ring_groups` groups (whole token groups, each in slot
    ``group index mod capacity``), enough for the ``W - 1`` keys before the next token beside the full-precision
    tail, and the step's mask says which slots each query sees (``code_positions``: the position each code row
    holds, -1 empty). Its bytes stop growing at the window, as transformers' sliding layers do.
    """

    addressed = False
    code_positions: Tensor
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
                 device: torch.device | str | None = None, window: int | None = None) -> None:
        super().__init__(batch=batch, n_kv_heads=n_kv_heads, head_dim=head_dim, n_layers=n_layers, max_len=max_len,
                         device=device)
        self.bits = check_bits(bits)
        self.group = check_count("group", group, least=1)
        self.residual = check_count("residual", residual, least=0)
        self.window = None if window is None else check_count("window", window, least=2)
        self.positional = window is None
        groups = -(-max_len // group)  # key-scale groups of the codes: every group, or the ring's
        if window is not None:
            groups = min(groups, ring_groups(window, group=group, residual=residual))
        self._groups = groups
        if head_dim % group:
            raise MultiheadError(f"group ({group}) must divide head_dim ({head_dim}): values are quantized per token "
                                 "over groups of that many channels")
        if (head_dim * self.bits) % 8:
            raise MultiheadError(f"head_dim ({head_dim}) * bits ({bits}) must fill whole bytes")
        lead = (n_layers, batch, n_kv_heads)
        f16: dict[str, object] = {"dtype": torch.float16, "device": device}
        packed = head_dim * self.bits // 8
        rows = max_len if window is None else groups * group  # code rows: every token, or the ring's
        for name, shape, kw in (
            ("codes_k", (*lead, rows, packed), {"dtype": torch.uint8, "device": device}),
            ("codes_v", (*lead, rows, packed), {"dtype": torch.uint8, "device": device}),
            ("scale_k", (*lead, groups, head_dim), f16),
            ("min_k", (*lead, groups, head_dim), f16),
            ("scale_v", (*lead, rows, head_dim // group), f16),
            ("min_v", (*lead, rows, head_dim // group), f16),
            ("res_k", (*lead, residual + group, head_dim), {"dtype": dtype, "device": device}),
            ("res_v", (*lead, residual + group, head_dim), {"dtype": dtype, "device": device}),
        ):
            self.register_buffer(name, torch.zeros(shape, **kw), persistent=False)  # type: ignore[arg-type,unused-ignore]
        self.register_buffer("code_positions", torch.full((rows if window is not None else 0,), -1, dtype=torch.long,
                                                          device=device), persistent=False)
        self.max_len: int = max_len
        self._quantized = 0  # tokens of every sequence held as codes (a multiple of group)
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}

    @property
    def quantized(self) -> int:
        return self._quantized

    @property
    def bytes(self) -> int:
        """Bytes of the codes, the scales and minimums and the full-precision residual buffers."""
        return sum(buf.nbytes for _, buf in self.named_buffers()
                   if buf is not self.lengths and buf is not self.code_positions)

    @property
    def held_codes(self) -> int:
        """Code rows a layer reads: every quantized token, or at most the ring's rows (``window``)."""
        return min(self._quantized, self._groups * self.group) if self.window is not None else self._quantized

    def reset(self) -> None:
        super().reset()
        self._quantized = 0
        self._pending.clear()
        self.code_positions.fill_(-1)

    def _span(self, s: int) -> int:
        return self.held_codes + self._used - self._quantized + s

    def _keep(self, q_positions: Tensor | None, s: int, attention_window: int | None) -> Tensor | None:
        """A ring (``window``): the code rows by the positions they hold, then the tail and the new tokens in
        order, each query seeing the keys within its layer's ``attention_window`` and the ring's own."""
        assert self.window is not None and q_positions is not None
        if s == 1 and self._used < self.window and (attention_window is None or self._used < attention_window):
            return None  # one token and nothing has left the window yet: every held key is seen
        held = self.held_codes
        new = q_positions[0]  # (s,): the sequences hold one length
        tail = torch.arange(self._quantized, self._used + s, device=new.device)
        keys = torch.cat([self.code_positions[:held], tail])  # (t,)
        seen = self.window if attention_window is None else min(attention_window, self.window)
        return sink_keep(new, keys, window=seen, sink_tokens=0)[None, None]  # (1, 1, s, t)

    def quantized_tokens(self, used: int) -> int:
        """How many of ``used`` held tokens are quantized: whole groups, leaving ``residual`` or more in full."""
        return quantized_tokens(used, group=self.group, residual=self.residual)

    def update(self, layer: int, k: Tensor, v: Tensor, slots: Slots, *, read_only: bool = False) -> QuantizedKV:
        """The layer's codes as they are stored and the full-precision tail: the residual and the new keys and values
        (b, g, s, d), t = used + s keys in all; the tail waits for :meth:`advance` (``read_only``: it is not kept).

        A decode step's token (one new token, no gradient asked) that quantizes no group is written into the residual
        buffer's next row, in the cache's dtype, and the tail is a view of that buffer: nothing is copied but the
        token, and advance moves nothing (so a view handed out before the commit still reads what it was given: a
        transformers model commits before its last layer attends). Otherwise the tail is the residual and the new
        tokens concatenated, in the cache's dtype; under autograd the new keys' gradient flows through it."""
        self._check_keys(layer, k)
        n, r, s = self.held_codes, self._used - self._quantized, k.shape[2]
        dtype = self.res_k.dtype
        grad = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
        if (s == 1 and not read_only and not grad and r < self.res_k.shape[3]
                and self.quantized_tokens(self._used + 1) == self._quantized):
            self.res_k[layer, :, :, r] = k[:, :, 0]  # (b, g, d): rounded to the cache's dtype
            self.res_v[layer, :, :, r] = v[:, :, 0]
            tail_k, tail_v = self.res_k[layer, :, :, :r + 1], self.res_v[layer, :, :, :r + 1]  # (b, g, r + 1, d) views
        elif r == 0 and k.dtype == dtype and v.dtype == dtype:
            tail_k, tail_v = k, v  # (b, g, s, d): nothing in the residual, the new tokens are the whole tail
        else:
            tail_k = torch.cat([self.res_k[layer, :, :, :r], k.to(dtype)], dim=2)  # (b, g, r + s, d)
            tail_v = torch.cat([self.res_v[layer, :, :, :r], v.to(dtype)], dim=2)
        if not read_only:
            self._pending[layer] = (tail_k, tail_v)
        return QuantizedKV(self.bits, self.group, n, self.codes_k[layer], self.scale_k[layer], self.min_k[layer],
                           self.codes_v[layer], self.scale_v[layer], self.min_v[layer], tail_k, tail_v, dtype)

    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        """Quantize the whole groups that left the residual window; keep the rest in full precision."""
        self._check_commit(s, lengths, self._pending)
        self.check_room(s)
        n0, n1 = self._quantized, self.quantized_tokens(self._used + s)
        runs = self._runs(n0 // self.group, n1 // self.group)
        new = n1 - n0
        for layer, (tail_k, tail_v) in self._pending.items():
            for first, slot, count in runs:  # whole groups into their slots (every one, or the ring's last)
                part = slice(first * self.group - n0, (first + count) * self.group - n0)
                self._store_codes(layer, tail_k[:, :, part], tail_v[:, :, part], slot * self.group,
                                  (slot + count) * self.group, slot, slot + count)
            if tail_k.data_ptr() == self.res_k[layer].data_ptr():
                continue  # a decode step's view of the residual (update wrote it so only when nothing is quantized)
            rest = tail_k.shape[2] - new
            self.res_k[layer, :, :, :rest] = tail_k[:, :, new:]
            self.res_v[layer, :, :, :rest] = tail_v[:, :, new:]
        if self.window is not None:
            for first, slot, count in runs:
                held = torch.arange(first * self.group, (first + count) * self.group, device=self.code_positions.device)
                self.code_positions[slot * self.group:(slot + count) * self.group] = held
        self._pending.clear()
        self._quantized = n1
        super().advance(s)

    def _runs(self, g0: int, g1: int) -> list[tuple[int, int, int]]:
        """Where the new whole groups g0 .. g1 - 1 go: (first group, first slot, count) runs of consecutive slots.
        Every group at its own index, or, in a ring of C groups, the last C of them at their index mod C."""
        if g1 <= g0:
            return []
        if self.window is None:
            return [(g0, g0, g1 - g0)]
        capacity = self._groups
        if capacity == 0:
            return []
        first = max(g0, g1 - capacity)
        runs: list[tuple[int, int, int]] = []
        while first < g1:
            slot = first % capacity
            count = min(g1 - first, capacity - slot)
            runs.append((first, slot, count))
            first += count
        return runs

    @torch.no_grad()
    def _store_codes(self, layer: int, keys: Tensor, values: Tensor, n0: int, n1: int, g0: int, g1: int) -> None:
        """Quantize a layer's keys and values (b, g, n1 - n0, d), whole groups, into its code rows n0 .. n1 and
        key-scale groups g0 .. g1 (the tokens' own, or their ring slots), scales and minimums (no gradient: codes are
        rounded values), by :func:`multihead.quant.quantize_into`."""
        quantize_into(keys, self.codes_k[layer, :, :, n0:n1], self.scale_k[layer, :, :, g0:g1],
                      self.min_k[layer, :, :, g0:g1], bits=self.bits, group=self.group, axis=0)
        quantize_into(values, self.codes_v[layer, :, :, n0:n1], self.scale_v[layer, :, :, n0:n1],
                      self.min_v[layer, :, :, n0:n1], bits=self.bits, group=self.group, axis=1)

    def extra_repr(self) -> str:
        return (f"n_layers={self.n_layers}, batch={self.batch}, n_kv_heads={self.n_kv_heads}, max_len={self.max_len}, "
                f"head_dim={self.head_dim}, bits={self.bits}, group={self.group}, residual={self.residual}, "
                + (f"window={self.window} (a ring of {self._groups} groups), " if self.window is not None else "")
                + f"bytes={self.bytes:,}")


def ring_groups(window: int, *, group: int, residual: int) -> int:
    """Token groups a sliding layer's quantized store needs beside its full-precision tail: the ``window - 1``
    keys before the next token reach back past the ``residual`` newest ones (kept in full precision) by
    ``window - 1 - residual`` tokens, which whole groups, aligned to multiples of ``group``, cover in
    ceil((window - 1 - residual) / group) of them (0 when the tail covers the window)."""
    return max(0, -(-(window - 1 - residual) // group))


def quantized_tokens(used: int, *, group: int, residual: int) -> int:
    """Tokens a :class:`QuantizedKVCache` holds as codes after ``used`` tokens: the most whole groups that leave
    at least ``residual`` tokens in full precision."""
    return max(0, (used - residual) // group) * group
