"""The ``multihead`` command: thin subcommands over library functions.

User errors (bad flags, impossible configurations) print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from multihead.config import AttentionConfig
from multihead.errors import MultiheadError


class CliError(Exception):
    """A bad command line: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(f"{self.prog}: {message}")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _fmt(n: int) -> str:
    return f"{n:,}"


# ---------------------------------------------------------------------------------------------- shapes
def _add_shapes(sub: Any) -> None:
    p = sub.add_parser("shapes", help="walk the shapes of one attention layer, step by step (runs on the meta device)")
    p.add_argument("--d-model", type=_positive, required=True, help="model width d_model")
    p.add_argument("--heads", type=_positive, required=True, help="query heads n_heads")
    p.add_argument("--kv-heads", type=_positive, default=None, help="key/value heads (default: --heads, MHA)")
    p.add_argument("--head-dim", type=_positive, default=None, help="width of a head (default d_model / heads)")
    p.add_argument("--seq", type=_positive, default=128, help="sequence length s (default 128)")
    p.add_argument("--batch", type=_positive, default=1, help="batch size b (default 1)")
    p.add_argument("--bias", action="store_true", help="give the projections biases (default: none, Llama-style)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run_shapes)


def _run_shapes(args: argparse.Namespace) -> int:
    from multihead.shapes import shape_walk

    config = AttentionConfig(
        d_model=args.d_model, n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim, bias=args.bias
    )
    walk = shape_walk(config, batch=args.batch, seq=args.seq)
    if args.json:
        print(json.dumps({
            "config": config.to_dict(),
            "variant": config.variant,
            "batch": walk.batch,
            "seq": walk.seq,
            "head_dim": config.head_dim,
            "steps": [{"step": s.name, "label": s.label, "legend": s.legend, "shape": list(s.shape)}
                      for s in walk.steps],
            "parameters": walk.parameters,
            "projection_parameters": walk.total_parameters,
        }, indent=2))
        return 0
    c = config
    print(f"d_model {c.d_model}, n_heads {c.n_heads}, n_kv_heads {c.n_kv_heads} ({c.variant}), "
          f"d_k = head_dim = {c.head_dim}" + ("" if args.head_dim else f" (= {c.d_model} / {c.n_heads})")
          + f", batch {walk.batch}, seq {walk.seq}")
    width = max(len(s.label) for s in walk.steps)
    shape_width = max(len(str(s.shape)) for s in walk.steps)
    for s in walk.steps:
        print(f"  {s.label:<{width}}  {s.shape!s:<{shape_width}}  {s.legend}")
    print("projection parameters:")
    for name, n in walk.parameters.items():
        print(f"  {name:<{width}}  {_fmt(n)}")
    print(f"  {'total':<{width}}  {_fmt(walk.total_parameters)}")
    return 0


# ---------------------------------------------------------------------------------------------- main
_COMMANDS: list[Callable[[Any], None]] = [_add_shapes]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="multihead", description="Multi-head attention: shapes, costs, real models and their heads.")
    from multihead import __version__

    parser.add_argument("--version", action="version", version=f"multihead {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 user error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return int(args.run(args))
    except (CliError, MultiheadError) as err:
        message = str(err)
        if not message.startswith("multihead"):
            message = f"multihead: error: {message}"
        print(message.replace("\n", " "), file=sys.stderr)
        return 2


def entry() -> NoReturn:
    sys.exit(main())
