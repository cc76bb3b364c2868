"""multihead as a transformers attention implementation: tiny random models of many architectures, built from
transformers' own config classes (nothing from a hub), give the logits of attn_implementation="eager" with left and
right padding, and the same greedy tokens with dynamic and static caches; the kernels' softcap and sinks against the
float64 oracle; bad input."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from torch import nn

from multihead import MultiheadError, hf
from multihead.cache import DenseKV
from multihead.kernels import AttentionCall, attend
from multihead.layers.hooks import hook_points, run_with_cache
from multihead.layers.masks import build_mask
from multihead.verify.reference import Weights, multihead_attention
from tests_support import aten_ops

os.environ.setdefault("HF_HUB_OFFLINE", "1")

V = 97  # vocabulary of the tiny models


def _decoder(config_cls: str, model_cls: str, **fields: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        base = {"vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
        base.update(fields)
        config = getattr(transformers, config_cls)(**{k: v for k, v in base.items() if v is not None})
        return getattr(transformers, model_cls)._from_config(config, attn_implementation="eager")
    return build


# architecture -> (builder, what it exercises)
DECODERS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "llama": (_decoder("LlamaConfig", "LlamaForCausalLM"), "GQA, RoPE"),
    "mistral": (_decoder("MistralConfig", "MistralForCausalLM", sliding_window=6), "sliding window 6"),
    "qwen2": (_decoder("Qwen2Config", "Qwen2ForCausalLM"), "q/k/v biases"),
    "qwen3": (_decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=16), "q/k norms"),
    "gemma2": (_decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=6,
                        attn_logit_softcapping=2.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16),
               "softcap 2.0 (strong enough to matter), alternating sliding window 6"),
    "gemma3": (_decoder("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16, sliding_window=6,
                        query_pre_attn_scalar=16), "q/k norms, alternating sliding window 6"),
    "phi3": (_decoder("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=4), "fused qkv projection"),
    "gpt2": (_decoder("GPT2Config", "GPT2LMHeadModel", n_embd=64, n_layer=2, n_head=4, n_positions=128,
                      hidden_size=None, intermediate_size=None, num_hidden_layers=None, num_attention_heads=None,
                      num_key_value_heads=None, max_position_embeddings=None), "MHA, learned positions"),
    "gpt_neox": (_decoder("GPTNeoXConfig", "GPTNeoXForCausalLM", num_key_value_heads=None,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.25}), "partial rotary (1/4)"),
    "olmo2": (_decoder("Olmo2Config", "Olmo2ForCausalLM"), "q/k norms over all heads"),
    "deepseek_v3": (_decoder("DeepseekV3Config", "DeepseekV3ForCausalLM", num_key_value_heads=4, q_lora_rank=32,
                             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                             moe_intermediate_size=32, first_k_dense_replace=1),
                    "MLA: q/k head_dim 24, value head_dim 12"),
    "falcon": (_decoder("FalconConfig", "FalconForCausalLM", new_decoder_architecture=True, num_kv_heads=2,
                        intermediate_size=None, num_key_value_heads=None, max_position_embeddings=None),
               "Falcon's fused qkv, new decoder architecture (on the interface since transformers 5.25)"),
    "gpt_oss": (_decoder("GptOssConfig", "GptOssForCausalLM", head_dim=16, num_local_experts=4,
                         num_experts_per_tok=2, sliding_window=6), "learned sinks (s_aux), sliding window"),
}


def _padded_batch(s: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences: the first left-padded by 3, the second right-padded by 4."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (2, s), generator=gen)
    mask = torch.ones(2, s, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -4:] = 0
    ids[mask == 0] = 0
    return ids, mask


def _perturb_sinks(model: nn.Module) -> None:
    """gpt-oss's sinks start at zero: give them values that matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.linspace(-1.0, 2.0, p.numel()))


@pytest.mark.parametrize("arch", list(DECODERS))
def test_a_decoder_gives_the_eager_logits_and_tokens(arch: str) -> None:
    torch.manual_seed(0)
    model = DECODERS[arch][0]().eval()
    _perturb_sinks(model)
    ids, mask = _padded_batch()
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits
        eager_tokens = {kind: model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                             cache_implementation=kind, pad_token_id=0)
                        for kind in ("dynamic", "static")}
    hf.enable(model)
    assert model.config._attn_implementation == "multihead"
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
        real = mask.bool()
        torch.testing.assert_close(ours[real], eager[real], rtol=1e-5, atol=1e-5 * float(eager.abs().max()))
        for kind, want in eager_tokens.items():
            got = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                 cache_implementation=kind, pad_token_id=0)
            assert torch.equal(got, want), kind
    points = hook_points(model)
    n_layers = model.config.num_hidden_layers
    assert len([n for n in points if n.endswith("hook_k")]) == n_layers


