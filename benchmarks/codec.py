"""A quantized cache's codec in a chunked prefill: its writes (whole groups quantized as each chunk is committed) and
the read-back of its codes into keys and values before each chunk's SDPA, the native codec
(:func:`multihead.kernels.native.quantize_into` / ``dequantize_into``) against :mod:`multihead.quant`'s PyTorch code
(the same bits: checked before anything is timed), alternating in one process.

For each model's cache shape (SmolLM2-135M: 30 layers, 3 KV heads of 64; Gemma 3 270M: 18 layers, one KV head of
256), dtype and bits: a :class:`~multihead.cache.QuantizedKVCache` (group 32, residual 128) is filled with
``--length`` random tokens in chunks of ``--chunk``, each layer's chunk updated and its keys read back as a prefill's
SDPA reads them (:func:`multihead.kernels.dense_view`), then the chunk committed (``advance``, which quantizes). The
table gives the median over ``--rounds`` of each path's milliseconds writing and reading in the whole prefill, and the
native codec's speed against PyTorch's (>1: faster). The PyTorch path is the one ``cpu.disabled()`` runs.

    .venv/bin/python benchmarks/codec.py [--models smollm2 gemma3] [--dtypes float32 bfloat16] [--bits 4 8]
        [--length 4096] [--chunk 512] [--rounds 5] [--record]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import time
from typing import Any

import bench
import torch
from results import publish

SHAPES = {"smollm2": (30, 3, 64), "gemma3": (18, 1, 256)}  # layers, KV heads, head_dim


def prefill(shape: tuple[int, int, int], dtype: torch.dtype, bits: int, length: int, chunk: int, native: bool
            ) -> tuple[float, float, Any]:
    """One chunked prefill's seconds writing (advance) and reading back (dense_view), and the filled cache."""
    from multihead.cache import QuantizedKVCache, Slots
    from multihead.kernels import cpu, dense_view

    layers, g, d = shape
    cache = QuantizedKVCache(batch=1, n_kv_heads=g, head_dim=d, max_len=length, bits=bits, group=32, residual=128,
                             n_layers=layers, dtype=dtype)
    gen = torch.Generator().manual_seed(bits)
    chunks = [(torch.randn(1, g, min(chunk, length - i), d, generator=gen).to(dtype),
               torch.randn(1, g, min(chunk, length - i), d, generator=gen).to(dtype)) for i in range(0, length, chunk)]
    wrote = read = 0.0
    with torch.no_grad(), (contextlib.nullcontext() if native else cpu.disabled()):
        for k, v in chunks:
            s = k.shape[2]
            for layer in range(layers):
                view = cache.update(layer, k, v, Slots(s=s, t=cache.used + s, positions=None, start=None,
                                                       aligned=True))
                start = time.perf_counter()
                dense_view(view)
                read += time.perf_counter() - start
            start = time.perf_counter()
            cache.advance(s)
            wrote += time.perf_counter() - start
    return wrote, read, cache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    p.add_argument("--bits", nargs="+", type=int, choices=(2, 4, 8), default=[4, 8])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    for name, value, least in (("--rounds", args.rounds, 1), ("--length", args.length, 1), ("--chunk", args.chunk, 1)):
        if value < least:
            p.error(f"{name} ({value}) must be at least {least}")
    from multihead.kernels import native

    if native.unavailable() is not None:
        p.error(f"the native kernels are not available: {native.unavailable()}")
    lines = ["| model | dtype | bits | PyTorch writes ms | native writes ms | writes, native vs PyTorch | "
             "PyTorch reads ms | native reads ms | reads, native vs PyTorch |", "|---|---|---|---|---|---|---|---|---|"]
    for model in args.models:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for bits in args.bits:
                def run(fast: bool, model: str = model, dtype: torch.dtype = dtype, bits: int = bits
                        ) -> tuple[float, float, Any]:
                    return prefill(SHAPES[model], dtype, bits, args.length, args.chunk, fast)

                stores = [dict(run(fast)[2].named_buffers()) for fast in (False, True)]  # also the warm-up
                if any(not torch.equal(stores[0][key], stores[1][key]) for key in stores[0]):
                    raise SystemExit(f"{model} {dtype_name} {bits} bits: the two paths wrote different stores")
                times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
                for _ in range(args.rounds):
                    for fast in (False, True):
                        times[fast].append(run(fast)[:2])
                w = {fast: 1000 * statistics.median(t[0] for t in times[fast]) for fast in times}
                r = {fast: 1000 * statistics.median(t[1] for t in times[fast]) for fast in times}
                lines.append(f"| {model} | {dtype_name} | {bits} | {w[False]:.1f} | {w[True]:.1f} | "
                             f"{w[False] / w[True]:.2f}x | {r[False]:.1f} | {r[True]:.1f} | "
                             f"{r[False] / r[True]:.2f}x |")
                print(lines[-1], flush=True)
    text = (f"### A quantized cache's codec in a {args.length:,}-token prefill in chunks of {args.chunk} "
            f"({datetime.date.today()})\n\n" + bench.header("batch 1, group 32, residual 128", args.rounds)
            + f"; native kernels: {native.loaded_variant()}; the two paths wrote the same bytes (checked); "
            + "`benchmarks/codec.py`\n\n" + "\n".join(lines) + "\n")
    publish(text, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
