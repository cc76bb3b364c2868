"""`multihead tradeoff --long` (issue 27): the flags map onto multihead.tradeoff.longctx.Settings, long-only flags are
refused without --long, bad values are refused naming them, and --cases-jsonl writes the run's cases for the kvpress
benchmark with the real tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from multihead.cli import build_parser, main
from multihead.cli.tradeoff_long import settings
from multihead.tradeoff.longctx import Settings


def _refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(message, err), err


def test_the_defaults_are_the_librarys_and_each_flag_sets_its_field() -> None:
    parser = build_parser()
    assert settings(parser.parse_args(["tradeoff", "--long"])) == Settings()
    args = parser.parse_args(["tradeoff", "--long", "--lengths", "1024,8144", "--tasks", "passkey,multikey",
                              "--haystacks", "filler", "--prompts", "3", "--keys", "5", "--seed", "7", "--chunk",
                              "256", "--sinks", "2", "--keep", "0.5", "--window-keep", "0.1", "--window", "300",
                              "--bits", "4", "--prune", "none", "--uptrain-steps", "0", "--context", "2048",
                              "--stride", "512", "--windows", "2", "--threshold", "0.9", "--no-mqa"])
    assert settings(args) == Settings(lengths=(1024, 8144), tasks=("passkey", "multikey"), haystacks=("filler",),
                                      prompts=3, keys=5, seed=7, chunk=256, sinks=2, keep=(0.5,), window_keep=(0.1,),
                                      windows=(300,), bits=(4,), prune=(), uptrain_steps=0, ppl_context=2048,
                                      ppl_scored=512, ppl_windows=2, threshold=0.9, mqa=False)
    # 'none' empties any method list: a run of head plans alone (with the full cache and each plan's control)
    args = parser.parse_args(["tradeoff", "--long", "--bits", "none", "--keep", "none", "--window-keep", "none",
                              "--prune", "none"])
    assert (settings(args).bits, settings(args).keep, settings(args).window_keep, settings(args).prune) == ((),) * 4


@pytest.mark.parametrize(("argv", "context", "scored"), [
    ([], 4096, 1024),
    (["--lengths", "1024"], 1024, 256),
    (["--lengths", "2048,512"], 2048, 512),
    (["--lengths", "1024", "--context", "3000"], 3000, 750),
    (["--lengths", "1024", "--stride", "100"], 1024, 100),
])
def test_the_perplexity_windows_follow_the_longest_length(argv: list[str], context: int, scored: int) -> None:
    """--lengths 1024 measured perplexity on 4,096-token windows (most of the run's time): the windows are now as
    long as the longest prompt unless --context says otherwise, the last quarter of each scored unless --stride."""
    s = settings(build_parser().parse_args(["tradeoff", "--long", *argv]))
    assert (s.ppl_context, s.ppl_scored) == (context, scored)


@pytest.mark.parametrize(("argv", "message"), [
    (["--lengths", "2048"], r"--lengths is for `tradeoff --long`: add --long"),
    (["--tasks", "passkey", "--no-mqa"], r"--tasks, --no-mqa are for `tradeoff --long`"),
    (["--long", "--model", "minilm"], r"--long measures retrieval by a causal model's greedy answer"),
    (["--long", "--sinks", "1,4"], r"--sinks 1,4: give one sink count with --long"),
    (["--long", "--tasks", "haystack-sum"], r"--tasks: .*task 'haystack-sum' is unknown: choose from passkey"),
    (["--long", "--keep", "1.5"], r"--keep"),
    (["--long", "--threshold", "2"], r"--threshold"),
    (["--long", "--keys", "1"], r"--keys"),
    (["--long", "--lengths", "1024", "--sinks", "600", "--keep", "0.5"], r"sinks"),
])
def test_bad_long_context_flags_are_refused_in_one_line(argv: list[str], message: str,
                                                         capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _refused(["tradeoff", *argv, "--out", str(tmp_path / "o")], message, capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_cases_jsonl_writes_the_cases_with_the_real_tokenizer(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cases.jsonl"
    assert main(["tradeoff", "--long", "--lengths", "1024", "--tasks", "passkey,multikey", "--haystacks", "filler",
                 "--keys", "2", "--cases-jsonl", str(path)]) == 0
    assert "3 cases written" in capsys.readouterr().out
    cases = [json.loads(line) for line in path.read_text().splitlines()]
    assert [c["task"] for c in cases] == ["passkey", "multikey", "multikey"]
    for c in cases:
        assert len(c["context_ids"]) + len(c["question_ids"]) == 1024 == c["length"]
        assert c["answer"] and c["answer_ids"]


@pytest.mark.slow
def test_a_length_past_the_models_context_is_refused_naming_it(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["tradeoff", "--long", "--lengths", "9000", "--cases-jsonl", str(tmp_path / "c.jsonl")],
             r"length 9,000 exceeds the model's context of 8,192 tokens", capsys)
    assert not (tmp_path / "c.jsonl").exists()


def test_a_failed_run_leaves_no_folder_behind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tradeoff --long --lengths 100000`: refused once the model's context is known, and the --out folder (and the
    settings.json a run would resume from) is not left behind."""
    from tiny_checkpoints import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", context=128)
    out = tmp_path / "new" / "out"
    _refused(["tradeoff", "--long", "--model", str(gguf), "--lengths", "100000", "--out", str(out)],
             r"length 100,000 exceeds the model's context of 128 tokens", capsys)
    assert list(tmp_path.iterdir()) == [gguf]
