"""benchmarks/bench.py (outside the installed package): the peak-memory measure (P4) is right, a long forward holds
no (s, t) matrix, each benchmark runs in a fresh process, the GPU code runs at a tiny size."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.errors import MultiheadError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is read from /proc")


def _fresh(code: str) -> list[int]:
    """Run ``code`` (which prints a JSON list of ints) in a fresh interpreter with benchmarks/ importable: the
    allocator's state there is the one a benchmark's own process starts from, whatever earlier tests in this
    process freed (after tests/test_readme.py, freed pages were reused and a 64 MiB tensor counted no fresh page)."""
    import json
    import subprocess

    bench_dir = str(Path(__file__).resolve().parents[1] / "benchmarks")
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {bench_dir!r})\n{code}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found: list[int] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


@linux
def test_peak_memory_measure_sees_what_is_allocated() -> None:
    mib = 2**20
    one, two = _fresh("""
import json, torch, bench
def two_live():
    a = torch.ones(16 * 2**20)  # 64 MiB
    b = torch.ones(16 * 2**20)
    del a
    return b
cpu = torch.device("cpu")
torch.ones(2**20)  # warm-up: a fresh process's first fill maps its thread pool and kernels (6-7 MiB more), as P4 warms
print(json.dumps([bench.peak_extra_bytes(lambda: torch.ones(16 * 2**20), cpu), bench.peak_extra_bytes(two_live, cpu)]))
""")
    assert 60 * mib < one < 70 * mib
    assert 124 * mib < two < 140 * mib


@linux
def test_a_long_causal_forward_holds_q_k_v_and_the_output_only() -> None:
    """8192 tokens: an (s, t) float32 matrix per head would be 256 MiB, Q, K, V and the output are 96 MiB."""
    tokens, d_model = 8192, 768
    layer = MultiHeadAttention(d_model=d_model, n_heads=12, bias=False).eval()
    x = torch.randn(1, tokens, d_model)
    with torch.no_grad():
        layer(x[:, :256], causal=True)
        extra = bench.peak_extra_bytes(lambda: layer(x, causal=True), torch.device("cpu"))
    qkvo = 4 * tokens * d_model * 4
    assert extra <= 1.25 * qkvo, f"peak {extra / 2**20:.0f} MiB > 1.25 x {qkvo / 2**20:.0f} MiB"


@pytest.mark.slow  # child processes that build or load torch: seconds each
@linux
def test_a_benchmark_runs_in_a_fresh_process_and_reports_its_target() -> None:
    (result,) = bench.run_cpu(1, ("P4",))
    assert result.name == "P4" and result.met and result.target == "<= 1.25x"


def test_the_gpu_benchmarks_code_runs_on_the_cpu_at_a_tiny_size() -> None:
    """benchmarks/gpu.py runs where CI cannot look: its code runs here at 1/8 of the sizes (figures meaningless)."""
    results = bench.run_gpu(1, device="cpu", tiny=8)
    assert [r.name for r in results] == ["G1", "G2", "G3", "G4"]
    for r in results:
        assert "nan" not in r.ours.lower() and r.ratio and r.target
    assert "auto: sdpa" in results[3].what  # on the CPU the masked prefill keeps SDPA; on CUDA auto picks flex


@linux
def test_page_faults_count_fresh_memory_and_the_table_shows_the_notes() -> None:
    pages = 16 * 2**20 * 4 // 4096
    fresh, none, note_fresh = _fresh("""
