"""SmolLM2 greedy decoding, batch 1: multihead against transformers' generate on the same weights, in one process.

Each round times multihead (eager, and with ``--compile`` its compiled decoding step too) then transformers
(alternating), for float32 and bfloat16; the ratio of medians is reported with two memory-bandwidth bounds: bytes
of weights read per token over the measured copy rate (bytes copied per second, one direction counted) and over the
measured read rate (a large tensor summed). The compiled step is compiled once before the rounds (time reported).

    .venv/bin/python benchmarks/decode.py [--new-tokens 128] [--rounds 5] [--compile] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench
import torch
from results import publish

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def copy_rate(nbytes: int = 512 * 2**20) -> float:
    """Bytes read per second by a large tensor copy (one direction counted), the median of 7."""
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def read_rate(nbytes: int = 512 * 2**20) -> float:
    """Bytes read per second by summing a large tensor, the median of 7."""
    a = torch.ones(nbytes // 4)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time multihead's compiled decoding step")
    parser.add_argument("--record", action="store_true", help="append the results to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from multihead.models import load_llama
    from multihead.models.generate import generate_ids
    from tests_support import smollm2_gguf

    logging.set_verbosity_error()
    path = smollm2_gguf()
    ours32, tok = load_llama()
    hf32 = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16).eval()
    models = {"float32": (ours32, hf32), "bfloat16": (load_llama(dtype=torch.bfloat16)[0], hf16)}
    prompt = tok.encode("Once upon a time, in a land far away, there lived")
    n = args.new_tokens
    rate, read = copy_rate(), read_rate()
    lines, notes = [], []

    def tokens_per_second(run: Callable[[], int]) -> float:
        t = time.perf_counter()
        got = run()
        return got / (time.perf_counter() - t)

    for dtype, (ours, hf) in models.items():
        runs: dict[str, Callable[[], int]] = {
            "multihead": lambda m=ours: sum(1 for _ in generate_ids(m, [prompt], max_new_tokens=n)),
        }
        if args.compile:
            runs["multihead compiled"] = lambda m=ours: sum(
                1 for _ in generate_ids(m, [prompt], max_new_tokens=n, compile=True))
            t = time.perf_counter()
            runs["multihead compiled"]()
            notes.append(f"{dtype}: compiling the decode step took {time.perf_counter() - t:.0f} s (once)")

        def hf_run(m: Any = hf) -> int:
            with torch.no_grad():
                m.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            return n

        speeds: dict[str, list[float]] = {name: [] for name in [*runs, "transformers"]}
        for _ in range(args.rounds):
            for name, run in runs.items():
                speeds[name].append(tokens_per_second(run))
            speeds["transformers"].append(tokens_per_second(hf_run))
        weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
        h = statistics.median(speeds["transformers"])
        for name in runs:
            o = statistics.median(speeds[name])
            lines.append(f"| {dtype} | {name} | {o:.1f} | {h:.1f} | {o / h:.2f}x | {rate / weight_bytes:.1f} | "
                         f"{o / (rate / weight_bytes):.0%} | {read / weight_bytes:.1f} | "
                         f"{o / (read / weight_bytes):.0%} |")
    header = [
        f"### SmolLM2-135M greedy decode, batch 1, {n} new tokens ({datetime.date.today()})",
        f"machine: {bench.machine()}, torch {torch.__version__}; copy rate {rate / 1e9:.1f} GB/s "
        f"(one direction), read rate {read / 1e9:.1f} GB/s; median of {args.rounds} alternating rounds",
        *[f"{note}" for note in notes],
        "",
        "| dtype | ours | ours tok/s | transformers tok/s | ratio | copy bound tok/s | of it | read bound tok/s "
        "| of it |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    text = "\n".join(header + lines) + "\n"
    publish(text, args.record)


if __name__ == "__main__":
    main()
