"""`multihead tradeoff --long`: every KV-saving method judged by retrieval at long context (multihead.tradeoff.longctx).

The flags `tradeoff` shares keep their meaning here: --chunk (tokens per step through a cache), --window (the sink +
window caches measured, beside the ones sized by --keep), --sinks (sink tokens: one count here), --bits, --group,
--residual, --prune, --uptrain-*, and --context / --stride / --windows for the perplexity windows (tokens per window,
the last --stride of them scored, how many windows). The rest exist only with --long; given without it they are
refused rather than ignored.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from multihead.cli import flags
from multihead.cli.common import out_folder
from multihead.cli.flags import POSITIVE, SEED, CliError

LONG_ONLY = ("lengths", "tasks", "haystacks", "prompts", "keys", "values", "seed", "keep", "window_keep",
             "threshold", "bootstrap", "no_mqa", "uptrain_from", "cases_jsonl", "plan", "engine", "protocol", "dtype",
             "split", "layers", "passkey_prompt")


def _names(allowed: Callable[[], tuple[str, ...]], what: str) -> flags.Listed:
    return flags.Listed(flags.OneOf(allowed, f"{what} {{value}} is unknown: choose from {{names}}"), f"{what}s")


def _tasks() -> tuple[str, ...]:
    from multihead.tradeoff.longctx import TASKS

    return TASKS


def _passkey_prompts() -> tuple[str, ...]:
    from multihead.evals.needles import PASSKEY_PROMPTS

    return tuple(PASSKEY_PROMPTS)


def _haystacks() -> tuple[str, ...]:
    from multihead.tradeoff.longctx import HAYSTACKS

    return HAYSTACKS


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of --long (the module's TASKS and HAYSTACKS, which import torch, are read when a value is parsed:
    `multihead tradeoff --help` imports no torch)."""
    g = p.add_argument_group("long context (--long)")
    g.add_argument("--long", action="store_true",
                   help="judge the methods by retrieval at long context (needles, passkeys) instead of perplexity "
                        "on short windows; by default 10 min 44 s on 2 idle cores (measured: "
                        "docs/experiments/long-context.md)")
    g.add_argument("--lengths", type=flags.LENGTHS, default=None, metavar="N,N",
                   help="prompt lengths in tokens (default 2048,4096; 8144 is the longest that leaves SmolLM2's "
                        "8,192-token context room for the answer)")
    g.add_argument("--tasks", type=_names(_tasks, "task"), default=None,
                   help="tasks (default passkey,single-number,multikey,multivalue; also single-word)")
    g.add_argument("--haystacks", type=_names(_haystacks, "haystack"), default=None,
                   help="haystack texts (default jargon,filler: the held-out Jargon File and a repeated filler)")
    g.add_argument("--prompts", type=POSITIVE, default=None, help="prompts per (length, task) (default 1)")
    g.add_argument("--keys", type=flags.Integer(2, flags.MAX_INT, "an integer of at least 2"), default=None,
                   help="needles of a multikey prompt, each asked once (default 4)")
    g.add_argument("--values", type=flags.Integer(2, flags.MAX_INT, "an integer of at least 2"), default=None,
                   help="values of the one key of a multivalue prompt (default 3)")
    g.add_argument("--seed", type=SEED, default=None, help="seed of the cases (default 0)")
    g.add_argument("--passkey-prompt", type=flags.OneOf(_passkey_prompts, "passkey prompt {value} is unknown: "
                                                                          "choose from {names}"), default=None,
                   help="the passkey task's wording: cue (default), colon, number or important "
                        "(multihead.evals.needles.PASSKEY_PROMPTS; Gemma 3 270M continues cue's 'The pass key is' "
                        "with words about the key, not the key)")
    g.add_argument("--keep", type=flags.FRACTIONS, default=None,
                   help="sink + window caches holding these shares of the prompt (default 0.5,0.25: the bytes of "
                        "kvpress at 50%% and 75%% compression)")
    g.add_argument("--window-keep", type=flags.FRACTIONS, default=None,
                   help="plain windows (no sinks) holding these shares of the prompt (default 0.25)")
    g.add_argument("--threshold", type=flags.Number(0, 1), default=None,
                   help="accuracy the full cache needs in a (length, task) cell for the cell to be compared "
                        "(default 0.8)")
    g.add_argument("--bootstrap", type=POSITIVE, default=None, help="bootstrap resamples (default 2000)")
    g.add_argument("--no-mqa", action="store_true", help="leave out pooled and uptrained MQA")
    g.add_argument("--uptrain-from", type=flags.PATH, default=None,
                   help="an uptraining checkpoint folder to reuse (e.g. a `multihead tradeoff` run's uptrain/)")
    g.add_argument("--plan", type=flags.PATH, action="append", default=None, metavar="FILE",
                   help="a head plan (HeadPlan JSON, e.g. docs/experiments/*-plan.json) measured as a head-wise "
                        "cache, beside a sinks + window cache of the same bytes; repeat for several")
    g.add_argument("--engine", choices=("auto", "ours", "transformers"), default=None,
                   help="auto (default): multihead's own port for Llama-style GGUF files and folders, transformers "
                        "(on multihead's attention and caches) for any other causal LM folder; ours or transformers "
                        "to choose (every cache kind and --plan run on both; MQA and pruning on ours only)")
    g.add_argument("--protocol", choices=("streaming", "shared"), default=None,
                   help="streaming (default): each method prefills through its own cache (its real peak memory); "
                        "shared: each case prefilled once with the full cache and every method's cache compressed "
                        "from it (kvpress's protocol: N methods for one prefill; one JSON line a case, resumable; "
                        "accuracy with Wilson intervals, McNemar against the full cache and each plan's control)")
    g.add_argument("--layers", choices=("all", "global"), default=None,
                   help="where the windowed and quantized methods apply: all (default) or global, a hybrid model's "
                        "global layers only, its sliding layers keeping their window (Gemma 2/3 through "
                        "transformers)")
    g.add_argument("--dtype", type=flags.Dtype(("fp32", "bf16")), default=None,
                   help="the model's element type with --protocol shared: fp32 (default) or bf16")
    g.add_argument("--split", choices=("test", "train"), default=None,
                   help="with --protocol shared: the text split the jargon haystacks come from, test (default: the "
                        "evaluation's) or train (cases to choose a plan on; give another --seed too)")
    g.add_argument("--cases-jsonl", type=flags.PATH, default=None,
                   help="write the run's cases as JSON lines to this file and stop (for benchmarks/kvpress_longctx.py)")


