"""The low-bit codec of keys and values, as KIVI (Liu et al. 2024) stores them: codes, scales and minimums.

::

    keys    per channel over groups of ``group`` tokens:    k[.., j, c] ~ codes * scale[.., j // group, c] + min
    values  per token over groups of ``group`` channels:    v[.., j, c] ~ codes * scale[.., j, c // group] + min
    codes   ``bits`` (8, 4 or 2) bits each, packed low bits first into bytes: (.., n, d * bits / 8) uint8

Both sides use it: :class:`multihead.cache.QuantizedKVCache` writes codes (:func:`quantize_into`) and
:mod:`multihead.kernels` reads them back where a kernel needs keys and values (:func:`dequantize_keys_into`,
:func:`dequantize_values_into`, or its native codec). This module sits below both on the forward's route and imports
neither: the kernels' room plugs its native write in (:func:`use_native_writer`, the same bits in one pass), and
:func:`quantize_into` runs it where it takes the call, else :func:`quantize` and :func:`pack_fast`.
:func:`read_keys` and :func:`read_values` are the reference reads, one op after another as the formula reads.
``fake_quantize_*`` give the uncached model's equal of a quantized cache.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import Tensor

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
    low = lo.float()
    scale = hi.sub_(low).div_(levels).to(torch.float16)
    scale.masked_fill_(scale <= 0, 1.0)  # a constant group: any scale, codes 0
    codes = torch.sub(x32, low).div_(scale.float()).round_().clamp_(0, levels).to(torch.uint8)
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


def pack_fast(codes: Tensor, bits: int) -> Tensor:
    """:func:`pack`, in whole-tensor passes (what a cache's write runs): each ``per`` codes are read as one
    little-endian integer of ``per`` bytes, whose bytes are the codes, and its bits are folded down into the low
    byte (4 bits: ``w | w >> 4``; 2 bits: ``w | w >> 6``, then ``| >> 12``), which is the packed byte (little-endian
    machines; elsewhere :func:`pack`)."""
    per = 8 // bits
    if per == 1:
        return codes
    if sys.byteorder != "little":
        return pack(codes, bits)
    c = codes.contiguous()
    wide = c.view(torch.int16 if per == 2 else torch.int32)  # (.., n / per): one integer per packed byte
    folded = wide | (wide >> (8 - bits))  # code 1 beside code 0 (and code 3 beside code 2)
    if per == 4:
        folded |= folded >> 12  # codes 2 and 3 beside codes 0 and 1
    return folded.to(torch.uint8)  # the low byte: codes below 2^bits leave no stray bits there


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


# ---------------------------------------------------------------------------------------------- reading a store
def read_keys(codes: Tensor, scale: Tensor, minimum: Tensor, n: int, *, bits: int, group: int, dtype: torch.dtype
              ) -> Tensor:
    """The reference read of ``n`` quantized keys: codes (b, g, >= n, d * bits / 8), scale and minimum
    (b, g, >= n / group, d) -> (b, g, n, d) in ``dtype`` (unpack, dequantize, one op after another)."""
    c = unpack(codes[:, :, :n], bits).unflatten(-2, (-1, group))  # (b, g, n / group, group, d)
    return dequantize(c, scale[:, :, :n // group, None], minimum[:, :, :n // group, None], dtype).flatten(-3, -2)


def read_values(codes: Tensor, scale: Tensor, minimum: Tensor, n: int, *, bits: int, group: int,
                dtype: torch.dtype) -> Tensor:
    """The reference read of ``n`` quantized values: codes (b, g, >= n, d * bits / 8), scale and minimum
    (b, g, >= n, d / group) -> (b, g, n, d) in ``dtype``."""
    c = unpack(codes[:, :, :n], bits).unflatten(-1, (-1, group))  # (b, g, n, d / group, group)
    return dequantize(c, scale[:, :, :n, :, None], minimum[:, :, :n, :, None], dtype).flatten(-2)


Writer = Callable[[Tensor, Tensor, Tensor, Tensor, int, int, int], bool]
_writer: list[Writer] = []  # the native write the kernels' room plugged in (multihead.kernels.codec), if any


def use_native_writer(write: Writer | None) -> None:
    """Plug in (or, None, take out) a faster write for :func:`quantize_into`: ``write(x, codes, scale, minimum, bits,
    group, axis)`` writes the same codes, scales and minimums as the PyTorch code here and returns True, or returns
    False having written nothing (a call it does not take). :mod:`multihead.kernels` plugs in its native codec when
    imported."""
    _writer.clear()
    if write is not None:
        _writer.append(write)


def quantize_into(x: Tensor, codes: Tensor, scale: Tensor, minimum: Tensor, *, bits: int, group: int, axis: int
                  ) -> None:
    """Quantize x (b, g, n, d) into a store's ``codes`` (b, g, n, d * bits / 8), ``scale`` and ``minimum`` (float16;
    each a view of the store's rows, written in place): keys (``axis`` 0) per channel over groups of ``group`` tokens,
    scale and minimum (b, g, n / group, d); values (``axis`` 1) per token over groups of ``group`` channels,
    (b, g, n, d / group). The plugged-in native write where it takes the call (:func:`use_native_writer`), else
    :func:`quantize` and :func:`pack_fast`: the same codes, scales and minimums."""
    if _writer and _writer[0](x, codes, scale, minimum, bits, group, axis):
        return
    if axis == 0:
        c, s, lo = quantize(x.unflatten(-2, (-1, group)), bits, dim=-2)
        codes.copy_(pack_fast(c.flatten(-3, -2), bits))
        scale.copy_(s.squeeze(-2))
        minimum.copy_(lo.squeeze(-2))
    else:
        c, s, lo = quantize(x.unflatten(-1, (-1, group)), bits, dim=-1)
        codes.copy_(pack_fast(c.flatten(-2), bits))
        scale.copy_(s.squeeze(-1))
        minimum.copy_(lo.squeeze(-1))


def dequantize_keys_into(out: Tensor, codes: Tensor, scale: Tensor, minimum: Tensor, *, bits: int, group: int
                         ) -> None:
    """Write the first n = out.shape[2] quantized keys, dequantised, into ``out`` (b, g, n, d): the values of
    :func:`read_keys` (codes * scale + minimum in float32, rounded once to out's dtype) in three passes (unpack, to
    float32, one multiply-add into the output) instead of six and a concatenation."""
    b, g, n, d = out.shape
    c = unpack_fast(codes[:, :, :n], bits).to(torch.float32)  # (b, g, n, d)
    torch.addcmul(minimum[:, :, :n // group, None].float(), c.view(b, g, n // group, group, d),
                  scale[:, :, :n // group, None].float(), out=out.view(b, g, n // group, group, d))


def dequantize_values_into(out: Tensor, codes: Tensor, scale: Tensor, minimum: Tensor, *, bits: int, group: int
                           ) -> None:
    """:func:`dequantize_keys_into` for values (per token over groups of ``group`` channels)."""
    b, g, n, d = out.shape
    c = unpack_fast(codes[:, :, :n], bits).to(torch.float32)  # (b, g, n, d)
    torch.addcmul(minimum[:, :, :n, :, None].float(), c.view(b, g, n, d // group, group),
                  scale[:, :, :n, :, None].float(), out=out.view(b, g, n, d // group, group))
