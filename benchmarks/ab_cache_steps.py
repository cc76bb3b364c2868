"""SmolLM2 decode steps at a long context through each cache kind: this checkout against another git revision, in one
process, step by step interleaved.

    .venv/bin/python benchmarks/ab_cache_steps.py --base REV [--length 8100] [--caches full int4 int8 sink headwise]
        [--dtypes float32 bfloat16] [--steps 40] [--record]

The package at ``--base`` is loaded beside the current one (``ab_decode.export``, its imports and torch operators
renamed); both prefill the same random prompt of ``--length`` tokens into a cache of the kind (in chunks of 512),
then each of ``--steps`` rounds takes one greedy decode step of each side, the side first alternating, after 4
untimed rounds. ``headwise`` is SmolLM2's shipped 50% plan (docs/experiments/smollm2-duo-50-plan.json). The ratio is
the new side's median step over the base's (below 1: the current checkout is faster).
Where ``benchmarks/cache_steps.py`` interleaves cache kinds and transformers within one tree, this interleaves the
two trees for one kind, so a change of the cache protocol or the dispatcher is seen apart from the host's drift.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench
import torch
from ab_decode import ROOT, export
from results import publish

CACHES = {"full": {}, "int4": {"bits": 4}, "int8": {"bits": 8}, "sink": {"window": 256, "sink_tokens": 4},
          "headwise": {"plan": "docs/experiments/smollm2-duo-50-plan.json"}}
CHUNK = 512


def runner(pkg: str, dtype: torch.dtype, cache_kind: str, prompt: torch.Tensor) -> Callable[[], None]:
    """One greedy decode step a call, of ``pkg``'s SmolLM2 after ``prompt`` went into a cache of the kind."""
    models: Any = importlib.import_module(f"{pkg}.models")
    model, _ = models.load_llama(dtype=dtype)
    options = dict(CACHES[cache_kind])
    if "plan" in options:  # the shipped 50% plan, read by this side's own HeadPlan
        options["plan"] = importlib.import_module(f"{pkg}.cache").HeadPlan.load(ROOT / options["plan"])
    length = prompt.shape[1]
    cache = (model.new_cache(1, **options) if "window" in options
             else model.new_cache(1, min(length + 64, model.config.max_context), **options))
    with torch.no_grad():
        for i in range(0, length, CHUNK):
            model(prompt[:, i:i + CHUNK], cache=cache)
            cache.advance(min(CHUNK, length - i))
    state = {"token": torch.tensor([[5]])}

    def step() -> None:
        with torch.no_grad():
            logits = model(state["token"], cache=cache)
        cache.advance(1)
        state["token"] = logits[:, -1:].argmax(-1)
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--length", type=int, default=8100, help="prompt tokens before the steps (default 8100)")
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=40, help="timed rounds (default 40)")
    parser.add_argument("--record", action="store_true", help="append the results to benchmarks/RESULTS.md")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="multihead-ab-"))
    base_rev = export(args.base, tmp)
    sys.path.insert(0, str(tmp))
    head_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    torch.manual_seed(0)
    prompt = torch.randint(100, 40000, (1, args.length))
    lines = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for kind in args.caches:
            runs = {name: runner(pkg, dtype, kind, prompt) for name, pkg in (("new", "multihead"),
                                                                            ("base", "multihead_base"))}
            for step in runs.values():
                for _ in range(4):
                    step()
            times: dict[str, list[float]] = {name: [] for name in runs}
            for r in range(args.steps):
                for name in (list(runs) if r % 2 else list(runs)[::-1]):
                    began = time.perf_counter()
                    runs[name]()
                    times[name].append(time.perf_counter() - began)
            new, base = (statistics.median(times[name]) * 1e3 for name in ("new", "base"))
            lines.append(f"| {dtype_name} | {kind} | {new:.1f} | {base:.1f} | {new / base:.3f} |")
            print(lines[-1], flush=True)
            del runs
    text = "\n".join([
        f"### SmolLM2-135M decode steps after {args.length} tokens, {head_rev} against {base_rev} "
        f"({datetime.date.today()})",
        f"machine: {bench.machine()}, torch {torch.__version__}; batch 1; one process, the two trees' steps "
        f"interleaved, median of {args.steps} (benchmarks/ab_cache_steps.py --base {args.base})",
        "",
        "| dtype | cache | new step ms | base step ms | new / base time |",
        "|---|---|---|---|---|",
        *lines,
    ]) + "\n"
    publish(text, args.record)


if __name__ == "__main__":
    main()
