"""The command line: the seed's shape walk, JSON, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from multihead.cli import main


def test_shape_walk_prints_each_step_and_the_parameter_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["shapes", "--d-model", "4096", "--heads", "32", "--seq", "128"]) == 0
    out = capsys.readouterr().out
    assert "d_k = head_dim = 128" in out
    for label, shape in [("input x", "(1, 128, 4096)"), ("q = x W_Q", "(1, 128, 4096)"),
                         ("k = x W_K", "(1, 128, 4096)"), ("q split into heads", "(1, 32, 128, 128)"),
                         ("attention weights per head", "(1, 32, 128, 128)"), ("heads merged", "(1, 128, 4096)"),
                         ("output = merged W_O", "(1, 128, 4096)")]:
        line = next(ln for ln in out.splitlines() if label in ln)
        assert shape in line, line
    assert "67,108,864" in out


def test_shape_walk_with_kv_heads_shrinks_k_and_v(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["shapes", "--d-model", "4096", "--heads", "32", "--seq", "128", "--kv-heads", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    shapes = {s["step"]: tuple(s["shape"]) for s in data["steps"]}
    assert shapes["k_heads"] == shapes["v_heads"] == (1, 8, 128, 128)
    assert shapes["q_heads"] == (1, 32, 128, 128)
    assert data["head_dim"] == 128 and data["variant"] == "GQA"
    assert data["projection_parameters"] == 2 * 4096 * 4096 + 2 * 4096 * 1024  # 41,943,040


def test_gpt2_small_head_dim(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["shapes", "--d-model", "768", "--heads", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["head_dim"] == 64


@pytest.mark.parametrize("argv", [
    ["shapes", "--d-model", "x", "--heads", "3"],
    ["shapes", "--d-model", "-4", "--heads", "2"],
    ["shapes", "--heads", "2"],
    ["shapes", "--d-model", "100", "--heads", "3"],
    ["shapes", "--d-model", "4096", "--heads", "32", "--kv-heads", "5"],
    ["shapes", "--d-model", "64", "--heads", "4", "--bogus"],
    ["nonsense"],
])
def test_bad_flags_exit_2_with_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("multihead"), captured.err
    assert "Traceback" not in captured.err


def test_console_entry_point_runs_as_a_process() -> None:
    done = subprocess.run([sys.executable, "-m", "multihead", "shapes", "--d-model", "4096", "--heads", "32",
                           "--kv-heads", "5"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("multihead: error: n_heads (32) must be divisible by n_kv_heads (5): "
                                   "choose n_kv_heads in 1, 2, 4, 8, 16, 32")
