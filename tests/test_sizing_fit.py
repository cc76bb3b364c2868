"""The fit model of `multihead count` and `compare` (issue 29): each defect of the issue's list, and count and
compare giving the same context for the same model, memory and flags."""

from __future__ import annotations

import json
import re

import pytest

from multihead import MultiheadError
from multihead.cli import build_parser, main
from multihead.sizing import cost, weight_bytes, whole_model
from multihead.sizing.presets import from_hf_dict, preset


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:  # type: ignore[type-arg]
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_attention_alone_uses_the_cache_kind_of_the_whole_model(capsys: pytest.CaptureFixture[str]) -> None:
    """It said 372,827 tokens for the KV cache alone (bf16) and 483,946 with the weights (int4): alone it must hold
    at least as many, by the int4 cache's own formula."""
    argv = ["count", "--preset", "smollm2-135m", "--weights-dtype", "q4_1", "--cache", "int4", "--device-memory",
            "8GiB"]
    r = _json(argv, capsys)
    alone, whole = r["max_context_by_memory"], r["whole_model"]["largest_context_by_memory"]
    assert alone >= whole
    assert r["max_context_in_device_memory"] == r["context_limit"] == 8192 and r["context_limit_binds"]
    a = preset("smollm2-135m").attention

    def int4(c: int) -> int:
        return cost.quantized_cache_bytes(a, context=c, bits=4, group=32, n_layers=30)

    assert int4(alone) <= 8 * 2**30 < int4(alone + 1)
    assert main(argv) == 0
    assert (f"8,192 tokens (KV cache alone, int4 cache in bf16; the model's own context binds: the memory alone "
            f"would hold {alone:,})") in capsys.readouterr().out


def test_per_device_terms_under_tp_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["count", "--preset", "llama-3-70b", "--seq", "8192", "--device-memory", "80GiB", "--tp", "2"]
    w = _json(argv, capsys)["whole_model"]
    assert (w["weight_bytes_per_device"] + w["kv_bytes_per_device"] + w["activation_bytes_per_device"]
            + w["reserve_bytes"] == w["bytes_per_device"])
    replicated = weight_bytes(2 * 128256 * 8192 + 161 * 8192, "bf16")  # embeddings, LM head, norms: on each device
    assert w["weight_bytes_per_device"] == replicated + (w["weight_bytes"] - replicated) // 2
    assert w["kv_bytes_per_device"] * 2 == w["kv_bytes"] == 80 * 2 * 8 * 128 * 2 * 8192
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory per device (tp 2)"))
    gib = [float(v) * {"GiB": 2**30, "MiB": 2**20}[u] for v, u in re.findall(r"([\d.]+) (GiB|MiB)", line)]
    assert len(gib) == 4 and sum(gib[:3]) == pytest.approx(gib[3], rel=2e-3)  # the left side sums to the right
    sharded = _json([*argv, "--shard-embeddings"], capsys)["whole_model"]
    assert w["weight_bytes_per_device"] - sharded["weight_bytes_per_device"] == weight_bytes(128256 * 8192, "bf16")


@pytest.mark.parametrize("bare", ["80", "80.5", "1e9"])
def test_a_memory_without_a_unit_is_refused(bare: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["count", "--preset", "gpt2", "--device-memory", bare]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device-memory" in err and "add a unit: GiB or GB" in err


def test_both_units_are_shown(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["count", "--preset", "llama-3-8b", "--device-memory", "80GB"]) == 0
    assert "fits in 74.5 GiB (80.0 GB)" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["count", "compare"])
def test_help_says_what_the_memory_holds(command: str) -> None:
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    text = " ".join(sub.choices[command].format_help().split())
    assert "memory for the KV cache" not in text
    assert "memory of one device" in text and "80GiB = 85.9 GB" in text
    assert "--prefill-chunk" in text and "--reserve" in text and "--tp" in text and "--weights-dtype" in text


def test_an_int8_cache_keeps_activations_in_bf16() -> None:
    m = preset("llama-3-8b")
    kw = {"seq": 4096, "batch": 1, "weights_dtype": "bf16"}
    bf16, int8 = whole_model(m, dtype="bf16", **kw), whole_model(m, dtype="int8", **kw)
    assert bf16 is not None and int8 is not None
    assert int8["activation_bytes"] == bf16["activation_bytes"] and int8["activation_dtype"] == "bf16"
    assert int8["kv_bytes"] * 2 == bf16["kv_bytes"]


