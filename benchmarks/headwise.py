"""Prefill and decode time of SmolLM2 with the head-wise cache against the full cache, as ratios in one process.

    .venv/bin/python benchmarks/headwise.py [--lengths 4096 8192] [--fractions 0.25 0.5 0.75] [--rounds 3]
                                            [--chunk 512] [--window 256] [--sinks 4] [--steps 16] [--random]

For each prompt length, a random prompt is prefilled in chunks of ``--chunk`` tokens into a full cache
(:class:`~multihead.cache.KVCache`) and into a :class:`~multihead.cache.HeadwiseCache` whose plan keeps
``--fractions`` of the KV heads full (which ones: the top fraction of seeded random scores, so layers mix both
kinds as a real plan does) and the rest at ``--sinks`` + ``--window``; then ``--steps`` decode steps follow, timed
one by one (median). The caches run in turn, the order rotated every round, ``--rounds`` rounds; each figure is the
median over rounds and the ratio is head-wise / full (below 1: the head-wise cache is faster). The machine, its
load average before and after, torch and the date are printed beside the table; timings on a shared machine are
noise, so compare ratios from one process on an idle one. ``--random``: random weights of SmolLM2's shape (no
model file needed; the time is the same).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics

import bench
import ctxbench
import torch

from multihead.cache import HeadPlan
from multihead.models import LlamaModel


def plan_for(model: LlamaModel, fraction: float, *, sinks: int, window: int) -> HeadPlan:
    c, a = model.config, model.config.attention()
    assert a.n_kv_heads is not None and a.head_dim is not None
    scores = torch.rand(c.n_layers, a.n_kv_heads, generator=torch.Generator().manual_seed(0))
    return HeadPlan.from_scores(scores, fraction, sinks=sinks, window=window, model="SmolLM2-135M-Instruct",
                                shape=(c.n_layers, a.n_heads, a.n_kv_heads, a.head_dim), method="benchmark")


def run_once(model: LlamaModel, plan: HeadPlan | None, tokens: torch.Tensor, chunk: int, steps: int
             ) -> tuple[float, float, int]:
    """(prefill seconds, median decode step seconds, cache bytes) of one cache."""
    cache = ctxbench.make_cache(model, "full" if plan is None else "headwise", tokens.shape[1] + steps, plan=plan)
    prefill, times = ctxbench.prefill_decode(model, cache, tokens, chunk, steps)
    return prefill, statistics.median(times), cache.bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed after each prefill")
    p.add_argument("--random", action="store_true", help="random weights of SmolLM2's shape (no model file)")
    args = p.parse_args()
    if min(args.lengths) < 1 or args.rounds < 1 or args.chunk < 1 or args.steps < 1:
        p.error("--lengths, --rounds, --chunk and --steps must be positive")
    load_before = os.getloadavg()
    model = ctxbench.load(args.random)
    plans: list[tuple[str, HeadPlan | None]] = [("full cache", None)] + [
        (f"head-wise {f:.0%} full", plan_for(model, f, sinks=args.sinks, window=args.window))
        for f in args.fractions]
    rows = []
    for length in args.lengths:
        tokens = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
        seen: dict[str, list[tuple[float, float, int]]] = {name: [] for name, _ in plans}
        for r in range(args.rounds):
            for name, plan in plans[r % len(plans):] + plans[:r % len(plans)]:  # the order rotated every round
                seen[name].append(run_once(model, plan, tokens, args.chunk, args.steps))
        base_prefill = statistics.median(x[0] for x in seen["full cache"])
        base_step = statistics.median(x[1] for x in seen["full cache"])
        base_bytes = seen["full cache"][0][2]
        for name, _ in plans:
            prefill = statistics.median(x[0] for x in seen[name])
            step = statistics.median(x[1] for x in seen[name])
            rows.append((length, name, seen[name][0][2], seen[name][0][2] / base_bytes, prefill,
                         prefill / base_prefill, step, step / base_step))
    load_after = os.getloadavg()
    print(f"machine: {bench.machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{'random weights' if args.random else 'SmolLM2-135M-Instruct'} ({model.dtype}); "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(f"load average (1, 5, 15 min) before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    print(f"prefill in chunks of {args.chunk}, streaming KV heads at {args.sinks} sinks + window {args.window}; "
          f"{args.steps} decode steps after it (median); median of {args.rounds} round(s), order rotated; "
          "ratio = head-wise / full cache")
    print("| tokens | cache | bytes | bytes ratio | prefill s | prefill ratio | decode step ms | decode ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for length, name, size, size_ratio, prefill, prefill_ratio, step, step_ratio in rows:
        print(f"| {length} | {name} | {size:,} | {size_ratio:.3f} | {prefill:.3f} | {prefill_ratio:.3f} | "
              f"{step * 1e3:.2f} | {step_ratio:.3f} |")


if __name__ == "__main__":
    main()
