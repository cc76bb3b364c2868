"""Throughput of the long-context evaluation itself (issue 39 item 2): cases an hour, by protocol, length and dtype.

    .venv/bin/python benchmarks/shared_throughput.py [--lengths 4096 8144] [--dtypes float32 bfloat16] [--cases 3]
        [--json docs/experiments/long-context-throughput.json]

SmolLM2 on this machine, the evaluation's own cases (the first ``--cases`` of passkey and single-number, taking
turns) and methods (the full cache, sinks + window at 50% and 25%, int8, int4, the shipped DuoAttention plan at 50%
and its uniform control). For each (length, dtype):

- shared prefill (:func:`multihead.tradeoff.longctx.shared.answer_case`): the prefill's seconds a case and each
  method's (compress + question + answer), so cases an hour for every method together and for one method with the
  full cache;
- streaming (:func:`multihead.evals.answers.run_prompt`: the method prefills through its own cache), for the full
  cache and one method (sinks + window 50%): seconds a case each;
- a batch of two contexts in one prefill against two prefills (float32 and bfloat16 at the first length only): the
  ratio says whether batching cases pays on this CPU;
- bfloat16's answers against float32's on the same cases (the full cache's).

Run it on an idle machine (the figures are wall-clock seconds); it says the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

from multihead.evals.answers import prefill, run_prompt
from multihead.evals.needles import make_cases
from multihead.evals.text import read_text, token_splits
from multihead.models import default_gguf_path, load_llama
from multihead.tradeoff.longctx import Settings, shared

PLAN = "docs/experiments/smollm2-duo-50-plan.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8144])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--cases", type=int, default=3, help="cases per (length, dtype)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    answers: dict[str, dict[str, bool]] = {}
    for dtype in args.dtypes:
        model, tok = load_llama(default_gguf_path(), dtype=getattr(torch, dtype))
        test = token_splits(tok.encode(read_text(None)), least=2).test
        for length in args.lengths:
            settings = Settings(lengths=(length,), tasks=("passkey", "single-number"), prompts=args.cases,
                                window_keep=(), bits=(8, 4), mqa=False, prune=(), plans=(PLAN,))
            methods = shared.cache_methods(settings.methods(model.config.n_kv_heads))
            cases = shared.interleaved(make_cases(settings, tok, test, max_context=model.config.max_context))
            cases = cases[:args.cases]
            shared.answer_case(model, cases[0], methods[:1], settings.chunk)  # warm-up: first-call costs
            records = [shared.answer_case(model, c, methods, settings.chunk) for c in cases]
            for r in records:
                answers.setdefault(r["id"], {})[dtype] = bool(r["methods"]["full cache"]["correct"])
            prefill_s = statistics.fmean(r["prefill_seconds"] for r in records)
            per = {m.name: statistics.fmean(r["methods"][m.name]["seconds"] for r in records) for m in methods}
            streaming = {}
            for m in (methods[0], next(m for m in methods if m.name.endswith("window 50%"))):
                began = time.perf_counter()
                for c in cases:
                    run_prompt(model, m, [c], chunk=settings.chunk)
                streaming[m.name] = (time.perf_counter() - began) / len(cases)
            row: dict[str, Any] = {
                "length": length, "dtype": dtype, "cases": len(cases), "methods": len(methods),
                "prefill_seconds": prefill_s, "method_seconds": per,
                "shared_cases_per_hour_all_methods": 3600 / (prefill_s + sum(per.values())),
                "shared_cases_per_hour_one_method": {n: 3600 / (prefill_s + s + per["full cache"])
                                                     for n, s in per.items() if n != "full cache"},
                "streaming_seconds_per_case": streaming,
                "streaming_cases_per_hour_all_methods_estimate":
                    3600 / (len(methods) * statistics.fmean(streaming.values())),
            }
            if length == args.lengths[0]:
                row["batch2_over_two_prefills"] = batch_ratio(model, cases[:2], settings.chunk)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del model
    agree = {i: a for i, a in answers.items() if len(a) == len(args.dtypes)}
    result = {"what": __doc__.split("\n")[0], "rows": rows,
              "full_cache_answers": {"cases": len(agree),
                                     "same_across_dtypes": sum(len(set(a.values())) == 1 for a in agree.values()),
                                     "by_case": agree},
              "load_before": load_before, "load_after": os.getloadavg(), "threads": torch.get_num_threads(),
              "machine": f"{platform.machine()} {platform.processor()}".strip(), "torch": torch.__version__,
              "date": date.today().isoformat()}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


def batch_ratio(model: Any, cases: list[Any], chunk: int) -> float:
    """Seconds of one prefill of two contexts as a batch over two prefills of one (the shorter length of the two)."""
    n = min(len(c.context_ids) for c in cases)
    ids = [list(c.context_ids[:n]) for c in cases]
    began = time.perf_counter()
    for one in ids:
        prefill(model, one, model.new_cache(1, n), chunk)
    single = time.perf_counter() - began
    tokens = torch.tensor(ids)
    cache = model.new_cache(2, n)
    began = time.perf_counter()
    with torch.no_grad():
        for start in range(0, n, chunk):
            model(tokens[:, start:start + chunk], cache=cache, logits_to_keep=1)
            cache.advance(min(chunk, n - start))
    return (time.perf_counter() - began) / single


if __name__ == "__main__":
    main()