def test_presets_show_mla(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("deepseek-v3 "))
    assert "(MHA)" not in line and "(MLA)" in line and "latent 512 + rope 64" in line
    data = _json(["presets"], capsys)
    assert data["deepseek-v3"]["mla"]["kv_lora_rank"] == 512 and data["deepseek-v3"]["mla"]["latent_dim"] == 576
    assert data["llama-3-8b"]["mla"] is None


def test_deepseek_v3_json_top_level_is_the_latent_cache(capsys: pytest.CaptureFixture[str]) -> None:
    r = _json(["count", "--preset", "deepseek-v3"], capsys)  # seq 4096
    assert r["kv_cache_bytes_total"] == 61 * 576 * 2 * 4096 == r["mla"]["cache_bytes_total"] == 287_834_112
    assert r["variant"] == "MLA" and r["params_per_layer"] == r["mla"]["params_per_layer"]
    assert r["as_mha"]["kv_cache_bytes_total"] == 61 * 2 * 128 * 128 * 2 * 4096 == 16_374_562_816
    assert r["whole_model"]["kv_bytes"] == r["kv_cache_bytes_total"]


def test_the_models_own_context_caps_the_answer_and_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["count", "--preset", "llama-3-8b", "--seq", "4096", "--device-memory", "24GiB"]
    w = _json(argv, capsys)["whole_model"]
    assert w["largest_context"] == w["context_limit"] == 8192 < w["largest_context_by_memory"]
    assert w["context_limit_binds"] is True
    assert main(argv) == 0
    assert "up to 8,192 tokens at batch 1 (the model's own context caps it; memory alone holds" in \
        capsys.readouterr().out
    # a YaRN rope scaling stretches it: Qwen2.5's recommended factor 4 over 32,768
    qwen = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 32768}}
    assert from_hf_dict(qwen).hf.context_limit == 131072  # type: ignore[union-attr]


