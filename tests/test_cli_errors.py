"""One format for every user error (issue 42 item 9): ``multihead <command>: error: <message>`` on one line of
stderr, status 2, whether argparse refused a flag, a command refused a combination or the library refused a value
(they were "multihead count: argument ...", "multihead: error: ..." and "multihead: unrecognized arguments ..."
without the command)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from multihead.cli import main

CASES = [  # argv, the command named in the line, what the message says
    (["count", "--seq", "x"], "count", r"argument --seq: 'x' is not an integer"),  # a flag's type
    (["count", "--preset", "gpt2", "--bogus"], "count", r"unrecognized arguments: --bogus"),  # argparse, top level
    (["count", "--preset", "nope"], "count", r"unknown preset 'nope'"),
    (["shapes", "--d-model", "4096", "--heads", "32", "--kv-heads", "5"], "shapes",
     r"n_heads \(32\) must be divisible by n_kv_heads \(5\)"),  # the library's MultiheadError
    (["shapes", "--heads", "2"], "shapes", r"--d-model"),
    (["compare", "--preset", "gpt2", "--no-plot", "--tp", "0"], "compare", r"argument --tp"),
    (["presets", "--json", "extra"], "presets", r"unrecognized arguments: extra"),
    (["embed"], "embed", r"the following arguments are required: TEXT"),
    (["experiment", "nothing"], "experiment", r"argument name: invalid choice: 'nothing'"),
    (["check", "--dtype", "int7"], "check", r"argument --dtype: dtype 'int7' is unknown"),
    (["generate", "hi", "--greedy", "--temperature", "0.7"], "generate", r"--greedy cannot be combined"),  # CliError
    (["patch", "--clean", "a b"], "patch", r"give --clean, --corrupt and --answers together"),
    (["circuit", "--method", "xyz"], "circuit", r"argument --method: invalid choice: 'xyz'"),
    (["tradeoff", "--bits", "3"], "tradeoff", r"argument --bits"),
    (["tradeoff", "--lengths", "1024"], "tradeoff", r"--lengths is for `tradeoff --long`"),
    (["heads", "--tokens", "0"], "heads", r"argument --tokens"),
    (["count", "--preset", "gpt2", "--seq", "\udcff"], "count", r"argument --seq: .* is not valid UTF-8 text"),
    (["--bogus"], None, r"unrecognized arguments: --bogus"),  # no command yet: `multihead: error: ...`
    (["nonsense"], None, r"argument COMMAND: invalid choice: 'nonsense'"),
]


@pytest.mark.parametrize(("argv", "command", "message"), CASES, ids=[" ".join(c[0])[:40] for c in CASES])
def test_every_user_error_is_one_line_in_one_format(argv: list[str], command: str | None, message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    prefix = f"multihead {command}: error: " if command else "multihead: error: "
    assert lines[0].startswith(prefix), lines[0]
    assert re.search(message, lines[0][len(prefix):]), lines[0]
    assert lines[0].count("error:") == 1 and "usage:" not in lines[0], lines[0]


def test_the_process_prints_the_same_line() -> None:
    done = subprocess.run([sys.executable, "-m", "multihead", "count", "--preset", "gpt2", "--bogus"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "multihead count: error: unrecognized arguments: --bogus\n"
