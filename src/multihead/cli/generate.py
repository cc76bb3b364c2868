"""`multihead generate`: text from SmolLM2 (or a Llama GGUF/folder) on multihead's layer and KV cache."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from multihead.cli import COMMANDS, flags
from multihead.cli.common import add_tp, is_rank0
from multihead.cli.flags import CliError
from multihead.cli.model import DTYPE_HELP, WINDOW_HELP

MAX_NEW_TOKENS = flags.Integer(1, flags.MAX_INT, "a positive integer",
                               below="--max-new-tokens ({value}) must be at least 1")


def add(sub: Any) -> None:
    p = sub.add_parser("generate", help=COMMANDS["generate"])
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument("--model", type=flags.PATH, metavar="PATH",
                   help="a Llama GGUF file or Hugging Face folder (default: SmolLM2)")
    p.add_argument("--max-new-tokens", type=MAX_NEW_TOKENS, default=64, help="tokens to generate (default 64)")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (the default)")
    p.add_argument("--temperature", type=flags.Number(0, 1e6), default=None, help="sample at this temperature")
    p.add_argument("--top-p", type=flags.Number(0, 1, open_low=True), default=None,
                   help="nucleus sampling: keep the top tokens with this mass")
    p.add_argument("--seed", type=flags.SEED, default=None, help="random seed for sampling")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--dtype", type=flags.Dtype(("fp32", "bf16")), default="fp32",
                   help=f"{DTYPE_HELP}, here the weights and activations: fp32 (default) or bf16")
    p.add_argument("--compile", action="store_true",
                   help="compile the decoding step with torch.compile (minutes the first time, then faster)")
    p.add_argument("--window", type=flags.POSITIVE, default=None, metavar="N",
                   help=f"{WINDOW_HELP}, beside --sinks: decode with a sink + window cache, constant memory, any "
                        "length (StreamingLLM)")
    p.add_argument("--sinks", type=flags.COUNT, default=4, help="sink tokens kept beside --window (default 4)")
    p.add_argument("--plan", type=flags.PATH, default=None, metavar="FILE",
                   help="decode with a head-wise cache: a head plan (JSON, multihead.cache.HeadPlan) saying which KV "
                        "heads keep every key and which keep sinks + a window; refused for a model of another shape")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    add_tp(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from multihead.cache import Cache
    from multihead.models import load_llama
    from multihead.models.generate import CACHE_BUCKET, Sampling, full_cache_bytes, generate_ids

    sampled = args.temperature is not None or args.top_p is not None or args.seed is not None
    if args.greedy and sampled:
        raise CliError("--greedy cannot be combined with --temperature, --top-p or --seed")
    sampling = Sampling(temperature=args.temperature if args.temperature is not None else (1.0 if sampled else 0.0),
                        top_p=args.top_p if args.top_p is not None else 1.0, seed=args.seed)
    if args.compile and args.tp > 1:
        raise CliError("--compile cannot be combined with --tp (the compiled step runs in one process)")
    if args.window is not None and (args.compile or args.tp > 1):
        raise CliError("--window decodes eagerly in one process: drop --compile and --tp")
    plan = None
    if args.plan is not None:
        from multihead.cache import HeadPlan

        if args.window is not None:
            raise CliError("--plan brings its own sinks and window: drop --window")
        if args.compile or args.tp > 1:
            raise CliError("--plan decodes eagerly in one process: drop --compile and --tp")
        plan = HeadPlan.load(args.plan)
    model, tok = load_llama(args.model, dtype=getattr(torch, flags.TORCH_NAMES[args.dtype]))
    if plan is not None:
        a = model.config.attention()
        assert a.n_kv_heads is not None and a.head_dim is not None
        plan.check(n_layers=model.config.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                   model=str(args.model or "SmolLM2"))
    quiet = False
    if args.tp > 1:
        from multihead import parallel

        parallel.shard_llama(model, parallel.init(args.tp))
        quiet = not is_rank0()
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt = tok.encode(text)
    out: list[int] = []
    caches: list[Cache] = []

    def produced() -> Iterator[int]:
        for step in generate_ids(model, [prompt], max_new_tokens=args.max_new_tokens, sampling=sampling,
                                 stop_ids=tok.stop_ids, compile=args.compile, window=args.window,
                                 sink_tokens=args.sinks, plan=plan, on_cache=caches.append):
            t = step[0]
            if t is None:
                return
            out.append(t)
            if t in tok.stop_ids:
                return
            yield t

    start = time.perf_counter()
    if args.json or quiet:
        for _ in produced():
            pass
        if quiet:
            return 0
    else:
        for piece in tok.stream(produced()):
            print(piece, end="", flush=True)
        print()
    seconds = time.perf_counter() - start
    per_second = round(len(out) / seconds, 2) if seconds > 0 else None
    # the cache that ran, read from the cache object; beside it the full cache generate makes without --window or
    # --plan, for the same positions (prompt + --max-new-tokens)
    ran = caches[0]
    full = full_cache_bytes(model, 1, len(prompt) + args.max_new_tokens)
    cache = {"kind": type(ran).__name__, "bytes": ran.bytes, "full_cache_bytes": full,
             "of_full": round(ran.bytes / full, 4)}
    if args.compile:  # the compiled step's cache is rounded up so that one graph serves many lengths
        cache["positions"] = getattr(ran, "max_len", None)
    if args.json:
        shown = [t for t in out if t not in tok.stop_ids]
        print(json.dumps({"prompt": args.prompt, "chat": args.chat, "prompt_tokens": len(prompt),
                          "text": tok.decode(shown), "tokens": out, "new_tokens": len(out),
                          "stopped": bool(out) and out[-1] in tok.stop_ids, "seconds": round(seconds, 3),
                          "tokens_per_second": per_second, "cache": cache}))
    else:
        from multihead.units import format_bytes

        beside = "" if ran.bytes == full else f"; a full KVCache {format_bytes(full)}, {ran.bytes / full:.2f} of it"
        if args.compile:
            beside += (f"; rounded up to {cache['positions']} positions for the compiled step (a multiple of "
                       f"{CACHE_BUCKET}, so that one graph serves many lengths)")
        sys.stdout.flush()
        print(f"multihead generate: {cache['kind']} {format_bytes(ran.bytes)} ({ran.bytes:,} bytes{beside}); "
              f"{len(out)} new tokens in {seconds:.2f} s, {per_second} tok/s (prompt included)", file=sys.stderr)
    return 0
