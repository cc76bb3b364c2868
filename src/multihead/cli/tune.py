"""`multihead tune`: measure this host's CPU decisions for a model once and write them to its tuning table, which
every later run reads (and never measures); or show or clear the table. The table is keyed by the CPU, its cores and
torch's version; a forward pass only reads it, so every step of a run and every process on the host computes the
same way. Run it on an otherwise idle machine."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from multihead.cli import COMMANDS, flags
from multihead.cli.model import DTYPE_HELP
from multihead.names import ENGINES

LENGTHS = (256, 512, 1024, 2048, 4096, 8192)  # multihead.kernels.tuning.LENGTHS (this module imports no torch)


def add(sub: Any) -> None:
    p = sub.add_parser("tune", help=COMMANDS["tune"])
    p.add_argument("--model", type=flags.PATH, metavar="PATH",
                   help="smollm2 (default), gemma3, or a GGUF file or Hugging Face folder of a decoder: the "
                        "decisions of the engine that runs it (--engine)")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="auto (default: our port where one applies, transformers otherwise), ours, or transformers "
                        "(the model in transformers with multihead's attention and products, hf.enable)")
    p.add_argument("--dtype", type=flags.Dtype(("fp32", "bf16"), many=True), default=("fp32", "bf16"),
                   help=f"{DTYPE_HELP}, here those to tune: comma-separated of fp32, bf16 (default: both)")
    p.add_argument("--lengths", type=flags.LENGTHS, default=LENGTHS,
                   help="context lengths whose decode attention is tuned (each stands for its power-of-two range; "
                        f"default {','.join(map(str, LENGTHS))}: 256 for a sinks + window ring or a 512-token "
                        "sliding window; capped at the model's context)")
    p.add_argument("--batch", type=flags.POSITIVE, default=1, help="decoding batch (default 1)")
    p.add_argument("--repeats", type=flags.Integer(3, 101, "a count of repeats"), default=7,
                   help="timed passes of each choice, alternating; the median decides (default 7)")
    p.add_argument("--show", action="store_true", help="print this host's table and the default rules; tune nothing")
    p.add_argument("--clear", action="store_true", help="remove this host's table (the default rules decide)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from multihead.kernels import cpu, tuning

    if args.show and args.clear:
        raise flags.CliError("--show and --clear do not go together")
    if args.show:
        if args.json:
            path = cpu.table_path()
            print(json.dumps({"path": str(path), "host": cpu.host(), "entries": cpu.table() if path.exists() else {},
                              "defaults": dict(cpu.DEFAULTS)}))
        else:
            print(tuning.describe())
        return 0
    if args.clear:
        had = tuning.clear_table()
        print(json.dumps({"path": str(cpu.table_path()), "removed": had}) if args.json else
              f"{'removed' if had else 'there was no'} tuning table {cpu.table_path()}")
        return 0
    import torch

    from multihead.kernels import native
    from multihead.models.decoder import load_decoder
    from multihead.models.route import route

    routed = route(args.model, args.engine)
    if routed.port == "bert":
        raise flags.CliError(f"tune measures the decisions of a decoder's decoding: {routed.describe()}")
    native.build_now()  # the explicit build step: a forward never builds them
    found: dict[str, str] = {}
    say = None if args.json else (lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    for name in args.dtype:
        decoder = load_decoder(routed.path, routed.engine, dtype=getattr(torch, flags.TORCH_NAMES[name]))
        shape = decoder.shape
        lengths = sorted({min(t, shape.max_context) for t in args.lengths})
        if say is not None:
            print(f"tuning {decoder.name} on {decoder.engine}, {name} (lengths {', '.join(map(str, lengths))}, "
                  f"batch {args.batch}):", file=sys.stderr)
        theirs = routed.engine != "ours"  # a transformers model: its attention modules are not ours
        found.update(tuning.tune_model(
            decoder.model, lengths=lengths, batch=args.batch, repeats=args.repeats, progress=say,
            heads=[(shape.n_heads, shape.n_kv_heads, shape.head_dim)] if theirs else None,
            n_layers=shape.n_layers if theirs else None))
    if args.json:
        print(json.dumps({"path": str(cpu.table_path()), "host": cpu.host(), "entries": found}))
    else:
        print(f"{len(found)} decisions written to {cpu.table_path()}")
    return 0