class _Adapted(nn.Linear):
    """A user's own linear (an adapter's, a quantized one): enable leaves its class alone."""


@pytest.mark.usefixtures("two_threads")  # the split product forced where a decode row's product may choose
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_enable_runs_our_products_on_the_linears_and_gives_them_back(dtype: torch.dtype) -> None:
    from multihead.layers.linear import Linear

    torch.manual_seed(0)
    # widths at which the decode step's products may choose their kind (weights of >= SPLIT_MIN_WEIGHT elements)
    model = _decoder("LlamaConfig", "LlamaForCausalLM", hidden_size=256, intermediate_size=512)().eval().to(dtype)
    model.model.layers[1].mlp.down_proj.__class__ = _Adapted
    plain = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    storage = {k: v.data_ptr() for k, v in model.state_dict().items()}
    ids = torch.randint(3, V, (1, 12), generator=torch.Generator().manual_seed(1))

    def decode() -> tuple[torch.Tensor, list[str]]:
        """Logits of a 6-token prefill, then one token a step (the rows the products choose for)."""
        model.set_attn_implementation("sdpa")  # transformers' attention on both sides: only the products differ
        cache = transformers.DynamicCache(config=model.config)
        out = []
        with torch.no_grad(), aten_ops() as ops:
            out.append(model(ids[:, :6], cache=cache).logits[:, -1])
            for i in range(6, 12):
                out.append(model(ids[:, i:i + 1], cache=cache).logits[:, -1])
        return torch.stack(out), ops.names

    hf.enable(model, products=False)
    assert {n for n, m in model.named_modules() if type(m) is nn.Linear} == plain
    theirs, their_ops = decode()
    hf.enable(model)  # products=True, the default
    mine = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert {n for n, m in mine.items() if type(m) is Linear} == plain  # the user's own subclass is left alone
    assert type(mine["model.layers.1.mlp.down_proj"]) is _Adapted
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == storage  # the same weights, no copy
    ours, our_ops = decode()
    assert "bmm.default" in our_ops and "bmm.default" not in their_ops  # the split product ran, and only with ours
    scale = float(theirs.float().abs().max())
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the same sums in another order, rounded to the dtype
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=tol * scale)
    with pytest.raises(MultiheadError, match=r"products='no': give True .* or False"):
        hf.enable(model, products="no")  # type: ignore[arg-type]
    assert hf.switch_products(model, False) == len(plain)
    assert {n for n, m in model.named_modules() if type(m) is nn.Linear} == plain
    assert hf.switch_products(model, False) == 0


def test_keys_stay_n_kv_heads_wide_into_the_kernel_with_a_padding_mask() -> None:
    model = hf.enable(DECODERS["llama"][0]().eval())
    ids, mask = _padded_batch()
    with torch.no_grad():
        _, cache = run_with_cache(model, ids, attention_mask=mask, names=["*.layers.0.*"])
    assert cache["model.layers.0.self_attn.hook_k"].shape == (2, 2, 12, 16)  # 2 KV heads, not 4
    assert cache["model.layers.0.self_attn.hook_pattern"].shape == (2, 4, 12, 12)
    assert cache["model.layers.0.self_attn.hook_z"].shape == (2, 4, 12, 16)
    # the pattern is exact: transformers' own eager weights
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(ids, attention_mask=mask, output_attentions=True).attentions[0]
    real = mask.bool()[:, :, None] & mask.bool()[:, None, :]  # rows and columns of real tokens
    got = cache["model.layers.0.self_attn.hook_pattern"]
    torch.testing.assert_close(got.permute(0, 2, 3, 1)[real], want.permute(0, 2, 3, 1)[real], atol=1e-6, rtol=0)


