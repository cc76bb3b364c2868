"""benchmarks/longctx_speed.py (outside the installed package): its arguments are checked, and one tiny run of every
runner (multihead's five cache kinds, transformers' Llama) gives a row each with the figures and the exact bytes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from multihead.cache import HeadPlan
from multihead.models import LlamaConfig, LlamaModel
from multihead.sizing import cost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench
import ctxbench
import longctx_speed


@pytest.mark.parametrize(("argv", "says"), [
    (["--rounds", "0"], "--rounds (0) must be at least 1"),
    (["--decode-tokens", "0"], "--decode-tokens (0) must be at least 1"),
    (["--lengths", "0"], "--lengths [0] must lie between 1 and SmolLM2's context (8192)"),
    (["--lengths", "8193"], "--lengths [8193]"),
    (["--dtypes", "float16"], "--dtypes ['float16']: choose from float32, bfloat16"),
    (["--caches", "int3"], "--caches ['int3']: choose from full, sink, int4, int8, headwise"),
    (["--sinks", "300"], "--sinks (300) must lie between 0 and --window (256)"),
    (["--plan", "no-such-plan.json"], "--plan no-such-plan.json is not a file"),
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        longctx_speed.parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and err.strip().splitlines()[-1].startswith("longctx_speed.py: error:")


def test_quick_and_the_defaults() -> None:
    quick = longctx_speed.parse(["--quick"])
    assert (quick.lengths, quick.dtypes, quick.rounds, quick.decode_tokens) == ((512,), ("float32",), 1, 4)
    full = longctx_speed.parse([])
    assert (full.lengths, full.dtypes, full.caches, full.rounds) == (
        (2048, 4096, 8192), ("float32", "bfloat16"), ctxbench.CACHE_KINDS, 3)
    assert full.transformers and not longctx_speed.parse(["--random"]).transformers
    assert Path(full.plan).is_file()  # the shipped plan the head-wise rows use
    assert longctx_speed.parse(["--quick", "--lengths", "64"]).lengths == (64,)  # --quick fills only what is not given


def test_a_tiny_run_gives_every_runner_a_row_with_exact_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers
    monkeypatch.setattr(bench.gc, "collect", lambda: 0)  # seconds per call in a large test process; nothing here
    torch.manual_seed(0)
    L, h, g, d, n, steps = 2, 4, 2, 32, 40, 3
    config = LlamaConfig(vocab_size=128, d_model=h * d, n_layers=L, n_heads=h, n_kv_heads=g, ffn_dim=64,
                         max_context=128)
    ours = LlamaModel(config).eval()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=h * d, intermediate_size=64, num_hidden_layers=L, num_attention_heads=h,
        num_key_value_heads=g, max_position_embeddings=128, attn_implementation="sdpa")).eval()
    plan = HeadPlan.from_scores(torch.rand(L, g), 0.5, sinks=2, window=8, model="tiny", shape=(L, h, g, d),
                                method="test")
    s = longctx_speed.Settings(lengths=(n,), dtypes=("float32",), caches=ctxbench.CACHE_KINDS, rounds=1,
                         decode_tokens=steps, chunk=16, window=8, sinks=2, plan="-", random=True, transformers=True,
                         group=8, residual=8)
    tokens = torch.randint(0, 128, (1, n))
    rows = longctx_speed.measure({"float32": (ours, hf)}, tokens, s, plan)
    by = {r.runner: r for r in rows}
    assert list(by) == [*ctxbench.CACHE_KINDS, "transformers"]
    held = n + steps
    full_bytes = 2 * L * g * held * d * 4  # every token's keys and values, float32
    assert by["full"].cache_bytes == by["transformers"].cache_bytes == full_bytes  # the same tokens held
    assert by["int4"].cache_bytes == cost.quantized_cache_bytes(config.attention(), context=held, bits=4, group=8,
                                                                residual=8, n_layers=L, dtype="fp32")
    assert by["sink"].cache_bytes == 2 * L * g * (2 + 8 - 1) * d * 4
    for r in rows:
        assert r.prefill_s > 0 and r.decode_tok_s > 0 and r.peak_rss_delta >= 0
        assert (r.decode_vs_transformers is None) == (r.runner == "transformers")
    assert by["full"].decode_vs_full == by["full"].bytes_vs_full == 1.0
    assert by["int4"].bytes_vs_full == pytest.approx(by["int4"].cache_bytes / full_bytes)
    assert by["int4"].prefill_vs_transformers == pytest.approx(
        by["transformers"].prefill_s / by["int4"].prefill_s)
    text = longctx_speed.table(rows, s, ["machine: test"])
    assert text.count("\n| float32 | 40 |") == len(rows)


def test_the_windowed_caches_prefill_in_chunks_the_others_in_one_call_unless_a_chunk_is_given() -> None:
    assert [longctx_speed.prefill_chunk(kind, 0) for kind in ctxbench.CACHE_KINDS] == [
        0 if kind in ("full", "int4", "int8") else longctx_speed.WINDOW_CHUNK for kind in ctxbench.CACHE_KINDS]
    assert {longctx_speed.prefill_chunk(kind, 64) for kind in ctxbench.CACHE_KINDS} == {64}
    with pytest.raises(SystemExit):
        longctx_speed.parse(["--chunk", "-1"])
