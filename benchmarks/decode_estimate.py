"""The decode estimate of `multihead count --hardware cpu` against multihead's measured SmolLM2 decode (issue 29).

One process: the CPU's read bandwidth and matmul rate are measured (multihead.sizing.hardware.measure_cpu),
multihead.sizing.hardware estimates a decode step of SmolLM2-135M (the preset; float32 weights and cache, batch 1, at
the mean context of the run) from them, and multihead's greedy decode of the shipped checkpoint is timed (eager,
float32, median of the rounds). The ratio measured / estimated is reported at the stated bandwidth efficiency and at
100% of the measured bandwidth. Run small here; record on an idle machine.

    .venv/bin/python benchmarks/decode_estimate.py [--new-tokens 32] [--rounds 3] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import bench
import torch
from results import publish

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--record", action="store_true", help="append the results to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    from multihead.models import load_llama
    from multihead.models.generate import generate_ids
    from multihead.sizing import model_size
    from multihead.sizing.hardware import BANDWIDTH_EFFICIENCY, estimate, measure_cpu
    from multihead.sizing.presets import preset

    model, tok = load_llama()
    prompt = tok.encode("Once upon a time, in a land far away, there lived")
    n = args.new_tokens
    device = measure_cpu()
    config = preset("smollm2-135m")
    context = len(prompt) + n // 2
    kw = {"seq": context, "batch": 1, "dtype": "fp32", "weights_dtype": "fp32"}
    est = estimate(config, model_size(config), device, **kw)["decode"]
    full = estimate(config, model_size(config), device, bandwidth_efficiency=1.0, **kw)["decode"]

    generate_ids(model, [prompt], max_new_tokens=2)  # warm-up
    speeds = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        got = sum(1 for _ in generate_ids(model, [prompt], max_new_tokens=n))
        speeds.append(got / (time.perf_counter() - t))
    measured = statistics.median(speeds)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = "\n".join([
        f"### Decode estimate against a measured decode: SmolLM2-135M, float32, batch 1 ({datetime.date.today()})",
        f"machine: {bench.machine()}, torch {torch.__version__}, load average {load:.1f}; measured read bandwidth "
        f"{device.bandwidth / 1e9:.1f} GB/s, fp32 matmul {device.flops['fp32'] / 1e9:.0f} GFLOP/s; {n} new tokens "
        f"after a {len(prompt)}-token prompt (estimate at context {context}), median of {args.rounds} rounds",
        "",
        "| | tok/s | bound | measured / estimate |",
        "|---|---|---|---|",
        f"| estimate, {BANDWIDTH_EFFICIENCY:.0%} of the bandwidth | {est['tokens_per_second']:.1f} | {est['bound']} | "
        f"{measured / est['tokens_per_second']:.2f} |",
        f"| estimate, 100% of the bandwidth | {full['tokens_per_second']:.1f} | {full['bound']} | "
        f"{measured / full['tokens_per_second']:.2f} |",
        f"| multihead measured | {measured:.1f} | | |",
    ]) + "\n"
    publish(text, args.record)


if __name__ == "__main__":
    main()
