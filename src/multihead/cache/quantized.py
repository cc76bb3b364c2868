"""QuantizedKVCache and its quantizers: keys and values in 8, 4 or 2 bits, as KIVI (Liu et al. 2024) stores them."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import Tensor

from multihead import cpu, native
from multihead.cache.base import Cache, Slots, check_count
from multihead.errors import MultiheadError

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


def unpack_fast(packed: Tensor, bits: int) -> Tensor:
    """:func:`unpack`, in whole-tensor passes without the (.., n, per) intermediate of shifted bytes: each byte is
    widened to an integer of ``per`` bytes whose bytes are its codes (low bits first, the order :func:`pack` writes),
    and that integer read back as bytes (little-endian machines; elsewhere :func:`unpack`)."""
    per = 8 // bits
    if per == 1:
        return packed
    if sys.byteorder != "little":
        return unpack(packed, bits)
    wide = packed.to(torch.int16 if per == 2 else torch.int32)  # (.., n / per): one byte per code to come
    mask = (1 << bits) - 1
    parts = [(wide & (mask << (i * bits))) << (i * (8 - bits)) for i in range(1, per)]  # code i into byte i
    wide.bitwise_and_(mask)
    for part in parts:
        wide.bitwise_or_(part)
    return wide.view(torch.uint8)  # (.., n)


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

    The sequences of a batch hold one length, and new tokens continue them (no positions). A step's own tokens are
    attended in full precision and kept beside the store until :meth:`advance`, which quantizes them once
    ``residual + group`` or more wait. This equals the uncached model whose keys
    and values before ``quantized_tokens(p)`` are replaced by their quantized copies (:func:`fake_quantize_keys`).
    """

    addressed = False
    attends = True  # a 4- or 8-bit decode step attends over the codes (:meth:`attend`)
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
        self.group = check_count("group", group, least=1)
        self.residual = check_count("residual", residual, least=0)
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

    def _span(self, s: int) -> int:
        return self._used + s

    def quantized_tokens(self, used: int) -> int:
        """How many of ``used`` held tokens are quantized: whole groups, leaving ``residual`` or more in full."""
        return quantized_tokens(used, group=self.group, residual=self.residual)

    def _read(self, layer: int) -> tuple[Tensor, Tensor]:
        """The layer's quantized tokens dequantised, (b, g, quantized, d) keys and values: the reference path (one
        op after another, as :func:`dequantize` writes it); :meth:`update` writes the same values in fewer passes."""
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

    def _dequantize_into(self, layer: int, keys: Tensor, values: Tensor) -> None:
        """Write the layer's quantized tokens, dequantised, into ``keys`` and ``values`` (b, g, quantized, d): the
        values of :meth:`_read` (codes * scale + minimum in float32, rounded once to the cache's dtype), in three
        passes (unpack, to float32, one multiply-add into the output) instead of six and a concatenation."""
        n, group = self._quantized, self.group
        b, g, _, d = keys.shape
        f32 = torch.float32
        codes_k = unpack_fast(self.codes_k[layer, :, :, :n], self.bits).to(f32)  # (b, g, n, d)
        torch.addcmul(self.min_k[layer, :, :, :n // group, None].to(f32), codes_k.view(b, g, n // group, group, d),
                      self.scale_k[layer, :, :, :n // group, None].to(f32),
                      out=keys.view(b, g, n // group, group, d))
        codes_v = unpack_fast(self.codes_v[layer, :, :, :n], self.bits).to(f32)
        torch.addcmul(self.min_v[layer, :, :, :n, :, None].to(f32), codes_v.view(b, g, n, d // group, group),
                      self.scale_v[layer, :, :, :n, :, None].to(f32), out=values.view(b, g, n, d // group, group))

    def update(self, layer: int, k: Tensor, v: Tensor, slots: Slots, *, read_only: bool = False
               ) -> tuple[Tensor, Tensor]:
        """The dequantized codes, the full-precision residual and the new keys and values (b, g, used + s, d); the
        tail after the codes waits for :meth:`advance` (``read_only``: it is not kept).

        The three parts are written into one new tensor each for keys and values (no concatenation): the codes
        dequantised in place there, the residual and the new tokens copied after them. Under autograd (the new
        keys need a gradient) the parts are concatenated instead, so the gradient reaches k and v. Resident bytes
        are :attr:`bytes` (no buffer is kept beside the codes); a step holds one layer's dequantised keys and values,
        2 * b * g * (used + s) * d elements of the cache's dtype, until that layer has attended."""
        self._check_keys(layer, k)
        n, r, s = self._quantized, self._used - self._quantized, k.shape[2]
        dtype = self.res_k.dtype
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            old_k, old_v = self._read(layer)
            keys = torch.cat([old_k, self.res_k[layer, :, :, :r], k.to(dtype)], dim=2)  # (b, g, used + s, d)
            values = torch.cat([old_v, self.res_v[layer, :, :, :r], v.to(dtype)], dim=2)
        else:
            b, g, _, d = k.shape
            keys = torch.empty(b, g, n + r + s, d, dtype=dtype, device=k.device)  # (b, g, used + s, d)
            values = torch.empty_like(keys)
            if n:
                self._dequantize_into(layer, keys[:, :, :n], values[:, :, :n])
            keys[:, :, n:n + r] = self.res_k[layer, :, :, :r]
            values[:, :, n:n + r] = self.res_v[layer, :, :, :r]
            keys[:, :, n + r:] = k
            values[:, :, n + r:] = v
        if not read_only:
            self._pending[layer] = (keys[:, :, n:], values[:, :, n:])  # the full tail
        return keys, values

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, slots: Slots, *, scale: float,
               read_only: bool = False) -> Tensor | None:
        """A decode step's attention over the codes themselves (4 or 8 bits,
        :func:`multihead.cpu.native_quantized_decode`): the quantized tokens are read once inside the attention
        (:func:`multihead.native.attend_q4`, :func:`~multihead.native.attend_q8`), never dequantised into a tensor,
        and the residual and the new tokens in full precision join the same softmax; the tail waits for
        :meth:`advance` as after :meth:`update`. None (nothing placed) where that path does not apply. Equal to
        :meth:`update` then SDPA within the cache dtype's rounding of the dequantised keys."""
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if (k.shape[2] != 1 or (self.bits == 4 and self.group % 2)
                or not cpu.native_quantized_decode(q, self.bits, needs_grad)):
            return None  # (the 4-bit kernel reads a value group as whole bytes: an even group)
        self._check_keys(layer, k)
        n, r = self._quantized, self._used - self._quantized
        b, g, _, d = k.shape
        # the residual and the new token, in float32 as the kernel reads them (exact: the cache dtype widened, and
        # narrowed back unchanged where advance keeps them); (b, g, r + 1, d)
        tail_k = torch.empty(b, g, r + 1, d, dtype=torch.float32, device=k.device)
        tail_v = torch.empty_like(tail_k)
        tail_k[:, :, :r] = self.res_k[layer, :, :, :r]
        tail_v[:, :, :r] = self.res_v[layer, :, :, :r]
        tail_k[:, :, r:] = k.to(self.res_k.dtype)  # rounded to the cache's dtype first, as update stores it
        tail_v[:, :, r:] = v.to(self.res_v.dtype)
        kernel = native.attend_q4 if self.bits == 4 else native.attend_q8
        z = kernel(q, self.codes_k[layer], self.scale_k[layer], self.min_k[layer], self.codes_v[layer],
                   self.scale_v[layer], self.min_v[layer], n, self.group, tail_k, tail_v, scale,
                   check=False)  # the cache's own buffers, laid out as the kernel reads them
        if not read_only:
            self._pending[layer] = (tail_k, tail_v)
        return z

    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        """Quantize the whole groups that left the residual window; keep the rest in full precision."""
        self._check_commit(s, lengths, self._pending)
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
