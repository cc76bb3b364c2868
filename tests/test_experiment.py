"""The heads-vs-width experiment: a tiny configuration end to end, equal cost across head counts, reproducibility."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from multihead import AttentionConfig, MultiheadError, cost
from multihead.cli import main
from multihead.experiments.heads_vs_width import (
    Settings,
    TaskConfig,
    TinyLM,
    Variant,
    default_variants,
    run,
    train_one,
)

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
    (["--lr", "-1"], r"lr \(-1.0\) must be positive"),
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
