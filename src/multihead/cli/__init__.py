"""The ``multihead`` command: one small module per subcommand (``multihead.cli.<name>``, each with ``add(subparsers)``
and ``run(args) -> int``), over library functions.

A command's module is imported only when that command runs (``COMMANDS`` holds what ``multihead --help`` lists), so
``multihead --help`` and ``multihead count`` load no model code. Exit status: 0 ok, 1 a failure (a check that failed,
output that could not be written), 2 a user error (one line on stderr), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from multihead.cli.flags import CliError, Parser, show
from multihead.errors import MultiheadError
from multihead.names import ENGINES

__all__ = ["COMMANDS", "ENGINES", "CliError", "build_parser", "entry", "main"]

# name -> what `multihead --help` says of it; the command's code is in multihead.cli.<name>
COMMANDS: dict[str, str] = {
    "heads": "what each head of a real model does: scores, labels, pictures, an HTML report",
    "shapes": "walk the shapes of one attention layer, step by step (runs on the meta device)",
    "count": "does it fit? the whole model's parameters and memory (weights, KV cache, activations), and attention's "
             "parameters, FLOPs and memory",
    "compare": "the same model as MHA, GQA and MQA: KV-cache memory side by side, and a plot",
    "presets": "list the named real-model configurations",
    "embed": "sentence embeddings with all-MiniLM-L6-v2 running on multihead's layer",
    "generate": "generate text with SmolLM2 running on multihead's layer and KV cache",
    "experiment": "experiments on heads (heads-vs-width: many small heads or one wide head)",
    "check": "the correctness harness on this machine: 2x rule, empty rows, cache, determinism",
    "patch": "which heads cause a behaviour: activation and attribution patching per head",
    "circuit": "how the heads wire a behaviour: direct logit attribution, composition and the circuit found by "
               "edge attribution patching, drawn as a graph in an HTML report",
    "tradeoff": "the KV-cache trade-off: perplexity against KV bytes for each way of saving cache (sinks + window, "
                "quantization, fewer KV heads, uptraining)",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only``, that command's flags in full and the others as names only (their modules not
    imported; ``only=""``: every command as a name, for `multihead --help`)."""
    from multihead import __version__

    parser = Parser(prog="multihead", description="Multi-head attention: shapes, costs, real models and their heads.")
    parser.add_argument("--version", action="version", version=f"multihead {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, summary in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(f"multihead.cli.{name}").add(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def _check_text(argv: list[str]) -> None:
    """Undecodable bytes arrive as lone surrogates (PEP 383): refused here, naming the flag they were given to."""
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            flag = argv[i - 1] if i and argv[i - 1].startswith("-") else None
            where = f"argument {flag}: " if flag else f"argument {i + 1}: "
            raise CliError(f"multihead: error: {where}{show(arg)} is not valid UTF-8 text") from None


def _stdout_gone() -> int:
    """The reader of stdout went away (`multihead ... | head -1`): say nothing more (Python's documented recipe:
    point stdout at devnull so the final flush cannot fail again), exit 1."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # stdout replaced by something without a file (io.StringIO)
        return 1
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 failure, 2 user error, 130 interrupted)."""
    try:
        args_list = list(sys.argv[1:] if argv is None else argv)
        _check_text(args_list)
        name = next((a for a in args_list if not a.startswith("-")), None)
        parser = build_parser(name if name in COMMANDS else "")
        args = parser.parse_args(args_list)
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
    except BrokenPipeError:
        return _stdout_gone()
    except KeyboardInterrupt:  # Ctrl-C: files are whole or absent (multihead.files), so one line is all to say
        print("multihead: interrupted", file=sys.stderr)
        return 130


def entry() -> NoReturn:
    status = main()
    try:
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not in the interpreter's shutdown
    except BrokenPipeError:
        status = _stdout_gone()
    sys.exit(status)
