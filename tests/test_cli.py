"""The command line: the seed's shape walk, JSON, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    assert done.stderr.strip() == ("multihead shapes: error: n_heads (32) must be divisible by n_kv_heads (5): "
                                   "choose n_kv_heads in 1, 2, 4, 8, 16, 32")


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_count_answers_the_seeds_questions(capsys: pytest.CaptureFixture[str]) -> None:
    assert _json(["count", "--d-model", "768", "--heads", "12"], capsys)["head_dim"] == 64
    assert _json(["count", "--d-model", "768", "--heads", "24"], capsys)["head_dim"] == 32
    r = _json(["count", "--d-model", "4096", "--heads", "32", "--seq", "128"], capsys)
    assert r["params_per_layer"] == 67_108_864 and r["head_dim"] == 128
    for key in ("kv_cache_bytes_per_token_per_layer", "kv_cache_bytes_total", "flops_forward"):
        assert isinstance(r[key], int) and r[key] > 0


def test_count_json_equals_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.sizing import cost
    from multihead.sizing.presets import preset

    r = _json(["count", "--preset", "llama-3-8b", "--seq", "8192", "--batch", "2", "--dtype", "fp16"], capsys)
    model = preset("llama-3-8b")
    assert r["params_per_layer"] == cost.parameters(model.attention).total
    assert r["params_total"] == 32 * r["params_per_layer"]
    assert r["kv_cache_bytes_per_token_per_layer"] == 2 * 8 * 128 * 2
    assert r["kv_cache_bytes_total"] == cost.kv_cache_bytes(model.attention, context=8192, batch=2, n_layers=32,
                                                            dtype="fp16")
    assert r["flops_forward"] == 32 * cost.flops(model.attention, s=8192, batch=2, causal=True).forward


def test_count_table_and_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests_support import minilm_dir

    assert main(["count", "--config", str(minilm_dir()), "--seq", "256", "--device-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "12 query, 12 key/value (MHA)" in out and "32 (= 384 / 12)" in out
    assert "bidirectional" in out and "context that fits in 1.0 GiB" in out


def test_compare_table_ratios_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "kv.png"
    r = _json(["compare", "--preset", "llama-2-70b", "--seq", "4096", "--device-memory", "80GB", "--plot", str(png)],
              capsys)
    variants = {v["n_kv_heads"]: v for v in r["variants"] if not v["variant"].startswith("MLA")}
    assert sorted(variants) == [1, 2, 4, 8, 16, 32, 64]
    mla = r["variants"][-1]  # DeepSeek's proportions at this width: latent 4 x 128, RoPE key 64
    assert mla["variant"] == "MLA (r 512, rope 64)" and mla["ratio_to_mha"] == pytest.approx(576 / (2 * 64 * 128))
    for g, v in variants.items():
        assert v["ratio_to_mha"] == pytest.approx(g / 64)
    assert variants[8]["is_model"] and variants[1]["variant"] == "MQA" and variants[64]["variant"] == "MHA"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and r["plot"] == str(png)
    assert main(["compare", "--preset", "falcon-7b", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "MQA *" in out and "MHA" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["count", "--preset", "llama"], "unknown preset 'llama': (did you mean .*\\? )?known presets are gpt2"),
    (["count"], "give exactly one model"),
    (["count", "--preset", "gpt2", "--d-model", "8"], "got --preset and --d-model/--heads"),
    (["count", "--heads", "8"], "--d-model and --heads are both needed"),
    (["count", "--preset", "gpt2", "--dtype", "fp4"], "dtype 'fp4' is unknown"),
    (["count", "--preset", "gpt2", "--seq", "0"], "0 must be a positive integer"),
    (["count", "--preset", "gpt2", "--device-memory", "lots"], "size 'lots' is not understood"),
    (["count", "--config", "/nonexistent/config.json"], "does not exist"),
    (["compare", "--d-model", "100", "--heads", "3"], r"d_model \(100\) must be divisible by n_heads \(3\)"),
])
def test_cost_commands_report_bad_input_in_one_line(argv: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err


def _preset_names() -> tuple[str, ...]:
    from multihead.sizing.presets import PRESET_NAMES

    return PRESET_NAMES


@pytest.mark.parametrize("name", _preset_names())
def test_count_compare_and_shapes_run_on_every_preset(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 52 item 1: `shapes --preset` on a sliding-window preset (mistral-7b, gpt-oss, gemma-3, ministral) walked a
    non-causal layer and exited 2 advising causal=True, a flag the command does not have. Every preset now runs
    through count, compare and shapes; the walk's shapes are the preset's own head counts and widths."""
    from multihead.sizing.presets import preset

    model = preset(name)
    seq = min(16, model.max_context or 16)
    assert main(["count", "--preset", name, "--device-memory", "80GB", "--json"]) == 0
    assert main(["compare", "--preset", name, "--no-plot", "--device-memory", "80GB", "--json"]) == 0
    capsys.readouterr()
    walk = _json(["shapes", "--preset", name, "--seq", str(seq)], capsys)
    if model.mla is not None:
        assert walk["variant"] == "MLA"
        return
    a = model.attention
    shapes = {s["step"]: tuple(s["shape"]) for s in walk["steps"]}
    assert shapes["q_heads"] == (1, a.n_heads, seq, a.head_dim)
    assert shapes["k_heads"] == shapes["v_heads"] == (1, a.n_kv_heads, seq, a.head_dim)
    assert shapes["weights"] == (1, a.n_heads, seq, seq)
    assert shapes["output"] == (1, seq, a.d_model)


