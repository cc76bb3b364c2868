"""SmolLM2 greedy decoding, batch 1: multihead against transformers' generate on the same weights, in one process.

Each round times multihead (eager, and with ``--compile`` its compiled decoding step too) then transformers
(alternating), for float32 and bfloat16; the ratio of medians is reported with two memory-bandwidth bounds: bytes
of weights read per token over the measured copy rate (bytes copied per second, one direction counted) and over the
measured read rate (a large tensor summed). The compiled step is compiled once before the rounds (time reported).
"multihead plain" is the same model with :mod:`multihead.kernels.cpu`'s speed paths off (``cpu.disabled()``).

``--load N`` runs every round twice, first as the machine is, then with N busy processes this benchmark starts (pure
Python loops, one core each), and reports both conditions in one table; ``--follow-load`` turns on
:func:`multihead.kernels.cpu.follow_load` (a step runs with the threads of the free cores: opt-in, the same numbers).
``--tune`` measures this host's decisions for the model first (:func:`multihead.kernels.tuning.tune_model`, written to
the host's table; without it the table as it is, or the default rules, decide); the header says which.
``--profile`` adds, for each dtype, the ops taking the most self CPU time over ``--profile-tokens`` decoded tokens
(torch.profiler, key_averages) for multihead (eager, compiled with --compile) and transformers; with --load, under
the load too.

    .venv/bin/python benchmarks/decode.py [--new-tokens 128] [--rounds 5] [--compile] [--load N] [--follow-load]
        [--tune] [--profile] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
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


def busy(parent: int) -> None:
    """One core's worth of load: a pure-Python loop until terminated, or until the benchmark that started it is gone
    (killed: its daemon children are not cleaned up then)."""
    while os.getppid() == parent:
        for _ in range(1_000_000):
            pass


def start_load(n: int) -> list[multiprocessing.Process]:
    """N busy processes, started and given a second to show in the load readings."""
    procs = [multiprocessing.get_context("spawn").Process(target=busy, args=(os.getpid(),), daemon=True)
             for _ in range(n)]
    for proc in procs:
        proc.start()
    time.sleep(1.0)
    return procs


def stop_load(procs: list[multiprocessing.Process]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.join()


def uptime() -> str:
    """The load averages (1, 5, 15 minutes) as the kernel reports them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def profile_table(title: str, run: Callable[[], int], rows: int) -> list[str]:
    """The ``rows`` ops with the most self CPU time while ``run`` decodes, as a markdown table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        began = time.perf_counter()
        got = run()
        wall = time.perf_counter() - began
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    # multihead.kernels.native's kernels run through ctypes, outside any aten op: the profiler does not see them, so the
    # wall time beside the ops' total says how much went there (and to Python between the ops)
    lines = [f"{title} ({got} tokens, self CPU {total / 1e3:.0f} ms in aten ops, {wall * 1e3:.0f} ms wall: "
             f"{max(wall * 1e6 - total, 0.0) / 1e3 / max(got, 1):.1f} ms a token outside them, "
             "multihead.kernels.native's kernels and Python):", "",
             "| op | self CPU ms | of all | calls | per token ms |", "|---|---|---|---|---|"]
    for e in events[:rows]:
        lines.append(f"| {e.key} | {e.self_cpu_time_total / 1e3:.1f} | {e.self_cpu_time_total / total:.0%} | "
                     f"{e.count} | {e.self_cpu_time_total / 1e3 / max(got, 1):.2f} |")
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time multihead's compiled decoding step")
    parser.add_argument("--load", type=int, default=0, metavar="N",
                        help="also run every round with N busy background processes (one core each)")
    parser.add_argument("--follow-load", action="store_true",
                        help="a step runs with the threads of the free cores (multihead.kernels.cpu.follow_load)")
    parser.add_argument("--tune", action="store_true", help="tune this host's decisions for SmolLM2 first")
    parser.add_argument("--profile", action="store_true", help="per-op self CPU time for each dtype and model")
    parser.add_argument("--profile-tokens", type=int, default=16)
    parser.add_argument("--profile-rows", type=int, default=10)
    parser.add_argument("--record", action="store_true", help="append the results to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from multihead.kernels import cpu
    from multihead.models import load_llama

    cpu.follow_load(args.follow_load)
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

    conditions = ["as is"] + ([f"{args.load} busy"] if args.load else [])
    profiles: list[str] = []
    for dtype, (ours, hf) in models.items():
        def plain(m: Any = ours) -> int:
            with cpu.disabled():
                return sum(1 for _ in generate_ids(m, [prompt], max_new_tokens=n))

        runs: dict[str, Callable[[], int]] = {
            "multihead": lambda m=ours: sum(1 for _ in generate_ids(m, [prompt], max_new_tokens=n)),
            "multihead plain": plain,
        }
        if args.tune:  # the host's table for this model's shapes, written before anything is timed
            from multihead.kernels import tuning

            t = time.perf_counter()
            found = tuning.tune_model(ours, lengths=(len(prompt) + n,))
            notes.append(f"{dtype}: tuned {len(found)} decisions in {time.perf_counter() - t:.0f} s "
                         f"({', '.join(sorted(set(found.values())))})")
        notes.append(f"{dtype}: {len(cpu.table())} decisions in the host's table {cpu.table_path()}; the rest by "
                     "the default rules")
        sum(1 for _ in generate_ids(ours, [prompt], max_new_tokens=8))  # warm-up (allocation, the native build)
        if args.compile:
            runs["multihead compiled"] = lambda m=ours: sum(
                1 for _ in generate_ids(m, [prompt], max_new_tokens=n, compile=True))
            t = time.perf_counter()
            runs["multihead compiled"]()
            notes.append(f"{dtype}: compiling the decode step took {time.perf_counter() - t:.0f} s (once)")

        def hf_run(m: Any = hf, k: int = n) -> int:
            with torch.no_grad():
                m.generate(torch.tensor([prompt]), max_new_tokens=k, min_new_tokens=k, do_sample=False)
            return k

        runs["transformers"] = hf_run
        hf_run(k=8)
        weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
        for condition in conditions:
            procs = start_load(args.load) if condition != "as is" else []
            try:
                notes.append(f"{dtype}, {condition}: load averages before the rounds {uptime()}, "
                             f"following the load: {cpu.following_load()}, free threads {cpu.free_threads()}")
                speeds: dict[str, list[float]] = {name: [] for name in runs}
                for _ in range(args.rounds):
                    for name, run in runs.items():
                        speeds[name].append(tokens_per_second(run))
                if args.profile:
                    k = args.profile_tokens
                    picked: dict[str, Callable[[], int]] = {
                        "multihead": lambda m=ours, k=k: sum(1 for _ in generate_ids(m, [prompt], max_new_tokens=k)),
                        "transformers": lambda k=k: hf_run(k=k)}
                    if args.compile:
                        picked["multihead compiled"] = lambda m=ours, k=k: sum(
                            1 for _ in generate_ids(m, [prompt], max_new_tokens=k, compile=True))
                    for name, run in picked.items():
                        profiles += profile_table(f"{dtype}, {condition}, {name}", run, args.profile_rows)
            finally:
                stop_load(procs)
            h = statistics.median(speeds["transformers"])
            for name in runs:
                if name == "transformers":
                    continue
                o = statistics.median(speeds[name])
                lines.append(f"| {dtype} | {condition} | {name} | {o:.1f} | {h:.1f} | {o / h:.2f}x | "
                             f"{rate / weight_bytes:.1f} | {o / (rate / weight_bytes):.0%} | "
                             f"{read / weight_bytes:.1f} | {o / (read / weight_bytes):.0%} |")
    header = [
        f"### SmolLM2-135M greedy decode, batch 1, {n} new tokens ({datetime.date.today()})",
        f"machine: {bench.machine()}, torch {torch.__version__}; copy rate {rate / 1e9:.1f} GB/s "
        f"(one direction), read rate {read / 1e9:.1f} GB/s; median of {args.rounds} alternating rounds",
        *[f"{note}" for note in notes],
        "",
        "| dtype | load | ours | ours tok/s | transformers tok/s | ratio | copy bound tok/s | of it | read bound "
        "tok/s | of it |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    text = "\n".join(header + lines + (["", *profiles] if profiles else [])) + "\n"
    publish(text, args.record)


if __name__ == "__main__":
    main()
