"""`multihead generate`: text from SmolLM2 (or a Llama GGUF/folder) on multihead's layer and KV cache, or from any
model transformers loads (another architecture's GGUF file or folder) on multihead's attention and caches."""

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
from multihead.names import ENGINES

MAX_NEW_TOKENS = flags.Integer(1, flags.MAX_INT, "a positive integer",
                               below="--max-new-tokens ({value}) must be at least 1")


def add(sub: Any) -> None:
    p = sub.add_parser("generate", help=COMMANDS["generate"])
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument("--model", type=flags.PATH, metavar="PATH",
                   help="smollm2 (default), gemma3, a GGUF file or Hugging Face folder: a Llama runs on multihead's "
                        "own port, any other model transformers loads on multihead's attention (--engine forces one)")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="ours: multihead's Llama port; transformers: the model as transformers builds it, its "
                        "attention and cache multihead's; auto (default): ours for a Llama, transformers otherwise")
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
    p.add_argument("--bits", type=_bits, default=None, metavar="{4,8}",
                   help="decode with a quantized cache: keys and values in 4- or 8-bit codes (KIVI, groups of 32 "
                        "channels or the head's width where smaller, the last 128 tokens in full)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    add_tp(p)
    p.set_defaults(run=run)


def _bits(text: str) -> int:
    bits = flags.POSITIVE(text)
    if bits not in (4, 8):
        raise argparse.ArgumentTypeError(f"{bits} bits: a quantized cache stores 4- or 8-bit codes: give 4 or 8")
    return bits


def _engine(args: argparse.Namespace) -> str:
    """"ours" (multihead's Llama port: SmolLM2 by default, a Llama GGUF file or folder) or "transformers", as every
    command routes --model (:func:`multihead.models.route.route`)."""
    from multihead.models.route import route

    found = route(args.model, args.engine)
    if found.engine == "ours" and found.port != "llama":
        raise CliError(f"generate decodes with a causal language model: {found.describe()}")
    return found.engine


def cache_spec(args: argparse.Namespace, plan: Any, head_dim: int, total: int) -> Any:
    """The :class:`~multihead.cache.CacheSpec` the flags ask for, the same for both engines: --window with --sinks,
    --plan, --bits (in groups of 32 channels, or the head's width where smaller), else a full cache, for ``total``
    positions (the prompt and the new tokens)."""
    from multihead.cache import CacheSpec

    if args.window is not None:
        return CacheSpec(window=args.window, sink_tokens=args.sinks)
    if plan is not None:
        return CacheSpec(total, plan=plan)
    if args.bits is not None:
        return CacheSpec(total, bits=args.bits, group=min(32, head_dim))
    return CacheSpec(total)


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
    if args.bits is not None and (args.window is not None or plan is not None or args.compile or args.tp > 1):
        raise CliError("--bits is one kind of cache, decoded eagerly in one process: drop --window, --plan, "
                       "--compile and --tp")
    if _engine(args) == "transformers":
        if args.compile or args.tp > 1:
            raise CliError("--compile and --tp run multihead's own port: drop them (or --engine ours, for a Llama)")
        return _run_transformers(args, sampling, plan)
    from multihead.models.route import route

    model, tok = load_llama(route(args.model, args.engine).path, dtype=getattr(torch, flags.TORCH_NAMES[args.dtype]))
    if plan is not None:
        a = model.config.attention()
        assert a.n_kv_heads is not None and a.head_dim is not None
        plan.check(n_layers=model.config.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                   model=str(args.model or "SmolLM2"))
    quiet = False
    if args.tp > 1:
        from multihead.layers import parallel

        parallel.shard_llama(model, parallel.init(args.tp))
        quiet = not is_rank0()
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt = tok.encode(text)
    out: list[int] = []
    caches: list[Cache] = []
    spec = cache_spec(args, plan, model.config.head_dim or model.config.d_model // model.config.n_heads,
                      len(prompt) + args.max_new_tokens)

    def produced() -> Iterator[int]:
        for step in generate_ids(model, [prompt], max_new_tokens=args.max_new_tokens, sampling=sampling,
                                 stop_ids=tok.stop_ids, compile=args.compile, spec=spec, on_cache=caches.append):
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
    # the cache that ran, read from the cache object; beside it the full cache generate makes without --window or
    # --plan, for the same positions (prompt + --max-new-tokens)
    ran = caches[0]
    full = full_cache_bytes(model, 1, len(prompt) + args.max_new_tokens)
    cache: dict[str, Any] = {"kind": type(ran).__name__, "bytes": ran.bytes, "full_cache_bytes": full,
                             "of_full": round(ran.bytes / full, 4)}
    if args.compile:  # the compiled step's cache is rounded up so that one graph serves many lengths
        cache["positions"] = getattr(ran, "max_len", None)
    note = (f"; rounded up to {cache['positions']} positions for the compiled step (a multiple of {CACHE_BUCKET}, so "
            "that one graph serves many lengths)" if args.compile else "")
    shown = tok.decode([t for t in out if t not in tok.stop_ids]) if args.json else ""
    _report(args, prompt, out, tok.stop_ids, shown, seconds, cache, note)
    return 0


def _report(args: argparse.Namespace, prompt: list[int], out: list[int], stop_ids: set[int] | frozenset[int],
            text: str, seconds: float, cache: dict[str, Any], note: str = "", engine: str = "ours") -> None:
    """The run's one JSON object, or its line on stderr: the cache that ran (kind, real bytes, a full cache's beside
    them) and the tokens per second."""
    per_second = round(len(out) / seconds, 2) if seconds > 0 else None
    if args.json:
        print(json.dumps({"prompt": args.prompt, "chat": args.chat, "engine": engine, "prompt_tokens": len(prompt),
                          "text": text, "tokens": out, "new_tokens": len(out),
                          "stopped": bool(out) and out[-1] in stop_ids, "seconds": round(seconds, 3),
                          "tokens_per_second": per_second, "cache": cache}))
        return
    from multihead.sizing.units import format_bytes

    ran, full = cache["bytes"], cache["full_cache_bytes"]
    full_kind = cache.get("full_kind", "KVCache")
    beside = "" if ran == full else f"; a full {full_kind} {format_bytes(full)}, {ran / full:.2f} of it"
    sys.stdout.flush()
    print(f"multihead generate: {cache['kind']} {format_bytes(ran)} ({ran:,} bytes{beside}{note}); "
          f"{len(out)} new tokens in {seconds:.2f} s, {per_second} tok/s (prompt included)", file=sys.stderr)


def _run_transformers(args: argparse.Namespace, sampling: Any, plan: Any) -> int:
    """The model as transformers builds it (multihead.hf.load: multihead's attention), decoding through a multihead
    cache (multihead.hf.new_cache: full, --window with --sinks, --bits, or --plan), token by token with the same
    sampling as the port; the cache's real bytes and the tokens per second are reported as the port's are."""

    import torch

    from multihead import hf
    from multihead.errors import MultiheadError
    from multihead.models.generate import sample
    from multihead.models.route import route

    path = route(args.model, args.engine).path
    import transformers

    transformers.utils.logging.disable_progress_bar()  # (stderr holds the run's one line)
    model = hf.load(path, dtype=getattr(torch, flags.TORCH_NAMES[args.dtype]), task="causal-lm")
    from transformers import AutoTokenizer

    try:
        tok = (AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name) if path.is_file()
               else AutoTokenizer.from_pretrained(str(path)))
    except (OSError, ValueError, KeyError) as err:
        raise MultiheadError(f"transformers could not load a tokenizer for {str(path)!r}: {err}") from None
    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise CliError(f"{str(path)!r} has no chat template: drop --chat")
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                       tokenize=False)
        prompt = [int(i) for i in tok(text, add_special_tokens=False).input_ids]
    else:
        prompt = [int(i) for i in tok(args.prompt).input_ids]
    if not prompt:
        raise CliError("the prompt has no tokens")
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stop_ids = {int(i) for i in ([eos] if isinstance(eos, int) else list(eos or []))}
    if tok.eos_token_id is not None:
        stop_ids.add(int(tok.eos_token_id))
    total = len(prompt) + args.max_new_tokens
    text_config: Any = getattr(model, "config").get_text_config()  # noqa: B009 (a Module's attribute: Any)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    spec = cache_spec(args, plan, int(head_dim), total)
    cache = hf.new_cache(model, spec=spec)
    device = next(model.parameters()).device
    out: list[int] = []

    def produced() -> Iterator[int]:
        gen = sampling.generator()
        with torch.no_grad():
            ids = torch.tensor([prompt], dtype=torch.long, device=device)
            last = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # (1, vocab)
            for n in range(args.max_new_tokens):
                t = int(sample(last, sampling, gen)[0])
                out.append(t)
                if t in stop_ids:
                    return
                yield t
                if n < args.max_new_tokens - 1:
                    step = torch.tensor([[t]], dtype=torch.long, device=device)
                    last = model(step, cache=cache, use_cache=True).logits[:, -1]

    start = time.perf_counter()
    if args.json:
        for _ in produced():
            pass
    else:
        printed = ""
        for _ in produced():
            text = str(tok.decode([t for t in out if t not in stop_ids], skip_special_tokens=True))
            if not text.endswith("\ufffd") and text.startswith(printed):  # a character whole, the text grown
                print(text[len(printed):], end="", flush=True)
                printed = text
        print()
    seconds = time.perf_counter() - start
    ran = int(cache.bytes)
    kind = type(cache.inner).__name__
    full_cache = cache if spec.kind == "full" else hf.new_cache(model, total)  # the full cache, same positions
    full = int(full_cache.bytes)
    info: dict[str, Any] = {"kind": kind, "bytes": ran, "full_cache_bytes": full, "of_full": round(ran / full, 4),
                            "full_kind": type(full_cache.inner).__name__}
    shown = str(tok.decode([t for t in out if t not in stop_ids], skip_special_tokens=True)) if args.json else ""
    _report(args, prompt, out, stop_ids, shown, seconds, info, engine="transformers")
    return 0
