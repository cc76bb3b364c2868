"""multihead tradeoff: the evaluation text, the strided perplexity, uptraining and its checkpoint, the command."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from multihead import MultiheadError
from multihead.cache import CacheSpec
from multihead.cli import main
from multihead.evals.text import JARGON, read_text, reflow, token_splits
from multihead.models.llama import LlamaConfig, LlamaModel
from multihead.tradeoff import lm
from multihead.tradeoff.uptrain import UptrainSettings, distillation_loss, uptrain


def test_the_evaluation_text_is_installed_and_long_enough(smollm2) -> None:  # type: ignore[no-untyped-def]
    assert JARGON.is_file(), "make text installs Debian's jargon-text"
    text = read_text()
    _, tokenizer = smollm2
    splits = token_splits(tokenizer.encode(text))
    assert len(splits.train) + len(splits.test) > 300_000 and len(splits.test) > 70_000
    assert "hacker" in text and "\u2500" not in text and "  " not in text  # prose, no tables, reflowed


def test_reflow_joins_paragraph_lines_and_drops_tables() -> None:
    raw = "   :foo: n.\n\n   A word that\n   means   nothing.\n   \u2502 a \u2502 table \u2502\n\n   Next.\n"
    assert reflow(raw) == ":foo: n.\n\nA word that means nothing.\n\nNext."


def test_text_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(MultiheadError, match="missing"):
        read_text(tmp_path / "none.txt")
    bad = tmp_path / "bad.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(MultiheadError, match=r"bad\.gz cannot be read"):
        read_text(bad)
    with pytest.raises(MultiheadError, match="fewer than one evaluation window of 1,024"):
        token_splits(list(range(1000)), least=1024)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"window": 1024}, r"window \(1024\) must be shorter than the context"),
    ({"sinks": (300,)}, r"sink count 300 must lie between 0 and the window \(256\)"),
    ({"bits": (3,)}, r"bits \(3\) is not a supported cache width"),
    ({"stride": 2048}, r"stride \(2048\) must not exceed the context"),
    ({"context": 0}, r"context \(0\) must be a positive integer"),
])
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(MultiheadError, match=message):
        lm.Settings(**kwargs)


def test_windows_score_each_token_once_with_at_least_context_minus_stride_before_it() -> None:
    settings = lm.Settings(context=8, stride=4, windows=100, window=4, sinks=(), bits=())
    starts = lm.window_starts(30, settings)
    assert starts == [0, 4, 8, 12, 16, 20]
    scored = [p for s in starts for p in range(s + 8 - 4, s + 8)]
    assert len(scored) == len(set(scored)) and min(scored) >= 4


def _tiny(seed: int = 0, n_kv_heads: int = 2) -> LlamaModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, ffn_dim=48,
                      max_context=64)
    model = LlamaModel(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)  # attention far from uniform: pooling KV heads changes the outputs
    return model


def test_every_cache_method_runs_its_real_cache_and_the_full_one_equals_a_plain_forward() -> None:
    model = _tiny()
    settings = lm.Settings(context=32, stride=16, windows=3, chunk=8, window=8, sinks=(2,), bits=(4,), group=8,
                           residual=0)
    test = torch.randint(0, 40, (80,)).tolist()
    methods = [*settings.methods(), lm.Method("full, through the cache", "check", CacheSpec(32))]
    rows = {r.method: r for r in lm.evaluate({"original": model}, methods, test, settings)}
    # the reference: cross-entropy of a plain forward over the same windows, scoring the last stride tokens
    nll = []
    for start in lm.window_starts(len(test), settings):
        x = torch.tensor(test[start:start + 32])[None]
        with torch.no_grad():
            nll.append(F.cross_entropy(model(x)[0, :-1], x[0, 1:], reduction="none")[-16:])
    want = math.exp(float(torch.cat(nll).double().mean()))
    assert rows["full cache"].perplexity == pytest.approx(want, rel=1e-6)
    assert rows["full, through the cache"].perplexity == pytest.approx(want, rel=1e-5)
    assert rows["window 8"].kv_ratio < rows["2 sinks + window 8"].kv_ratio < rows["int4 (g8, r0)"].kv_ratio < 1
    assert all(r.cache_bytes_checked for r in rows.values() if r.series != "full")


def test_pooling_to_one_kv_head_equals_the_pooling_hook() -> None:
    from multihead.layers.hooks import hooks, pool_kv_hook

    model = _tiny()
    x = torch.randint(0, 40, (1, 20))
    with hooks(model, {"*.hook_k": pool_kv_hook(1), "*.hook_v": pool_kv_hook(1)}), torch.no_grad():
        want = model(x)
    pooled = lm.pooled_model(model, 1)
    assert pooled.config.n_kv_heads == 1
    torch.testing.assert_close(pooled(x), want, atol=1e-5, rtol=1e-5)


def test_uptraining_lowers_the_kl_and_a_resumed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    teacher = _tiny()
    train = torch.randint(0, 40, (400,)).tolist()
    settings = UptrainSettings(steps=6, seq=24, lr=1e-2, warmup=1, train="kv", every=3)
    x = torch.tensor(train[:48])[None]

    def kl(m: LlamaModel) -> float:
        with torch.no_grad():
            return float(distillation_loss(m(x), teacher(x)))

    whole = lm.pooled_model(teacher, 1)
    before = kl(whole)
    history = uptrain(whole, teacher, train, settings, progress=False)
    assert kl(whole) < before and len(history) == 6
    # interrupted after 3 steps (the checkpoint), then resumed
    first = lm.pooled_model(teacher, 1)
    uptrain(first, teacher, train, UptrainSettings(**{**settings.__dict__, "steps": 3}), checkpoint=tmp_path / "a",
            progress=False)
    state = json.loads((tmp_path / "a" / "state.json").read_text())
    assert state["step"] == 3
    state["settings"]["steps"] = 6  # the same run, asked to go on to 6 steps
    (tmp_path / "a" / "state.json").write_text(json.dumps(state))
    resumed = lm.pooled_model(teacher, 1)
    history = uptrain(resumed, teacher, train, settings, checkpoint=tmp_path / "a", resume=True, progress=False)
    assert [h["step"] for h in history if "kl" in h] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with pytest.raises(MultiheadError, match="made with other settings"):
        uptrain(lm.pooled_model(teacher, 1), teacher, train, UptrainSettings(steps=9, seq=24),
                checkpoint=tmp_path / "a", resume=True, progress=False)


@pytest.mark.slow
def test_the_tradeoff_command_on_smollm2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real model and the real text at a tiny size: every row present, bytes checked, uptraining resumable."""
    argv = ["tradeoff", "--context", "96", "--stride", "48", "--windows", "2", "--chunk", "32", "--window", "32",
            "--sinks", "4", "--bits", "4", "--group", "32", "--residual", "32", "--uptrain-steps", "2",
            "--prune", "0.3", "--out", str(tmp_path)]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["method"]: r for r in data["rows"]}
    assert list(rows) == ["full cache", "window 32", "4 sinks + window 32", "int4 (g32, r32)", "MQA, pooled 3 -> 1",
                          "MQA, uptrained 2 steps", "pruned 30% of KV groups"]
    assert all(r["cache_bytes_checked"] for r in rows.values())
    pruned = rows["pruned 30% of KV groups"]
    assert pruned["extra"]["kv_groups_kept"] == 90 - 27 and pruned["kv_ratio"] == pytest.approx(63 / 90)
    assert pruned["extra"]["parameters"] < pruned["extra"]["parameters_original"]
    assert (tmp_path / "pruned-30" / "model.safetensors").exists()
    full = rows["full cache"]
    assert full["kv_bytes"] == 30 * 2 * 3 * 64 * 2 * 96  # 30 layers, K and V, 3 KV heads of 64, bf16, 96 tokens
    assert rows["MQA, pooled 3 -> 1"]["kv_bytes"] * 3 == full["kv_bytes"]
    assert rows["4 sinks + window 32"]["kv_bytes"] == 30 * 2 * 3 * 64 * 2 * (4 + 32 - 1)
    assert 1 < full["perplexity"] < rows["MQA, pooled 3 -> 1"]["perplexity"]
    assert data["text"]["scored_tokens"] == 96 and data["uptrain"]["history"][0]["step"] == 0
    assert (tmp_path / "kv-tradeoff.png").stat().st_size > 10_000 and (tmp_path / "kv-tradeoff.json").exists()
    assert (tmp_path / "uptrain" / "state.json").exists()
    assert main([*argv[:-6], "--uptrain-steps", "0", "--window", "2000", "--out", str(tmp_path)]) == 2
    assert "window (2000) must be shorter than the context (96)" in capsys.readouterr().err


def test_gzip_text_is_read(tmp_path: Path) -> None:
    path = tmp_path / "t.txt.gz"
    path.write_bytes(gzip.compress(b"one\ntwo\n\nthree"))
    assert read_text(path) == "one two\n\nthree"


@pytest.mark.slow
def test_the_encoder_tradeoff_on_minilm() -> None:
    from multihead.tradeoff.encoder import EncoderSettings, run

    result = run(EncoderSettings(texts=6, calibration=2, kv_heads=(4, 1), bits=(8, 2), prune=(0.25,)),
                 progress=False)
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["original"]["kv_bytes_per_token"] == 2 * 6 * 384 * 2  # 6 layers, K and V, bf16
    assert rows["4 KV heads (pooled)"]["kv_ratio"] == pytest.approx(4 / 12)
    assert rows["int8 K/V (g32)"]["one_minus_cosine"] < 1e-4 < rows["int2 K/V (g32)"]["one_minus_cosine"]
    assert rows["pruned 25% of heads"]["kv_ratio"] == pytest.approx(54 / 72)
    assert 0 < rows["pruned 25% of heads"]["one_minus_cosine"] < 1
