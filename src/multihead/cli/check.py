"""`multihead check`: the correctness harness on this machine (2x rule, empty rows, cache, determinism)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from multihead.cli import COMMANDS, flags
from multihead.cli.model import DTYPE_HELP

CHECK_DTYPES = ("fp32", "fp16", "bf16")


def add(sub: Any) -> None:
    p = sub.add_parser("check", help=COMMANDS["check"])
    p.add_argument("--device", type=flags.DEVICE, default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", type=flags.Dtype(CHECK_DTYPES, many=True), default=CHECK_DTYPES,
                   help=f"{DTYPE_HELP}, here those the checks run in: comma-separated, of fp32, fp16, bf16 "
                        "(default: all three)")
    p.add_argument("--backend", type=flags.BACKENDS, default=("sdpa", "math", "flex"),
                   help="comma-separated backends (default: all three; flex compiles for each shape on first use)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from multihead.verify.check import run_checks

    results = run_checks(device=args.device, dtypes=[flags.TORCH_NAMES[d] for d in args.dtype],
                         backends=tuple(args.backend))
    failed = [r for r in results if not r.passed]
    if args.json:
        print(json.dumps({"device": args.device, "passed": not failed,
                          "results": [dataclasses.asdict(r) for r in results]}))
    else:
        for r in results:
            print(f"{'ok  ' if r.passed else 'FAIL'} {r.dtype:<9} {r.backend:<5} {r.check:<14} {r.detail}")
        print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
