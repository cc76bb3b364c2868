"""One format for every user error (issue 42 item 9): ``multihead <command>: error: <message>`` on one line of
stderr, status 2, whether argparse refused a flag, a command refused a combination or the library refused a value
(they were "multihead count: argument ...", "multihead: error: ..." and "multihead: unrecognized arguments ..."
without the command)."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

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


# ---------------------------------------------------------------------------------------------- issue 52 item 10
@pytest.mark.parametrize("command", ["heads", "patch", "circuit", "tradeoff"])
@pytest.mark.parametrize("path", ["/no/such/model.gguf", "missing.gguf", "./no-such-folder"])
def test_a_missing_model_path_is_said_not_to_exist(command: str, path: str, capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """It said 'unknown model' as for a mistyped name."""
    monkeypatch.chdir(tmp_path)
    assert main([command, "--model", path]) == 2
    err = capsys.readouterr().err.strip()
    assert f"model path {path!r} does not exist" in err and "unknown model" not in err, err


def test_an_unreadable_file_is_named_once(tmp_path: Any, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError's own text names the file again ("cannot read --file 'x': [Errno 21] Is a directory: 'x'")."""
    from pathlib import Path

    from multihead.errors import MultiheadError
    from multihead.evals.text import read_text

    folder = tmp_path / "a-folder"
    folder.mkdir()
    assert main(["heads", "--file", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count(str(folder)) == 1 and "Is a directory" in err, err
    text = tmp_path / "text.txt"
    text.write_text("some text")

    def refused(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refused)
    with pytest.raises(MultiheadError, match="Permission denied") as caught:
        read_text(text)
    assert str(caught.value).count(str(text)) == 1, caught.value


def test_one_kv_head_is_one_kv_head(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """'(1 KV heads)': a tiny MQA Llama (the tiny GGUF with one KV head) through `multihead heads`."""
    from tiny_checkpoints import TINY, gguf_bytes, tiny_llama_gguf

    fields, tensors = tiny_llama_gguf()
    fields = [(k, t, 1 if k.endswith("head_count_kv") else v) for k, t, v in fields]
    for name in list(tensors):
        if name.endswith(("attn_k.weight", "attn_v.weight")):
            tensors[name] = tensors[name][:TINY["head_dim"]]  # one KV head's rows
    gguf = tmp_path / "mqa.gguf"
    gguf.write_bytes(gguf_bytes(fields, tensors))
    assert main(["heads", "--model", str(gguf), "--text", "the cat sat on the mat", "--out", str(tmp_path / "o")]) == 0
    summary = next(line for line in capsys.readouterr().out.splitlines() if " query heads (" in line)
    assert f"{TINY['n_heads']} query heads (1 KV head)," in summary, summary


def test_the_readme_and_the_help_give_tradeoff_long_one_duration(capsys: pytest.CaptureFixture[str]) -> None:
    """The README said `tradeoff --long` takes 10 min 44 s where its --help said about 20 minutes (the line is in the
    long-context guide now)."""
    from pathlib import Path

    guide = (Path(__file__).parents[1] / "docs" / "guides" / "long-context.md").read_text()
    line = next(x for x in guide.splitlines() if x.startswith("multihead tradeoff --long ") and "#" in x)
    duration = re.search(r"(\d+ min \d+ s) on 2 idle cores", line)
    assert duration is not None, line
    with pytest.raises(SystemExit):
        main(["tradeoff", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert f"{duration.group(1)} on 2 idle cores" in shown and "about 20 minutes" not in shown
