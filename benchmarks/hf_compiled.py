"""Compiled decoding on the transformers path (issue 50 item 3): a model in transformers, its attention and products
on multihead (:func:`multihead.hf.enable`), transformers' StaticCache and ``torch.compile(model.forward)`` (inductor),
one token a step at explicit cache positions; against eager decoding over multihead's own full cache from the same
prefill, the two alternating step by step in one process. ``--anchor`` compiles transformers' own (sdpa, its
``nn.Linear``) instead of the multihead-switched model. One compiled variant a process: two compiled variants of one
``forward`` share dynamo's cache of it and run into its recompile limit.

multihead's own caches do not compile (:mod:`multihead.hf.cache` says why); this measures what does, and what the
eager path over multihead's caches costs against it.

    .venv/bin/python benchmarks/hf_compiled.py [--model smollm2|gemma3] [--dtype bfloat16|float32]
        [--cached 1024] [--steps 10] [--anchor] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from typing import Any

import bench
import torch
from hf_decode import load
from results import publish

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--cached", type=int, default=1024, help="tokens prefilled before the timed steps (default 1024)")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each variant (default 10)")
    p.add_argument("--anchor", action="store_true", help="compile transformers' own model (sdpa, nn.Linear) instead")
    p.add_argument("--record", action="store_true", help="append the result to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    if args.cached < 1 or args.steps < 1:
        p.error(f"--cached ({args.cached}) and --steps ({args.steps}) must be at least 1")
    from multihead import hf
    from multihead.kernels import native

    native.build_now()
    model = load(args.model).to(getattr(torch, args.dtype))
    hf.enable(model)
    ids = torch.randint(10, model.config.vocab_size, (1, args.cached), generator=torch.Generator().manual_seed(0))
    room = args.cached + 2 * (args.steps + 4)
    label = ("transformers sdpa + StaticCache, compiled" if args.anchor else
             "multihead attention and products + StaticCache, compiled")

    def switch(mine: bool) -> None:
        model.set_attn_implementation("multihead" if mine else "sdpa")
        hf.switch_products(model, mine)

    def prefill(cache: Any) -> None:
        with torch.no_grad():
            for i in range(0, args.cached, 512):
                model(ids[:, i:i + 512], cache=cache, logits_to_keep=1)

    from transformers import StaticCache

    switch(not args.anchor)
    static = StaticCache(config=model.config, max_cache_len=room)
    prefill(static)
    forward = torch.compile(model.forward)
    switch(True)
    eager = hf.new_cache(model, room)
    prefill(eager)
    position = {"compiled": args.cached}
    token = {"compiled": ids[:, -1:], "eager": ids[:, -1:]}

    def step(which: str) -> float:
        switch(which == "eager" or not args.anchor)
        with torch.no_grad():
            if which == "compiled":
                at = torch.tensor([position["compiled"]])
                start = time.perf_counter()
                logits = forward(token[which], cache=static, cache_position=at, position_ids=at[None]).logits
            else:
                start = time.perf_counter()
                logits = model(token[which], cache=eager).logits
            took = time.perf_counter() - start
        position["compiled"] += which == "compiled"
        token[which] = logits[:, -1:].argmax(-1)
        return took

    start = time.perf_counter()
    step("compiled")
    step("compiled")  # the first compiles; the second may recompile for the sizes that changed
    warm = time.perf_counter() - start
    step("eager")
    times: dict[str, list[float]] = {"compiled": [], "eager": []}
    for _ in range(args.steps):
        for which in times:
            times[which].append(step(which))
    ms = {which: 1000 * statistics.median(t) for which, t in times.items()}
    text = (f"### Compiled decoding on the transformers path, {args.model} {args.dtype}, {args.cached:,} cached "
            f"({datetime.date.today().isoformat()})\nmachine: {bench.machine()}; {args.steps} steps each, "
            f"alternating, median; `benchmarks/hf_compiled.py{' --anchor' if args.anchor else ''}`\n\n"
            f"| variant | ms a step |\n|---|---|\n| {label} (compiled and warm in {warm:.1f} s) | "
            f"{ms['compiled']:.1f} |\n| multihead full cache, eager | {ms['eager']:.1f} |\n")
    publish(text, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