def test_shapes_of_a_sliding_window_preset_says_its_window(capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.sizing.presets import preset

    assert main(["shapes", "--preset", "mistral-7b", "--seq", "8"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f"causal sliding window {preset('mistral-7b').attention.window}" in first, first


def test_count_reads_a_gguf_files_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 52 item 4: `count --config FILE.gguf` said the file was not a config instead of reading its metadata.
    The reference: the config.json transformers would read for the same tiny Llama (written by tiny_checkpoints from
    the same weights), counted the same way."""
    from tiny_checkpoints import write_tiny_hf_llama

    folder = write_tiny_hf_llama(tmp_path / "tiny")
    gguf = tmp_path / "tiny.gguf"
    from_gguf = _json(["count", "--config", str(gguf), "--device-memory", "1MiB"], capsys)
    from_json = _json(["count", "--config", str(folder), "--device-memory", "1MiB"], capsys)
    assert from_gguf["model"] == "tiny"
    for key in ("params_total", "flops_forward", "kv_cache_bytes_total", "max_context_in_device_memory", "head_dim",
                "n_kv_heads"):
        assert from_gguf[key] == from_json[key], key
    for key in ("total_parameters", "parameters_by_part", "weight_bytes", "largest_context", "largest_batch"):
        assert from_gguf["whole_model"][key] == from_json["whole_model"][key], key


def test_a_mistyped_preset_is_answered_with_the_closest_names(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 52 item 5: a typo got a list cut off at 400 characters and no suggestion."""
    from multihead.sizing.presets import PRESET_NAMES

    assert main(["count", "--preset", "llama-3.1-7b"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    suggested = err.split("did you mean ", 1)[1].split("?", 1)[0].split(" or ")
    assert "llama-3.1-8b" in suggested and all(name in PRESET_NAMES for name in suggested)
    listed = err.split("known presets are ", 1)[1].split(" (", 1)[0].split(", ")
    assert listed == list(PRESET_NAMES)
    assert main(["count", "--preset", "zzzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_mistral_7b_says_it_is_v0_1(capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.sizing.presets import preset, published

    source, cfg = published("mistral-7b")
    assert source.startswith("https://huggingface.co/mistralai/Mistral-7B-v0.1/")
    note = _json(["presets"], capsys)["mistral-7b"]["note"]
    assert "v0.1" in note and f"{cfg['sliding_window']:,}" in note
    assert preset("mistral-7b").attention.window == cfg["sliding_window"]
    assert main(["presets"]) == 0
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("mistral-7b "))
    assert f"note: {note}" in out[at + 1]


def test_presets_lists_them_all(capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.sizing.presets import PRESET_NAMES

    data = _json(["presets"], capsys)
    assert list(data) == list(PRESET_NAMES)
    assert data["gemma-7b"]["attention"]["head_dim"] == 256


@pytest.mark.slow
def test_embed_json_equals_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.models import load_sentence_encoder

    data = _json(["embed", "A man is eating food.", "The sky is blue."], capsys)
    got = torch.tensor([e["embedding"] for e in data["embeddings"]])
    want = load_sentence_encoder().embed(["A man is eating food.", "The sky is blue."])
    assert data["dim"] == 384
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_generate_streams_and_json_matches_the_library(smollm2, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from multihead.models.generate import generate_ids

    model, tok = smollm2
    data = _json(["generate", "The capital of France is", "--max-new-tokens", "8"], capsys)
    want = [t for s in generate_ids(model, [tok.encode("The capital of France is")], max_new_tokens=8) for t in s]
    assert data["tokens"] == want[: len(data["tokens"])] and data["new_tokens"] == len(data["tokens"])
    assert main(["generate", "The capital of France is", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == tok.decode(want)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_generate_compile_flag_gives_the_same_tokens(smollm2, dtype: str, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """--compile decodes through the compiled step (traced by dynamo here, without inductor's minutes of code
    generation; benchmarks/decode.py --compile runs the real thing) and streams the eager tokens: one graph (no break,
    no recompile), and the graph calls the native one-row product as its operator where the kernels have it."""
    from torch._dynamo.testing import CompileCounter

    from multihead.kernels import native
    from multihead.models import generate as gen

    torch._dynamo.reset()
    counter = CompileCounter()
    called: set[str] = set()

    def backend(gm: torch.fx.GraphModule, example: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        called.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return counter(gm, example)

    real_compile = torch.compile
    monkeypatch.setattr(gen.torch, "compile", lambda fn, **kw: real_compile(fn, backend=backend))
    argv = ["generate", "The capital of France is", "--max-new-tokens", "6", "--json", "--dtype", dtype]
    plain = _json(argv, capsys)
    monkeypatch.setattr(native, "_state", {})  # the trace is the kernels' first use: loaded, not a graph break
    compiled = _json([*argv, "--compile"], capsys)
    assert compiled["tokens"] == plain["tokens"] and counter.frame_count == 1  # one graph: no break, no recompile
    assert ("multihead.gemv_bf16" in called) == (dtype == "bf16" and native.vectorised())
    assert ("multihead.gemv_f32" in called) == (dtype == "fp32" and native.avx512())
    assert compiled["cache"]["positions"] % gen.CACHE_BUCKET == 0 and "positions" not in plain["cache"]
    if dtype == "fp32":
        assert compiled["cache"]["bytes"] == gen.full_cache_bytes(smollm2[0], 1, compiled["cache"]["positions"])


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "hi", "--max-new-tokens", "0"], r"--max-new-tokens \(0\) must be at least 1"),
    (["generate", "hi", "--max-new-tokens", "-2"], r"--max-new-tokens \(-2\) must be at least 1"),
    (["generate", "hi", "--greedy", "--temperature", "0.7"], "--greedy cannot be combined"),
    (["generate", "hi", "--top-p", "1.5"], r"argument --top-p: '1.5' must be a finite number in \(0, 1\]"),
    (["generate", "hi", "--model", "/nonexistent.gguf"], "does not exist"),
    (["generate", "hi", "--compile", "--tp", "2"], r"--compile cannot be combined with --tp"),
    (["embed", "hi", "--model", "/nonexistent"], "does not exist"),
    (["embed"], "the following arguments are required: TEXT"),
])
def test_model_commands_report_bad_input_in_one_line(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err


def test_count_compare_and_shapes_show_deepseek_mla(capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSeek-V3's published shape: 576 cached values per token per layer against 32,768 for MHA with its heads;
    the preset equals transformers' DeepseekV3Config defaults (V3's published config)."""
    from transformers import DeepseekV3Config

    from multihead.sizing.presets import from_hf_dict, preset

    assert from_hf_dict(DeepseekV3Config().to_dict()).mla == preset("deepseek-v3").mla
    r = _json(["count", "--preset", "deepseek-v3", "--seq", "8192"], capsys)
    assert r["mla"]["latent_dim"] == 576 and r["mla"]["cache_bytes_per_token"] == 576 * 2 * 61
    assert r["mla"]["cache_vs_mha"] == pytest.approx(576 / 32768)
    assert r["mla"]["params_per_layer"] == 187_107_328  # q_a, q_b, kv_a, kv_b, o and the two norms
    assert r["mla"]["decode_flops_absorbed"] < r["mla"]["decode_flops_expanded"] / 50
    r = _json(["compare", "--preset", "deepseek-v2-lite", "--seq", "4096", "--no-plot"], capsys)
    assert r["variants"][-1]["variant"] == "MLA" and r["variants"][-1]["is_model"]
    assert not any(v["is_model"] for v in r["variants"][:-1])
    walk = _json(["shapes", "--preset", "deepseek-v3", "--seq", "16", "--path", "absorbed"], capsys)
    shapes = {s["step"]: s["shape"] for s in walk["steps"]}
    assert shapes["hook_k"] == [1, 1, 16, 576] and shapes["hook_q"] == [1, 128, 16, 576]
    assert shapes["hook_z"] == [1, 128, 16, 128] and walk["projection_parameters"] == 187_107_328
    assert main(["shapes", "--preset", "deepseek-v3", "--d-model", "64"]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_with_a_window_decodes_at_constant_memory(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(["generate", "The capital of France is", "--max-new-tokens", "6", "--window", "32"], capsys)
    assert data["new_tokens"] >= 1
    assert main(["generate", "Hi", "--window", "32", "--compile"]) == 2
    assert "--window decodes eagerly" in capsys.readouterr().err


def _list_flags() -> list[tuple[str, str]]:
    """(command, flag) for every flag of every command whose value is a comma-separated list (flags.Listed, or
    flags.Dtype with many), found by walking the whole parser."""
    import argparse

    from multihead.cli import build_parser, flags

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for command, parser in sub.choices.items():
        for action in parser._actions:
            kind = action.type
            if isinstance(kind, flags.Listed) or (isinstance(kind, flags.Dtype) and kind.many):
                found.append((command, max(action.option_strings, key=len)))
    return found


LIST_FLAGS = _list_flags()


def test_the_list_flags_are_all_found() -> None:
    """The walk below sees the list flags of every command (so that a new one is tested without being named)."""
    for expected in [("experiment", "--heads"), ("check", "--dtype"), ("check", "--backend"), ("tune", "--lengths"),
                     ("tradeoff", "--bits"), ("tradeoff", "--prune"), ("heads", "--tasks")]:
        assert expected in LIST_FLAGS, LIST_FLAGS
    assert len({command for command, _ in LIST_FLAGS}) >= 5


@pytest.mark.parametrize("value", ["1,,2", ",1", "1,", "1, ,2"], ids=["doubled", "leading", "trailing", "blank"])
@pytest.mark.parametrize(("command", "flag"), LIST_FLAGS, ids=[f"{c} {f}" for c, f in LIST_FLAGS])
def test_a_list_flag_refuses_an_empty_item(command: str, flag: str, value: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """'1,,2' ran as 1,2 (issue 40 item 5): every list flag of every command now refuses an empty item in one line
    that names the flag and the value, before anything runs."""
    assert main([command, flag, value]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and captured.out == "", captured
    assert f"error: argument {flag}: {value!r} has an empty item (item " in err, err


def test_the_empty_item_is_said_where_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["experiment", "heads-vs-width", "--heads"]
    assert main([*argv, "1,,2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "multihead experiment: error: argument --heads: '1,,2' has an empty item (item 2 of 3: two commas in a "
        "row): give comma-separated integers (head counts), e.g. 1,4,16")
    for value, where in [(",1", "item 1 of 2: a leading comma"), ("1,", "item 2 of 2: a trailing comma")]:
        assert main([*argv, value]) == 2
        assert where in capsys.readouterr().err
    assert main([*argv, ","]) == 2
    assert "',' must be comma-separated integers (head counts), e.g. 1,4,16: there are none" in \
        capsys.readouterr().err


@pytest.mark.parametrize("argv", [["tradeoff", "--long"], ["heads", "--retrieval"], ["tune"]])
def test_lengths_are_named_lengths(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """--lengths 0 was told to give 'integers (head counts), e.g. 1,4,16': every --lengths says what it counts."""
    assert main([*argv, "--lengths", "0"]) == 2
    err = capsys.readouterr().err
    assert "argument --lengths: '0' must be comma-separated integers (lengths in tokens), e.g. 2048,4096" in err
    assert "head counts" not in err
