"""A prefill chunk's attention on the CPU: PyTorch's SDPA in one call against the ways :mod:`multihead.kernels.sdpa`
gives its flash kernel less to compute (the figures behind ``QUERY_BLOCK``, ``CAUSAL_BLOCKS``, ``SPLIT_FROM`` and
``SPLIT_BLOCKED_FROM``), alternating in one process.

For each model's heads (SmolLM2-135M: 9 query heads over 3 KV heads of 64; Gemma 3 270M: 4 over one of 256) and
dtype, random q, k, v (batch 1):

- a causal square of s rows (a chunk with nothing cached): one call with SDPA's causal flag, against query blocks of
  ``QUERY_BLOCK`` rows each over the keys up to its last row (``blocks``, run whether or not
  :func:`~multihead.kernels.sdpa.causal_blocks` would take them, so float32 is measured too);
- a chunk of s queries after p cached keys: one call with the dense causal mask aligned bottom-right, against the
  split (the prefix unmasked, the chunk's own keys causal, merged; its own keys in blocks where
  :func:`~multihead.kernels.sdpa.causal_blocks` says).

Each pair is checked to agree (within the dtype's rounding) before it is timed; the table gives medians over
``--rounds`` and the faster path's time against one call's (<1: the multihead path is faster).

    .venv/bin/python benchmarks/prefill_attention.py [--dtypes float32 bfloat16] [--rounds 15] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable

import bench
import torch
import torch.nn.functional as F
from results import publish

from multihead.kernels import sdpa
from multihead.layers.masks import build_mask

HEADS = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}
SQUARES = (256, 384, 512, 768, 1024)
CHUNK = 512
PREFIXES = (256, 512, 768, 2048)


def _median_ms(a: Callable[[], torch.Tensor], b: Callable[[], torch.Tensor], rounds: int) -> tuple[float, float]:
    a(), b()
    ta, tb = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        a()
        ta.append(time.perf_counter() - start)
        start = time.perf_counter()
        b()
        tb.append(time.perf_counter() - start)
    return 1000 * statistics.median(ta), 1000 * statistics.median(tb)


def _agree(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    tol = 1e-4 if a.dtype == torch.float32 else 3e-2
    if not torch.allclose(a.float(), b.float(), atol=tol, rtol=0):
        raise SystemExit(f"{what}: the two paths disagree by {(a.float() - b.float()).abs().max().item():.3g}")


def rows(name: str, dtype: torch.dtype, rounds: int) -> list[str]:
    h, g, d = HEADS[name]
    gen = torch.Generator().manual_seed(0)
    scale = d ** -0.5
    out = []
    for s in SQUARES:
        q, k, v = (torch.randn(1, n, s, d, generator=gen).to(dtype) for n in (h, g, g))
        spec = build_mask(batch=1, n_heads=h, s=s, t=s, causal=True)
        blocks = sdpa._key_blocks(spec, q.device, dtype)  # the plain causal plan, whatever causal_blocks says

        def one(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

        def blocked(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, spec: object = spec,
                    blocks: object = blocks) -> torch.Tensor:
            return sdpa.sdpa_attention(q, k, v, spec, scale=scale, blocks=blocks)  # type: ignore[arg-type]

        _agree(one(), blocked(), f"{name} {dtype} causal {s}")
        a, b = _median_ms(one, blocked, rounds)
        taken = "taken" if sdpa.causal_blocks(s, dtype) else "not taken"
        out.append(f"| {name} | {str(dtype).removeprefix('torch.')} | causal square of {s} | {a:.2f} | blocks of "
                   f"{sdpa.QUERY_BLOCK} ({taken}) | {b:.2f} | {b / a:.2f} |")
    for p in PREFIXES:
        s, t = CHUNK, CHUNK + p
        q = torch.randn(1, h, s, d, generator=gen).to(dtype)
        k, v = (torch.randn(1, g, t, d, generator=gen).to(dtype) for _ in range(2))
        spec = build_mask(batch=1, n_heads=h, s=s, t=t, causal=True)
        keep = torch.ones(s, t, dtype=torch.bool).tril(p)

        def masked(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, keep: torch.Tensor = keep
                   ) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=True)

        def split(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, spec: object = spec
                  ) -> torch.Tensor:
            return sdpa.sdpa_attention(q, k, v, spec, scale=scale, split=True)  # type: ignore[arg-type]

        _agree(masked(), split(), f"{name} {dtype} {s} after {p}")
        a, b = _median_ms(masked, split, rounds)
        own = "own keys in blocks" if sdpa.causal_blocks(s, dtype) else "own keys one causal call"
        taken = "taken" if sdpa.splits(spec, q, k, v) else "not taken"
        out.append(f"| {name} | {str(dtype).removeprefix('torch.')} | {s} queries after {p:,} keys | {a:.2f} | "
                   f"split, {own} ({taken}) | {b:.2f} | {b / a:.2f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=tuple(HEADS), default=list(HEADS))
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds ({args.rounds}) must be at least 1")
    lines = ["| heads | dtype | case | one call ms | multihead's path | ms | against one call |",
             "|---|---|---|---|---|---|---|"]
    for name in args.models:
        for dtype_name in args.dtypes:
            for line in rows(name, getattr(torch, dtype_name), args.rounds):
                lines.append(line)
                print(line, flush=True)
    text = (f"### A prefill chunk's attention: one SDPA call against blocks and the split ({datetime.date.today()})\n\n"
            + bench.header("batch 1, random q, k, v", args.rounds) + "; the two paths checked to agree first; "
            + "`benchmarks/prefill_attention.py`\n\n" + "\n".join(lines) + "\n")
    publish(text, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
