"""`multihead generate` says which cache ran (issue 42 item 9): its kind and bytes read from the cache object, a
full KVCache's bytes beside them, and the tokens per second of the run; --json carries the same as "cache"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multihead.cache import HeadPlan
from multihead.cli import main
from multihead.sizing import cost
from tiny_checkpoints import TINY, write_tiny_gguf

NEW = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HeadPlan, Path]:
    out = tmp_path_factory.mktemp("generate")
    gguf = write_tiny_gguf(out / "tiny.gguf")
    n, h, g, d = TINY["n_layers"], TINY["n_heads"], TINY["n_kv_heads"], TINY["head_dim"]
    plan = HeadPlan(full=[[i % 2 == 0 for i in range(g)]] * n, sinks=1, window=2, model="tiny", shape=(n, h, g, d))
    return gguf, plan, plan.save(out / "half-plan.json")


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:  # type: ignore[type-arg]
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_plan_reports_the_head_wise_cache_that_ran(tiny: tuple[Path, HeadPlan, Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.models import load_llama

    gguf, plan, plan_file = tiny
    data = _json(["generate", "the", "--model", str(gguf), "--max-new-tokens", str(NEW), "--plan", str(plan_file)],
                 capsys)
    positions = data["prompt_tokens"] + NEW
    model, _ = load_llama(str(gguf))
    full = model.new_cache(1, positions)  # the cache generate makes without --plan: its real tensors
    assert data["cache"] == {
        "kind": "HeadwiseCache",
        "bytes": cost.headwise_cache_bytes(plan, batch=1, max_len=positions, dtype="fp32"),
        "full_cache_bytes": full.bytes,
        "of_full": round(cost.headwise_cache_bytes(plan, batch=1, max_len=positions, dtype="fp32") / full.bytes, 4),
    }
    assert data["cache"]["bytes"] < full.bytes  # half the KV heads keep 2 of the 7 positions
    # tokens per second of the run: new tokens over its seconds, which --json rounds to 1 ms
    seconds, rate = data["seconds"], data["tokens_per_second"]
    assert data["new_tokens"] / (seconds + 5e-4) - 0.01 <= rate <= data["new_tokens"] / max(seconds - 5e-4, 1e-9) + 0.01


def test_window_and_full_caches_are_reported_too(tiny: tuple[Path, HeadPlan, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.models import load_llama

    gguf, _, _ = tiny
    model, _ = load_llama(str(gguf))
    argv = ["generate", "the", "--model", str(gguf), "--max-new-tokens", str(NEW)]
    plain = _json(argv, capsys)
    assert plain["cache"]["kind"] == "KVCache"
    assert plain["cache"]["bytes"] == plain["cache"]["full_cache_bytes"] == model.new_cache(
        1, plain["prompt_tokens"] + NEW).bytes
    windowed = _json([*argv, "--window", "3", "--sinks", "1"], capsys)
    assert windowed["cache"]["kind"] == "SinkCache"
    assert windowed["cache"]["bytes"] == model.new_cache(1, window=3, sink_tokens=1).bytes


def test_the_streamed_run_prints_the_cache_and_speed_on_stderr(tiny: tuple[Path, HeadPlan, Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    gguf, _, plan_file = tiny
    argv = ["generate", "the", "--model", str(gguf), "--max-new-tokens", str(NEW), "--greedy"]
    want = _json([*argv, "--plan", str(plan_file)], capsys)
    assert main([*argv, "--plan", str(plan_file)]) == 0
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    assert line.startswith("multihead generate: HeadwiseCache ")
    assert f"({want['cache']['bytes']:,} bytes; a full KVCache " in line
    assert f"{want['cache']['bytes'] / want['cache']['full_cache_bytes']:.2f} of it" in line
    assert f"{want['new_tokens']} new tokens in " in line and " tok/s" in line
    assert "multihead generate:" not in out  # stdout holds the text alone


# ---------------------------------------------------------------------------------------------- issue 52 item 8
@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 saved by transformers (a model multihead's port does not run)."""
    from tiny_checkpoints import write_tiny_hf_qwen2

    return write_tiny_hf_qwen2(tmp_path_factory.mktemp("generate-hf") / "tiny-qwen2")


def test_generate_runs_any_transformers_model_as_transformers_does(qwen2: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 52 item 8: `generate --model` took Llama only. A Qwen2 folder now runs through multihead.hf.load and a
    multihead cache; greedy, its tokens are transformers' own (its model.generate with its own attention and
    DynamicCache), and the cache reported is the one that ran."""
    import torch
    import transformers

    argv = ["generate", "the cat", "--model", str(qwen2), "--max-new-tokens", str(NEW)]
    data = _json(argv, capsys)
    assert data["engine"] == "transformers" and data["cache"]["kind"] == "KVCache"
    tok = transformers.AutoTokenizer.from_pretrained(str(qwen2))
    prompt = tok("the cat").input_ids
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(qwen2), attn_implementation="eager")
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt):]
    assert data["prompt_tokens"] == len(prompt) and data["tokens"] == want.tolist()
    text = reference.config
    per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads)
    assert data["cache"]["bytes"] == data["cache"]["full_cache_bytes"] == per_token * 4 * (len(prompt) + NEW)
    # a window holding every position keeps every key: the same tokens, in a sinks + window cache
    wide = _json([*argv, "--window", str(len(prompt) + NEW), "--sinks", "1"], capsys)
    assert wide["tokens"] == data["tokens"] and wide["cache"]["kind"] == "SinkCache"


def test_generate_on_transformers_takes_window_bits_and_plan(qwen2: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from multihead import hf

    model = hf.load(qwen2)
    argv = ["generate", "the cat", "--model", str(qwen2), "--max-new-tokens", str(NEW)]
    positions = _json(argv, capsys)["prompt_tokens"] + NEW
    windowed = _json([*argv, "--window", "2", "--sinks", "1"], capsys)["cache"]
    assert windowed["kind"] == "SinkCache"
    assert windowed["bytes"] == hf.new_cache(model, window=2, sink_tokens=1).bytes < windowed["full_cache_bytes"]
    quantized = _json([*argv, "--bits", "8"], capsys)["cache"]
    assert quantized["kind"] == "QuantizedKVCache"
    assert quantized["bytes"] == hf.new_cache(model, positions, bits=8, group=8).bytes
    plan = HeadPlan(full=[[True, False]] * 2, sinks=1, window=2, model="tiny-qwen2", shape=(2, 4, 2, 8))
    ran = _json([*argv, "--plan", str(plan.save(tmp_path / "plan.json"))], capsys)["cache"]
    assert ran["kind"] == "HeadwiseCache"
    assert ran["bytes"] == cost.headwise_cache_bytes(plan, batch=1, max_len=positions, dtype="fp32")
    assert main(argv) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("multihead generate: KVCache ") and f"{NEW} new tokens in " in line and "tok/s" in line
    assert main([*argv, "--bits", "3"]) == 2
    assert "give 4 or 8" in capsys.readouterr().err


def test_generate_bits_on_the_port(tiny: tuple[Path, HeadPlan, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.models import load_llama

    gguf, _, _ = tiny
    data = _json(["generate", "the", "--model", str(gguf), "--max-new-tokens", str(NEW), "--bits", "4"], capsys)
    model, _ = load_llama(str(gguf))
    assert data["engine"] == "ours" and data["cache"]["kind"] == "QuantizedKVCache"
    positions = data["prompt_tokens"] + NEW
    assert data["cache"]["bytes"] == model.new_cache(1, positions, bits=4, group=TINY["head_dim"]).bytes
