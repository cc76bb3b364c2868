"""Hostile command lines (issues 21 and 26): every flag of every subcommand given values a hostile or careless user
might type. Each case runs `multihead` in a forked child under a time and memory limit. A value the flag's declared
type refuses (its range, its names; judged here from the declaration, not from what the command did) must be
refused: status 2 and exactly one line on stderr naming the flag. A value the type accepts may run (status 0, or 1
for a failed `check`) or be refused for another reason (status 2, one line). Never a traceback, a hang or a memory
blow-up, and never a garbage value taken silently: every value-taking flag declares a type."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
from collections import Counter
from pathlib import Path

import pytest

from isolation import isolated_map
from multihead.cli import CliError, build_parser, flags, main

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
        "circuit": ["circuit", "--max-pairs", "1", "--edges", "3", "--check", "0", "--out", str(out / "c")],
        "tradeoff": ["tradeoff", "--model", "minilm", "--texts", "4", "--out", str(out / "t")],
        "tune": ["tune", "--show"],  # shows the table: the tuning flags are parsed, nothing is measured
    }[command]


def options(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    """Each subcommand's option flags that take a value."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: [a for a in p._actions if a.option_strings and a.nargs != 0
                   and not isinstance(a, argparse._HelpAction)] for name, p in sub.choices.items()}


def valid(action: argparse.Action, value: str) -> bool:
    """Whether ``value`` is one the flag declares it takes: an integer or number in the type's declared range
    (checked here by plain int()/float()), one of its choices, text its declared parser accepts; never text that is
    not UTF-8 (the command line refuses it), never one value for a flag that takes two."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    if action.nargs not in (None, "?"):
        return False
    kind = action.type
    if isinstance(kind, flags.Integer):
        try:
            return kind.low <= int(value) <= kind.high
        except ValueError:
            return False
    if isinstance(kind, flags.Number):
        try:
            number = float(value)
        except ValueError:
            return False
        return math.isfinite(number) and kind.low <= number <= kind.high and not (kind.open_low and number == kind.low)
    if kind is not None:
        try:
            value = kind(value)  # type: ignore[operator]
        except argparse.ArgumentTypeError:
            return False
    return action.choices is None or value in action.choices


def parses(argv: list[str], parser: argparse.ArgumentParser | None = None) -> bool:
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            (parser or build_parser()).parse_args(argv)
    except (CliError, SystemExit):
        return False
    return True


def run_cli(argv: list[str]) -> str:
    """Run main in this (forked) process with stdout and stderr captured; the status and stderr, as text."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        status = main(argv)
    return f"{status}\n{err.getvalue()}"


def cases(out: Path) -> list[tuple[str, list[str], str, bool]]:
    """(name, argv, the flag, whether the value is valid for it)."""
    parser = build_parser()
    found = []
    (out / "a-file").write_text("x")
    for command, actions in options(parser).items():
        base = base_argv(command, out)
        for action in actions:
            flag = action.option_strings[-1]
            values = [(v, valid(action, v)) for v in HOSTILE]
            if command not in LIGHT:  # the commands that load models run only the values to refuse, and paths
                values = [(v, ok) for v, ok in values if not ok]
                if isinstance(action.type, flags.Text):  # paths a user gets wrong (a new --out folder is fine)
                    paths = [str(out / "a-file" / "x")] + ([] if flag == "--out" else [str(out / "missing" / "x.txt")])
                    values += [(v, valid(action, v)) for v in paths]
            for value, ok in values:
                found.append((f"{command} {flag} {value[:20]!r}", [*base, flag, value], flag, ok))
    for command in LIGHT:  # bad positionals and unknown flags too
        found.append((f"{command} --no-such-flag", [*base_argv(command, out), "--no-such-flag"], "--no-such-flag",
                      False))
    return found


def test_every_value_taking_flag_declares_its_type() -> None:
    untyped = [f"{command} {a.option_strings[-1]}" for command, actions in options(build_parser()).items()
               for a in actions if a.type is None and a.choices is None]
    assert not untyped, f"flags that take any text, garbage included: {untyped}"


def test_the_validity_rule_agrees_with_the_parser_on_the_light_commands(tmp_path: Path) -> None:
    """The fuzz rule's own check: a value it calls invalid is one the parser refuses, and the reverse."""
    parser = build_parser()
    for name, argv, _, ok in cases(tmp_path):
        if argv[0] in LIGHT and "\udcff" not in argv[-1] and name.split()[1] != "--no-such-flag":
            assert parses(argv, parser) == ok, name


@pytest.mark.slow
def test_every_flag_of_every_subcommand_takes_hostile_values(tmp_path: Path) -> None:
    seen: Counter[str] = Counter()
    bad = []
    all_cases = cases(tmp_path)
    # two children at a time: the only cases that write (compare's PNG, one path) write it whole or not at all
    outcomes = isolated_map(run_cli, [(argv,) for _, argv, _, _ in all_cases], seconds=60, memory=2 << 30)
    for (name, argv, flag, ok), outcome in zip(all_cases, outcomes, strict=True):
        if outcome.kind != "ok":
            bad.append(f"{name}: {outcome}")
            continue
        status, _, err = outcome.detail.partition("\n")
        lines = [line for line in err.splitlines() if line.strip()]
        allowed = ({"0", "2", "1"} if argv[0] == "check" else {"0", "2"}) if ok else {"2"}
        if status not in allowed or "Traceback" in err or (status == "2" and len(lines) != 1):
            bad.append(f"{name} ({'valid' if ok else 'invalid'}): status {status}, stderr {err[-600:]!r}")
        elif not ok and flag not in lines[0]:
            bad.append(f"{name}: the refusal does not name {flag}: {lines[0][:300]!r}")
        seen[f"{status} ({'valid' if ok else 'refused'})"] += 1
    print(f"\nfuzz cases, command lines: {len(all_cases)} (exit status: {dict(seen)})")
    assert not bad, "\n".join(bad[:40]) + f"\n({len(bad)} of {len(all_cases)})"
    assert sum(seen.values()) >= 929, seen
