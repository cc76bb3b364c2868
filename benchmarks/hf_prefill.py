"""The transformers path's chunked prefill (issue 50 item 2): a model in transformers prefilling a context in chunks
into each multihead cache kind, against transformers' own sdpa attention and DynamicCache, in one process, the
variants taking turns.

For each model, dtype and length: the same random context (seeded) is prefilled in chunks of ``--chunk`` tokens
(``logits_to_keep=1``, as ``generate`` does), into a new cache of each variant, ``--rounds`` times after one untimed
round, the variants taking turns chunk by chunk, in an order that rotates round by round (no variant always runs
after the same one); the table gives each variant's median seconds (its chunks summed) and its speed against
transformers' (>1: faster) as the median over the rounds of each round's ratio (transformers' seconds over the
variant's, the pair timed side by side), with the lowest and highest of those ratios: a speed whose range straddles
1.0 is not told apart from transformers' on that run. The variants are those of ``benchmarks/hf_decode.py``:
transformers' sdpa + DynamicCache with its own ``nn.Linear``; multihead's attention (``hf.enable``) with its
products over each kind (full, sinks + window, int8, int4, head-wise 50% and 25%); and the full kind with
transformers' products. Each
variant's last logits are compared with transformers' (the largest difference over the vocabulary, in the table):
the full kind computes the same prefill and must agree within the dtype's rounding; the other kinds see fewer or
rounded keys and are not expected to.

``--load N`` repeats the rounds with N busy processes (one core each); multihead's prefill follows the load
(:func:`multihead.kernels.cpu.follow_load`, the default), transformers' does not.

    .venv/bin/python benchmarks/hf_prefill.py [--models smollm2 gemma3] [--dtypes float32 bfloat16]
        [--lengths 1024 4096] [--chunk 512] [--rounds 3] [--load 0] [--json out.json] [--resume] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import bench
import torch
from hf_decode import SINKS, THEIR_PRODUCTS, WINDOW, bench_load, load, plans
from results import publish

ANCHOR = "transformers sdpa + DynamicCache"


def variants(model: Any, room: int, plan_of: dict[str, Any]) -> dict[str, Any]:
    """Each variant's label and a function making its empty cache."""
    from transformers import DynamicCache

    from multihead import hf

    return {ANCHOR: lambda: DynamicCache(config=model.config),
            "multihead full": lambda: hf.new_cache(model, room),
            "multihead sinks + window": lambda: hf.new_cache(model, room, window=WINDOW, sink_tokens=SINKS),
            "multihead int8": lambda: hf.new_cache(model, room, bits=8),
            "multihead int4": lambda: hf.new_cache(model, room, bits=4),
            **{f"multihead {label}": (lambda p=p: hf.new_cache(model, room, plan=p)) for label, p in plan_of.items()},
            THEIR_PRODUCTS: lambda: hf.new_cache(model, room)}


def use(model: Any, label: str) -> None:
    """Switch the model to the variant's attention and products (and its steps' load following)."""
    from multihead import hf
    from multihead.kernels import cpu

    mine = label.startswith("multihead")
    model.set_attn_implementation("multihead" if mine else "sdpa")
    hf.switch_products(model, mine and label != THEIR_PRODUCTS)
    cpu.follow_load(mine)


