"""GPT-2 (transformers) through hf.enable: the residual-stream points of its blocks (ln_1, attn, ln_2, mlp) read the
stream its own modules compute; direct logit attribution's parts (LayerNorm with a bias, learned positions, Conv1D
weights) sum to the model's own logit difference and each head's part equals a float64 recomputation from c_proj's
weight; composition scores equal Elhage's formula written out in float64 NumPy from c_attn and c_proj, with ln_1
folded as P diag(gamma), which is ln_1's real linear part."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import transformers
from torch import Tensor, nn

from multihead.heads.attribution import direct_logit_attribution
from multihead.heads.composition import KINDS, circuits, composition_scores
from multihead.layers.hooks import RESID_POINTS, run_with_cache

os.environ.setdefault("HF_HUB_OFFLINE", "1")

V, D, H, S = 50, 32, 4, 6
ANSWERS, WRONGS = [3, 7], [5, 9]


def _gpt2(n_layers: int = 2, *, enable: bool = True) -> nn.Module:
    config = transformers.GPT2Config(vocab_size=V, n_embd=D, n_layer=n_layers, n_head=H, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # GPT-2's init leaves the LayerNorms at (1, 0) and the biases at 0: move them all
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if ".ln_" in name and name.endswith("weight")
                    else torch.randn_like(p) * 0.3)
    from multihead import hf

    return hf.enable(model) if enable else model


def _ids(seed: int = 1) -> Tensor:
    return torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(seed))


def test_gpt2_block_points_read_the_stream_its_modules_compute() -> None:
    model, ids = _gpt2(), _ids()
    base: Any = model.transformer
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        logits, cache = run_with_cache(model, ids)
        torch.testing.assert_close(logits.logits, out.logits, rtol=0, atol=0)
        embed = base.wte(ids) + base.wpe(torch.arange(S))
        torch.testing.assert_close(cache["transformer.h.0.hook_resid_pre"], embed, rtol=0, atol=0)
        for i, block in enumerate(base.h):
            c = {p: cache[f"transformer.h.{i}.{p}"] for p in RESID_POINTS}
            torch.testing.assert_close(c["hook_attn_out"], cache[f"transformer.h.{i}.attn.hook_out"], rtol=0, atol=0)
            torch.testing.assert_close(c["hook_resid_mid"], c["hook_resid_pre"] + c["hook_attn_out"], rtol=0, atol=0)
            torch.testing.assert_close(c["hook_mlp_out"], block.mlp(block.ln_2(c["hook_resid_mid"])), rtol=0, atol=0)
            torch.testing.assert_close(c["hook_resid_post"], c["hook_resid_mid"] + c["hook_mlp_out"], rtol=0, atol=0)
        torch.testing.assert_close(model.lm_head(base.ln_f(cache["transformer.h.1.hook_resid_post"])), out.logits,
                                   rtol=0, atol=0)


def test_gpt2_attribution_parts_sum_to_the_models_own_logit_difference() -> None:
    model, ids = _gpt2(), _ids()
    plain = _gpt2(enable=False)  # the same weights on transformers' own eager attention
    with torch.no_grad():
        real = plain(ids).logits.double()
    a = direct_logit_attribution(model, ids, ANSWERS, WRONGS)
    rows = torch.arange(2)
    expected = real[rows, :, torch.tensor(ANSWERS)] - real[rows, :, torch.tensor(WRONGS)]  # (b, s)
    torch.testing.assert_close(a.logit_diff, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(a.total(), expected, rtol=0, atol=1e-4)
    assert float(a.remainder.abs().max()) < 1e-4
    assert float(a.constant.abs().max()) > 1e-2  # ln_f's beta matters here: it is counted, not lost
    assert any("LayerNorm" in note for note in a.notes)


def test_gpt2_head_parts_equal_a_float64_recomputation_from_c_proj() -> None:
    model, ids = _gpt2(), _ids()
    base: Any = model.transformer
    a = direct_logit_attribution(model, ids, ANSWERS, WRONGS)
    _, cache = run_with_cache(model, ids)
    f64 = torch.float64
    final = cache["transformer.h.1.hook_resid_post"].to(f64)  # (b, s, D)
    centred = final - final.mean(-1, keepdim=True)
    sigma = (centred.pow(2).mean(-1) + base.ln_f.eps).sqrt()  # (b, s)
    unembed = model.lm_head.weight.to(f64)
    u = (unembed[ANSWERS] - unembed[WRONGS]) * base.ln_f.weight.to(f64)  # (b, D)

    def project(x: Tensor) -> Tensor:  # a write (b, s, D) through the frozen ln_f onto u
        x = x - x.mean(-1, keepdim=True)
        return torch.einsum("bsD,bD->bs", x, u) / sigma

    d = D // H
    for layer, block in enumerate(base.h):
        z = cache[f"transformer.h.{layer}.attn.hook_z"].to(f64)  # (b, h, s, d)
        c_proj = block.attn.c_proj
        share = project(c_proj.bias.to(f64).expand(2, S, D)) / H
        for head in range(H):
            write = z[:, head] @ c_proj.weight.to(f64)[head * d:(head + 1) * d]  # Conv1D: x @ W, W (in, out)
            torch.testing.assert_close(a.heads[:, layer, head], project(write) + share, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(a.mlps[:, layer], project(cache[f"transformer.h.{layer}.hook_mlp_out"].to(f64)),
                                   rtol=1e-9, atol=1e-9)
    embed = (base.wte.weight[ids] + base.wpe.weight[:S]).detach().to(f64)  # summed in float32, as the model does
    torch.testing.assert_close(a.embed, project(embed), rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------- composition
def _c(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a @ b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def _elhage_np(model: nn.Module) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """Every (D, D) matrix formed in float64 NumPy from c_attn (D, 3D) and c_proj (D, D), ln_1 as P diag(gamma)."""
    d = D // H
    centring = np.eye(D) - np.ones((D, D)) / D
    layers = []
    for block in model.transformer.h:  # type: ignore[union-attr]
        w = block.attn.c_attn.weight.detach().double().numpy()
        o = block.attn.c_proj.weight.detach().double().numpy()
        n = centring @ np.diag(block.ln_1.weight.detach().double().numpy())
        q, k, v = (n @ w[:, j * D:(j + 1) * D] for j in range(3))
        heads = [(q[:, i * d:(i + 1) * d], k[:, i * d:(i + 1) * d], v[:, i * d:(i + 1) * d], o[i * d:(i + 1) * d])
                 for i in range(H)]
        layers.append(([wq @ wk.T for wq, wk, _, _ in heads], [wv @ wo for _, _, wv, wo in heads]))
    out = {}
    for reader, (qk, ov) in enumerate(layers):
        for writer in range(reader):
            writers = layers[writer][1]
            mats = {"q": qk, "k": [x.T for x in qk], "v": ov, "k_kv": [x.T for x in qk], "v_kv": ov}
            out[(writer, reader)] = {kind: np.array([[_c(a, b) for a in writers] for b in mats[kind]])
                                     for kind in KINDS}
    return out


def test_gpt2_composition_equals_elhages_formula_in_float64_numpy() -> None:
    model = _gpt2(3, enable=False)
    got, expected = composition_scores(model, samples=4), _elhage_np(model)
    assert set(got.pairs) == set(expected)
    for pair, kinds in expected.items():
        for kind in KINDS:
            np.testing.assert_allclose(got.scores(kind, *pair), kinds[kind], rtol=1e-10, atol=1e-12,
                                       err_msg=f"{kind} {pair}")
    assert any("absolute positions" in note for note in got.notes)


def test_gpt2_folded_ln_1_is_its_real_linear_part() -> None:
    """q, k, v of a block's attention, less c_attn's bias and ln_1's beta, are x (P diag(gamma) W) / sigma(x)."""
    model = _gpt2(enable=False)
    block: Any = model.transformer.h[1]
    circ = circuits(model)
    x = torch.randn(5, D, dtype=torch.float64)
    with torch.no_grad():
        ln = nn.LayerNorm(D, eps=block.ln_1.eps).double()
        ln.weight.copy_(block.ln_1.weight)
        ln.bias.zero_()
        qkv = ln(x) @ block.attn.c_attn.weight.double()  # (5, 3D) without the bias
    sigma = (x.var(-1, unbiased=False) + block.ln_1.eps).sqrt()[:, None]
    layer = circ.layers[1]
    for j, folded in enumerate((layer.w_q, layer.w_k, layer.w_v)):  # (h, D, d)
        mine = torch.einsum("nD,hDd->nhd", x, folded).reshape(5, D) / sigma
        torch.testing.assert_close(mine, qkv[:, j * D:(j + 1) * D], rtol=1e-10, atol=1e-10)
    o = block.attn.c_proj.weight.double()  # (h d, D) in Conv1D's (in, out)
    torch.testing.assert_close(layer.w_o.reshape(D, D), o, rtol=0, atol=0)
