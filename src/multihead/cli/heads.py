"""`multihead heads`: what each head of a real model does: scores, labels, pictures, an HTML report."""

from __future__ import annotations

import argparse
import json
from typing import Any

from multihead.cli import COMMANDS, flags
from multihead.cli.common import out_folder, say_model
from multihead.cli.flags import CliError, kv_heads
from multihead.names import ENGINES, head_name


def add(sub: Any) -> None:
    p = sub.add_parser("heads", help=COMMANDS["heads"])
    p.add_argument("--model", type=flags.MODEL, default="smollm2",
                   help="smollm2 (default), minilm, gemma3, a .gguf file of any architecture or a model folder "
                        "(multihead.models.route: our port where one reads it, else transformers)")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="auto (default): multihead's own port where one applies (Llama-style GGUF or folder, BERT), "
                        "else transformers with its attention on multihead; or force one")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", type=flags.TEXT,
                      help="the text to analyse (default: the shipped public-domain passage)")
    text.add_argument("--file", type=flags.PATH, help="a UTF-8 text file to analyse")
    p.add_argument("--out", type=flags.PATH, default="multihead-heads",
                   help="folder for the report and pictures (default multihead-heads)")
    p.add_argument("--ablate", action="store_true", help="zero each head in turn and measure the change in loss")
    p.add_argument("--convert", action="store_true", help="mean-pool K/V into fewer KV heads (MHA -> GQA) and "
                   "measure the change")
    p.add_argument("--patch", action="store_true", help="activation patching of every head on the shipped "
                   "indirect-object prompt pairs (causal models), shown in the report")
    p.add_argument("--tokens", type=flags.POSITIVE, default=64, help="tokens shown in the pictures (default 64)")
    p.add_argument("--top", type=flags.POSITIVE, default=3, help="heads listed per score (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object (a record per head)")
    r = p.add_argument_group("retrieval heads at long context (--retrieval)")
    r.add_argument("--retrieval", action="store_true",
                   help="also score retrieval heads on long-context needle cases (Wu et al. 2024: the head's top key "
                        "is the needle token being copied), the attention a sinks + window cache would drop, and "
                        "RazorAttention-style echo/induction scores per KV head, and write head-wise cache plans "
                        "from them (causal models: our port for Llama, transformers with its attention on multihead "
                        "for other decoders, e.g. a Qwen2, Mistral or Gemma folder; --engine forces one)")
    r.add_argument("--lengths", type=flags.LENGTHS, default=None, metavar="N,N",
                   help="prompt lengths in tokens (default 2048)")
    r.add_argument("--tasks", type=flags.Listed(flags.OneOf(("passkey", "single-number", "single-word", "multikey",
                                                               "multivalue"), "task {value} is unknown: choose from "
                                                              "{names}"), "tasks"),
                   default=None, help="needle tasks (default passkey,single-number)")
    r.add_argument("--prompts", type=flags.POSITIVE, default=None, help="prompts per (length, task) (default 2)")
    r.add_argument("--seed", type=flags.SEED, default=None, help="seed of the needle cases (default 0)")
    r.add_argument("--split", choices=("test", "train"), default=None,
                   help="the text split the jargon haystacks come from: test (default: the long-context "
                        "evaluation's, seed 0 its cases) or train (cases to choose a plan on: give another --seed "
                        "too, as the filler haystack is the same text in both)")
    r.add_argument("--passkey-prompt", type=flags.OneOf(_passkey_prompts, "passkey prompt {value} is unknown: "
                                                                          "choose from {names}"), default=None,
                   help="the passkey task's wording, as tradeoff --long takes it (default cue)")
    r.add_argument("--sinks", type=flags.COUNT, default=None, help="sink tokens of the dropped-mass score (default 4)")
    r.add_argument("--window", type=flags.POSITIVE, default=None,
                   help="window of the dropped-mass score (default 256)")
    r.add_argument("--block", type=flags.POSITIVE, default=None,
                   help="query rows per block of the dropped-mass score (default 128)")
    r.add_argument("--all-cases", action="store_true",
                   help="average the retrieval score over every case, not only those the model answers right")
    r.add_argument("--ablate-top", type=flags.POSITIVE, default=None, metavar="K",
                   help="zero the K best retrieval heads, and K random others (--draws sets), and measure the "
                        "needle accuracy")
    r.add_argument("--draws", type=flags.POSITIVE, default=None, help="random head sets for --ablate-top (default 5)")
    r.add_argument("--budget", type=flags.FRACTIONS, default=None, metavar="F,F",
                   help="write a head plan (HeadPlan JSON in --out: MODEL-SCORE-PCT-plan.json) keeping every key for "
                        "this fraction of KV heads and --sinks + --window for the rest, per fraction (default 0.5; "
                        "'none' for no plan)")
    r.add_argument("--plan-by", type=flags.Listed(flags.OneOf(PLAN_SCORES, "score {value} is unknown: choose from "
                                                                          "{names}"), "scores"),
                   default=None, metavar="SCORE,SCORE",
                   help="the score(s) plans rank KV heads by: retrieval (default; ties by the dropped mass), mass, "
                        "razor")
    p.set_defaults(run=run)