def test_an_encoder_gives_the_eager_hidden_states() -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=64)
    model = transformers.BertModel._from_config(config, attn_implementation="eager").eval()
    ids, mask = _padded_batch()
    mask[0] = 1  # an encoder is right-padded
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).last_hidden_state
        hf.enable(model)
        ours = model(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(ours[real], eager[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["bart", "t5"])
def test_an_encoder_decoder_gives_the_eager_logits_and_tokens(arch: str) -> None:
    torch.manual_seed(0)
    if arch == "bart":
        config = transformers.BartConfig(vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2,
                                         encoder_attention_heads=4, decoder_attention_heads=4,
                                         encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                         decoder_start_token_id=2, forced_eos_token_id=None)
        model = transformers.BartForConditionalGeneration._from_config(config, attn_implementation="eager")
    else:
        config = transformers.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
                                       pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)
        model = transformers.T5ForConditionalGeneration._from_config(config, attn_implementation="eager")
    model.eval()
    ids, mask = _padded_batch()
    mask[0] = 1
    decoder_ids = torch.tensor([[config.decoder_start_token_id, 5, 6, 7]] * 2)
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        want = model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        hf.enable(model)
        ours = model(ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        got = model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5 * float(eager.abs().max()))
    assert torch.equal(got, want)


def test_architectures_without_the_interface_are_refused_by_name() -> None:
    """BLOOM writes its ALiBi attention inline (Falcon did too until transformers 5.25 moved it to the interface)."""
    config = transformers.BloomConfig(vocab_size=V, hidden_size=64, n_layer=1, n_head=4)
    model = transformers.BloomForCausalLM(config)
    assert not model._can_set_attn_implementation()  # transformers' own word: no attention interface
    with pytest.raises(MultiheadError, match="BloomForCausalLM does not call transformers' attention interface"):
        hf.enable(model)
    with pytest.raises(MultiheadError, match="is not a transformers model"):
        hf.enable(nn.Linear(2, 2))


def test_unsupported_keywords_are_refused_by_name() -> None:
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(MultiheadError, match="passed 'cu_seq_lens_q' to the attention function"):
        hf.attention_forward(nn.Module(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 3]))
    with pytest.raises(MultiheadError, match="passed 'head_mask' to the attention function"):
        hf.attention_forward(nn.Module(), q, q, q, None, head_mask=torch.ones(4))  # it would change the result


def test_bad_model_paths(tmp_path: Any) -> None:
    with pytest.raises(MultiheadError, match="does not exist"):
        hf.load(tmp_path / "nothing")
    with pytest.raises(MultiheadError, match=r"has no config\.json"):
        hf.load(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(MultiheadError, match="has no weights"):
        hf.load(tmp_path)
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(MultiheadError, match=r"not a \.gguf"):
        hf.load(tmp_path / "x.txt")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(MultiheadError, match=r"transformers could not load '.*bad\.gguf'"):
        hf.load(bad)


def test_the_heads_command_refuses_an_unreadable_model_and_writes_nothing(tmp_path: Any,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.cli import main

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(200)))
    out = tmp_path / "out"
    assert main(["heads", "--model", str(bad), "--engine", "transformers", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "bad.gguf" in err and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())


# ---------------------------------------------------------------------------------------------- softcap and sinks
def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, **options: Any
            ) -> np.ndarray:
    """The float64 oracle on q, k, v themselves: identity projections (cross-attention, so q, k, v are separate)."""
    from multihead import AttentionConfig

    b, h, s, d = q.shape
    g, t = k.shape[1], k.shape[2]
    config = AttentionConfig(d_model=h * d, n_heads=h, n_kv_heads=g, kv_dim=g * d, value_dim=g * d, scale=scale,
                             bias=False)
    eye = Weights(wq=np.eye(h * d), wk=np.eye(g * d), wv=np.eye(g * d), wo=np.eye(h * d))
    out, _ = multihead_attention(config, eye, q.transpose(1, 2).reshape(b, s, h * d).double().numpy(),
                                 k.transpose(1, 2).reshape(b, t, g * d).double().numpy(),
                                 value=v.transpose(1, 2).reshape(b, t, g * d).double().numpy(), causal=causal,
                                 **options)
    return out.reshape(b, s, h, d).transpose(0, 2, 1, 3)  # type: ignore[no-any-return]


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_and_sinks_match_the_oracle(n_kv_heads: int, causal: bool) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8) * 3, torch.randn(2, n_kv_heads, 6, 8) * 3, torch.randn(2, n_kv_heads, 6, 8)
    spec = build_mask(batch=2, n_heads=4, s=6, t=6, causal=causal)
    sinks = torch.tensor([-1.0, 0.0, 1.5, 3.0])
    for options in ({"softcap": 1.5}, {"sinks": sinks}, {"softcap": 2.0, "sinks": sinks}):
        call = AttentionCall(q.double(), DenseKV(k.double(), v.double()), spec, scale=0.5, **options)  # type: ignore[arg-type]
        got, _ = attend(call)
        ref_options = {k_: (v_.numpy() if isinstance(v_, torch.Tensor) else v_) for k_, v_ in options.items()}
        want = _oracle(q, k, v, 0.5, causal, **ref_options)
        np.testing.assert_allclose(got.numpy(), want, atol=1e-12)
    with pytest.raises(MultiheadError, match=r"backend 'sdpa' cannot cap scores \(softcap\)"):
        attend(AttentionCall(q, DenseKV(k, v), spec, scale=0.5, backend="sdpa", softcap=1.0))
    for backend in ("sdpa", "flex"):
        with pytest.raises(MultiheadError, match=rf"backend '{backend}' cannot take sink logits \(s_aux\)"):
            attend(AttentionCall(q, DenseKV(k, v), spec, scale=0.5, backend=backend, sinks=sinks))


