"""A long generation at constant memory: SmolLM2 decodes N tokens (default 20,000, past its 8,192-token context)
through a SinkCache (4 sinks + a window of 256), the process's resident memory (RSS) and the speed sampled every
``--every`` tokens. Writes the curve as JSON and a PNG; prints the growth of RSS after the first interval.

    python benchmarks/long_run.py [--tokens 20000] [--every 500] [--out long-run] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
from results import publish

from multihead.models import load_llama
from multihead.models.generate import Sampling, generate_ids


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=20_000)
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--out", default="long-run")
    p.add_argument("--record", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    model, tok = load_llama()
    prompt = tok.encode("Here is a long story about a hacker, a terminal and a very old computer. Once upon a time")
    curve = []
    began = last = time.perf_counter()
    n = 0
    for _ in generate_ids(model, [prompt], max_new_tokens=args.tokens, window=args.window, sink_tokens=4,
                          sampling=Sampling(temperature=1.0, top_p=0.95, seed=0)):
        n += 1
        if n % args.every == 0:
            now = time.perf_counter()
            curve.append({"tokens": n, "rss_bytes": rss_bytes(), "tokens_per_second": args.every / (now - last),
                          "seconds": now - began})
            last = now
            print(f"{n:>7} tokens  RSS {curve[-1]['rss_bytes'] / 2**20:8.1f} MiB  "
                  f"{curve[-1]['tokens_per_second']:6.1f} tok/s", flush=True)
    first, final = curve[0], curve[-1]
    growth = final["rss_bytes"] / first["rss_bytes"] - 1
    speeds = [c["tokens_per_second"] for c in curve]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"tokens": n, "window": args.window, "sink_tokens": 4, "curve": curve, "rss_growth": growth,
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    (out / "long-run.json").write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([c["tokens"] for c in curve], [c["rss_bytes"] / 2**20 for c in curve], marker="o", label="RSS (MiB)")
    ax2 = ax.twinx()
    ax2.plot([c["tokens"] for c in curve], speeds, color="tab:orange", marker="s", label="tokens / s")
    ax.set_xlabel("tokens generated")
    ax.set_ylabel("resident memory (MiB)")
    ax2.set_ylabel("tokens per second")
    ax.set_ylim(0, max(c["rss_bytes"] for c in curve) / 2**20 * 1.2)
    ax2.set_ylim(0, max(speeds) * 1.3)
    ax.set_title(f"SmolLM2, {n:,} tokens through 4 sinks + a window of {args.window}")
    fig.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "long-run.png")
    publish(f"### Long generation at constant memory ({result['date']})\n"
            f"SmolLM2-135M float32, {n:,} tokens sampled through SinkCache(window {args.window}, 4 sinks), "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads (benchmarks/long_run.py): RSS "
            f"{first['rss_bytes'] / 2**20:.0f} MiB at {first['tokens']} tokens, {final['rss_bytes'] / 2**20:.0f} MiB "
            f"at {final['tokens']:,} ({growth:+.1%}); speed {min(speeds):.1f}-{max(speeds):.1f} tokens/s per "
            f"{args.every}-token interval (median {sorted(speeds)[len(speeds) // 2]:.1f})", args.record)


if __name__ == "__main__":
    main()
