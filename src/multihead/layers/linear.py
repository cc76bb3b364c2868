"""``Linear``: torch.nn.Linear with faster kinds of the few-row products of decoding on the CPU.

Decoding multiplies one token (a few rows) by every weight matrix: a matrix-vector product, bound by reading the
weights from memory. PyTorch has several kernels for the same product and none is fastest for every shape, dtype
and machine, so :func:`linear` runs the one :func:`multihead.kernels.cpu.product_kind` decides for the shape (the host's
tuning table, :mod:`multihead.kernels.tuning`, or the rule beside it; never a timing):

- "linear": ``F.linear`` (MKL's sgemv for float32, oneDNN's matmul for bfloat16/float16);
- "mv": ``torch.mv(W, x)`` at one row (the matrix-vector kernel);
- "split": a batched product over ``n`` row blocks of the weight, spread over the intra-op threads and with the
  weight as the left operand::

      W (out, in) viewed as (n, out / n, in);   y = (W @ x^T) -> (n, out / n, m) -> (m, out)

- "blas" (bfloat16/float16): ``F.linear`` with oneDNN off for the call: PyTorch's own vectorised kernels, without
  oneDNN's fixed cost per call;
- "onednn" (float32, more than one row, inference): oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``), where
  MKL's float32 GEMM is not the faster: the rule takes it from :data:`multihead.kernels.cpu.ONEDNN_MIN_ROWS` rows on
  AMD CPUs with AVX-512 (:func:`multihead.kernels.cpu.onednn_host`; 1.4-2.8x F.linear's speed there), the tuning
  table elsewhere; also a prefill's many-row products, which no other kind takes;
- "native" (one bfloat16 or float32 row, inference): :func:`multihead.kernels.native.gemv_bf16` or
  :func:`~multihead.kernels.native.gemv_f32`, C kernels built by the set-up that read the weight at the memory's
  speed (AVX512-BF16 products or AVX-512 FMA, software prefetch); offered only where they built vectorised.

A prefill's many-row bfloat16 product runs in float32 on x86 CPUs without bfloat16 instructions (:func:`upcast`,
decided by :func:`multihead.kernels.cpu.upcast_product`): about 3x faster there.

A float32 product of more than one row (upcast ones too) runs with the process's configured intra-op threads, also
inside a step that follows a busy machine's load with fewer (:func:`multihead.kernels.cpu.configured_threads`): MKL
splits those sums by its thread count, and a step's bits never depend on the load.

Same weights, same parameters and state_dict, no copy of W; the kinds differ at the last bits of the dtype's
rounding (the same sums in another order), and a shape always runs the same kind in a process. What each kind
gains in SmolLM2-135M's greedy decoding (benchmarks/decode.py, one process, alternating) is recorded with its host
and date in benchmarks/RESULTS.md. Which calls may choose is decided in :func:`multihead.kernels.cpu.split_product`
(with the other CPU speed paths, behind one switch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.kernels import cpu, native

# the kinds of product a call may take (multihead.kernels.cpu.product_kind): by dtype, and with "mv" at one row
KINDS = {True: ("linear", "split", "onednn"), False: ("linear", "split", "blas")}
ONE_ROW_KINDS = {True: ("linear", "mv", "split"), False: ("linear", "mv", "split", "blas")}
# one row with multihead.kernels.native built and vectorised for the dtype (AVX512-BF16 for bfloat16, AVX-512 float32)
NATIVE_KINDS = {True: ("linear", "mv", "split", "native"), False: ("linear", "mv", "split", "blas", "native")}


def kinds(rows: int, dtype: torch.dtype) -> tuple[str, ...]:
    """The kinds of product a call of ``rows`` rows in ``dtype`` may take (the first, "linear", is F.linear)."""
    if rows == 1:
        if (dtype == torch.bfloat16 and native.vectorised()) or (dtype == torch.float32 and native.avx512()):
            return NATIVE_KINDS[dtype == torch.float32]
        return ONE_ROW_KINDS[dtype == torch.float32]
    return KINDS[dtype == torch.float32]


# a float32 product of more rows than the split takes (a prefill's), or of a weight it does not split
MANY_ROW_KINDS = ("linear", "onednn")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, as the kind of product :func:`multihead.kernels.cpu.product_kind` decides for its
    shape where :func:`multihead.kernels.cpu.split_product` lets it choose (few rows on the CPU)."""
    in_features = x.shape[-1] if x.ndim else 0
    rows = x.numel() // in_features if in_features else 0
    n = cpu.split_product(rows, weight, x)
    if n == 1:  # not a decode step's product: a prefill's may run upcast or in oneDNN (asked only off decoding's path)
        if cpu.upcast_product(rows, weight, x):
            with cpu.configured_threads():  # float32 sums, which MKL splits by its thread count
                return upcast(x, weight, bias)
        kind = "linear"
        if rows > 1 and cpu.onednn_fits(x, weight, bias):
            shape = (weight.shape[0], in_features, weight.dtype, min(rows, cpu.SPLIT_MAX_ROWS + 1), 1,
                     cpu.intra_op_threads())
            kind = "onednn" if cpu.product_kind(shape, MANY_ROW_KINDS, native_default=False) == "onednn" else kind
    else:
        allowed = kinds(rows, weight.dtype)
        kind = cpu.product_kind((weight.shape[0], in_features, weight.dtype, rows, n, cpu.intra_op_threads()),
                                allowed, native_default=rows == 1 and "native" in allowed)
    if rows > 1 and weight.dtype in cpu.KEEPS_THREADS and cpu.fewer_threads():
        with cpu.configured_threads():  # sums that some kernels split by their thread count: the configured one
            return run(kind, x, weight, bias, n)
    return run(kind, x, weight, bias, n, n > 1 and cpu.product_in_one_thread(n, weight))


