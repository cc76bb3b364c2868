"""SmolLM2 through transformers (its own modules and weights, read from the GGUF), batch 4, 512 tokens with left
padding, float32 on the CPU: the attention implementation "multihead" against transformers' "sdpa" and "eager".

    .venv/bin/python benchmarks/hf_forward.py [--rounds 3] [--record]

- speed: one process, the three implementations alternating on the same model (set_attn_implementation between
  calls), tokens per second of a forward, median of the rounds;
- peak memory of a forward above the loaded model, each implementation in a fresh process (RSS high-water mark);
- capturing every head's pattern: multihead's hook_pattern (the fused kernel keeps the output) against
  ``output_attentions=True`` with eager, time and peak memory likewise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench
import torch
from results import publish

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
BATCH, TOKENS = 4, 512
RUNS = ("multihead", "sdpa", "eager", "capture: multihead hooks", "capture: eager output_attentions")


def setup() -> tuple[Any, torch.Tensor, torch.Tensor]:
    from transformers.utils import logging

    from multihead import hf
    from multihead.models import default_gguf_path

    logging.set_verbosity_error()
    model = hf.load(default_gguf_path())
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(20, model.config.vocab_size, (BATCH, TOKENS), generator=gen)
    mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
    for row, pad in enumerate((0, 64, 128, 192)):  # left padding
        mask[row, :pad] = 0
    return model, ids, mask


def run(model: Any, name: str, ids: torch.Tensor, mask: torch.Tensor) -> object:
    from multihead.layers.hooks import run_with_cache

    with torch.no_grad():
        if name == "capture: multihead hooks":
            model.set_attn_implementation("multihead")
            return run_with_cache(model, ids, attention_mask=mask, names="*.hook_pattern")
        if name == "capture: eager output_attentions":
            model.set_attn_implementation("eager")
            return model(ids, attention_mask=mask, output_attentions=True)
        model.set_attn_implementation(name)
        return model(ids, attention_mask=mask)


def memory_child(name: str) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    model, ids, mask = setup()
    run(model, name, ids[:, :64], mask[:, :64])  # warm-up at a small size
    print(json.dumps({"extra": bench.peak_extra_bytes(lambda: run(model, name, ids, mask), torch.device("cpu"))}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child)
        return
    torch.set_num_threads(os.cpu_count() or 1)
    model, ids, mask = setup()
    for name in RUNS:
        run(model, name, ids, mask)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    for _ in range(args.rounds):
        for name in RUNS:
            t = time.perf_counter()
            run(model, name, ids, mask)
            times[name].append(time.perf_counter() - t)
    memory = {}
    for name in RUNS:
        done = subprocess.run([sys.executable, __file__, "--memory-child", name], capture_output=True, text=True,
                              check=True, cwd=ROOT)
        memory[name] = json.loads(done.stdout.strip().splitlines()[-1])["extra"]
    real = int(mask.sum())
    ours = statistics.median(times["multihead"])
    rows = []
    for name in RUNS:
        t = statistics.median(times[name])
        versus = ours if not name.startswith("capture") else statistics.median(times["capture: multihead hooks"])
        rows.append(f"| {name} | {t:.2f} s | {real / t:.0f} | {t / versus:.2f}x | {memory[name] / 2**20:.0f} MiB |")
    text = "\n".join([
        f"### SmolLM2-135M through transformers, batch {BATCH} x {TOKENS} tokens, left padding "
        f"({datetime.date.today()})",
        f"machine: {bench.machine()}, torch {torch.__version__}, float32; one process, median of {args.rounds} "
        "alternating rounds; peak memory above the loaded model in a fresh process each (benchmarks/hf_forward.py)",
        "",
        "| attention | forward | real tokens/s | time / multihead's | peak extra memory |",
        "|---|---|---|---|---|",
        *rows,
    ]) + "\n"
    publish(text, args.record)


if __name__ == "__main__":
    main()
