"""A decode step's one-row products, each kind of :mod:`multihead.layers.linear` over every ``nn.Linear`` of a real
model (SmolLM2-135M, Gemma 3 270M in transformers; the tied LM head included), alternating kind by kind in one
process: what each kind costs a step and the speed it reads the weights at. ``--rows N`` multiplies N rows instead
(a batch's decode step, or a prefill chunk's products: past the split's 64 rows the kinds are F.linear and, in
float32, oneDNN's matmul; the LM head is left out there, as a prefill with ``logits_to_keep=1`` runs it at one row).

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


def kinds_at(n_rows: int, dtype: torch.dtype) -> tuple[str, ...]:
    """The kinds a product of ``n_rows`` rows in ``dtype`` may take."""
    from multihead.kernels import cpu
    from multihead.layers import linear

    if n_rows <= cpu.SPLIT_MAX_ROWS:
        return linear.kinds(n_rows, dtype)
    return linear.MANY_ROW_KINDS if dtype == torch.float32 else ("linear",)


def measure(weights: list[torch.Tensor], rounds: int, n_rows: int = 1) -> dict[str, list[float]]:
    from multihead.kernels import cpu
    from multihead.layers import linear

    dtype = weights[0].dtype
    rows = {w.shape[1]: torch.randn(n_rows, w.shape[1], dtype=dtype) for w in weights}
    blocks = {id(w): cpu.split_product(n_rows, w, rows[w.shape[1]]) for w in weights}
    kinds = kinds_at(n_rows, dtype)
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
    p.add_argument("--rows", type=int, default=1, help="rows a product (default 1: a decode step)")
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds ({args.rounds}) must be at least 1")
    if args.rows < 1:
        p.error(f"--rows ({args.rows}) must be at least 1")
    from multihead.kernels import native

    lines = ["| model | dtype | rows | kind | ms over the weights | GB/s | GFLOP/s | vs F.linear |",
             "|---|---|---|---|---|---|---|---|"]
    for name in args.models:
        model = load(name)
        vocab = model.config.vocab_size
        for dtype_name in args.dtypes:
            weights = weights_of(model, getattr(torch, dtype_name))
            if args.rows > 1:  # a prefill runs the head at one row (logits_to_keep=1)
                weights = [w for w in weights if w.shape[0] != vocab]
            size = sum(w.numel() * w.element_size() for w in weights)
            flops = 2 * args.rows * sum(w.numel() for w in weights)
            times = measure(weights, args.rounds, args.rows)
            anchor = statistics.median(times["linear"])
            for kind, took in times.items():
                ms = statistics.median(took)
                lines.append(f"| {name} | {dtype_name} | {args.rows} | {kind} | {1000 * ms:.1f} | "
                             f"{size / ms / 1e9:.1f} | {flops / ms / 1e9:.0f} | {anchor / ms:.2f}x |")
                print(lines[-1], flush=True)
        del model
    what = "one-row products" if args.rows == 1 else f"products at {args.rows} rows"
    text = (f"### A model's {what} by kind ({datetime.date.today()})\n\n"
            + bench.header("float32 and bfloat16", args.rounds)
            + f"; native kernels: {native.loaded_variant() or native.unavailable()}; every nn.Linear of the model "
            + f"once a round at {args.rows} row(s), the kinds taking turns, after a round untimed; "
            + f"`benchmarks/products.py --rows {args.rows}`\n\n" + "\n".join(lines) + "\n")
    publish(text, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