def prefill_round(model: Any, made: dict[str, Any], ids: torch.Tensor, chunk: int, turn: int = 0
                  ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One chunked prefill of ``ids`` into a new cache of every variant, the variants taking turns chunk by chunk
    (a slow moment of the host falls on all of them alike), the first to run being the ``turn``-th (modulo their
    number): each variant's seconds, summed over its chunks, and its last logits (float32)."""
    use(model, "multihead full")  # a multihead cache is made for a model on multihead's attention
    labels = list(made)
    first = turn % len(labels)
    caches = {label: made[label]() for label in labels[first:] + labels[:first]}
    took = dict.fromkeys(made, 0.0)
    last: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i in range(0, ids.shape[1], chunk):
            for label, cache in caches.items():
                use(model, label)
                start = time.perf_counter()
                logits = model(ids[:, i:i + chunk], cache=cache, logits_to_keep=1).logits
                took[label] += time.perf_counter() - start
                last[label] = logits[0, -1].float()
    return took, last


def cell(name: str, model: Any, dtype: torch.dtype, length: int, *, chunk: int, rounds: int, load: int,
         plan_of: dict[str, Any]) -> list[dict[str, Any]]:
    from multihead import hf
    from multihead.kernels import cpu

    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(10, model.config.vocab_size, (1, length), generator=gen)
    hf.enable(model)  # multihead's attention is registered; each variant sets the implementation and the products
    made = variants(model, length, plan_of)
    rows = []
    for condition, busy in [("idle", 0)] + ([(f"{load} busy", load)] if load else []):
        times: dict[str, list[float]] = {label: [] for label in made}
        with bench_load(busy):
            for r in range(rounds + 1):  # the first round untimed
                took, last = prefill_round(model, made, ids, chunk, turn=r)
                if r:
                    for label, seconds in took.items():
                        times[label].append(seconds)
        cpu.follow_load(None)
        for label in made:
            ratios = [a / s for a, s in zip(times[ANCHOR], times[label], strict=True)]  # round by round
            rows.append({"model": name, "dtype": str(dtype).removeprefix("torch."), "length": length,
                         "condition": condition, "variant": label,
                         "seconds": round(statistics.median(times[label]), 3),
                         "speed_vs_transformers": round(statistics.median(ratios), 3),
                         "speed_low": round(min(ratios), 3), "speed_high": round(max(ratios), 3),
                         "max_logit_diff": round((last[label] - last[ANCHOR]).abs().max().item(), 4)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | dtype | tokens | condition | variant | prefill s | vs transformers | rounds' range | last "
             "logits vs transformers' |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spread = f"{r['speed_low']:.2f}-{r['speed_high']:.2f}" if "speed_low" in r else "-"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['length']:,} | {r['condition']} | {r['variant']} | "
                     f"{r['seconds']:.2f} | {r['speed_vs_transformers']:.2f}x | {spread} | "
                     f"{r['max_logit_diff']:.3g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=("smollm2", "gemma3"), default=["smollm2", "gemma3"])
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--load", type=int, default=0, help="also prefill with N busy processes (default 0: idle only)")
    p.add_argument("--json", type=Path, default=None, help="write the rows and the machine to this JSON file")
    p.add_argument("--resume", action="store_true", help="keep the cells the --json file holds and run the rest")
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    for flag, value in (("--chunk", args.chunk), ("--rounds", args.rounds), *(("--lengths", n) for n in args.lengths)):
        if value < 1:
            p.error(f"{flag} must be at least 1, got {value}")
    if args.load < 0:
        p.error(f"--load must be at least 0, got {args.load}")
    if args.resume and args.json is None:
        p.error("--resume needs --json (the file of the run it resumes)")
    from multihead.kernels import native

    native.build_now()
    rows: list[dict[str, Any]] = []
    if args.resume and args.json.exists():
        rows = json.loads(args.json.read_text())["rows"]
    done = {(r["model"], r["dtype"], r["length"]) for r in rows}
    for name in args.models:
        if all((name, d, n) in done for d in args.dtypes for n in args.lengths):
            continue
        model = load(name)
        plan_of = plans(name, model)
        for dtype_name in args.dtypes:
            model.to(getattr(torch, dtype_name))
            for length in args.lengths:
                if (name, dtype_name, length) in done:
                    continue
                found = cell(name, model, getattr(torch, dtype_name), length, chunk=args.chunk,
                             rounds=args.rounds, load=args.load, plan_of=plan_of)
                rows.extend(found)
                print(table(found), flush=True)
                if args.json is not None:
                    write_json(args.json, rows)
        del model
    text = (f"### The transformers path's chunked prefill against transformers' sdpa + DynamicCache "
            f"({datetime.date.today()})\nmachine: {bench.machine()}; chunks of {args.chunk} tokens, "
            f"logits_to_keep=1, a new cache each round, the variants taking turns chunk by chunk in an order rotating "
            f"round by round; seconds: the median of {args.rounds} rounds after one untimed; speed: the median of the "
            f"rounds' ratios, with their range; `benchmarks/hf_prefill.py`\n\n{table(rows)}\n")
    publish(text, args.record)
    if args.json is not None:
        write_json(args.json, rows)
    return 0


def write_json(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": bench.machine(), "date": datetime.date.today().isoformat(),
                                "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
