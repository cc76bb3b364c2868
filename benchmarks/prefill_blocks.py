"""A whole chunked prefill on the transformers path with a dtype's causal squares in query blocks and without (the
model-level figure behind :data:`multihead.kernels.sdpa.CAUSAL_BLOCKS`), alternating in one process.

``benchmarks/prefill_attention.py`` times the attention calls alone; here a model (SmolLM2 or Gemma 3 in transformers,
``hf.enable``) prefills a seeded random context in chunks into a new multihead cache of each kind (full, 4-bit), once
with :func:`multihead.kernels.sdpa.causal_blocks` as shipped and once with ``--dtype`` in blocks too (or, for a dtype
that runs in blocks, without them), the arms taking turns and their order reversed every round. The table gives each
arm's median seconds, the speed of the blocks against one call as the median of the rounds' ratios with their range,
and the largest difference of the two arms' last logits.

    .venv/bin/python benchmarks/prefill_blocks.py [--models smollm2] [--dtype float32] [--length 1024] [--chunk 512]
        [--rounds 10] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import bench
import torch
from hf_decode import load
from results import publish

from multihead.kernels import sdpa

KINDS = {"full": {}, "int4": {"bits": 4}}


@contextmanager
def blocks(dtype: torch.dtype, on: bool) -> Iterator[None]:
    """Causal squares of ``dtype`` in blocks (``on``) or in one call, whatever :func:`sdpa.causal_blocks` says."""
    real = sdpa.causal_blocks

    def causal_blocks(s: int, d: torch.dtype) -> bool:
        if d != dtype:
            return real(s, d)
        return on and sdpa.CAUSAL_BLOCKS[0] < s <= sdpa.CAUSAL_BLOCKS[1]

    sdpa.causal_blocks = causal_blocks  # read by splits and key_blocks, the dispatcher's two questions
    try:
        yield
    finally:
        sdpa.causal_blocks = real


def prefill(model: Any, ids: torch.Tensor, chunk: int, kind: dict[str, Any]) -> tuple[float, torch.Tensor]:
    from multihead import hf

    cache = hf.new_cache(model, ids.shape[1], **kind)
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, ids.shape[1], chunk):
            logits = model(ids[:, i:i + chunk], cache=cache, logits_to_keep=1).logits
    return time.perf_counter() - start, logits[0, -1].float()


def rows(name: str, model: Any, dtype: torch.dtype, length: int, chunk: int, rounds: int) -> list[str]:
    from multihead import hf

    hf.enable(model)
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(10, model.config.vocab_size, (1, length), generator=gen)
    arms = [(kind, on) for kind in KINDS for on in (False, True)]
    times: dict[tuple[str, bool], list[float]] = {arm: [] for arm in arms}
    last: dict[tuple[str, bool], torch.Tensor] = {}
    for r in range(rounds + 1):  # the first round untimed
        for kind, on in arms if r % 2 else arms[::-1]:
            with blocks(dtype, on):
                seconds, last[kind, on] = prefill(model, ids, chunk, KINDS[kind])
            if r:
                times[kind, on].append(seconds)
    out = []
    for kind in KINDS:
        ratios = [a / b for a, b in zip(times[kind, False], times[kind, True], strict=True)]
        out.append(f"| {name} | {str(dtype).removeprefix('torch.')} | {length:,} | {kind} | "
                   f"{statistics.median(times[kind, False]):.3f} | {statistics.median(times[kind, True]):.3f} | "
                   f"{statistics.median(ratios):.3f}x | {min(ratios):.2f}-{max(ratios):.2f} | "
                   f"{(last[kind, False] - last[kind, True]).abs().max().item():.2g} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=("smollm2", "gemma3"), default=["smollm2"])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    for flag, value in (("--length", args.length), ("--chunk", args.chunk), ("--rounds", args.rounds)):
        if value < 1:
            p.error(f"{flag} ({value}) must be at least 1")
    dtype = getattr(torch, args.dtype)
    lines = ["| model | dtype | tokens | cache | one call s | blocks s | blocks' speed | rounds' range | last logits "
             "apart |", "|---|---|---|---|---|---|---|---|---|"]
    for name in args.models:
        model = load(name).to(dtype)
        for line in rows(name, model, dtype, args.length, args.chunk, args.rounds):
            lines.append(line)
            print(line, flush=True)
        del model
    title = f"A chunked prefill with {args.dtype} causal squares in blocks and in one call"
    how = bench.header(f"chunks of {args.chunk}, arms alternating, order reversed each round", args.rounds)
    text = (f"### {title} ({datetime.date.today()})\n\n{how}; speed: the median of the rounds' one-call / blocks "
            f"ratios; `benchmarks/prefill_blocks.py`\n\n" + "\n".join(lines) + "\n")
    publish(text, args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
