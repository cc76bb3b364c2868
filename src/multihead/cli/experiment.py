"""`multihead experiment heads-vs-width`: many small heads or one wide head, trained side by side."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from multihead.cli import COMMANDS, flags
from multihead.cli.common import out_folder


def add(sub: Any) -> None:
    p = sub.add_parser("experiment", help=COMMANDS["experiment"])
    p.add_argument("name", choices=["heads-vs-width"], help="which experiment")
    p.add_argument("--task", choices=["recall", "lm"], default="recall",
                   help="recall: multi-query associative recall (default); lm: byte-level language modelling on the "
                        "Jargon File (held-out perplexity), Vaswani et al.'s setting")
    p.add_argument("--d-model", type=flags.POSITIVE, default=None, help="model width (default 64; 128 for lm)")
    p.add_argument("--layers", type=flags.POSITIVE, default=2, help="layers (default 2)")
    p.add_argument("--steps", type=flags.POSITIVE, default=None,
                   help="training steps per model (default 500; 400 for lm)")
    p.add_argument("--seeds", type=flags.POSITIVE, default=3, help="seeds per configuration (default 3)")
    p.add_argument("--pairs", type=flags.POSITIVE, default=8, help="recall: key-value pairs per sequence (default 8)")
    p.add_argument("--context", type=flags.POSITIVE, default=64, help="lm: bytes per training window (default 64)")
    p.add_argument("--text", type=flags.PATH, default=None,
                   help="lm: a UTF-8 text file, plain or .gz (default: the Jargon File that `make text` installs)")
    p.add_argument("--batch", type=flags.POSITIVE, default=None, help="sequences per step (default 64; 32 for lm)")
    p.add_argument("--lr", type=flags.Number(0, 1, open_low=True), default=None,
                   help="learning rate (default 3e-3; 1e-2 for lm)")
    p.add_argument("--workers", type=flags.POSITIVE, default=2, help="training processes side by side (default 2)")
    p.add_argument("--heads", type=flags.HEAD_COUNTS, default=None,
                   help="comma-separated head counts (default 1,2,4,8,16; 1,2,4,8,16,32 for lm; plus GQA and MQA)")
    p.add_argument("--out", type=flags.PATH, default="multihead-experiment", help="folder for the plot and the JSON")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from multihead.experiments.heads_vs_width import (
        LM_HEADS,
        LM_SETTINGS,
        Settings,
        TaskConfig,
        TextTask,
        Variant,
        default_variants,
        plot,
    )
    from multihead.experiments.heads_vs_width import run as train
    from multihead.files import write_text

    lm = args.task == "lm"
    base = LM_SETTINGS if lm else Settings()
    task: TaskConfig | TextTask
    if lm:
        task = TextTask(context=args.context, path=args.text)
        task.splits()  # a missing or unreadable text fails here, before any training
    else:
        task = TaskConfig(n_pairs=args.pairs)
    d_model = args.d_model or base.d_model
    settings = dataclasses.replace(base, d_model=d_model, n_layers=args.layers, steps=args.steps or base.steps,
                                   batch=args.batch or base.batch, lr=base.lr if args.lr is None else args.lr,
                                   seeds=tuple(range(args.seeds)), workers=args.workers, task=task)
    variants = default_variants(d_model, LM_HEADS if lm else (1, 2, 4, 8, 16))
    if args.heads:
        variants = [Variant(f"MHA h={h}", h, h) for h in args.heads]
    stem = "heads-vs-width-lm" if lm else "heads-vs-width"
    with out_folder(args.out) as out:
        result = train(settings, variants, progress=not args.json)
        png = plot(result, str(Path(out) / f"{stem}.png"))
        write_text(Path(out) / f"{stem}.json", json.dumps(result))
    if args.json:
        slim = {**result, "rows": [{k: v for k, v in r.items() if k != "runs"} | {
            "heads": [run_["heads"] for run_ in r["runs"]]} for r in result["rows"]], "plot": png}
        print(json.dumps(slim))
        return 0
    if lm:
        _print_lm(result, settings, task, args, png)
    else:
        _print_recall(result, settings, task, png)
    return 0


def _print_lm(result: dict[str, Any], settings: Any, task: Any, args: argparse.Namespace, png: str) -> None:
    print(f"byte-level LM on {args.text or 'the Jargon File'}, context {task.seq_len - 1}, d_model "
          f"{settings.d_model}, {settings.n_layers} layers, {settings.steps} steps of {settings.batch}, "
          f"{len(settings.seeds)} seeds, {result['rows'][0]['runs'][0]['scored']:,} held-out bytes "
          f"({result['seconds']} s)")
    print(f"{'variant':<13} {'d_k':>4} {'attn params':>11} {'attn FLOPs':>11} {'KV B/token':>10} "
          f"{'held-out ppl':>15} {'bits/byte':>9}  head labels (mean per model)")
    for r in result["rows"]:
        labels = ", ".join(f"{name} {n:.1f}" for name, n in sorted(r["label_counts"].items(), key=lambda x: -x[1]))
        print(f"{r['variant']:<13} {r['head_dim']:>4} {r['attention_params_per_layer']:>11,} "
              f"{r['attention_flops_per_layer']:>11,} {r['kv_cache_bytes_per_token']:>10,} "
              f"{r['perplexity_mean']:>7.3f} ± {r['perplexity_std']:<5.3f} "
              f"{r['loss_mean'] / math.log(2):>9.3f}  {labels}")
    print(f"plot: {png}")


def _print_recall(result: dict[str, Any], settings: Any, task: Any, png: str) -> None:
    print(f"MQAR, {task.n_pairs} pairs, d_model {settings.d_model}, {settings.n_layers} layers, "
          f"{settings.steps} steps, {len(settings.seeds)} seeds ({result['seconds']} s)")
    print(f"{'variant':<13} {'d_k':>4} {'attn params':>11} {'attn FLOPs':>11} {'KV B/token':>10} "
          f"{'loss':>13} {'accuracy':>13} {'prev heads':>10} {'ind heads':>9}")
    for r in result["rows"]:
        prev = _mean([run_["heads"]["previous_token_heads"] for run_ in r["runs"]])
        ind = _mean([run_["heads"]["induction_heads"] for run_ in r["runs"]])
        print(f"{r['variant']:<13} {r['head_dim']:>4} {r['attention_params_per_layer']:>11,} "
              f"{r['attention_flops_per_layer']:>11,} {r['kv_cache_bytes_per_token']:>10,} "
              f"{r['loss_mean']:>6.3f} ± {r['loss_std']:<4.3f} {r['accuracy_mean']:>6.3f} ± {r['accuracy_std']:<4.3f} "
              f"{prev:>10.1f} {ind:>9.1f}")
    print(f"plot: {png}")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
