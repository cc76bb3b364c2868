"""A decode step's one-row products, each kind of :mod:`multihead.layers.linear` over every ``nn.Linear`` of a real
model (SmolLM2-135M, Gemma 3 270M in transformers; the tied LM head included), alternating kind by kind in one
process: what each kind costs a step and the speed it reads the weights at.

Each round runs every kind the shape may take (:func:`multihead.layers.linear.kinds`: "linear" is F.linear, "native"
the C kernel where it built vectorised for the dtype) once over all the model's weights in turn, one row each, in
inference; the table gives each kind's median over the rounds, its GB/s (the weights' bytes over the time) and its
speed against F.linear. Every kind's result is checked against F.linear first (the same product within the dtype's
rounding), so a fast wrong kind is refused, not timed.

    .venv/bin/python benchmarks/products.py [--models smollm2 gemma3] [--dtypes float32 bfloat16] [--rounds 9]
        [--record]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Any

import bench
import torch
from hf_decode import load
from results import publish


def weights_of(model: Any, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every ``nn.Linear`` weight of the model (a tied LM head once), in ``dtype``, contiguous."""
    model.to(dtype)
    seen: set[int] = set()
    out = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            out.append(module.weight.detach().contiguous())
    return out


def measure(weights: list[torch.Tensor], rounds: int) -> dict[str, list[float]]:
    from multihead.kernels import cpu
    from multihead.layers import linear

    dtype = weights[0].dtype
    rows = {w.shape[1]: torch.randn(1, w.shape[1], dtype=dtype) for w in weights}
    blocks = {id(w): cpu.split_product(1, w, rows[w.shape[1]]) for w in weights}
    kinds = linear.kinds(1, dtype)
    tol = 1e-4 if dtype == torch.float32 else 2.0**-7
    with torch.no_grad():
        for w in weights[:8] + weights[-1:]:
            x, n = rows[w.shape[1]], blocks[id(w)]
            ref = torch.nn.functional.linear(x.double(), w.double())
            for kind in kinds:
                got = linear.run(kind, x, w, None, n)
                err = ((got.double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
                if err > tol:
                    raise SystemExit(f"kind {kind!r} on {tuple(w.shape)} {dtype}: error {err:.2e} over {tol:.0e}")
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for r in range(rounds + 1):  # the first round untimed (a warm-up)
            for kind in kinds:
                start = time.perf_counter()
                for w in weights:
                    linear.run(kind, rows[w.shape[1]], w, None, blocks[id(w)])
                if r:
                    times[kind].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=("smollm2", "gemma3"), default=["smollm2", "gemma3"])
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds ({args.rounds}) must be at least 1")
    from multihead.kernels import native

    lines = ["| model | dtype | kind | ms a step's products | GB/s | vs F.linear |", "|---|---|---|---|---|---|"]
    for name in args.models:
        model = load(name)
        for dtype_name in args.dtypes:
            weights = weights_of(model, getattr(torch, dtype_name))
            size = sum(w.numel() * w.element_size() for w in weights)
            times = measure(weights, args.rounds)
            anchor = statistics.median(times["linear"])
            for kind, took in times.items():
                ms = statistics.median(took)
                lines.append(f"| {name} | {dtype_name} | {kind} | {1000 * ms:.1f} | {size / ms / 1e9:.1f} | "
                             f"{anchor / ms:.2f}x |")
                print(lines[-1], flush=True)
        del model
    text = (f"### A decode step's one-row products by kind ({datetime.date.today()})\n\n"
            + bench.header("float32 and bfloat16", args.rounds)
            + f"; native kernels: {native.loaded_variant() or native.unavailable()}; every nn.Linear of the model "
            + "once a round at one row, the kinds taking turns, after a round untimed; `benchmarks/products.py`\n\n"
            + "\n".join(lines) + "\n")
    publish(text, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