def test_softcap_through_flex_matches_the_oracle() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 128, 16) * 3, torch.randn(1, 2, 128, 16) * 3, torch.randn(1, 2, 128, 16)
    spec = build_mask(batch=1, n_heads=4, s=128, t=128, causal=True)
    with torch.no_grad():
        got, _ = attend(AttentionCall(q, DenseKV(k, v), spec, scale=0.25, backend="flex", softcap=1.5))
    np.testing.assert_allclose(got.numpy(), _oracle(q, k, v, 0.25, True, softcap=1.5), atol=2e-5)


# ---------------------------------------------------------------------------------------------- the real checkpoints
def test_smollm2_from_its_gguf_through_transformers_equals_our_port(smollm2) -> None:  # type: ignore[no-untyped-def]
    """The GGUF read by transformers, attention on multihead: the logits of our own port (1e-4)."""
    from tests_support import smollm2_gguf

    ours, tok = smollm2
    model = hf.load(smollm2_gguf())
    ids = torch.tensor([tok.encode("The capital of France is Paris, and the capital of Italy is")])
    with torch.no_grad():
        theirs = model(ids).logits
        mine = ours(ids)
    torch.testing.assert_close(theirs, mine, atol=1e-4 * float(mine.abs().max()), rtol=1e-4)
    assert len([n for n in hook_points(model) if n.endswith("hook_z")]) == 30


@pytest.mark.slow
def test_minilm_from_its_folder_through_transformers_equals_our_port() -> None:
    from multihead.models import load_sentence_encoder
    from tests_support import minilm_dir

    encoder = load_sentence_encoder()
    model = hf.load(minilm_dir())
    assert type(model).__name__ == "BertModel"
    texts = ["A man is eating food.", "Multi-head attention runs several heads in parallel."]
    ids, valid, _ = encoder.tokenize(texts)
    with torch.no_grad():
        hidden = model(ids, attention_mask=valid.long()).last_hidden_state
    theirs = encoder.pool(hidden, valid)
    torch.testing.assert_close(theirs, encoder.embed(texts), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- head tools on them
TEXT = "The cat sat on the mat because the cat was tired, and the mat was warm."


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "minilm"])
def test_head_scores_through_transformers_equal_those_through_our_ports(name: str) -> None:
    from multihead.heads.adapters import load_head_model
    from multihead.heads.analysis import analyse

    ours = analyse(load_head_model(name, engine="ours"), TEXT, progress=False)
    theirs = analyse(load_head_model(name, engine="transformers"), TEXT, progress=False)
    assert ours.engine == "multihead's own port" and theirs.engine == "transformers, attention on multihead"
    assert theirs.tokens == ours.tokens
    assert set(theirs.scores.scores) == set(ours.scores.scores)
    for score, values in ours.scores.scores.items():
        np.testing.assert_allclose(theirs.scores.scores[score], values, atol=1e-4, rtol=0, err_msg=score)


@pytest.mark.slow
def test_the_heads_command_runs_any_transformers_folder(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny random Qwen2 saved as a folder, with MiniLM's tokenizer files: auto picks transformers (no port of ours
    for Qwen2); ablation and KV pooling run through the hook points."""
    import json
    import shutil

    from multihead.cli import main
    from tests_support import minilm_dir

    folder = tmp_path / "tiny-qwen2"
    config = transformers.Qwen2Config(vocab_size=30522, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm_dir() / name).exists():
            shutil.copy(minilm_dir() / name, folder / name)
    out = tmp_path / "report"
    assert main(["heads", "--model", str(folder), "--text", TEXT, "--ablate", "--convert", "--json",
                 "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["engine"] == "transformers, attention on multihead"
    assert (data["n_layers"], data["n_heads"], data["n_kv_heads"]) == (2, 4, 2)
    assert len(data["heads"]) == 8 and len(data["ablation"]) == 8
    assert [r["n_kv_heads"] for r in data["conversion"]] == [1]
    assert (out / "report.html").is_file()
    assert main(["heads", "--model", str(folder), "--engine", "ours", "--out", str(out)]) == 2
    assert "multihead has no port of it" in capsys.readouterr().err
    assert main(["heads", "--model", "minilm", "--patch", "--out", str(tmp_path / "enc")]) == 2
    assert "not a causal language model" in capsys.readouterr().err
    from multihead import cli
    from multihead.models import route

    assert cli.ENGINES == route.ENGINES
