"""The command line's help (issue 42 item 6): `multihead --help` and every `multihead <command> --help` import no
torch (they were 3-5 s because `import multihead` loaded it), and each command's help says what it does and shows
examples that its own parser accepts."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from multihead.cli import COMMANDS, EXAMPLES, build_parser, main

# run in a child: the CLI's help, then which heavy packages the child has imported (stderr, as JSON)
CHILD = """
import json, sys
from multihead.cli import main
try:
    main(sys.argv[1:])
except SystemExit as done:
    assert done.code == 0, done.code
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'transformers'})),
      file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in COMMANDS)],
                         ids=["multihead", *COMMANDS])
def test_help_imports_no_torch(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: multihead" in done.stdout
    assert json.loads(done.stderr.strip().splitlines()[-1]) == []


def test_the_module_entry_point_helps_without_torch() -> None:
    """`python -m multihead --help`, as the console script starts it, never reaches torch (-X importtime lists
    every module the interpreter imported)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "multihead", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "multihead.cli" in imported and "torch" not in imported


def _help(name: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_helps_with_a_description_and_examples(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(name, capsys)
    # argparse prints the usage, a blank line, the description, a blank line, the sections of flags
    description = text.split("\n\n")[1].strip()
    assert not description.endswith(":"), f"no description in `multihead {name} --help`: {description}"
    summary = COMMANDS[name]
    assert description.lower().startswith(summary.lower()[:40]), description
    assert len(description.split()) >= 5, description
    examples = text.split("\nexamples:\n", 1)
    assert len(examples) == 2, f"no examples section in `multihead {name} --help`"
    lines = examples[1].splitlines()
    commands = [line.strip() for line in lines if line.strip().startswith(f"multihead {name}")]
    comments = [line.strip() for line in lines if line.strip().startswith("# ")]
    assert commands and len(comments) == len(commands), examples[1]


@pytest.mark.parametrize(("name", "line"), [(name, line) for name, rows in EXAMPLES.items() for line, _ in rows])
def test_each_example_is_a_command_line_its_parser_accepts(name: str, line: str) -> None:
    words = shlex.split(line)
    assert words[:2] == ["multihead", name]
    args = build_parser(name).parse_args(words[1:])
    assert args.command == name and callable(args.run)


def test_help_shows_each_example_whole(capsys: pytest.CaptureFixture[str]) -> None:
    """What the help prints is the example itself: joined back over its shell continuations, it is the line."""
    for name, rows in EXAMPLES.items():
        text = _help(name, capsys).split("\nexamples:\n", 1)[1]
        joined = re.sub(r" \\\n\s+", " ", text)
        for line, what in rows:
            assert f"# {what}\n  {line}\n" in joined + "\n", (name, line)


def test_every_command_has_examples() -> None:
    assert set(EXAMPLES) == set(COMMANDS)
