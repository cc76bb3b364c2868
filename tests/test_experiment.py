"""The heads-vs-width experiment: a tiny configuration end to end, equal cost across head counts, reproducibility."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from multihead import AttentionConfig, MultiheadError
from multihead.cli import main
from multihead.evals.text import read_text
from multihead.experiments.heads_vs_width import (
    LM_HEADS,
    LM_SETTINGS,
    Settings,
    TaskConfig,
    TextTask,
    TinyLM,
    Variant,
    default_variants,
    run,
    train_one,
)
from multihead.sizing import cost

TINY = Settings(d_model=16, n_layers=1, steps=6, batch=8, seeds=(0,), eval_batches=1, workers=1,
                task=TaskConfig(n_keys=8, n_values=8, n_pairs=3))


def test_task_batches_ask_for_the_value_of_each_repeated_key() -> None:
    task = TaskConfig(n_keys=8, n_values=8, n_pairs=3)
    tokens, scored = task.batch(4, torch.Generator().manual_seed(0))
    assert tokens.shape == (4, 12) and scored.shape == (4, 11)
    for row, mask in zip(tokens.tolist(), scored, strict=True):
        pairs = dict(zip(row[0:6:2], row[1:6:2], strict=True))
        assert len(pairs) == 3 and all(k < 8 <= v for k, v in pairs.items())
        for i in mask.nonzero().flatten().tolist():  # position i holds a query key; its next token is the value
            assert row[i + 1] == pairs[row[i]]


def test_parameters_and_flops_are_equal_across_head_counts() -> None:
    rows = [AttentionConfig(d_model=64, n_heads=h) for h in (1, 2, 4, 8, 16)]
    assert len({cost.parameters(a).total for a in rows}) == 1
    assert len({cost.flops(a, s=32, causal=True).forward for a in rows}) == 1
    models = [TinyLM(a, n_layers=2, vocab=128, max_len=32) for a in rows]
    assert len({sum(p.numel() for p in m.parameters()) for m in models}) == 1
    variants = {v.name: v for v in default_variants(64)}
    assert {"MHA h=1", "MHA h=16", "GQA h=8 g=2", "MQA h=8 g=1"} <= set(variants)


def test_tiny_run_end_to_end_and_the_same_seed_gives_the_same_result() -> None:
    variants = [Variant("MHA h=1", 1, 1), Variant("MHA h=4", 4, 4), Variant("MQA h=4 g=1", 4, 1)]
    first = run(TINY, variants, progress=False)
    assert [r["variant"] for r in first["rows"]] == ["MHA h=1", "MHA h=4", "MQA h=4 g=1"]
    for r in first["rows"]:
        assert len(r["runs"][0]["curve"]) == 6 and 0.0 <= r["accuracy_mean"] <= 1.0
        assert {"max_previous_token", "max_induction"} <= set(r["runs"][0]["heads"])
    assert first["rows"][2]["kv_cache_bytes_per_token"] * 4 == first["rows"][1]["kv_cache_bytes_per_token"]
    again = train_one(variants[1], TINY, 0)
    assert again["curve"] == first["rows"][1]["runs"][0]["curve"] and again["loss"] == first["rows"][1]["loss_mean"]


def test_cli_writes_a_plot_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["experiment", "heads-vs-width", "--d-model", "16", "--layers", "1", "--steps", "4", "--seeds", "1",
            "--pairs", "3", "--batch", "8", "--workers", "1", "--heads", "1,2", "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["n_heads"] for r in data["rows"]] == [1, 2]
    assert (tmp_path / "heads-vs-width.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("argv", "message"), [
    (["--heads", "1,x"], "must be comma-separated integers"),
    (["--heads", "3"], r"d_model \(16\) must be divisible by n_heads \(3\)"),
    (["--pairs", "99"], r"n_pairs \(99\) must be between 1 and n_keys \(64\)"),
    (["--lr", "-1"], r"argument --lr: '-1' must be a finite number in \(0, 1\]"),
    (["--lr", "inf"], r"argument --lr: 'inf' must be a finite number in \(0, 1\]"),
    (["--lr", "nan"], r"argument --lr: 'nan' must be a finite number in \(0, 1\]"),
    (["--task", "lm", "--text", "/nonexistent/text.gz"], r"the evaluation text /nonexistent/text.gz is missing"),
    (["--task", "lm", "--context", "1"], r"context \(1\) must be an int of at least 2 bytes"),
])
def test_bad_experiment_flags(argv: list[str], message: str, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    base = ["experiment", "heads-vs-width", "--d-model", "16", "--steps", "2", "--workers", "1", "--out", str(tmp_path)]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    import re

    assert re.search(message, err), err


def test_settings_validate() -> None:
    with pytest.raises(MultiheadError, match=r"steps \(0\) must be a positive int"):
        Settings(steps=0)
    for lr in (-1.0, math.inf, math.nan, 2.0):
        with pytest.raises(MultiheadError, match=r"must be a number in \(0, 1\]"):
            Settings(lr=lr)


def test_text_task_trains_on_the_first_80_percent_and_scores_every_held_out_byte_once() -> None:
    task = TextTask(context=16)
    data = read_text().encode("utf-8")
    cut = int(len(data) * 0.8)
    tokens, scored = task.batch(5, torch.Generator().manual_seed(0))
    assert tokens.shape == (5, 17) and scored.shape == (5, 16) and bool(scored.all())
    for row in tokens.tolist():  # each window is a contiguous run of the training bytes
        assert bytes(row) in data[:cut]
    windows = task.evaluation(2, 3)
    assert [w[0].shape for w in windows] == [(3, 17), (3, 17)]
    held = torch.cat([w[0] for w in windows]).tolist()
    for k, row in enumerate(held):  # consecutive windows from the start of the held-out part, overlapping by one
        assert bytes(row) == data[cut + 16 * k: cut + 16 * k + 17]


def test_lm_rows_have_equal_attention_parameters_and_flops_across_1_to_32_heads(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text(read_text()[:20_000], encoding="utf-8")
    settings = Settings(d_model=32, n_layers=1, steps=3, batch=4, seeds=(0,), eval_batches=2, workers=1,
                        task=TextTask(context=16, path=str(text)))
    result = run(settings, default_variants(32, LM_HEADS), progress=False)
    rows = {r["variant"]: r for r in result["rows"]}
    mha = [rows[f"MHA h={h}"] for h in LM_HEADS]
    assert [r["head_dim"] for r in mha] == [32, 16, 8, 4, 2, 1]
    assert len({r["attention_params_per_layer"] for r in mha}) == 1
    assert len({r["attention_flops_per_layer"] for r in mha}) == 1
    assert mha[0]["attention_flops_per_layer"] == cost.flops(AttentionConfig(d_model=32, n_heads=1), s=16,
                                                             causal=True).forward
    models = [TinyLM(AttentionConfig(d_model=32, n_heads=h), n_layers=1, vocab=256, max_len=17) for h in LM_HEADS]
    assert len({sum(p.numel() for p in m.parameters()) for m in models}) == 1
    gqa, mqa = rows["GQA h=8 g=2"], rows["MQA h=8 g=1"]
    assert mqa["attention_params_per_layer"] < gqa["attention_params_per_layer"] < mha[0]["attention_params_per_layer"]
    assert gqa["kv_cache_bytes_per_token"] * 4 == rows["MHA h=8"]["kv_cache_bytes_per_token"]
    for r in result["rows"]:
        run_ = r["runs"][0]
        assert run_["scored"] == 2 * 4 * 16  # every byte of the held-out windows
        assert r["perplexity_mean"] == pytest.approx(math.exp(r["loss_mean"]))
        assert 1 < r["perplexity_mean"] < 400  # a few steps from random init: about the 256-byte vocabulary
        labels = run_["heads"]["labels"]
        assert len(labels) == 1 and len(labels[0]) == r["n_heads"]
        assert sum(r["label_counts"].values()) == r["n_heads"]


def test_lm_defaults_are_the_documented_run() -> None:
    assert (LM_SETTINGS.d_model, LM_SETTINGS.n_layers, LM_SETTINGS.steps, LM_SETTINGS.batch, LM_SETTINGS.lr) == (
        128, 2, 400, 32, 1e-2)
    assert isinstance(LM_SETTINGS.task, TextTask) and LM_SETTINGS.task.context == 64
    names = [v.name for v in default_variants(128, LM_HEADS)]
    assert names == ["MHA h=1", "MHA h=2", "MHA h=4", "MHA h=8", "MHA h=16", "MHA h=32", "GQA h=8 g=2", "MQA h=8 g=1"]


def test_cli_lm_task_writes_its_own_plot_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.txt"
    text.write_text(read_text()[:20_000], encoding="utf-8")
    argv = ["experiment", "heads-vs-width", "--task", "lm", "--text", str(text), "--context", "16", "--d-model", "16",
            "--layers", "1", "--steps", "3", "--seeds", "1", "--batch", "4", "--workers", "1", "--heads", "1,4",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "byte-level LM" in out and "MHA h=4" in out and "head labels" in out
    data = json.loads((tmp_path / "out" / "heads-vs-width-lm.json").read_text())
    assert data["task"] == "lm" and [r["n_heads"] for r in data["rows"]] == [1, 4]
    assert (tmp_path / "out" / "heads-vs-width-lm.png").read_bytes()[:4] == b"\x89PNG"
