"""Peak memory of the retrieval scores at long context (issue 28): SmolLM2 on one passkey case of ~8k tokens.

The scores (multihead.heads.retrieval) read q and k at the hook points and reduce them block by block, so the peak
is the model's own working set (its full KV cache, one prefill chunk's attention) plus a few (b, h, block, t)
blocks, never a layer's (b, h, s, t) weights. Measured as the peak of the bytes torch allocates on the CPU while
the scores run (the profiler's allocation and free events in time order, above what was held before: the model's
weights are not counted), beside one layer's b * h * s * t float32 matrix and the KV cache's own bytes.

    .venv/bin/python benchmarks/retrieval_memory.py                  # 8144 tokens (8,192 less the answer room)
    .venv/bin/python benchmarks/retrieval_memory.py --length 2048 --block 64 --json
    .venv/bin/python benchmarks/retrieval_memory.py --rows 64       # the mass over the last 64 rows of each chunk

The logits of a prefill chunk (chunk x vocab float32: 96 MiB for SmolLM2 at chunk 512) are the model's own and are
in the peak.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import torch


def peak_cpu_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(peak bytes torch allocated on the CPU above the start while ``fn()`` ran, fn's result)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
                    if e.name() == "[memory]")
    held = peak = 0
    for _, n in events:
        held += n
        peak = max(peak, held)
    return peak, out


def _load() -> list[str]:
    from pathlib import Path

    return Path("/proc/loadavg").read_text().split()[:3]


def main() -> None:
    from multihead.heads.retrieval import RetrievalSettings, long_cases, retrieval_scores
    from multihead.models import load_llama

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=8144)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--rows", type=int, default=None,
                   help="the mass score over the last ROWS rows of each chunk (default every row): the peak is the "
                        "same (blocks run one after another), the time is not")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    model, tok = load_llama(None)
    cases = long_cases(tok, model.config.max_context, lengths=(args.length,), tasks=("passkey",), prompts=1)
    st = RetrievalSettings(sinks=args.sinks, window=args.window, block=args.block, chunk=args.chunk,
                           rows=args.rows, correct_only=False)
    load = _load()
    began = time.perf_counter()
    peak, scores = peak_cpu_bytes(lambda: retrieval_scores(model, cases, st, name="smollm2"))
    seconds = time.perf_counter() - began
    c = model.config
    s = len(cases[0].context_ids)
    matrix = 1 * c.n_heads * s * s * 4
    room = s + len(cases[0].question_ids) + len(cases[0].answer_ids)
    cache = int(model.new_cache(1, room).bytes)
    block = 1 * c.n_heads * args.block * room * 4
    result = {"model": "SmolLM2-135M-Instruct (float32)", "context_tokens": s, "chunk": args.chunk,
              "block": args.block, "rows": args.rows, "peak_bytes": peak, "kv_cache_bytes": cache,
              "one_layer_matrix_bytes": matrix,
              "one_block_bytes": block, "peak_over_matrix": round(peak / matrix, 4),
              "peak_less_cache_over_matrix": round((peak - cache) / matrix, 4), "correct": scores.cases[0]["correct"],
              "seconds": round(seconds, 1), "load_before": load, "load_after": _load(),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"}
    if args.json:
        print(json.dumps(result))
        return
    mib = 2**20
    print(f"{s} context tokens, chunk {args.chunk}, block {args.block}: peak {peak / mib:,.0f} MiB torch CPU "
          f"allocations (of which the KV cache {cache / mib:,.0f} MiB) against one layer's (b, h, s, t) float32 "
          f"matrix of {matrix / mib:,.0f} MiB: {peak / matrix:.1%} ({(peak - cache) / matrix:.1%} without the cache); "
          f"{seconds:.0f} s, load {' '.join(load)}")


if __name__ == "__main__":
    main()
