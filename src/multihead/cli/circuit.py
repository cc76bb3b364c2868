"""`multihead circuit`: what writes the answer and how it is wired: direct logit attribution, composition between
the top heads, and the circuit found by edge attribution patching, in one HTML report."""

from __future__ import annotations

import argparse
import json
from typing import Any

from multihead.cli import COMMANDS, flags
from multihead.cli.common import out_folder, say_model
from multihead.cli.flags import CliError, kv_heads
from multihead.names import ENGINES

STEPS = 5  # EAP-IG's default steps


def add(sub: Any) -> None:
    p = sub.add_parser("circuit", help=COMMANDS["circuit"])
    p.add_argument("--model", type=flags.MODEL, default="smollm2",
                   help="smollm2 (default), gemma3, a .gguf file of any architecture or a causal model folder")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="as for 'heads': our port where one applies (default), or transformers")
    p.add_argument("--pairs", type=flags.PATH, default=None, metavar="FILE",
                   help="prompt pairs as JSON, shaped as the shipped ones ({\"pairs\": [{\"clean\", \"corrupt\", "
                        "\"answer\", \"wrong\"}]}; default: the shipped indirect-object pairs)")
    p.add_argument("--max-pairs", type=flags.POSITIVE, default=None, metavar="N", help="use the first N pairs")
    p.add_argument("--method", choices=("eap", "eap-ig"), default="eap",
                   help="edge attribution patching (eap, default: one backward per batch of pairs) or its "
                        "integrated-gradients form (eap-ig: --steps backwards)")
    p.add_argument("--steps", type=flags.POSITIVE, default=None, help=f"eap-ig's steps (default {STEPS})")
    p.add_argument("--edges", type=flags.POSITIVE, default=20, metavar="N",
                   help="the circuit's size in edges (default 20; greedy may keep a few more, see --select)")
    p.add_argument("--select", choices=("greedy", "top"), default="greedy",
                   help="how the N edges are chosen: greedy (default; from the logits back, the strongest edge into "
                        "the circuit so far, then only the edges on a path from the embeddings: Hanna et al. 2024) "
                        "or top (the N largest |scores|, connected or not)")
    p.add_argument("--check", type=flags.COUNT, default=5, metavar="K",
                   help="check the top K edges by exact path patching (default 5; 0: none)")
    p.add_argument("--ablation", choices=("corrupt", "mean"), default="corrupt",
                   help="faithfulness: edges outside the circuit carry the corrupted prompt's writes (default) or "
                        "their mean over the corrupted prompts of the same token length (the pairs run as one "
                        "batch; a pair alone in its length is corrupt-ablated)")
    p.add_argument("--top", type=flags.POSITIVE, default=10, metavar="K",
                   help="heads shown in the composition heatmaps and parts listed (default 10)")
    p.add_argument("--out", type=flags.PATH, default="multihead-circuit", metavar="DIR",
                   help="folder for the report, the DLA picture and the JSON (default multihead-circuit)")
    p.add_argument("--html", type=flags.PATH, default=None, metavar="FILE",
                   help="write the HTML report here (.html) instead of OUT/circuit.html")
    p.add_argument("--json", action="store_true", help="print one JSON object (everything, and the files)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from multihead.errors import MultiheadError
    from multihead.files import output_file

    if args.steps is not None and args.method != "eap-ig":
        raise CliError("--steps is for --method eap-ig")
    from multihead.heads.circuit import read_pairs
    from multihead.heads.patching import shipped_pairs

    if args.pairs is None:
        pairs = shipped_pairs()
    else:
        try:
            pairs = read_pairs(args.pairs)
        except MultiheadError as err:
            raise CliError(f"argument --pairs: {err}") from None
    pairs = pairs[:args.max_pairs] if args.max_pairs else pairs
    html_path = None
    if args.html is not None:
        try:
            html_path = output_file(args.html, ("html", "htm"))
        except MultiheadError as err:
            raise CliError(f"argument --html: {err}") from None
    with out_folder(args.out) as out:  # fails before the long work if the report cannot be written
        from multihead.heads.adapters import load_head_model
        from multihead.heads.circuit import analyse_circuit
        from multihead.heads.circuit_report import write_report

        say_model(args.model, args.engine, quiet=args.json)
        model = load_head_model(args.model, engine=args.engine)
        report = analyse_circuit(model, pairs, method=args.method, steps=args.steps or STEPS, edges=args.edges,
                                 top=args.top, check=args.check, ablation=args.ablation, select=args.select,
                                 progress=not args.json)
        files = write_report(report, out, None if html_path is None else Path(html_path))
    if args.json:
        print(json.dumps({**report.to_json(), "files": files}))
        return 0
    _print(report, args.top)
    print(f"report: {files['html']}")
    print(f"picture: {files['dla_png']}; data: {files['json']}")
    return 0


def _print(report: Any, top: int) -> None:
    d = report.dla
    print(f"{report.model} ({report.engine}): {report.n_layers} layers x {report.n_heads} query heads "
          f"({kv_heads(report.n_kv_heads)}); {len(report.pairs)} prompt pair(s), logit difference {d.logit_diff:.3f} "
          "(mean, clean prompts' last token)")
    print(f"direct logit attribution: embed {d.embed:+.3f} + heads {d.heads.sum():+.3f} + MLPs {d.mlps.sum():+.3f} "
          f"+ constant {d.constant:+.3f} + remainder {d.remainder:+.1e}")
    print("largest parts (+ raises the logit difference: helps the answer; - lowers it: opposes): "
          + "  ".join(f"{name} = {value:+.3f}" for name, value in d.top(top)))
    c = report.circuit
    if c is not None:
        print("edge scores: the change of the logit difference when the edge carries the corrupted prompt's write "
              "(- the edge carries the behaviour, + it works against it)")
        print(f"circuit ({c['method']}{', ' + str(c['steps']) + ' steps' if c['method'] == 'eap-ig' else ''}; "
              f"{len(c['edges'])} of {c['n_scored']} edges, {c['select']}): " + "  ".join(
                  f"{e['sender']} -> {e['receiver']} {e['score']:+.3f}" for e in c["edges"][:min(top, 8)]))
        f = c["faithfulness"]
        print(f"faithfulness ({f['ablation']}-ablation outside the circuit): {f['kept']:.3f} of the logit "
              f"difference kept (circuit {f['circuit_metric']:.3f}, clean {f['clean_metric']:.3f}, corrupted "
              f"{f['corrupted_metric']:.3f})")
        if c["checks"]:
            print("exact check (path patching, the same change measured): " + "  ".join(
                f"{k['sender']} -> {k['receiver']} {k['score']:+.3f} vs {k['exact']:+.3f}" for k in c["checks"]))
    view = report.composition
    if view.reason is not None:
        print(f"composition: {view.reason}")
    else:
        strongest = []
        for kind in ("q", "k", "v"):
            readers, writers, matrix = view.kinds[kind]
            cells = [(v, writers[j], readers[i]) for i, row in enumerate(matrix) for j, v in enumerate(row)
                     if v is not None]
            if cells:
                v, w, r = max(cells)
                strongest.append(f"{kind.upper()} {w} -> {r} {v:+.3f}")
        print(f"composition between {len(view.heads)} heads (score - random baseline: + above it), strongest: "
              + "  ".join(strongest))
    print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in report.seconds.items()))
