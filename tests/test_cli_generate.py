"""`multihead generate` says which cache ran (issue 42 item 9): its kind and bytes read from the cache object, a
full KVCache's bytes beside them, and the tokens per second of the run; --json carries the same as "cache"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multihead import cost
from multihead.cache import HeadPlan
from multihead.cli import main
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
