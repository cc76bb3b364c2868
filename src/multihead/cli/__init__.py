"""The ``multihead`` command: one small module per subcommand (``multihead.cli.<name>``, each with ``add(subparsers)``
and ``run(args) -> int``), over library functions.

A command's module is imported only when that command runs (``COMMANDS`` holds what ``multihead --help`` lists), so
``multihead --help`` and ``multihead count`` load no model code; ``import multihead`` is lazy and the commands import
torch inside their ``run``, so no ``--help`` imports torch (tests/test_cli_help.py) and Ctrl-C during a command's
start-up is handled like any other. Each command's help shows its ``EXAMPLES``.

Exit status: 0 ok, 1 a failure (a check that failed, output that could not be written), 2 a user error (one line on
stderr, ``multihead <command>: error: <message>``), 130 Ctrl-C (one line).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from multihead.cli.flags import CliError, Parser, check_models, show
from multihead.errors import MultiheadError
from multihead.names import ENGINES

__all__ = ["COMMANDS", "ENGINES", "EXAMPLES", "CliError", "build_parser", "entry", "error_line", "main"]

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
    "tune": "measure this host's CPU speed decisions for a model once (which kind of each product, which attention "
            "kernel) and write them to its tuning table, which every run reads and never measures",
}

# name -> examples that `multihead <name> --help` shows (each a command line, then what it does); a test parses each
EXAMPLES: dict[str, tuple[tuple[str, str], ...]] = {
    "heads": (("multihead heads", "SmolLM2 on the shipped passage; report in multihead-heads/"),
              ("multihead heads --model minilm --text 'The cat sat on the mat.' --ablate --out my-report",
               "MiniLM on your text, each head zeroed in turn"),
              ("multihead heads --retrieval --lengths 2048", "retrieval heads on 2k-token needle cases")),
    "shapes": (("multihead shapes --d-model 4096 --heads 32 --seq 128", "the shape of every step of MHA"),
               ("multihead shapes --d-model 4096 --heads 32 --seq 128 --kv-heads 8", "the same as GQA"),
               ("multihead shapes --preset deepseek-v3 --path absorbed", "MLA's absorbed path")),
    "count": (("multihead count --preset llama-3-8b --seq 8192 --device-memory 80GB",
               "does the whole model fit in 80 GB at 8k tokens?"),
              ("multihead count --d-model 768 --heads 12 --json", "one attention layer's figures as JSON"),
              ("multihead count --preset llama-3-70b --hardware h100-80g --tp 2 --seq 8192",
               "memory and estimated speed on two H100s")),
    "compare": (("multihead compare --preset llama-2-70b --seq 4096 --device-memory 80GiB --plot kv.png",
                 "MHA vs GQA vs MQA, plotted"),
                ("multihead compare --preset llama-3-8b --no-plot --json", "the same as JSON, no picture")),
    "presets": (("multihead presets", "the named models and their shapes"),
                ("multihead presets --json", "the same as JSON")),
    "embed": (("multihead embed 'A man is eating food.' 'A man eats.' --json", "two sentence embeddings"),),
    "generate": (("multihead generate 'The capital of France is' --max-new-tokens 32", "greedy text, streamed"),
                 ("multihead generate 'What is 2+2?' --chat --temperature 0.7 --top-p 0.9 --seed 1",
                  "a sampled chat answer"),
                 ("multihead generate 'Once upon a time' --plan docs/experiments/smollm2-duo-50-plan.json",
                  "decode with a head-wise cache; prints its bytes and speed")),
    "experiment": (("multihead experiment heads-vs-width --steps 1500 --heads 1,4,16 --seeds 2",
                    "many small heads or one wide head, three head counts"),
                   ("multihead experiment heads-vs-width --task lm", "the same on real text")),
    "check": (("multihead check --backend sdpa,math", "the correctness harness, without flex's compiles"),
              ("multihead check --device cuda --dtype bfloat16", "on a GPU, in bfloat16")),
    "patch": (("multihead patch", "SmolLM2 on the 8 shipped indirect-object prompt pairs"),
              ("multihead patch --clean 'When Mary and John went to the store, John gave a drink to' "
               "--corrupt 'When Mary and John went to the store, Mary gave a drink to' --answers ' Mary' ' John' "
               "--json", "your own prompt pair")),
    "circuit": (("multihead circuit", "SmolLM2, the shipped pairs: DLA, composition, the EAP circuit, a report"),
                ("multihead circuit --method eap-ig --steps 5 --edges 40 --check 5 --out runs/ioi --json",
                 "EAP-IG, a larger circuit, as JSON")),
    "tradeoff": (("multihead tradeoff --model minilm", "the encoder: 1 - cosine against KV bytes"),
                 ("multihead tradeoff --long --lengths 2048 --tasks passkey",
                  "retrieval at 2k tokens for every KV-saving method")),
    "tune": (("multihead tune --dtype bf16 --lengths 1024,4096,8192", "SmolLM2's bfloat16 decoding, up to 8k keys"),
             ("multihead tune --show", "the table's path, its decisions and the default rules"),
             ("multihead tune --clear", "forget them: the default rules decide again")),
}


def _wrapped(line: str, width: int = 96) -> str:
    """A long command line broken before a flag, with a shell continuation (``\\``), each part indented."""
    lines = [""]
    for i, part in enumerate(line.split(" --")):
        piece = part if i == 0 else f"--{part}"
        if lines[-1].strip() and len(lines[-1]) + 1 + len(piece) > width:
            lines[-1] += " \\"
            lines.append("    ")
        lines[-1] += (" " if lines[-1].strip() else "") + piece
    return "\n  ".join(lines)


def _describe(parser: argparse.ArgumentParser, name: str) -> None:
    """A command's help: what it does (COMMANDS) above the flags, its EXAMPLES below them, each under a comment
    that says what it does."""
    parser.description = COMMANDS[name][:1].upper() + COMMANDS[name][1:] + "."
    parser.epilog = "examples:\n" + "\n".join(f"  # {what}\n  {_wrapped(line)}" for line, what in EXAMPLES[name])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only``, that command's flags in full and the others as names only (their modules not
    imported; ``only=""``: every command as a name, for `multihead --help`)."""
    from multihead import __version__

    parser = Parser(prog="multihead", description="Multi-head attention: shapes, costs, real models and their heads.",
                    epilog="`multihead COMMAND --help` shows a command's flags and examples, e.g. "
                           "`multihead count --help`.")
    parser.add_argument("--version", action="version", version=f"multihead {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, summary in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(f"multihead.cli.{name}").add(sub)
            _describe(sub.choices[name], name)
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
            raise CliError(f"{where}{show(arg)} is not valid UTF-8 text") from None


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


def error_line(command: str | None, err: Exception) -> str:
    """The one line a user error prints, the same for argparse's errors and the library's:
    ``multihead <command>: error: <message>`` (``multihead: error: ...`` before a command is known)."""
    message = " ".join(str(err).split("\n"))
    return f"multihead{f' {command}' if command else ''}: error: {message}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 failure, 2 user error, 130 interrupted)."""
    name: str | None = None
    try:
        args_list = list(sys.argv[1:] if argv is None else argv)
        name = next((a for a in args_list if not a.startswith("-")), None)
        if name not in COMMANDS:
            name = None
        _check_text(args_list)
        parser = build_parser(name or "")
        args = parser.parse_args(args_list)
        if args.command is None:
            parser.print_help()
            return 2
        check_models(args)  # a --model path that does not exist: said before the command loads anything
        status = int(args.run(args))
        if status == 0 and getattr(args, "tp_processes", False) and args.tp > 1:  # ranks leave their group together
            from multihead.layers import parallel

            parallel.finish()
        return status
    except (CliError, MultiheadError) as err:
        print(error_line(name, err), file=sys.stderr)
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
    parallel = sys.modules.get("multihead.layers.parallel")
    if parallel is not None and parallel.joined:  # a --tp rank: gloo's threads must not meet finalization
        parallel.leave(status)
    sys.exit(status)