PLAN_SCORES = ("retrieval", "mass", "razor")


def _passkey_prompts() -> tuple[str, ...]:
    from multihead.evals.needles import PASSKEY_PROMPTS

    return tuple(PASSKEY_PROMPTS)


RETRIEVAL_ONLY = ("lengths", "tasks", "prompts", "seed", "split", "passkey_prompt", "sinks", "window", "block",
                  "ablate_top", "draws", "all_cases", "budget", "plan_by")


def _retrieval(args: argparse.Namespace, model: Any, report: Any) -> Any:
    """The retrieval scores of --retrieval, attached to the report (razor scores from its own echo/induction): our
    port's through its KV cache, a transformers decoder's through transformers' cache with its attention on
    multihead (the same hook points, the same code)."""
    from multihead.heads.adapters import DecoderHeads
    from multihead.heads.retrieval import RetrievalSettings, analyse_retrieval, razor_from_head_scores

    if not isinstance(model, DecoderHeads):
        raise CliError(f"--retrieval answers needle questions with a causal language model: {model.name} is an "
                       "encoder (give a decoder: --model smollm2, a .gguf file or a decoder's folder)")
    chosen = {"sinks": args.sinks, "window": args.window, "block": args.block,
              "correct_only": False if args.all_cases else None}
    settings = RetrievalSettings(**{k: v for k, v in chosen.items() if v is not None})
    report.retrieval = analyse_retrieval(
        model.decoder, model.tokenizer, lengths=tuple(args.lengths or (2048,)),
        tasks=tuple(args.tasks or ("passkey", "single-number")), prompts=args.prompts or 2, settings=settings,
        seed=args.seed or 0, split=args.split or "test", passkey_prompt=args.passkey_prompt or "cue",
        razor=razor_from_head_scores(report.scores), ablate_top=args.ablate_top or 0, draws=args.draws or 5,
        name=model.name, progress=not args.json)
    return report.retrieval


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    text = args.text
    if args.file is not None:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)  # (an OSError's own
            raise CliError(f"cannot read --file {args.file!r}: {why}") from None  # text names the file again)
    if text is not None and not text.strip():
        raise CliError("the text is empty: give some text to analyse")
    if not args.retrieval:
        given = [f"--{name.replace('_', '-')}" for name in RETRIEVAL_ONLY if getattr(args, name) not in (None, False)]
        if given:
            raise CliError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --retrieval: add --retrieval")
    with out_folder(args.out) as out:  # fails before the long work if the report cannot be written
        from multihead.heads.adapters import load_head_model
        from multihead.heads.analysis import analyse
        from multihead.heads.patching import shipped_pairs
        from multihead.heads.report import result_json, write_all

        say_model(args.model, args.engine, quiet=args.json)
        model = load_head_model(args.model, engine=args.engine)
        report = analyse(model, text, display_tokens=args.tokens, ablate=args.ablate, convert=args.convert,
                         pairs=shipped_pairs() if args.patch else None, progress=not args.json)
        if args.retrieval:
            _retrieval(args, model, report)
        files = write_all(report, out)
        plans = _write_plans(args, report.retrieval, out) if report.retrieval is not None else []
    if args.json:
        print(json.dumps({**result_json(report), "files": files, **({"plans": plans} if args.retrieval else {})}))
        return 0
    scores = report.scores
    print(f"{report.model}: {report.n_layers} layers x {report.n_heads} query heads ({kv_heads(report.n_kv_heads)}), "
          f"{'causal' if report.causal else 'bidirectional'}; engine: {report.engine}")
    names = ["previous_token", "induction", "duplicate_token", "first_token", "self", "local", "entropy"]
    if not report.causal:
        names.insert(1, "next_token")
    print(f"{'score':<16} top heads (LxHy: layer x, head y = score)")
    for name in names:
        tops = "  ".join(f"{head_name(layer, head)} = {value:.2f}" for layer, head, value in scores.top(name, args.top))
        print(f"{name:<16} {tops}")
    counts: dict[str, int] = {}
    for row in scores.labels:
        for label in row:
            counts[label] = counts.get(label, 0) + 1
    print("labels: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])))
    from multihead.heads.scores import LABEL_RULES

    print("a head's label is the first rule it meets, else mixed: " + ", ".join(
        f"{label} ({score} >= {threshold:.2f})" for score, label, threshold in LABEL_RULES)
        + "; each score is defined in the report")
    summary = report.ablation_summary()
    if summary:
        top = ", ".join(f"{head_name(r['layer'], r['head'])} ({r['delta']:+.4f})"
                        for r in summary["most_important"][:5])
        print(f"ablation ({report.metric_name}, baseline {report.baseline:.4f}): most important {top}; "
              f"{summary['share_below_1_percent']:.0%} of heads change it by less than 1%")
    for converted in report.conversion:
        print(f"GQA by mean-pooling to {converted['n_kv_heads']} KV heads: {report.metric_name} "
              f"{converted['metric']:.4f} ({converted['delta']:+.4f})")
    if report.retrieval is not None:
        _print_retrieval(report.retrieval, args.top)
        if plans:
            print("plans: " + ", ".join(plans))
    print(f"report: {files['html']}")
    print("pictures: " + ", ".join(files[k] for k in ("grid_png", "heads_png", "retrieval_png") if k in files))
    print(f"data: {files['json']}")
    return 0


def _write_plans(args: argparse.Namespace, scores: Any, out: Any) -> list[str]:
    """The head plans of --budget and --plan-by, written into ``out`` (one file per score and fraction)."""
    import re
    from pathlib import Path

    budgets = (0.5,) if args.budget is None else args.budget
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", scores.model).strip("-.") or "model"
    written = []
    for by in args.plan_by or ("retrieval",):
        for budget in budgets:
            plan = scores.plan(budget, by)
            written.append(str(plan.save(Path(out) / f"{stem}-{by}-{budget * 100:g}-plan.json")))
    return written


def _print_retrieval(scores: Any, top: int) -> None:
    used = sum(1 for c in scores.cases if c["used"])
    st = scores.settings
    print(f"retrieval (Wu et al.): {used} of {len(scores.cases)} needle cases answered right and used; top KV heads "
          "(LxKVy = max over its query heads): " + "  ".join(f"L{a}KV{b} = {v:.2f}" for a, b, v in scores.top(top)))
    print("retrieval, query heads: " + "  ".join(f"{head_name(a, b)} = {v:.2f}"
                                                for a, b, v in scores.top(top, kind="query")))
    print(f"mass outside {st['sinks']} sinks + window {st['window']} (over {scores.mass_rows} prefill rows): "
          + "  ".join(f"{head_name(a, b)} = {v:.2f}" for a, b, v in scores.top(top, kind="mass_outside")))
    ab = scores.ablation
    if ab:
        print(f"ablation: accuracy {ab['baseline']:.0%} -> {ab['top_k']:.0%} without the top {ab['k']} retrieval "
              f"heads; {sum(ab['random']) / len(ab['random']):.0%} on average without {ab['k']} random others "
              f"({ab['draws']} draws)")
