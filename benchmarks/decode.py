"""SmolLM2 greedy decoding, batch 1: multihead against transformers' generate on the same weights, in one process.

Each round times multihead then transformers (alternating), for float32 and bfloat16; the ratio of medians is
reported with the memory-bandwidth bound (bytes of weights read per token over the measured copy rate).

    .venv/bin/python benchmarks/decode.py [--new-tokens 128] [--rounds 5] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def machine() -> str:
    """The CPU's model name, from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
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
    rate = copy_rate()
    lines = []
    for dtype, (ours, hf) in models.items():
        ours_tps, hf_tps = [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            got = sum(1 for _ in generate_ids(ours, [prompt], max_new_tokens=n))
            ours_tps.append(got / (time.perf_counter() - t))
            t = time.perf_counter()
            with torch.no_grad():
                hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            hf_tps.append(n / (time.perf_counter() - t))
        weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
        bound = rate / weight_bytes
        o, h = statistics.median(ours_tps), statistics.median(hf_tps)
        lines.append(f"| {dtype} | {o:.1f} | {h:.1f} | {o / h:.2f}x | {bound:.1f} | {o / bound:.0%} |")
    header = [
        f"### SmolLM2-135M greedy decode, batch 1, {n} new tokens ({datetime.date.today()})",
        f"machine: {machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"copy rate {rate / 1e9:.1f} GB/s; median of {args.rounds} alternating rounds",
        "",
        "| dtype | multihead tok/s | transformers tok/s | ratio | bandwidth bound tok/s | of bound |",
        "|---|---|---|---|---|---|",
    ]
    text = "\n".join(header + lines) + "\n"
    print(text)
    if args.record:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
