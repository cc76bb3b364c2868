"""`multihead tradeoff`: the KV-cache trade-off, quality against KV bytes for each way of saving cache."""

from __future__ import annotations

import argparse
import json
from typing import Any

from multihead.cli import COMMANDS, flags, tradeoff_long
from multihead.cli.common import out_folder
from multihead.cli.flags import COUNT, POSITIVE, CliError
from multihead.cli.model import WINDOW_HELP


def add(sub: Any) -> None:
    p = sub.add_parser("tradeoff", help=COMMANDS["tradeoff"])
    p.add_argument("--model", type=flags.MODEL, default="smollm2",
                   help="smollm2 (default), minilm (the encoder: 1 - cosine), gemma3 (--long), or a .gguf file or "
                        "model folder (a Llama; --long takes any causal LM)")
    p.add_argument("--text", type=flags.PATH, default=None,
                   help="another evaluation text (plain or .gz; default: the Jargon File)")
    p.add_argument("--texts", type=POSITIVE, default=256, help="minilm: held-out paragraphs embedded (default 256)")
    p.add_argument("--context", type=POSITIVE, default=None,
                   help="tokens per perplexity window (default 1024; with --long the longest of --lengths)")
    p.add_argument("--stride", type=POSITIVE, default=None,
                   help="tokens between windows, each scoring its last stride tokens (default 512; with --long a "
                        "quarter of the window)")
    p.add_argument("--windows", type=POSITIVE, default=None,
                   help="perplexity windows at most (default 10; 1 with --long)")
    p.add_argument("--chunk", type=POSITIVE, default=None,
                   help="tokens per step through a cache (default 64; 512 with --long)")
    p.add_argument("--window", type=POSITIVE, default=None, metavar="N",
                   help=f"{WINDOW_HELP}, beside --sinks: the sink + window caches measured (default 256; with "
                        "--long none beyond those --keep sizes)")
    p.add_argument("--sinks", type=flags.COUNTS, default=None,
                   help="sink token counts beside the window (default 1,4; one count with --long, default 4)")
    p.add_argument("--bits", type=flags.BITS, default=(8, 4, 2),
                   help="quantized cache widths (default 8,4,2; 'none' for none)")
    p.add_argument("--group", type=POSITIVE, default=32, help="quantization group size (default 32)")
    p.add_argument("--residual", type=COUNT, default=128, help="newest tokens kept in full precision (default 128)")
    p.add_argument("--prune", type=flags.FRACTIONS, default=None,
                   help="fractions of KV groups pruned by importance (default 0.1,0.25,0.5, with --long 0.25; "
                        "'none' for none)")
    p.add_argument("--uptrain-steps", type=COUNT, default=40,
                   help="distillation steps for pooled MQA (0: none; default 40)")
    p.add_argument("--uptrain-lr", type=flags.Number(0, 1, open_low=True), default=3e-3,
                   help="uptraining learning rate (default 3e-3)")
    p.add_argument("--train", choices=("kv", "attention", "all"), default="kv",
                   help="what uptraining changes: the pooled K/V projections (default), attention, or all")
    p.add_argument("--resume", action="store_true", help="continue the uptraining checkpoint in --out")
    p.add_argument("--out", type=flags.PATH, default="multihead-tradeoff",
                   help="folder for the PNG, the JSON and the checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    tradeoff_long.add_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from multihead.models.route import route

    found = route(args.model, "auto" if args.engine is None else args.engine)  # names what --model cannot be
    if args.long:
        return tradeoff_long.run(args)
    tradeoff_long.refuse_without_long(args)
    if found.engine != "ours":
        raise CliError(f"the perplexity trade-off pools, prunes and uptrains multihead's own port's KV heads: "
                       f"{found.describe()}; give a Llama-architecture model (or --long, which takes any causal "
                       "LM)")
    for name, default in (("context", 1024), ("stride", 512), ("windows", 10), ("chunk", 64), ("window", 256),
                          ("sinks", (1, 4)), ("prune", (0.1, 0.25, 0.5))):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.model == "minilm":
        return _encoder(args)
    from multihead.files import write_text
    from multihead.tradeoff.lm import Settings, plot
    from multihead.tradeoff.lm import run as measure
    from multihead.tradeoff.uptrain import UptrainSettings

    settings = Settings(context=args.context, stride=args.stride, windows=args.windows, chunk=args.chunk,
                        window=args.window, sinks=args.sinks, bits=args.bits, group=args.group,
                        residual=args.residual, prune=args.prune)
    up = None if args.uptrain_steps == 0 else UptrainSettings(steps=args.uptrain_steps, lr=args.uptrain_lr,
                                                               train=args.train)
    with out_folder(args.out) as out:
        result = measure(settings, model_path=None if args.model == "smollm2" else args.model, text_path=args.text,
                         uptrain_settings=up, out=out, resume=args.resume, progress=not args.json)
        result["plot"] = plot(result, out / "kv-tradeoff.png")
        write_text(out / "kv-tradeoff.json", json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}; {result['text']['scored_tokens']:,} held-out tokens of {result['text']['source']}; "
          f"KV bytes for one sequence of {settings.context} tokens in bf16 ({result['seconds']:.0f} s)")
    print(f"{'method':<30} {'KV MiB':>8} {'of full':>8} {'perplexity':>11} {'vs full':>9}")
    full = next(r for r in result["rows"] if r["series"] == "full")
    for r in result["rows"]:
        print(f"{r['method']:<30} {r['kv_bytes'] / 2**20:>8.2f} {r['kv_ratio']:>8.1%} {r['perplexity']:>11.3f} "
              f"{r['perplexity'] / full['perplexity'] - 1:>+9.1%}")
    print(f"plot: {result['plot']}")
    return 0


def _encoder(args: argparse.Namespace) -> int:
    from multihead.files import write_text
    from multihead.tradeoff.encoder import EncoderSettings, plot
    from multihead.tradeoff.encoder import run as measure

    settings = EncoderSettings(texts=args.texts, bits=args.bits, group=args.group, prune=args.prune)
    with out_folder(args.out) as out:
        result = measure(settings, text_path=args.text, progress=not args.json)
        result["plot"] = plot(result, out / "kv-tradeoff-minilm.png")
        write_text(out / "kv-tradeoff-minilm.json", json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}: {result['metric']} over {result['text']['texts']} held-out paragraphs "
          f"({result['seconds']:.0f} s)")
    print(f"{'method':<28} {'K/V B/token':>11} {'of full':>8} {'1 - cos':>10}")
    for r in result["rows"]:
        print(f"{r['method']:<28} {r['kv_bytes_per_token']:>11,.0f} {r['kv_ratio']:>8.1%} "
              f"{r['one_minus_cosine']:>10.2e}")
    print(f"plot: {result['plot']}")
    return 0
