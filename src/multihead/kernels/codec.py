"""A quantized cache's codec on the kernels' side: its write (plugged into :func:`multihead.quant.quantize_into` when
this room is imported) and a kernel's read of the codes back into keys and values, each in the native codec
(:func:`multihead.kernels.native.quantize_into` / :func:`~multihead.kernels.native.dequantize_into`, one pass, the
same bits) where :func:`multihead.kernels.cpu.native_codec` says so and it takes the tensors, else
:mod:`multihead.quant`'s PyTorch code."""

from __future__ import annotations

from torch import Tensor

from multihead import quant
from multihead.kernels import cpu, native


def write(x: Tensor, codes: Tensor, scale: Tensor, minimum: Tensor, bits: int, group: int, axis: int) -> bool:
    """:func:`multihead.quant.quantize_into` in the native codec: True when it ran, False (nothing written) where it
    does not (another device, the fast paths off, a mode watching, a layout it does not take, no kernels)."""
    if not (cpu.native_codec(x) and native.codec_fits(x, codes, scale, minimum, bits=bits, group=group, axis=axis)):
        return False
    native.quantize_into(x, codes, scale, minimum, bits=bits, group=group, axis=axis, check=False)
    return True


def read(out: Tensor, codes: Tensor, scale: Tensor, minimum: Tensor, *, bits: int, group: int, axis: int) -> None:
    """Write the first n = out.shape[2] keys (``axis`` 0) or values (``axis`` 1) a store holds as codes into ``out``
    (b, g, n, d): the values of :func:`multihead.quant.read_keys` / :func:`~multihead.quant.read_values`, by the
    native codec where it runs, else :func:`multihead.quant.dequantize_keys_into` /
    :func:`~multihead.quant.dequantize_values_into`. ``codes``, ``scale``, ``minimum``: the store's buffers (b, g,
    >= n rows, ..)."""
    n = out.shape[2]
    rows = n // group if axis == 0 else n
    codes, scale, minimum = codes[:, :, :n], scale[:, :, :rows], minimum[:, :, :rows]
    if cpu.native_codec(out) and native.codec_fits(out, codes, scale, minimum, bits=bits, group=group, axis=axis):
        native.dequantize_into(out, codes, scale, minimum, bits=bits, group=group, axis=axis, check=False)
    elif axis == 0:
        quant.dequantize_keys_into(out, codes, scale, minimum, bits=bits, group=group)
    else:
        quant.dequantize_values_into(out, codes, scale, minimum, bits=bits, group=group)


quant.use_native_writer(write)
