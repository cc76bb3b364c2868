"""Residual-stream hook points (hook_resid_pre, hook_attn_out, hook_resid_mid, hook_mlp_out, hook_resid_post) on the
Llama and BERT ports' blocks and on transformers decoder layers through hf.enable: what they read is the stream
recomputed from the block's own modules, a replacement changes the output exactly as recomputing from it does, and
points with no hook run no hook code."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn

from multihead import MultiheadError
from multihead.layers.hooks import RESID_POINTS, HookPoint, hook_points, hooks, run_with_cache
from multihead.layers.linear import linear
from multihead.models.bert import BertConfig, BertEncoder
from multihead.models.llama import LlamaConfig, LlamaModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")

V = 50


def _llama() -> LlamaModel:
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48))
    with torch.no_grad():
        for block in model.layers:
            block.ffn_norm.weight.uniform_(0.5, 1.5)
        model.norm.weight.uniform_(0.5, 1.5)
    return model.eval()


def _hf(model_type: str = "llama", *, enable: bool = True, **fields: Any) -> nn.Module:
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[model_type]
    config = getattr(transformers, classes[0])(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64, **fields)
    torch.manual_seed(0)
    model = getattr(transformers, classes[1])._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # weights large enough that every part matters
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.2)
    from multihead import hf

    return hf.enable(model) if enable else model


def _ids(seed: int = 1) -> Tensor:
    return torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(seed))


def _blocks(model: nn.Module) -> list[Any]:
    base: Any = getattr(model, "model", model)
    return list(base.layers)


def test_every_block_has_the_five_points_by_name_on_ports_and_transformers_models() -> None:
    bert = BertEncoder(BertConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, ffn_dim=48))
    for model, prefix in ((_llama(), "layers"), (bert, "layers"), (_hf(), "model.layers")):
        names = hook_points(model)
        for i in range(2):
            for point in RESID_POINTS:
                assert isinstance(names[f"{prefix}.{i}.{point}"], HookPoint)
                assert names[f"{prefix}.{i}.{point}"].role == point
    from multihead import hf

    other = _hf(enable=False)
    other.config.model_type = "gpt_neox"  # a family whose layers run attention and MLP side by side: not read
    assert hf.decoder_layers(other) == {}
    assert not [n for n in hook_points(hf.enable(other)) if "resid" in n]


def test_llama_port_points_read_the_stream_its_modules_compute() -> None:
    model, ids = _llama(), _ids()
    with torch.no_grad():
        logits, cache = run_with_cache(model, ids)
        h = model.embed(ids)
        for i, block in enumerate(model.layers):
            torch.testing.assert_close(cache[f"layers.{i}.hook_resid_pre"], h, rtol=0, atol=0)
            a = cache[f"layers.{i}.hook_attn_out"]
            torch.testing.assert_close(a, cache[f"layers.{i}.attn.hook_out"], rtol=0, atol=0)
            mid = h + a
            torch.testing.assert_close(cache[f"layers.{i}.hook_resid_mid"], mid, rtol=0, atol=0)
            x = block.ffn_norm(mid)
            m = block.down_proj(F.silu(block.gate_proj(x)) * block.up_proj(x))
            torch.testing.assert_close(cache[f"layers.{i}.hook_mlp_out"], m, rtol=0, atol=0)
            h = mid + m
            torch.testing.assert_close(cache[f"layers.{i}.hook_resid_post"], h, rtol=0, atol=0)
        torch.testing.assert_close(logits, linear(model.norm(h), model.embed.weight), rtol=0, atol=0)


def _replacements_change_the_output_as_recomputing_does(model: nn.Module, run: Any, prefix: str, embed: Any,
                                                        final: Any, mlp: Any, o_proj: str, down_proj: str) -> None:
    ids, other = _ids(1), _ids(2)
    with torch.no_grad():
        # block 0's input replaced by another prompt's embeddings: the model runs that prompt
        swap = {f"{prefix}.0.hook_resid_pre": lambda x, p: embed(other)}
        with hooks(model, swap):
            torch.testing.assert_close(run(ids), run(other), rtol=1e-5, atol=1e-5)
        # the last block's stream replaced: what follows is recomputed from it
        new = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
        with hooks(model, {f"{prefix}.1.hook_resid_post": lambda x, p: new}):
            torch.testing.assert_close(run(ids), final(new), rtol=1e-5, atol=1e-5)
        with hooks(model, {f"{prefix}.1.hook_resid_mid": lambda x, p: new}):
            torch.testing.assert_close(run(ids), final(new + mlp(new)), rtol=1e-5, atol=1e-5)
        # a sublayer's output zeroed: the block without that sublayer's output projection
        for point, weight in (("hook_attn_out", o_proj), ("hook_mlp_out", down_proj)):
            edited = copy.deepcopy(model)
            for block in _blocks(edited)[:1]:
                proj = block.get_submodule(weight)
                proj.weight.zero_()
                if proj.bias is not None:
                    proj.bias.zero_()
            with hooks(model, {f"{prefix}.0.{point}": lambda x, p: torch.zeros_like(x)}):
                torch.testing.assert_close(run(ids), _rerun(edited, ids), rtol=1e-5, atol=1e-5)


def _rerun(model: nn.Module, ids: Tensor) -> Tensor:
    out: Any = model(ids)
    return out.logits if hasattr(out, "logits") else out


def test_llama_port_replacements_change_the_output_as_recomputing_does() -> None:
    model = _llama()
    last = model.layers[1]

    def mlp(x: Tensor) -> Tensor:
        n = last.ffn_norm(x)
        out: Tensor = last.down_proj(F.silu(last.gate_proj(n)) * last.up_proj(n))
        return out

    _replacements_change_the_output_as_recomputing_does(
        model, lambda ids: _rerun(model, ids), "layers", model.embed,
        lambda x: linear(model.norm(x), model.embed.weight), mlp, "attn.o_proj", "down_proj")


@pytest.mark.parametrize("model_type", ["llama", "qwen2"], ids=["llama-gqa", "qwen2-qkv-bias"])
def test_transformers_points_read_the_stream_and_replacements_act_as_recomputing(model_type: str) -> None:
    fields = {"attention_bias": True, "mlp_bias": True} if model_type == "llama" else {}
    model = _hf(model_type, **fields)
    base: Any = model.model
    ids = _ids()
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        logits, cache = run_with_cache(model, ids)
    torch.testing.assert_close(logits.logits, out.logits, rtol=0, atol=0)  # reading changes nothing
    torch.testing.assert_close(cache["model.layers.0.hook_resid_pre"], out.hidden_states[0], rtol=0, atol=0)
    torch.testing.assert_close(cache["model.layers.0.hook_resid_post"], out.hidden_states[1], rtol=0, atol=0)
    for i, block in enumerate(base.layers):
        c = {p: cache[f"model.layers.{i}.{p}"] for p in RESID_POINTS}
        torch.testing.assert_close(c["hook_attn_out"], cache[f"model.layers.{i}.self_attn.hook_out"], rtol=0, atol=0)
        torch.testing.assert_close(c["hook_resid_mid"], c["hook_resid_pre"] + c["hook_attn_out"], rtol=0, atol=0)
        with torch.no_grad():
            mlp = block.mlp(block.post_attention_layernorm(c["hook_resid_mid"]))
        torch.testing.assert_close(c["hook_mlp_out"], mlp, rtol=0, atol=0)
        torch.testing.assert_close(c["hook_resid_post"], c["hook_resid_mid"] + c["hook_mlp_out"], rtol=0, atol=0)
        if i:
            torch.testing.assert_close(c["hook_resid_pre"], cache[f"model.layers.{i - 1}.hook_resid_post"],
                                       rtol=0, atol=0)
    last = base.layers[1]
    _replacements_change_the_output_as_recomputing_does(
        model, lambda ids: _rerun(model, ids), "model.layers", base.embed_tokens,
        lambda x: model.lm_head(base.norm(x)), lambda x: last.mlp(last.post_attention_layernorm(x)),
        "self_attn.o_proj", "mlp.down_proj")


def test_bert_port_points_sit_before_each_post_layernorm() -> None:
    torch.manual_seed(0)
    model = BertEncoder(BertConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, ffn_dim=48)).eval()
    ids = _ids()
    with torch.no_grad():
        out, cache = run_with_cache(model, ids)
        for i, layer in enumerate(model.layers):
            c = {p: cache[f"layers.{i}.{p}"] for p in RESID_POINTS}
            torch.testing.assert_close(c["hook_resid_mid"], c["hook_resid_pre"] + c["hook_attn_out"], rtol=0, atol=0)
            normed = layer.attn_norm(c["hook_resid_mid"])
            mlp = layer.ffn_out(layer.act(layer.ffn_in(normed)))
            torch.testing.assert_close(c["hook_mlp_out"], mlp, rtol=0, atol=0)
            torch.testing.assert_close(c["hook_resid_post"], normed + mlp, rtol=0, atol=0)
            following = cache[f"layers.{i + 1}.hook_resid_pre"] if i + 1 < 2 else out
            torch.testing.assert_close(following, layer.ffn_norm(c["hook_resid_post"]), rtol=0, atol=0)
        new = torch.randn(2, 6, 32)
        with hooks(model, {"layers.1.hook_resid_post": lambda x, p: new}):
            torch.testing.assert_close(model(ids), model.layers[1].ffn_norm(new), rtol=0, atol=0)


def test_points_with_no_hook_run_no_hook_code(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = HookPoint.forward

    def counted(self: HookPoint, x: Tensor) -> Tensor:
        calls.append(self.name)
        return original(self, x)

    monkeypatch.setattr(HookPoint, "forward", counted)
    llama, hf_model, ids = _llama(), _hf(), _ids()
    bert = BertEncoder(BertConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, ffn_dim=48)).eval()
    with torch.no_grad():
        before = [llama(ids), hf_model(ids).logits, bert(ids)]
        assert calls == []
        # a hook that returns None on every point: called at each, the outputs bitwise unchanged
        for model, out in zip((llama, hf_model, bert), before, strict=True):
            with hooks(model, {"*.hook_resid_*": lambda x, p: None, "*_out": lambda x, p: None}):
                after = _rerun(model, ids)
            torch.testing.assert_close(after, out, rtol=0, atol=0)
    assert len(calls) == 3 * 2 * 6  # three models, two blocks, five points + the attention's hook_out


def test_a_bad_replacement_names_the_point() -> None:
    model, ids = _llama(), _ids()
    with hooks(model, {"layers.1.hook_resid_mid": lambda x, p: x[:, :1]}), \
            pytest.raises(MultiheadError, match=r"layers\.1\.hook_resid_mid .*shape"):
        model(ids)