def refuse_without_long(args: argparse.Namespace) -> None:
    given = [f"--{name.replace('_', '-')}" for name in LONG_ONLY
             if getattr(args, name) not in (None, False)]
    if given:
        raise CliError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for `tradeoff --long`: add --long")


def settings(args: argparse.Namespace) -> Any:
    """The run's Settings from the flags: a flag left out keeps the library's default."""
    from multihead.tradeoff.longctx import Settings

    if args.sinks is not None and len(args.sinks) != 1:
        raise CliError(f"--sinks {','.join(map(str, args.sinks))}: give one sink count with --long (the sink + window "
                       "caches of one run share it)")
    # the perplexity windows are as long as the longest prompt (4096 by default), the last quarter of each scored:
    # what a cache sized for these lengths does, at the cost of these lengths
    context = args.context or max(args.lengths or Settings.lengths)
    scored = args.stride or max(1, context // 4)
    chosen: dict[str, Any] = {
        "lengths": args.lengths, "tasks": args.tasks, "haystacks": args.haystacks, "prompts": args.prompts,
        "keys": args.keys, "values": args.values, "seed": args.seed, "passkey_prompt": args.passkey_prompt,
        "chunk": args.chunk,
        "sinks": None if args.sinks is None else args.sinks[0], "keep": args.keep, "window_keep": args.window_keep,
        "windows": None if args.window is None else (args.window,), "bits": args.bits, "group": args.group,
        "residual": args.residual, "prune": args.prune, "uptrain_steps": args.uptrain_steps,
        "uptrain_lr": args.uptrain_lr, "uptrain_train": args.train, "uptrain_from": args.uptrain_from,
        "ppl_context": context, "ppl_scored": scored, "ppl_windows": args.windows,
        "threshold": args.threshold, "bootstrap": args.bootstrap,
        "plans": None if args.plan is None else tuple(args.plan), "layers": args.layers,
    }
    if args.no_mqa:
        chosen["mqa"] = False
    return Settings(**{k: v for k, v in chosen.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    if args.model == "minilm":
        raise CliError("--long measures retrieval by a causal model's greedy answer: give --model smollm2 (the "
                       "default) or a Llama-style .gguf file or folder, not minilm")
    from multihead.tradeoff import longctx

    s = settings(args)
    model_path = None if args.model == "smollm2" else args.model
    if args.cases_jsonl is not None:
        cases = longctx.build_cases(s, model_path=model_path, text_path=args.text)
        path = longctx.write_jsonl(cases, args.cases_jsonl)
        print(f"{len(cases)} cases written to {path}")
        return 0
    for name in ("dtype", "split"):
        if getattr(args, name) is not None and args.protocol != "shared":
            raise CliError(f"--{name} is for --protocol shared (the streaming run is float32, on the test split)")
    if args.protocol == "shared":
        from multihead.tradeoff.longctx import shared

        with out_folder(args.out) as out:
            result = shared.run(s, out=out, model_path=model_path, text_path=args.text, engine=args.engine or "auto",
                                dtype=flags.TORCH_NAMES[args.dtype or "fp32"], split=args.split or "test",
                                progress=not args.json)
        print(json.dumps(result) if args.json else shared.table(result))
        return 0
    with out_folder(args.out) as out:
        result = longctx.run(s, out=out, progress=not args.json, model_path=model_path, text_path=args.text,
                             engine=args.engine or "auto")
        result["plot"] = longctx.plot(result, out / "long-context.png")
    if args.json:
        print(json.dumps(result))
        return 0
    print(longctx.table(result))
    print(f"plot: {result['plot']}")
    return 0
