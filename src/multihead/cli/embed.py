"""`multihead embed`: sentence embeddings with all-MiniLM-L6-v2 running on multihead's layer."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from multihead.cli import COMMANDS, flags
from multihead.cli.common import add_tp, is_rank0


def add(sub: Any) -> None:
    p = sub.add_parser("embed", help=COMMANDS["embed"])
    p.add_argument("texts", nargs="+", metavar="TEXT", help="one or more texts")
    p.add_argument("--model", type=flags.PATH, metavar="DIR",
                   help="minilm (default: the installed all-MiniLM-L6-v2) or a sentence-transformers folder")
    p.add_argument("--json", action="store_true", help="print one JSON object with the vectors")
    add_tp(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from multihead.models import load_sentence_encoder
    from multihead.models.route import route

    found = route(args.model, "auto", default="minilm")
    if found.port != "bert":
        raise flags.CliError(f"embed runs multihead's sentence-encoder port (BERT): {found.describe()}")
    encoder = load_sentence_encoder(found.path)
    if args.tp > 1:
        from multihead.layers import parallel

        parallel.shard_bert(encoder.encoder, parallel.init(args.tp))
        if not is_rank0():
            encoder.embed(args.texts)  # every rank takes part in each all-reduce; rank 0 prints
            return 0
    _, _, truncated = encoder.tokenize(args.texts)
    vectors = encoder.embed(args.texts)
    for text, cut in zip(args.texts, truncated, strict=True):
        if cut:
            print(f"multihead: note: {text[:40]!r}... is longer than {encoder.max_length} tokens and was truncated "
                  "(as the model was trained)", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": str(args.model or "all-MiniLM-L6-v2"), "dim": vectors.shape[1],
                          "embeddings": [{"text": t, "truncated": c, "embedding": v.tolist()}
                                         for t, c, v in zip(args.texts, truncated, vectors, strict=True)]}))
        return 0
    for text, v in zip(args.texts, vectors, strict=True):
        head = ", ".join(f"{x:+.4f}" for x in v[:6].tolist())
        print(f"{text[:50]!r:<54} [{head}, ...] ({v.shape[0]} dims)")
    if len(args.texts) > 1:
        sims = vectors @ vectors.T
        print("cosine similarity:")
        for i in range(len(args.texts)):
            print("  " + " ".join(f"{x:6.3f}" for x in sims[i].tolist()))
    return 0
