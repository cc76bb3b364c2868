"""Hostile command lines (issue 21): every flag of every subcommand given values a hostile or careless user might
type. Each case runs `multihead` in a forked child under a time and memory limit; it must end with status 0 (or 1
for a failed `check`), or status 2 and exactly one line on stderr: never a traceback, a hang or a memory blow-up."""

from __future__ import annotations

import argparse
import contextlib
import io
from collections import Counter
from pathlib import Path

from isolation import isolated
from multihead.cli import CliError, build_parser, main

HOSTILE = ["0", "-1", "", "nan", "1e400", "1" + "0" * 30, str(2**70), "\udcff\udcfe", "x" * 5000, "/etc/passwd/x",
           "/"]
# Subcommands that load a real model or train: only values the parser refuses are run in full for these,
# plus the curated path and text cases below.
LIGHT = ("shapes", "count", "compare", "presets")


def base_argv(command: str, out: Path) -> list[str]:
    return {
        "shapes": ["shapes", "--d-model", "64", "--heads", "8"],
        "count": ["count", "--preset", "gpt2", "--seq", "128"],
        "compare": ["compare", "--preset", "gpt2", "--seq", "128", "--plot", str(out / "c.png")],
        "presets": ["presets"],
        "embed": ["embed", "hello"],
        "generate": ["generate", "hi", "--max-new-tokens", "2"],
        "heads": ["heads", "--model", "minilm", "--text", "a short text", "--out", str(out / "h")],
        "experiment": ["experiment", "heads-vs-width", "--d-model", "8", "--layers", "1", "--steps", "2", "--seeds",
                       "1", "--batch", "2", "--workers", "1", "--heads", "1,2", "--pairs", "2", "--out",
                       str(out / "e")],
        "check": ["check", "--dtype", "float32", "--backend", "math"],
        "patch": ["patch", "--point", "z", "--top", "3"],
        "tradeoff": ["tradeoff", "--model", "minilm", "--texts", "4", "--out", str(out / "t")],
    }[command]


def flags(parser: argparse.ArgumentParser) -> dict[str, list[tuple[str, bool]]]:
    """Each subcommand's option flags that take a value, and whether the value is free text (no type, no choices)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, p in sub.choices.items():
        out[name] = [(a.option_strings[-1], a.type is None and a.choices is None) for a in p._actions
                     if a.option_strings and a.nargs != 0 and not isinstance(a, argparse._HelpAction)]
    return out


def parses(argv: list[str]) -> bool:
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except (CliError, SystemExit):
        return False
    return True


def run_cli(argv: list[str]) -> str:
    """Run main in this (forked) process with stdout and stderr captured; the status and stderr, as text."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        status = main(argv)
    return f"{status}\n{err.getvalue()}"


def cases(out: Path) -> list[tuple[str, list[str]]]:
    parser = build_parser()
    found = []
    (out / "a-file").write_text("x")
    for command, options in flags(parser).items():
        base = base_argv(command, out)
        for flag, free in options:
            values = HOSTILE if command in LIGHT else [v for v in HOSTILE if not parses([*base, flag, v])]
            if command not in LIGHT and free:  # paths a user gets wrong, run in full (a new --out folder is fine)
                values += [str(out / "a-file" / "x")] + ([] if flag == "--out" else [str(out / "missing" / "x.txt")])
            for value in values:
                found.append((f"{command} {flag} {value[:20]!r}", [*base, flag, value]))
    for command in LIGHT:  # bad positionals and unknown flags too
        found.append((f"{command} --no-such-flag", [*base_argv(command, out), "--no-such-flag"]))
    return found


def test_every_flag_of_every_subcommand_takes_hostile_values(tmp_path: Path) -> None:
    seen: Counter[str] = Counter()
    bad = []
    all_cases = cases(tmp_path)
    for name, argv in all_cases:
        outcome = isolated(run_cli, argv, seconds=60, memory=2 << 30)
        if outcome.kind != "ok":
            bad.append(f"{name}: {outcome}")
            continue
        status, _, err = outcome.detail.partition("\n")
        lines = [line for line in err.splitlines() if line.strip()]
        command = argv[0]
        allowed = {"0", "2", "1"} if command == "check" else {"0", "2"}
        if status not in allowed or "Traceback" in err or (status == "2" and len(lines) != 1):
            bad.append(f"{name}: status {status}, stderr {err[-600:]!r}")
        seen[status] += 1
    print(f"\nfuzz cases, command lines: {len(all_cases)} (exit status: {dict(seen)})")
    assert not bad, "\n".join(bad[:40]) + f"\n({len(bad)} of {len(all_cases)})"
    assert sum(seen.values()) >= 600, seen
