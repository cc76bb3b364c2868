"""``Linear``: torch.nn.Linear with a faster path for the few-row products of decoding on the CPU.

Decoding multiplies one token (a few rows) by every weight matrix: a matrix-vector product, bound by reading the
weights from memory. For these shapes on the CPU, torch's ``F.linear`` runs a BLAS gemv/gemm that keeps to one core
here, while a batched product over ``n`` row blocks of the weight is spread over the intra-op threads::

    W (out, in) viewed as (n, out / n, in);   y = (W @ x^T) -> (n, out / n, m) -> (m, out)

Same weights, same parameters and state_dict, no copy of W. The product is the same sum in a different order
(float32 rounding differs at the last bits). Measured on the 2-core machine of benchmarks/RESULTS.md, float32, the 210
matrices of SmolLM2-135M at one row: 63 ms with F.linear, 33 ms split in 2; 1536 x 576 at 1-64 rows: 0.4-0.8x the time
of F.linear; from about 128 rows the two are level and F.linear is kept. In bfloat16 and float16 the product runs
split too, in at least 2 blocks: their one-row F.linear (oneDNN, x as the left operand) was up to 8x slower than the
weight-as-left-operand product for SmolLM2's MLP matrices. On a loaded machine float32 falls back to F.linear (a
split waits for its descheduled thread) and a low-precision split runs in one thread. When to split is decided in
:func:`multihead.cpu.split_product` (with the other CPU speed paths, behind one switch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import cpu


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, split over the CPU threads where :func:`multihead.cpu.split_product` says so."""
    in_features = x.shape[-1] if x.ndim else 0
    rows = x.numel() // in_features if in_features else 0
    n = cpu.split_product(rows, weight, x)
    if n == 1:
        return F.linear(x, weight, bias)
    one = cpu.product_in_one_thread(n, weight)

    def split() -> Tensor:
        if not one:
            return _split(x, weight, bias, n, rows, in_features)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _split(x, weight, bias, n, rows, in_features)
        finally:
            torch.set_num_threads(threads)

    key = (weight.shape[0], in_features, weight.dtype, rows, n, one)
    if cpu.split_pays(key, split, lambda: F.linear(x, weight, bias)):
        return split()
    return F.linear(x, weight, bias)


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