def upcast(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` of low-precision tensors computed in float32 and rounded to x's dtype once
    (:func:`multihead.kernels.cpu.upcast_product` decides where): the weight converted
    :data:`multihead.kernels.cpu.UPCAST_BLOCK` elements at a time, each block's output written into the result, so the
    float32 copies stay small."""
    x32 = x.float()
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    step = max(1, cpu.UPCAST_BLOCK // max(1, weight.shape[1]))
    for i in range(0, weight.shape[0], step):
        b = None if bias is None else bias[i:i + step].float()
        out[..., i:i + step] = F.linear(x32, weight[i:i + step].float(), b)
    return out


def run(kind: str, x: Tensor, weight: Tensor, bias: Tensor | None, n: int, one: bool = False) -> Tensor:
    """The product ``F.linear(x, weight, bias)`` as ``kind`` (:func:`multihead.kernels.cpu.product_kind`) with ``n`` row
    blocks for the split; "split", "blas", "mv" and "native" in one intra-op thread when ``one``. "blas" on float32
    is F.linear (MKL, no oneDNN there to switch off); "mv" with more than one row is F.linear; "native" is F.linear
    unless it is one contiguous bfloat16 or float32 row without autograd and the kernels built (the kernels read raw
    memory: every layout they rely on is checked here)."""
    in_features = x.shape[-1]
    rows = x.numel() // in_features if in_features else 0
    if kind == "linear" or (kind == "blas" and weight.dtype == torch.float32) or (kind == "mv" and rows != 1):
        return F.linear(x, weight, bias)
    if kind == "onednn":  # oneDNN's float32 matmul where the call fits it (cpu.onednn_fits checks), else F.linear
        fits = rows > 1 and cpu.onednn_fits(x, weight, bias)
        return onednn_linear(x, weight, bias) if fits else F.linear(x, weight, bias)
    if kind == "native":
        dtype = weight.dtype
        if (rows == 1 and dtype in (torch.bfloat16, torch.float32) and x.dtype == dtype and x.is_contiguous()
                and weight.stride(-1) == 1 and native.available()
                and (bias is None or (bias.dtype == dtype and bias.is_contiguous() and bias.shape == weight.shape[:1]))
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                      or (bias is not None and bias.requires_grad)))):
            ops = torch.ops.multihead  # looked up a call: eager and compiled alike
            gemv = ops.gemv_bf16 if dtype == torch.bfloat16 else ops.gemv_f32
            out: Tensor = gemv(x, weight, bias, 1 if one else 0)
            return out
        return F.linear(x, weight, bias)  # another dtype, autograd or a strided row: PyTorch's product
    threads = torch.get_num_threads() if one else 0
    if one:
        torch.set_num_threads(1)
    try:
        if kind == "split":
            return _split(x, weight, bias, n, rows, in_features)
        if kind == "mv":  # one row: torch.mv, the matrix-vector kernel (oneDNN's for low precision)
            y = torch.mv(weight, x.reshape(in_features)).view(*x.shape[:-1], weight.shape[0])
            return y if bias is None else y + bias
        return _without_onednn(x, weight, bias)
    finally:
        if one:
            torch.set_num_threads(threads)


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` as oneDNN's float32 matmul (the kind "onednn"; the caller checks
    :func:`multihead.kernels.cpu.onednn_fits`)."""
    y: Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return y


def _without_onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear with oneDNN off for the call: PyTorch's own low-precision gemv/gemm (float32 accumulation). The
    switch is process-wide; another thread's product meanwhile also runs without oneDNN (same result within its
    dtype's rounding)."""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return F.linear(x, weight, bias)
    finally:
        torch._C._set_mkldnn_enabled(was)


def _split(x: Tensor, weight: Tensor, bias: Tensor | None, n: int, rows: int, in_features: int) -> Tensor:
    """``F.linear(x, weight, bias)`` as a batched product over ``n`` row blocks of the weight."""
    out_features = weight.shape[0]
    # x^T as (in, m) with unit stride along in: MKL takes a fast path for this layout (a (in, 1) column with other
    # strides measured 3-5x slower)
    xt = x.reshape(rows, in_features).t().expand(n, in_features, rows)
    blocks = torch.bmm(weight.view(n, out_features // n, in_features), xt)  # (n, out/n, m)
    if rows == 1:
        y = blocks.view(*x.shape[:-1], out_features)  # already the contiguous row F.linear gives
    else:  # (n, out/n, m) -> (m, out), contiguous like F.linear's result (reshape alone can give a strided view)
        y = blocks.permute(2, 0, 1).reshape(rows, out_features).contiguous().view(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """torch.nn.Linear (same parameters, state_dict and hooks) computing :func:`linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
