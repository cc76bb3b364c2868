"""The correctness harness a user runs on their own hardware (``multihead check``).

For every backend and dtype on the chosen device:

- ``2x rule``: the error of the layer to the float64 oracle is at most twice the error of plain PyTorch math in the
  same dtype (FlashAttention's rule) plus 1/8 rounding step at the output's scale, for MHA, GQA and MQA, with no
  mask, a causal mask and a boolean mask;
- ``empty rows``: a query with no allowed key gives zeros, no NaN, and finite gradients;
- ``cache``: decoding token by token with a KVCache equals the uncached forward;
- ``deterministic``: 50 reruns are bitwise equal under ``torch.use_deterministic_algorithms(True)``.

Every case has heads 16 wide: flex attention's GPU kernel takes none narrower
(:func:`multihead.kernels.flex.unsupported`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from multihead.cache import KVCache
from multihead.errors import MultiheadError
from multihead.layers.attention import MultiHeadAttention
from multihead.verify.reference import Weights, multihead_attention

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CheckResult:
    check: str
    backend: str
    dtype: str
    passed: bool
    detail: str


def plain_layer(layer: MultiHeadAttention, x: torch.Tensor, keep: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """Projections and softmax(q k^T * scale) v with K/V repeated, written with plain ops in x's dtype: the common
    Hugging Face eager path, the 2x rule's yardstick and the benchmarks' anchor."""
    b, s, _ = x.shape
    h, g, d = layer.n_heads, layer.n_kv_heads, layer.head_dim
    q = layer.q_proj(x).view(b, s, h, d).transpose(1, 2)
    k = layer.k_proj(x).view(b, s, g, d).transpose(1, 2).repeat_interleave(h // g, 1)
    v = layer.v_proj(x).view(b, s, g, d).transpose(1, 2).repeat_interleave(h // g, 1)
    scores = q @ k.transpose(-2, -1) * layer.config.softmax_scale
    allowed = torch.ones(s, s, dtype=torch.bool, device=x.device)
    if causal:
        allowed = allowed.tril()
    if keep is not None:
        allowed = allowed & keep
    out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    y: torch.Tensor = layer.o_proj(out.transpose(1, 2).reshape(b, s, h * d))
    return y


def two_x_rule(err: float, plain: float, scale: float, dtype: torch.dtype) -> bool:
    """FlashAttention's rule: ``err <= 2 * plain + eps(dtype) * scale / 8``.

    ``err`` and ``plain`` are the largest absolute errors of the kernel and of plain PyTorch math (same dtype) to the
    float64 oracle. The floor, an eighth of a rounding step at the output's scale (its largest magnitude), only
    guards against a plain result that happens to be exact: plain math's own error measured 0.25-0.45 of a step in
    float32, bfloat16 and float16 (the output's own rounding), so the floor never dominates and a kernel with 3x the
    plain error fails in every dtype (the fixed 1e-6 floor used before let 4-12x through in float32).
    """
    return err <= 2 * plain + torch.finfo(dtype).eps * scale / 8


S_2X = 128  # one flex block: grouped heads over fewer queries than a block can find no GPU kernel (flex.unsupported)


def _case(backend: str, dtype: torch.dtype, device: str, n_kv_heads: int, masking: str
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(oracle, layer, plain math) outputs for one case of the 2x rule."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_model=128, n_heads=8, n_kv_heads=n_kv_heads, device=device, dtype=dtype)
    x = torch.randn(2, S_2X, 128, device=device, dtype=dtype)
    keep = None
    if masking == "bool":
        keep = (torch.rand(S_2X, S_2X, device=device) < 0.8) | torch.eye(S_2X, dtype=torch.bool, device=device)
    causal = masking == "causal"
    want, _ = multihead_attention(layer.config, Weights.of(layer), x.double().cpu().numpy(),
                                  mask=None if keep is None else keep.cpu().numpy(), causal=causal)
    with torch.no_grad():
        ours = layer(x, mask=keep, causal=causal, backend=backend).double().cpu().numpy()
        plain = plain_layer(layer, x, keep, causal).double().cpu().numpy()
    return want, ours, plain


def _two_x(backend: str, dtype: torch.dtype, device: str) -> tuple[bool, str]:
    worst = 0.0
    for n_kv_heads in (8, 2, 1):
        for masking in ("none", "causal", "bool"):
            want, ours, plain = _case(backend, dtype, device, n_kv_heads, masking)
            err, base = float(np.abs(ours - want).max()), float(np.abs(plain - want).max())
            scale = float(np.abs(want).max())
            worst = max(worst, err / max(base, 1e-300))
            if not two_x_rule(err, base, scale, dtype):
                floor = torch.finfo(dtype).eps * scale / 8
                return False, (f"kv heads {n_kv_heads}, {masking}: error {err:.2e} > 2 x plain {base:.2e} + "
                               f"{floor:.1e} (1/8 rounding step at the output's scale {scale:.2f})")
    return True, f"worst error / plain error = {worst:.2f}"


def _empty_rows(backend: str, dtype: torch.dtype, device: str) -> tuple[bool, str]:
    layer = MultiHeadAttention(d_model=64, n_heads=4, n_kv_heads=2, device=device, dtype=dtype)
    backward = not (backend == "flex" and device == "cpu")  # PyTorch's flex attention has no CPU backward
    x = torch.randn(2, 6, 64, device=device, dtype=dtype, requires_grad=backward)
    keep = torch.rand(2, 1, 6, 6, device=device) < 0.5
    keep[:, :, 3] = False
    with torch.set_grad_enabled(backward):
        y = layer(x, mask=keep, backend=backend)
    finite = bool(torch.isfinite(y).all())
    if backward:
        y.float().square().sum().backward()
        finite = finite and x.grad is not None and bool(torch.isfinite(x.grad).all())
    zero = bool((y[:, 3] == layer.o_proj.bias).all())
    what = "zeros and finite gradients" if backward else "zeros, no NaN (forward only: no CPU backward)"
    return finite and zero, what if finite and zero else f"finite {finite}, zero rows {zero}"


def _cache(backend: str, dtype: torch.dtype, device: str) -> tuple[bool, str]:
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_model=64, n_heads=4, n_kv_heads=2, rope=10000.0, device=device, dtype=dtype).eval()
    x = torch.randn(2, 10, 64, device=device, dtype=dtype)
    with torch.no_grad():
        full = layer(x, causal=True, backend=backend)
        cache = KVCache(batch=2, n_kv_heads=2, head_dim=16, max_len=10, dtype=dtype, device=device)
        steps = [layer(x[:, :4], causal=True, cache=cache.layer(0), backend=backend)]
        cache.advance(4)
        for i in range(4, 10):
            steps.append(layer(x[:, i:i + 1], causal=True, cache=cache.layer(0), backend=backend))
            cache.advance(1)
    err = float((torch.cat(steps, dim=1) - full).abs().max())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return err <= tol, f"max difference {err:.1e} (tolerance {tol:.0e})"


def _deterministic(backend: str, dtype: torch.dtype, device: str) -> tuple[bool, str]:
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_model=128, n_heads=8, n_kv_heads=2, device=device, dtype=dtype)
    x = torch.randn(2, 32, 128, device=device, dtype=dtype)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.no_grad():
            first = layer(x, causal=True, backend=backend)
            same = all(torch.equal(first, layer(x, causal=True, backend=backend)) for _ in range(49))
    finally:
        torch.use_deterministic_algorithms(before)
    return same, "50 runs bitwise equal" if same else "runs differ"


CHECKS = {"2x rule": _two_x, "empty rows": _empty_rows, "cache": _cache, "deterministic": _deterministic}


BACKENDS = ("sdpa", "math", "flex")


def run_checks(*, device: str = "cpu", dtypes: list[str] | None = None,
               backends: tuple[str, ...] = BACKENDS, checks: tuple[str, ...] | None = None) -> list[CheckResult]:
    """Run every check (or those named in ``checks``) for every backend and dtype; never raises for a failing check,
    only for bad arguments."""
    chosen = tuple(CHECKS) if checks is None else checks
    if not chosen or any(c not in CHECKS for c in chosen):
        raise MultiheadError(f"checks {chosen!r}: choose from {', '.join(CHECKS)}")
    unknown_backends = [b for b in backends if b not in BACKENDS]
    if unknown_backends or not backends:
        raise MultiheadError(f"backend {(unknown_backends or [''])[0]!r} is unknown: choose from {', '.join(BACKENDS)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise MultiheadError("--device cuda: no CUDA device is available here")
    if device not in ("cpu", "cuda"):
        raise MultiheadError(f"device {device!r} is not supported: choose cpu or cuda")
    names = dtypes or list(DTYPES)
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        raise MultiheadError(f"dtype {unknown[0]!r} is unknown: choose from {', '.join(DTYPES)}")
    results = []
    for name in names:
        for backend in backends:
            for check in chosen:
                fn = CHECKS[check]
                try:
                    passed, detail = fn(backend, DTYPES[name], device)
                except Exception as err:  # a check that crashes is a failed check, reported with its error
                    passed, detail = False, f"{type(err).__name__}: {err}"
                results.append(CheckResult(check, backend, name, passed, detail))
    return results