@pytest.mark.parametrize("flags", [
    [], ["--tp", "2"], ["--weights-dtype", "q4_1", "--cache", "int8"], ["--prefill-chunk", "512", "--reserve", "10%"],
    ["--tp", "2", "--shard-embeddings", "--reserve", "1GiB"],
], ids=["plain", "tp2", "q4-int8", "chunk-reserve", "tp2-shard"])
def test_count_and_compare_give_the_same_context(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--preset", "llama-3-8b", "--seq", "8192", "--device-memory", "24GiB", *flags]
    w = _json(["count", *common], capsys)["whole_model"]
    c = _json(["compare", *common, "--no-plot"], capsys)
    row = next(v for v in c["variants"] if v["is_model"])
    assert row["max_context"] == w["largest_context"]
    assert row["max_context_by_memory"] == w["largest_context_by_memory"]
    assert c["counted"] == w["counted"]


def test_compare_with_tp_answers_for_llama_2_70b(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's own `compare --preset llama-2-70b --seq 4096 --device-memory 80GiB` printed 0 in every row and
    did not say why; with --tp 2 the model's row fits."""
    argv = ["compare", "--preset", "llama-2-70b", "--seq", "4096", "--device-memory", "80GiB", "--no-plot"]
    assert main(argv) == 0
    assert "not even one token fits beside the weights; try --tp" in capsys.readouterr().out
    rows = {r["variant"]: r for r in _json([*argv, "--tp", "2"], capsys)["variants"]}
    assert rows["GQA-8"]["max_context"] == 4096 and rows["GQA-8"]["max_context_by_memory"] > 4096
    # one KV head over two devices: replicated, as vLLM does (it was n/a), each device holding the whole cache
    assert rows["MQA"]["note"] is None and rows["MQA"]["devices_per_kv_head"] == 2
    assert rows["MQA"]["max_context"] == 4096


def test_hardware_estimates_name_their_bound_and_add_up(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """Issue 29's check: llama-3-70b on two H100s at 8192: per-device terms, the cap, prefill and decode with the
    bound named; each figure against the roofline formula of multihead.sizing.hardware."""
    from multihead.sizing.hardware import HARDWARE

    argv = ["count", "--preset", "llama-3-70b", "--hardware", "h100-80g", "--tp", "2", "--seq", "8192"]
    r = _json(argv, capsys)
    w, e = r["whole_model"], r["estimate"]
    h100 = HARDWARE["h100-80g"]
    assert r["device_memory_bytes"] == h100.memory == 80 * 2**30  # the preset's memory (GiB), no --device-memory
    d = e["decode"]
    weights = weight_bytes(70_553_706_496, "bf16")
    replicated = weight_bytes(2 * 128256 * 8192 + 161 * 8192, "bf16")  # embeddings, LM head, norms: each device's
    assert d["bytes_per_step"] == replicated + (weights - replicated) // 2 + w["kv_bytes"] // 2
    assert d["memory_seconds"] == pytest.approx(d["bytes_per_step"] / (0.8 * 3.35e12))
    assert e["ridge_flops_per_byte"] == pytest.approx(989 / 3.35)
    assert d["bound"] == "memory" and d["arithmetic_intensity"] < e["effective_ridge_flops_per_byte"]
    assert e["effective_ridge_flops_per_byte"] == pytest.approx(0.5 * 989e12 / (0.8 * 3.35e12))
    assert d["step_seconds"] == pytest.approx(d["memory_seconds"] + d["allreduce_seconds"])
    # two all-reduces per layer of 8192 bf16 values, each NCCL's ring latency (6.6 us + 2 steps of 0.6 us over
    # NVLink) and half of its bytes crossing 450 GB/s in a ring of two
    assert d["allreduce_seconds"] == pytest.approx(2 * 80 * (6.6e-6 + 2 * 0.6e-6 + 8192 * 2 / 450e9))
    p = e["prefill"]
    linear = 70_553_706_496 - 2 * 128256 * 8192
    core = 80 * cost.flops(preset("llama-3-70b").attention, s=8192, causal=True).attention
    assert p["flops"] == 2 * linear * 8192 + 2 * 128256 * 8192 + core
    assert p["bound"] == "compute" and p["compute_seconds"] == pytest.approx(p["flops"] / 2 / (0.5 * 989e12))
    assert e["decode_largest_batch"]["batch"] == w["largest_batch"] > 1
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "speed on h100-80g x 2" in out and "memory-bound" in out and "compute-bound" in out
    assert "the model's own context caps it" in out
    png = tmp_path / "roofline.png"
    assert main([*argv, "--plot", str(png)]) == 0 and png.read_bytes()[:4] == b"\x89PNG"
    assert f"roofline                      {png}" in capsys.readouterr().out
    assert main(["count", "--preset", "gpt2", "--plot", str(png)]) == 2
    assert "give --hardware too" in capsys.readouterr().err
    assert _json([*argv, "--device-memory", "40GiB"], capsys)["device_memory_bytes"] == 40 * 2**30


def test_this_machine_is_measured() -> None:
    from multihead.sizing.hardware import hardware, measure_cpu

    cpu = measure_cpu(nbytes=8 * 2**20, n=64)
    assert cpu.verified and cpu.bandwidth > 0 and cpu.flops["fp32"] > 0 and cpu.memory > 2**30
    assert cpu.interconnect == 0 and cpu.ridge("fp32") == cpu.flops["fp32"] / cpu.bandwidth
    with pytest.raises(MultiheadError, match="hardware 'h100' is unknown: choose one of h100-80g"):
        hardware("h100")


def test_layers_are_bounded_before_the_layer_by_layer_count(capsys: pytest.CaptureFixture[str]) -> None:
    """Each layer is one entry of the per-layer description: --layers past MAX_LAYERS (4,096) is refused by the
    parser, for a preset too (the preset path took any count before)."""
    assert main(["count", "--preset", "gpt2", "--layers", "1000000000000"]) == 2
    assert "argument --layers: 1,000,000,000,000 must be a number of layers (from 1 to 4,096)" in \
        capsys.readouterr().err
    assert _json(["count", "--preset", "mistral-7b", "--layers", "3"], capsys)["layer_kinds"] == "3 sliding 4096"
