"""`multihead patch`: which heads cause a behaviour: activation and attribution patching per head."""

from __future__ import annotations

import argparse
import json
from typing import Any

from multihead.cli import COMMANDS, flags
from multihead.cli.common import out_folder, say_model
from multihead.cli.flags import CliError
from multihead.names import ENGINES, head_name


def add(sub: Any) -> None:
    p = sub.add_parser("patch", help=COMMANDS["patch"])
    p.add_argument("--model", type=flags.MODEL, default="smollm2",
                   help="smollm2 (default), gemma3, a .gguf file of any architecture or a causal model folder")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="as for 'heads': our port where one applies (default), or transformers")
    p.add_argument("--clean", type=flags.TEXT, help="the clean prompt (default: the shipped indirect-object pairs)")
    p.add_argument("--corrupt", type=flags.TEXT, help="the corrupted prompt, of the same token length")
    p.add_argument("--answers", type=flags.TOKEN, nargs=2, metavar=("RIGHT", "WRONG"),
                   help="the clean prompt's right and wrong next tokens (one token each, e.g. ' Mary' ' John')")
    p.add_argument("--point", choices=("z", "q", "k", "v", "pattern"), default="z",
                   help="what is patched per head (default z, each head's output; k and v per KV head)")
    p.add_argument("--method", choices=("both", "patching", "attribution"), default="both",
                   help="activation patching (a forward per 16 heads), attribution (one backward), or both")
    p.add_argument("--top", type=flags.POSITIVE, default=10, help="heads listed (default 10)")
    p.add_argument("--out", type=flags.PATH, default=None, help="a folder for the layer x head heatmap PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import contextlib

    given = [args.clean is not None, args.corrupt is not None, args.answers is not None]
    if any(given) and not all(given):
        raise CliError("give --clean, --corrupt and --answers together (or none, for the shipped prompt pairs)")
    with contextlib.ExitStack() as stack:
        out = None if args.out is None else stack.enter_context(out_folder(args.out))
        from multihead.heads.adapters import load_head_model
        from multihead.heads.patching import PromptPair, patch_pairs, shipped_pairs

        pairs = ([PromptPair(args.clean, args.corrupt, args.answers[0], args.answers[1])] if all(given)
                 else shipped_pairs())
        say_model(args.model, args.engine, quiet=args.json)
        model = load_head_model(args.model, engine=args.engine)
        if not model.causal:
            raise CliError(f"{model.name} is not a causal language model: patching compares next-token logits")
        result = patch_pairs(model.logits, model.layers(), model.token_ids, pairs, point=f"hook_{args.point}",
                             patching=args.method != "attribution", attribution=args.method != "patching",
                             progress=not args.json, prompt=model.prompt_ids)
        files = {}
        if out is not None:
            from multihead.heads.report import write_patching_png

            files = write_patching_png(result, model.name, out)
    method = "patching" if result.patching is not None else "attribution"
    if args.json:
        print(json.dumps({
            "model": model.name, "engine": model.engine, "point": result.point, "pairs": result.pairs,
            "clean_logit_diff": result.clean, "corrupted_logit_diff": result.corrupted,
            "patching": None if result.patching is None else result.patching.tolist(),
            "attribution": None if result.attribution is None else result.attribution.tolist(),
            "correlation": result.correlation(), "seconds": result.seconds, "files": files,
        }))
        return 0
    kv = args.point in ("k", "v")
    unit = "KV head" if kv else "head"
    print(f"{model.name} ({model.engine}): {result.pairs} prompt pair(s), logit difference clean "
          f"{result.clean:.3f}, corrupted {result.corrupted:.3f}; {args.point} patched per {unit}")
    print(f"top {unit}s by {method} ({head_name(0, 1, kv=kv)}: layer 0, {unit} 1 = recovered fraction): " + "  ".join(
        f"{head_name(layer, head, kv=kv)} = {value:+.3f}" for layer, head, value in result.top(args.top, method)))
    if result.correlation() is not None:
        print(f"attribution vs activation patching, Pearson r over all {unit}s: {result.correlation():.3f}")
    print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items() if v))
    for name, path in files.items():
        print(f"{name}: {path}")
    return 0
