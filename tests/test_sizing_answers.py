"""Sizing answers that misled a new user (issue 42 items 1-4, 9): a fit answer without the weights, a --seq past the
model's context, compare's plot and --hardware, the TP figures, the all-reduce latency and replicated KV heads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from multihead.cli import main

GEMMA3_TEXT = {"model_type": "gemma3_text", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 64, "num_hidden_layers": 6, "max_position_embeddings": 131072, "sliding_window": 512,
               "vocab_size": 1000, "intermediate_size": 512, "rope_theta": 1000000.0}


def _write(folder: Path, cfg: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *parts: str) -> str:
    """Exit 2, one line on stderr holding every one of ``parts``, nothing on stdout."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and captured.out == "", captured
    for part in parts:
        assert part in err, err
    return err


# ---------------------------------------------------------------------------------------------- item 1
@pytest.mark.parametrize("layout", ["gemma3_text", "gemma3 with text_config"])
@pytest.mark.parametrize("command", ["count", "compare"])
@pytest.mark.parametrize("memory", [["--device-memory", "24GiB"], ["--hardware", "h100-80g"]],
                         ids=["device-memory", "hardware"])
def test_a_family_the_count_does_not_know_gets_no_fit_answer(layout: str, command: str, memory: list[str],
                                                            tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """It exited 0 with "context that fits in 24.0 GiB 1,252,357 tokens (KV cache alone)": no weights, past the
    model's own 131,072, and --hardware's speed section silently gone. Now exit 2, saying why."""
    cfg = GEMMA3_TEXT if layout == "gemma3_text" else {"model_type": "gemma3", "text_config": GEMMA3_TEXT,
                                                       "vision_config": {"hidden_size": 32}}
    path = _write(tmp_path / "g3", cfg)
    if command == "compare" and memory[0] == "--hardware":
        pytest.skip("compare --hardware: item 3's test")
    argv = [command, "--config", str(path), *memory] + (["--no-plot"] if command == "compare" else [])
    _refused(argv, capsys, "cannot say what fits in", "model_type 'gemma3_text' is not counted yet",
             "weights are not counted", str(path))


def test_without_a_memory_an_unknown_family_still_gets_its_attention_figures(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "g3", GEMMA3_TEXT)
    assert main(["count", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "whole model: model_type 'gemma3_text' is not counted yet" in out and "context that fits" not in out
    assert main(["compare", "--config", str(path), "--no-plot", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["variants"]
    assert all(r["weight_bytes"] is None and r["max_context"] is None for r in rows)


@pytest.mark.parametrize("command", ["count", "compare"])
def test_a_config_without_a_vocabulary_gets_no_fit_answer(command: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {k: v for k, v in GEMMA3_TEXT.items() if k != "vocab_size"} | {"model_type": "llama"}
    path = _write(tmp_path / "novocab", cfg)
    argv = [command, "--config", str(path), "--device-memory", "24GiB"] + (["--no-plot"] if command == "compare"
                                                                           else [])
    _refused(argv, capsys, "cannot say what fits in 24.0 GiB", "no vocab_size")


def test_hardware_needs_a_whole_model(capsys: pytest.CaptureFixture[str]) -> None:
    """Sizes on the command line describe the attention alone: --hardware's speed section was silently left out."""
    _refused(["count", "--d-model", "4096", "--heads", "32", "--hardware", "h100-80g"], capsys,
             "--hardware estimates the whole model's speed")
    # the attention sizes alone keep their KV-cache answer, said as such
    assert main(["count", "--d-model", "4096", "--heads", "32", "--layers", "32", "--device-memory", "24GiB"]) == 0
    assert "tokens (KV cache alone, full cache in bf16)" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- item 2
@pytest.mark.parametrize("argv", [
    ["count", "--preset", "llama-3-8b", "--seq", "100000000000000", "--hardware", "h100-80g"],
    ["count", "--preset", "llama-3-8b", "--seq", "32768", "--device-memory", "24GiB"],
    ["count", "--preset", "llama-3-8b", "--seq", "8193"],
    ["compare", "--preset", "llama-3-8b", "--seq", "32768", "--device-memory", "24GiB", "--no-plot"],
    ["shapes", "--preset", "llama-3-8b", "--seq", "8193"],
], ids=["count-hardware", "count-memory", "count", "compare", "shapes"])
def test_a_seq_past_the_models_context_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """It printed a 4e21 ms prefill and 0.0 tok/s, or 'up to 8,192 tokens ... or batch 1 at 32768 tokens': the
    one rule now, for every command that takes --seq: refused, naming the seq and the context."""
    seq = f"{int(argv[argv.index('--seq') + 1]):,}"
    _refused(argv, capsys, f"--seq {seq} is past llama-3-8b's own context of 8,192 tokens",
             "give --seq 8,192 or less")


def test_the_library_refuses_it_the_same_way() -> None:
    from multihead import MultiheadError, compare, sizing
    from multihead.hardware import HARDWARE, estimate
    from multihead.presets import preset

    m = preset("llama-3-8b")
    kw: dict[str, Any] = {"seq": 8193, "batch": 1, "dtype": "bf16"}
    calls = [lambda: sizing.whole_model(m, weights_dtype="bf16", **kw),
             lambda: sizing.attention_report(m, causal=True, **kw),
             lambda: compare.compare_variants(m, **kw),
             lambda: estimate(m, sizing.model_size(m), HARDWARE["h100-80g"], weights_dtype="bf16", **kw)]
    for call in calls:
        with pytest.raises(MultiheadError, match="--seq 8,193 is past llama-3-8b's own context of 8,192 tokens"):
            call()
    kw["seq"] = 8192  # the context itself is answered
    assert sizing.whole_model(m, weights_dtype="bf16", **kw) is not None


def test_a_rope_scaling_context_is_the_limit_and_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
           "vocab_size": 100, "intermediate_size": 96, "max_position_embeddings": 32768,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    path = _write(tmp_path / "yarn", cfg)
    assert main(["count", "--config", str(path), "--seq", "131072", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["whole_model"]["context_limit"] == 131072
    _refused(["count", "--config", str(path), "--seq", "131073"], capsys, "own context of 131,072 tokens",
             "rope_scaling's factor x original_max_position_embeddings")


@pytest.mark.parametrize(("argv", "seq"), [
    (["count", "--preset", "bert-base"], 512), (["count", "--preset", "llama-3-8b"], 4096),
    (["compare", "--preset", "gpt2", "--no-plot"], 1024), (["compare", "--preset", "llama-3-8b", "--no-plot"], 8192),
    (["count", "--d-model", "64", "--heads", "4"], 4096),
])
def test_the_default_seq_stays_within_the_models_context(argv: list[str], seq: int,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The defaults (4096 for count, 8192 for compare) would be refused for GPT-2 (1,024) and BERT (512): without
    --seq, the model's own context where that is shorter."""
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq"] == seq
