"""The speed decisions measured on a small CPU, gathered in one place behind one switch.

Each function here answers "take the fast path for this call?" for one trick that gives the same result as the plain
code (within float32 rounding) and was measured faster on the 2-core machine of benchmarks/RESULTS.md:

- :func:`split_product`: few-row projections (decoding) as a batched product over row blocks of the weight, spread
  over the intra-op threads (:mod:`multihead.linear`);
- :func:`fold_gqa_decode`: a GQA decode step with the query heads of each KV head folded into rows, so SDPA's CPU
  kernel reads each KV head once (consulted by :func:`multihead.kernels.resolve_backend`, the one place that decides
  which kernel runs and how; run by :func:`multihead.kernels.sdpa_attention`);
- :func:`plain_decode_mask`: one sequence continuing at its cached length attends with a plain bottom-right causal
  mask instead of a mask by positions (no per-call position tensor in the kernel);
- :func:`slice_cache_write`: sequences that all continue at the same length write the cache as one slice copy instead
  of index arithmetic.

``set_enabled(False)`` (or ``with disabled():``) turns every one of them off, so the plain path can be compared with
the fast one on a whole model (the tests do: same tokens, same logits within float32 rounding). Under torch.compile
the switch is read when the graph is traced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

_enabled = True

# split product: at most this many rows (tokens x batch), weights of at least this many elements, float32 only
SPLIT_MAX_ROWS = 64
SPLIT_MIN_WEIGHT = 65536


def enabled() -> bool:
    """Whether the CPU fast paths are on (the default)."""
    return _enabled


def set_enabled(on: bool) -> None:
    """Turn every fast path of this module on or off, process-wide."""
    global _enabled
    _enabled = bool(on)


@contextmanager
def disabled() -> Iterator[None]:
    """The plain paths while the block runs."""
    before = _enabled
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(before)


def _threads() -> int:
    return torch.get_num_threads()


# under torch.compile the thread count is read once, when the graph is traced (set_num_threads before compiling)
intra_op_threads: Callable[[], int] = torch.compiler.assume_constant_result(_threads)


def split_product(rows: int, weight: Tensor, x: Tensor) -> int:
    """How many row blocks to split ``x @ weight.T`` into (1 = plain ``F.linear``).

    Measured (float32, the 210 matrices of SmolLM2-135M at one row): 63 ms with F.linear, whose gemv kept to one core
    here, 33 ms split in 2; 1536 x 576 at 1-64 rows 0.4-0.8x the time of F.linear; from about 128 rows the two are
    level. bfloat16 gains nothing (its gemm already uses both cores). Weights under SPLIT_MIN_WEIGHT elements sit in
    cache and the split's own dispatch costs more than it saves (72 x 64 at one row: 20 us split, 5 us plain).
    """
    if (  # cheapest tests first: this runs for every projection of every step
        not _enabled
        or not 0 < rows <= SPLIT_MAX_ROWS
        or weight.numel() < SPLIT_MIN_WEIGHT
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or type(weight) not in (Tensor, torch.nn.Parameter)  # tensor subclasses (DTensor shards) dispatch their own
        or type(x) is not Tensor
        or weight.ndim != 2
        or weight.shape[1] != x.shape[-1]  # F.linear says what is wrong
        or not weight.is_contiguous()
    ):
        return 1
    n = intra_op_threads()
    return n if n > 1 and weight.shape[0] % n == 0 else 1


def fold_gqa_decode(batch: int, n_heads: int, n_kv_heads: int, s: int, device: torch.device,
                    plain_causal: bool) -> bool:
    """Whether SDPA runs a GQA decode step with each group's query heads folded into rows.

    On the CPU, when the folded work items (b * g) share evenly among the threads, or are at least two per thread, or
    each KV head serves at least 4 query heads. Measured with SDPA's CPU flash kernel (float32, head_dim 64, time
    folded / not folded): 32/8 heads, 4096 keys 0.73; 8/1, 2048 keys 0.71; 16/2 0.40, 12/4 0.91, 9/3 at batch 2
    0.88, 15/5 1.00 (1024 keys); but 9/3 at batch 1 (3 items for 2 threads) 1.07-1.24 slower for 4096-64 keys, so it
    stays unfolded there.
    """
    if not _enabled or n_kv_heads == n_heads or s != 1 or device.type != "cpu" or plain_causal:
        return False
    items, threads = batch * n_kv_heads, intra_op_threads()
    return n_heads // n_kv_heads >= 4 or items % threads == 0 or items >= 2 * threads


def plain_decode_mask(batch: int, at_cache_end: bool) -> bool:
    """Whether a cached step may use plain bottom-right causal alignment instead of a mask by positions: one
    sequence, continuing at its cached length (its queries are the last s of the t cached keys). Not under
    torch.compile, where the cache keeps its full length and positions decide."""
    return _enabled and batch == 1 and at_cache_end and not torch.compiler.is_compiling()


def slice_cache_write(uniform: bool) -> bool:
    """Whether a cache write of sequences that all continue at the same host-known length is one slice copy."""
    return _enabled and uniform and not torch.compiler.is_compiling()
