"""Ctrl-C (issue 18): an interrupted `heads --ablate`, `experiment` or `generate` exits with status 130 and one line,
and leaves in --out only whole files (each one written under a temporary name and renamed when complete): never half
a report, PNG or JSON, and no temporary file."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from isolation import isolated
from multihead.cli import main

HEADS = ["heads", "--model", "minilm", "--text", "Heads attend to the previous token, and ablating one at a time "
         "shows which matter.", "--ablate", "--tokens", "16"]
EXPERIMENT = ["experiment", "heads-vs-width", "--d-model", "16", "--layers", "1", "--steps", "3", "--seeds", "1",
              "--batch", "4", "--workers", "1", "--heads", "1,2", "--pairs", "2"]


def interrupted_run(argv: list[str], *, at: int, where: str) -> str:
    """Run the CLI with Ctrl-C arriving at the ``at``-th file the run completes (``where`` = "rename": just before
    it is renamed into place; "write": half-way through writing its bytes). Returns the status and stderr."""
    import multihead.files as files

    real_replace, real_savefig = os.replace, None
    count = {"renames": 0, "figures": 0}

    def replace(src: str | Path, dst: str | Path) -> None:
        count["renames"] += 1
        if where == "rename" and count["renames"] == at:
            raise KeyboardInterrupt
        real_replace(src, dst)

    files.os.replace = replace  # type: ignore[assignment]
    if where == "write":
        from matplotlib.figure import Figure

        real_savefig = Figure.savefig

        def savefig(self: Figure, target: Path, **kw: object) -> None:
            count["figures"] += 1
            real_savefig(self, target, **kw)
            if count["figures"] == at:
                Path(target).write_bytes(Path(target).read_bytes()[:100])  # half-written, then Ctrl-C
                raise KeyboardInterrupt

        Figure.savefig = savefig  # type: ignore[method-assign]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    return f"{status}\n{err.getvalue()}"


def whole_files(out: Path) -> list[str]:
    """Every file in ``out``, each checked to be whole (PNG end marker, JSON that parses, HTML that closes)."""
    names = []
    for path in sorted(out.rglob("*")):
        if not path.is_file():
            continue
        assert ".partial" not in path.name, f"a temporary file was left: {path}"
        data = path.read_bytes()
        if path.suffix == ".png":
            assert data.startswith(b"\x89PNG") and data.rstrip().endswith(b"IEND\xaeB`\x82"), path
        elif path.suffix == ".json":
            json.loads(data)
        elif path.suffix == ".html":
            assert data.rstrip().endswith(b"</html>"), path
        names.append(path.name)
    return names


@pytest.mark.parametrize(("argv", "files", "figures"), [
    pytest.param(HEADS, 4, 2, id="heads --ablate", marks=pytest.mark.slow),  # the real MiniLM
    pytest.param(EXPERIMENT, 2, 1, id="experiment"),
])
def test_ctrl_c_at_any_file_leaves_only_whole_files(argv: list[str], files: int, figures: int,
                                                    tmp_path: Path) -> None:
    trials = [("rename", 1), ("rename", files), ("write", figures)]  # the first file, the last, a figure half-written
    for where, at in trials:
        out = tmp_path / f"{where}{at}"
        outcome = isolated(interrupted_run, [*argv, "--out", str(out)], at=at, where=where, seconds=120)
        assert outcome.kind == "ok", outcome
        status, _, err = outcome.detail.partition("\n")
        assert status == "130" and err.strip().splitlines()[-1] == "multihead: interrupted", (where, at, err[-500:])
        kept = whole_files(out)
        assert len(kept) < files, (where, at, kept)  # the interrupted file and those after it are absent


@pytest.mark.slow
def test_ctrl_c_during_a_long_generation_exits_with_one_line(tmp_path: Path) -> None:
    """A real SIGINT to `multihead generate` once it has streamed its first tokens."""
    # greedy: this prompt's greedy text runs on without an end-of-text token (a sampled one may end early when a
    # speed path rounds differently, and a run that ends by itself returns 0 before the signal lands)
    # the child starts as from a terminal: SIGINT at its default and unblocked, whatever the test process inherited
    # or set (a process that starts with SIGINT ignored never raises KeyboardInterrupt; the suite once saw that)
    parent = (signal.getsignal(signal.SIGINT), sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))

    def terminal_signals() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    proc = subprocess.Popen([sys.executable, "-m", "multihead", "generate", "Once upon a time", "--max-new-tokens",
                             "2000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=terminal_signals)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        streamed = ""
        while len(streamed) < 40 and time.monotonic() < deadline:
            streamed += proc.stdout.read(1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # never leave a 2,000-token generation running past a failed test
    assert len(streamed) >= 40, f"nothing streamed: {err[-2000:]}"
    assert proc.returncode == 130, f"streamed {streamed!r}; test process SIGINT {parent}; stderr: {err[-2000:]}"
    assert err.strip().splitlines()[-1] == "multihead: interrupted" and "Traceback" not in err, err[-2000:]


def _terminal_signals() -> None:
    """The child starts as from a terminal: SIGINT at its default and unblocked, whatever the test process set."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _loading_torch(pid: int) -> bool:
    """The process has mapped torch's C++ library: it is inside `import torch` (which takes seconds here)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("argv", [["generate", "hi", "--max-new-tokens", "1"], ["check", "--backend", "math"]],
                         ids=["generate", "check"])
def test_ctrl_c_while_torch_is_imported_exits_with_one_line(argv: list[str]) -> None:
    """Issue 42: Ctrl-C in the seconds a command spends importing torch at start-up printed a 41-line traceback
    (torch was imported by `import multihead`, before the CLI's handler). SIGINT lands while torch's library is being
    loaded: status 130 and one line."""
    proc = subprocess.Popen([sys.executable, "-m", "multihead", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_terminal_signals)
    try:
        deadline = time.monotonic() + 60
        while not _loading_torch(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert proc.poll() is None, "the command ended before torch was loaded"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines() == ["multihead: interrupted"], err[-2000:]