import json, torch, bench
fresh = bench.page_faults(lambda: torch.ones(16 * 2**20))  # 64 MiB: above glibc's largest mmap threshold
none = bench.page_faults(lambda: 1 + 1)
note = bench.faults_note(lambda: 1 + 1, lambda: torch.ones(16 * 2**20))
print(json.dumps([fresh, none, int(note.rpartition("anchor ")[2].replace(",", ""))]))
""")
    assert fresh >= 0.9 * pages
    assert none < 16
    assert note_fresh >= 0.9 * pages
    note = bench.faults_note(lambda: 1 + 1, lambda: 1 + 1)
    r = bench.Result("P9", "what", "anchor", "1 ms", "2 ms", "0.50x", "<= 1x", True, note)
    assert re.fullmatch(r"page faults per call: multihead [\d,]+, anchor [\d,]+", r.note)
    assert bench.table([r]).endswith(f"- P9 against anchor: {r.note}")


def test_unknown_cpu_benchmarks_are_named() -> None:
    with pytest.raises(MultiheadError, match="unknown CPU benchmark\\(s\\) P7: choose from P1, P2, P3, P4, P5"):
        bench.run_cpu(1, ("P1", "P7"))


def test_p3_compares_the_same_step_against_an_anchor_that_takes_no_fresh_pages() -> None:
    """P3 checks that both sides compute the same output before timing; its anchor writes into buffers made once."""
    result = bench.p3(1)
    assert result.name == "P3" and result.ratio.endswith("x faster")
    if sys.platform.startswith("linux"):
        anchor_faults = int(result.note.rsplit("anchor ", 1)[1].replace(",", ""))
        assert anchor_faults < 100, result.note  # a fresh 9.4 MB repeat per step would be 2,300 pages


def test_the_hf_decode_bytes_bound_scales_the_full_cache_step_by_the_bytes_read() -> None:
    """benchmarks/hf_decode.py's bytes bound (issue 50 item 2): a kind's step against the full cache's step scaled by
    weights + cache bytes; the weights a step reads count a tied LM head once and leave an untied input table out."""
    import transformers
    from hf_decode import bytes_bound, weights_read

    rows = [{"condition": "idle", "variant": "transformers sdpa + DynamicCache", "ms_per_step": 10.0,
             "cache_bytes": 600},
            {"condition": "idle", "variant": "multihead full", "ms_per_step": 8.0, "cache_bytes": 600},
            {"condition": "idle", "variant": "multihead half", "ms_per_step": 7.0, "cache_bytes": 300},
            {"condition": "idle", "variant": "multihead full, threads as configured", "ms_per_step": 9.0,
             "cache_bytes": 600}]
    bytes_bound(rows, 400)
    assert rows[2]["ms_bound"] == 8.0 * 700 / 1000 and rows[2]["of_bound"] == round(7.0 / 5.6, 3)
    assert "of_bound" not in rows[3]  # another way to run a kind, not a kind: no bound of its own
    assert rows[1]["of_bound"] == 1.0 and "of_bound" not in rows[0] and rows[0]["bytes_read"] == 1000
    config = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1)
    for tied in (True, False):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, tie_word_embeddings=tied))
        every = sum(p.numel() * p.element_size() for p in model.parameters())
        assert weights_read(model) == every - (0 if tied else 50 * 16 * 4)


def test_the_codec_benchmark_checks_both_paths_wrote_the_same_store_and_times_each(capsys: pytest.CaptureFixture[str]
                                                                                   ) -> None:
    """benchmarks/codec.py: its arguments are checked; a tiny run compares the native codec's store with PyTorch's
    (the same bytes, or it stops) and gives each path's writes and reads."""
    import codec

    with pytest.raises(SystemExit):
        codec.main(["--rounds", "0"])
    assert "--rounds (0) must be at least 1" in capsys.readouterr().err
    assert codec.main(["--models", "gemma3", "--dtypes", "bfloat16", "--bits", "4", "--length", "200", "--chunk", "80",
                       "--rounds", "1"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| gemma3 | bfloat16 | 4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(float(c.rstrip("x")) > 0 for c in cells[3:]), row
    wrote, read, cache = codec.prefill(codec.SHAPES["gemma3"], torch.float32, 8, 200, 80, True)
    assert wrote > 0 and read > 0 and cache.quantized == 64  # 200 - 128 tokens past the residual: 2 groups


def test_the_prefill_attention_benchmark_checks_each_pair_and_names_the_path_the_library_takes(
        capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/prefill_attention.py (the figures behind sdpa's CAUSAL_BLOCKS and SPLIT_BLOCKED_FROM): its arguments
    are checked; a one-round run agrees path by path and says which path the dispatcher takes."""
    import prefill_attention

    with pytest.raises(SystemExit):
        prefill_attention.main(["--rounds", "0"])
    assert "--rounds (0) must be at least 1" in capsys.readouterr().err
    assert prefill_attention.main(["--models", "smollm2", "--dtypes", "bfloat16", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "| causal square of 512 | " in out and "blocks of 128 (taken)" in out
    assert "| causal square of 256 | " in out and "blocks of 128 (not taken)" in out
    assert "512 queries after 256 keys" in out and "split, own keys in blocks (taken)" in out


def test_the_hf_prefill_benchmark_rotates_the_order_and_gives_each_rounds_ratio_range() -> None:
    """benchmarks/hf_prefill.py on a tiny random Llama: the first variant to run rotates round by round (none always
    runs after the same one), each variant's speed is the median of its rounds' paired ratios with their range, and
    the full kind's last logits agree with transformers' own."""
    import hf_prefill
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    rows = hf_prefill.cell("tiny", model, torch.float32, 24, chunk=8, rounds=3, load=0, plan_of={})
    by = {r["variant"]: r for r in rows}
    assert next(iter(by)) == hf_prefill.ANCHOR and by[hf_prefill.ANCHOR]["speed_vs_transformers"] == 1.0
    for r in rows:
        assert r["speed_low"] <= r["speed_vs_transformers"] <= r["speed_high"], r
    assert by["multihead full"]["max_logit_diff"] < 1e-4
    assert "| rounds' range |" in hf_prefill.table(rows) and "| 1.00x | 1.00-1.00 |" in hf_prefill.table(rows)
    made = hf_prefill.variants(model, 24, {})
    ids = torch.randint(10, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    used: list[str] = []
    real = hf_prefill.use
    hf_prefill.use = lambda m, label: (used.append(label), real(m, label))[1]  # type: ignore[assignment]
    try:
        for turn in range(len(made) + 1):
            used.clear()
            took, _ = hf_prefill.prefill_round(model, made, ids, 8, turn=turn)
            assert used[1:len(made) + 1] == list(made)[turn % len(made):] + list(made)[:turn % len(made)]
            assert len(used) == 1 + 3 * len(made) and set(took) == set(made)
    finally:
        hf_prefill.use = real


def test_the_prefill_blocks_benchmark_turns_a_dtypes_blocks_on_and_off_and_compares_whole_prefills() -> None:
    """benchmarks/prefill_blocks.py (the model-level figure behind CAUSAL_BLOCKS): its switch turns one dtype's blocks
    on or off and gives the shipped rule back; a tiny Llama's prefill with a 384-token first chunk (in blocks when on)
    gives both arms' rows, the same last logits within float32 rounding."""
    import prefill_blocks
    import transformers

    from multihead.kernels import sdpa

    shipped = sdpa.causal_blocks
    with prefill_blocks.blocks(torch.float32, False):
        assert not sdpa.causal_blocks(384, torch.float32)
        assert sdpa.causal_blocks(384, torch.bfloat16)  # another dtype: as shipped
    with prefill_blocks.blocks(torch.bfloat16, True):
        assert sdpa.causal_blocks(384, torch.bfloat16) and not sdpa.causal_blocks(600, torch.bfloat16)
    with prefill_blocks.blocks(torch.float64, True):
        assert sdpa.causal_blocks(384, torch.float64)
    assert sdpa.causal_blocks is shipped and shipped(384, torch.float32) and not shipped(384, torch.float64)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    lines = prefill_blocks.rows("tiny", model, torch.float32, 768, 384, 1)
    assert [line.split(" | ")[3] for line in lines] == ["full", "int4"]
    for line in lines:
        cells = line.strip("| ").split(" | ")
        assert float(cells[4]) > 0 and float(cells[5]) > 0 and float(cells[-1]) < 1e-4, line
