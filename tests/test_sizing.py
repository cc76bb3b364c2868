"""Whole-model sizing: every parameter count against transformers' own models, the shipped checkpoints and
published totals; weight bytes against a real GGUF file; the fit answer of `multihead count`."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from multihead import MultiheadError
from multihead.cli import main
from multihead.sizing import GGML_TYPES, GGUF_BITS, model_size, weight_bytes
from multihead.sizing.presets import from_hf_dict, preset

SMALL = {"vocab_size": 101, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def _tiny_models():  # type: ignore[no-untyped-def]
    t = transformers
    yield "llama, untied", t.LlamaConfig(**SMALL, tie_word_embeddings=False), t.LlamaForCausalLM
    yield "llama, tied", t.LlamaConfig(**SMALL, tie_word_embeddings=True), t.LlamaForCausalLM
    yield "qwen2 (q/k/v biases)", t.Qwen2Config(**SMALL, tie_word_embeddings=False), t.Qwen2ForCausalLM
    yield "gemma (tied, head_dim)", t.GemmaConfig(**SMALL, head_dim=32), t.GemmaForCausalLM
    yield "mistral", t.MistralConfig(**SMALL, sliding_window=16), t.MistralForCausalLM
    yield "gpt2", t.GPT2Config(vocab_size=101, n_embd=64, n_layer=3, n_head=4, n_positions=128), t.GPT2LMHeadModel
    yield "bert", t.BertConfig(vocab_size=101, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                               intermediate_size=96, max_position_embeddings=128), t.BertModel
    yield "falcon-7b style", t.FalconConfig(vocab_size=101, hidden_size=64, num_hidden_layers=3,
                                            num_attention_heads=4, multi_query=True, parallel_attn=True,
                                            new_decoder_architecture=False, bias=False), t.FalconForCausalLM
    yield "mixtral (MoE)", t.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2), \
        t.MixtralForCausalLM
    yield "qwen2-moe (MoE, shared expert)", t.Qwen2MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=32,
                                                             shared_expert_intermediate_size=48,
                                                             tie_word_embeddings=False), t.Qwen2MoeForCausalLM
    yield "deepseek-v3 (MLA, MoE)", t.DeepseekV3Config(
        vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=12, qk_nope_head_dim=16), t.DeepseekV3ForCausalLM


@pytest.mark.parametrize(("name", "config", "cls"), list(_tiny_models()), ids=lambda v: v if isinstance(v, str)
                         else "")
def test_the_count_equals_transformers_own_model(name: str, config, cls) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = cls(config)
    ours = model_size(from_hf_dict(config.to_dict(), name=name))
    assert ours.total == sum(p.numel() for p in model.parameters()), ours.parts
    if "MoE" in name:
        assert ours.active < ours.total
        if name.startswith("mixtral"):
            expert = 3 * 64 * 96
            assert ours.active == ours.total - 3 * (4 - 2) * expert  # 3 layers, 2 of 4 experts unused per token


@pytest.mark.parametrize(("name", "published"), [
    ("gpt2", 124_439_808), ("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496),
    ("mistral-7b", 7_241_732_096), ("llama-2-7b", 6_738_415_616), ("falcon-7b", 6_921_720_704),
    ("deepseek-v3", 671_026_419_200),
    # issue 52 item 5: Llama 3.1, 3.2 and 3.3 (the totals of their published safetensors)
    ("llama-3.1-8b", 8_030_261_248), ("llama-3.1-70b", 70_553_706_496), ("llama-3.1-405b", 405_853_388_800),
    ("llama-3.2-1b", 1_235_814_400), ("llama-3.2-3b", 3_212_749_824), ("llama-3.3-70b", 70_553_706_496),
])
def test_published_totals(name: str, published: int) -> None:
    assert model_size(preset(name)).total == pytest.approx(published, rel=1e-3)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "llama-3.2-1b", "llama-3.2-3b",
                                  "llama-3.3-70b"])
def test_llama_3_1_to_3_3_are_made_for_128k(name: str) -> None:
    """Their model cards' 128K context: max_position_embeddings, which the llama3 rope scaling's factor times 8,192
    does not stretch further (3.2's factor 32 would claim 262,144)."""
    from multihead.sizing import context_limit
    from multihead.sizing.presets import published

    _, cfg = published(name)
    assert context_limit(preset(name)) == cfg["max_position_embeddings"] == 128 * 1024
    assert cfg["rope_scaling"]["rope_type"] == "llama3"


def test_deepseek_v3_is_671b_total_and_about_37b_active() -> None:
    size = model_size(preset("deepseek-v3"))
    assert 36e9 < size.active < 38e9 and size.notes  # the multi-token-prediction layer is left out, and said so


@pytest.mark.slow
def test_the_shipped_checkpoints_hold_the_counted_parameters() -> None:
    from multihead.models.gguf_file import GGUFFile
    from multihead.models.loaders import default_gguf_path, default_minilm_dir, read_safetensors, safetensors_files

    minilm = read_safetensors(safetensors_files(default_minilm_dir()))
    params = sum(t.numel() for k, t in minilm.items() if not k.endswith("position_ids"))  # a buffer, not a weight
    assert params == model_size(preset("all-minilm-l6-v2")).total
    gguf = GGUFFile(default_gguf_path())
    elements = sum(int(torch.tensor(t.shape).prod()) for t in gguf.tensors.values())
    assert elements == model_size(preset("smollm2-135m")).total  # tied: no separate output.weight in the file
    # llama.cpp's bits per weight of each type reproduce every tensor's bytes in the file, scales included
    for t in gguf.tensors.values():
        n = int(torch.tensor(t.shape).prod())
        assert n * GGUF_BITS[GGML_TYPES[t.ggml_type]] / 8 == t.nbytes, t.name
    data = sum(t.nbytes for t in gguf.tensors.values())
    assert 0 < gguf.path.stat().st_size - data < 2 * 2**20  # the rest is metadata (the tokenizer's vocabulary)
    # all-Q4_1 would be 84 MB; the file keeps its embedding in Q8_0 and the norms in F32
    assert weight_bytes(elements, "q4_1") < data < weight_bytes(elements, "q8_0")


def test_count_says_llama_3_70b_does_not_fit_in_80gib_and_how_many_devices_it_needs(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["count", "--preset", "llama-3-70b", "--seq", "8192", "--device-memory", "80GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no: the weights alone do not fit; it needs 2 devices of that size (--tp 2)" in out
    assert "70,553,706,496" in out and "KV cache alone" in out
    assert main([*argv, "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["whole_model"]
    assert w["total_parameters"] == w["active_parameters"] == 70_553_706_496
    assert w["weight_bytes"] == 2 * 70_553_706_496 and w["kv_bytes"] == 80 * 2 * 8 * 128 * 2 * 8192
    assert w["fits"] is False and w["devices_needed"] == 2 and w["activation_bytes"] > 0
    assert main([*argv, "--tp", "2", "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["whole_model"]
    assert w["fits"] and w["largest_context"] >= 8192 and w["largest_batch"] >= 1
    assert w["bytes_per_device"] < w["weight_bytes"]


def test_count_fit_of_a_small_model_names_the_largest_context_and_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["count", "--preset", "smollm2-135m", "--seq", "4096", "--device-memory", "8GiB",
                 "--weights-dtype", "q4_1", "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["whole_model"]
    assert w["fits"] and w["weight_bytes"] == weight_bytes(134_515_008, "q4_1")
    assert w["largest_batch"] > 1 and w["largest_context"] > 4096
    assert main(["count", "--preset", "deepseek-v3", "--seq", "4096", "--device-memory", "141GB", "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["whole_model"]
    assert w["active_parameters"] < w["total_parameters"] and w["fits"] is False


@pytest.mark.parametrize(("argv", "message"), [
    (["--tp", "3"], "--tp 3 must divide the 64 query heads and divide, or be a multiple of, the 8 KV heads "
                    "(fewer KV heads than devices are replicated, as vLLM does): choose one of 1, 2, 4, 8, 16, 32, 64"),
    (["--cache", "latent"], "has no latent attention"),
    (["--weights-dtype", "q9"], "weight dtype 'q9' is unknown"),
    (["--cache", "window:x"], "window:N"),
])
def test_bad_sizing_flags_are_one_line_errors(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["count", "--preset", "llama-3-70b", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_model_type_not_counted_is_said_by_name() -> None:
    with pytest.raises(MultiheadError, match="model_type 'rwkv' is not counted yet"):
        model_size(from_hf_dict({"model_type": "rwkv", "hidden_size": 64, "num_attention_heads": 4,
                                 "num_hidden_layers": 2, "vocab_size": 10}))


def test_compare_puts_the_weights_beside_the_cache(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert main(["compare", "--preset", "llama-3-8b", "--seq", "8192", "--device-memory", "24GiB",
                 "--plot", str(tmp_path / "c.png"), "--json"]) == 0
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["variants"]}
    model = rows["GQA-8"]
    assert model["weight_bytes"] == weight_bytes(8_030_261_248, "bf16")
    # count's fit model: beside the weights, each token costs its KV (2 K/V x 8 heads x 128 x 2 B x 32 layers) and
    # its prefill activations (D 4096 + 3 x 14336 for the MLP's gate, up and product, 2 B each), plus the last
    # position's logits in float32; the model's own context (8,192) caps the answer
    room = 24 * 2**30 - model["weight_bytes"] - 128256 * 4
    assert model["max_context_by_memory"] == room // (32 * 2 * 8 * 128 * 2 + (4096 + 3 * 14336) * 2)
    assert model["max_context"] == 8192
    assert rows["MHA"]["weight_bytes"] > model["weight_bytes"] > rows["MQA"]["weight_bytes"]  # K/V projections
