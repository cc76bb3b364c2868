"""Composition scores (Elhage et al. 2021) against Elhage's formula written out in float64 NumPy on (D, D) matrices
read straight from the parameters; the norm fold against the modules' own forward; GQA against the MHA model whose
KV heads were repeated; a transformers Llama and BERT against our ports carrying the same weights; the random
baseline against independent draws; bad input."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from torch import Tensor, nn

from multihead import MultiheadError
from multihead.heads.composition import KINDS, circuits, composition_score, composition_scores, random_baseline
from multihead.models.bert import BertConfig, BertEncoder
from multihead.models.llama import LlamaConfig, LlamaModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
D, H, D_HEAD = 32, 4, 8


def _np(t: Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def _randomise_norms(model: nn.Module, generator: torch.Generator) -> None:
    """Norm weights (and biases) away from their init, so that folding them matters."""
    with torch.no_grad():
        for module in model.modules():
            if "norm" in type(module).__name__.lower():
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=generator))
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(torch.randn(module.bias.shape, generator=generator))


def _llama(n_kv_heads: int, n_layers: int = 3, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(LlamaConfig(vocab_size=40, d_model=D, n_layers=n_layers, n_heads=H, n_kv_heads=n_kv_heads,
                                   ffn_dim=48, head_dim=D_HEAD))
    _randomise_norms(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


# ---------------------------------------------------------------------------------------------- the float64 oracle
def _heads_np(q: Tensor, k: Tensor, v: Tensor, o: Tensor, h: int, g: int, gamma: np.ndarray | None
              ) -> tuple[list[np.ndarray], ...]:
    """nn.Linear weights (out, in) -> per-head W_Q^i, W_K^j, W_V^j (D, d) with diag(gamma) on the left, W_O^i (d, D)."""
    d = q.shape[0] // h
    n = np.eye(q.shape[1]) if gamma is None else np.diag(gamma)
    wq, wk, wv, wo = _np(q), _np(k), _np(v), _np(o)
    return ([n @ wq[i * d:(i + 1) * d].T for i in range(h)], [n @ wk[j * d:(j + 1) * d].T for j in range(g)],
            [n @ wv[j * d:(j + 1) * d].T for j in range(g)], [wo[:, i * d:(i + 1) * d].T for i in range(h)])


def _c(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a @ b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def _oracle(layers: list[tuple[list[np.ndarray], ...]], path: Any = None) -> dict[tuple[int, int], dict[str, Any]]:
    """Elhage's scores with every (D, D) matrix formed: W_OV^w T against W_QK^i, W_QK^i^T, W_OV^i, and per KV head
    against the group's matrices side by side."""
    out = {}
    for m, (wq, wk, wv, wo) in enumerate(layers):
        h, g = len(wq), len(wk)
        r = h // g
        qk = [wq[i] @ wk[i // r].T for i in range(h)]
        ov = [wv[i // r] @ wo[i] for i in range(h)]
        for w_layer in range(m):
            pq, pk, pv, po = layers[w_layer]
            rw = len(pq) // len(pk)
            t = np.eye(qk[0].shape[0]) if path is None else path(w_layer, m)
            writers = [pv[w // rw] @ po[w] @ t for w in range(len(pq))]
            scores = {kind: np.array([[_c(a, b) for a in writers] for b in mats]) for kind, mats in
                      (("q", qk), ("k", [x.T for x in qk]), ("v", ov),
                       ("k_kv", [np.concatenate([qk[i].T for i in range(j * r, (j + 1) * r)], 1) for j in range(g)]),
                       ("v_kv", [np.concatenate([ov[i] for i in range(j * r, (j + 1) * r)], 1) for j in range(g)]))}
            out[(w_layer, m)] = scores
    return out


def _llama_np(model: LlamaModel) -> list[tuple[list[np.ndarray], ...]]:
    return [_heads_np(b.attn.q_proj.weight, b.attn.k_proj.weight, b.attn.v_proj.weight, b.attn.o_proj.weight,
                      b.attn.n_heads, b.attn.n_kv_heads, _np(b.attn_norm.weight)) for b in model.layers]


def _assert_scores(got: Any, expected: dict[tuple[int, int], dict[str, Any]], atol: float = 1e-12) -> None:
    assert set(got.pairs) == set(expected)
    for pair, kinds in expected.items():
        for kind in KINDS:
            np.testing.assert_allclose(got.scores(kind, *pair), kinds[kind], rtol=1e-10, atol=atol,
                                       err_msg=f"{kind} {pair}")


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_scores_equal_a_float64_numpy_computation_of_elhages_formula(n_kv_heads: int) -> None:
    model = _llama(n_kv_heads)
    got = composition_scores(model, samples=8)
    _assert_scores(got, _oracle(_llama_np(model)))
    assert got.scores("q", 0, 2).shape == (H, H) and got.scores("k_kv", 1, 2).shape == (n_kv_heads, H)
    for m in (0, 2):  # the circuits themselves: W_QK^i and W_OV^i formed for one head, as the oracle forms them
        wq, wk, wv, wo = _llama_np(model)[m]
        layer, r = circuits(model).layers[m], H // n_kv_heads
        for i in range(H):
            np.testing.assert_allclose(_np(layer.qk(i)), wq[i] @ wk[i // r].T, rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(_np(layer.ov(i)), wv[i // r] @ wo[i], rtol=1e-12, atol=1e-14)


def test_the_plain_formula_on_two_matrices() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((6, 5)), rng.standard_normal((5, 7))
    assert composition_score(torch.tensor(a), torch.tensor(b)) == pytest.approx(_c(a, b), rel=1e-12)
    assert composition_score(torch.zeros(6, 5), torch.tensor(b)) == 0.0


def test_a_subset_of_layers_gives_the_same_scores() -> None:
    model = _llama(2, n_layers=4)
    full, some = composition_scores(model, samples=4), composition_scores(model, layers=[3, 1], samples=4)
    assert set(some.pairs) == {(1, 3)}
    for kind in KINDS:
        np.testing.assert_array_equal(some.scores(kind, 1, 3), full.scores(kind, 1, 3))


def test_the_head_analysis_adapters_are_read_through() -> None:
    from multihead.heads.adapters import DecoderHeads, EncoderHeads
    from multihead.models.bert import Pooling, SentenceEncoder

    llama, bert = _llama(2), _bert()
    for adapter, model in ((DecoderHeads(llama, None), llama),  # type: ignore[arg-type]
                           (EncoderHeads(SentenceEncoder(bert, None, pooling=Pooling(), max_length=16)), bert)):  # type: ignore[arg-type]
        got, expected = composition_scores(adapter, samples=2), composition_scores(model, samples=2)
        for kind in KINDS:
            np.testing.assert_array_equal(got.scores(kind, 0, 2), expected.scores(kind, 0, 2))


# ---------------------------------------------------------------------------------------------- the norms
def test_the_folded_rmsnorm_is_exact_for_the_linear_part() -> None:
    """What a layer's q, k and v really are in a forward (position 0: RoPE is the identity) equals x / rms(x) times
    the circuits' folded W_Q, W_K, W_V: the 1 / rms(x) per token is all the fold leaves out."""
    model = _llama(2)
    seen: dict[str, Tensor] = {}
    block = model.layers[1]
    block.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0]))
    handles = [getattr(block.attn, f"hook_{n}").add(lambda t, _p, n=n: seen.__setitem__(n, t)) for n in "qkv"]
    with torch.no_grad():
        model(torch.arange(5).view(5, 1))  # five sequences of one token each
    for handle in handles:
        handle.remove()
    x = seen["x"].double()[:, 0]  # (5, D)
    unit = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + model.config.rms_eps)
    layer = circuits(model).layers[1]
    for name, w in (("q", layer.w_q), ("k", layer.w_k), ("v", layer.w_v)):
        expected = torch.einsum("bD,hDd->bhd", unit, w)
        torch.testing.assert_close(seen[name].double()[:, :, 0], expected, rtol=1e-5, atol=1e-5)


def _bert(seed: int = 0) -> BertEncoder:
    torch.manual_seed(seed)
    model = BertEncoder(BertConfig(vocab_size=40, d_model=D, n_layers=3, n_heads=H, ffn_dim=48, max_positions=16))
    _randomise_norms(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def _bert_np(model: BertEncoder) -> tuple[list[tuple[list[np.ndarray], ...]], Any]:
    layers = [_heads_np(x.attn.q_proj.weight, x.attn.k_proj.weight, x.attn.v_proj.weight, x.attn.o_proj.weight, H, H,
                        None) for x in model.layers]
    centre = np.eye(D) - np.ones((D, D)) / D
    norms = [centre @ np.diag(_np(n.weight)) for x in model.layers for n in (x.attn_norm, x.ffn_norm)]

    def path(writer: int, reader: int) -> np.ndarray:
        t = np.eye(D)
        for n in norms[2 * writer:2 * reader]:
            t = t @ n
        return t
    return layers, path


def test_post_norm_bert_scores_carry_the_layernorms_between_writer_and_reader() -> None:
    model = _bert()
    layers, path = _bert_np(model)
    _assert_scores(composition_scores(model, samples=4), _oracle(layers, path))


def test_the_post_norm_path_is_the_real_layernorms_linear_part() -> None:
    """Through the real LayerNorms of layers 0 and 1 (biases zeroed: they are left out), a row comes out parallel
    to the path T applied to it: the per-token 1 / sigma factors are all T leaves out."""
    model = _bert().double()
    with torch.no_grad():
        for x in model.layers:
            x.attn_norm.bias.zero_()
            x.ffn_norm.bias.zero_()
        y = torch.randn(3, D, dtype=torch.float64)
        real = y
        for x in list(model.layers)[:2]:
            real = x.ffn_norm(x.attn_norm(real))
    folded = circuits(model).write(0, 2, y)
    ratio = real / folded
    torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-9, atol=0)
    assert bool((ratio > 0).all())


# ---------------------------------------------------------------------------------------------- GQA
def _repeated(model: LlamaModel) -> LlamaModel:
    """The MHA model computing the same function: every KV head's K and V projections repeated to its r query
    heads."""
    c = model.config
    mha = LlamaModel(LlamaConfig(**{**c.__dict__, "n_kv_heads": c.n_heads}))
    state = dict(model.state_dict())
    r = c.n_heads // c.n_kv_heads
    for key, w in list(state.items()):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            state[key] = w.view(c.n_kv_heads, D_HEAD, D).repeat_interleave(r, 0).reshape(c.n_heads * D_HEAD, D)
    mha.load_state_dict(state)
    return mha.eval()


@pytest.mark.parametrize("n_kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_gqa_scores_equal_those_of_the_mha_model_with_repeated_kv_heads(n_kv_heads: int) -> None:
    gqa = _llama(n_kv_heads)
    mha = _repeated(gqa)
    ids = torch.arange(12).view(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(mha(ids), gqa(ids), rtol=1e-5, atol=1e-5)  # the same function
    ours, theirs = composition_scores(gqa, samples=4), composition_scores(mha, samples=4)
    r = H // n_kv_heads
    mha_np = _llama_np(mha)
    for pair in ours.pairs:
        for kind in ("q", "k", "v"):  # per query head: the MHA model's figures (TransformerLens's repeated heads)
            np.testing.assert_allclose(ours.scores(kind, *pair), theirs.scores(kind, *pair), rtol=1e-10, atol=1e-12)
        wq, wk, wv, wo = mha_np[pair[1]]
        for kind, base in (("k", [(wq[i] @ wk[i].T).T for i in range(H)]), ("v", [wv[i] @ wo[i] for i in range(H)])):
            # per KV head: the MHA figures of the group's r heads pooled with weights ||B_i||^2
            weight = np.array([np.linalg.norm(b) ** 2 for b in base]).reshape(n_kv_heads, r)
            per_query = theirs.scores(kind, *pair).reshape(n_kv_heads, r, H)
            pooled = np.sqrt((weight[:, :, None] * per_query**2).sum(1) / weight.sum(1)[:, None])
            np.testing.assert_allclose(ours.scores(f"{kind}_kv", *pair), pooled, rtol=1e-10, atol=1e-12)
            # and the MHA model's own per-KV-head figures are its per-query-head ones (groups of one)
            np.testing.assert_allclose(theirs.scores(f"{kind}_kv", *pair), theirs.scores(kind, *pair), rtol=1e-12)


# ---------------------------------------------------------------------------------------------- transformers


def _hf_llama_and_port(model_type: str = "llama") -> tuple[nn.Module, LlamaModel]:
    cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[model_type]
    config = getattr(transformers, cls[0])(vocab_size=40, hidden_size=D, intermediate_size=48, num_hidden_layers=3,
                                           num_attention_heads=H, num_key_value_heads=2, head_dim=D_HEAD,
                                           max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_model = getattr(transformers, cls[1])._from_config(config, attn_implementation="eager").eval()
    _randomise_norms(hf_model, torch.Generator().manual_seed(1))
    port = LlamaModel(LlamaConfig(vocab_size=40, d_model=D, n_layers=3, n_heads=H, n_kv_heads=2, ffn_dim=48,
                                  head_dim=D_HEAD, rms_eps=config.rms_norm_eps, tie_embeddings=False))
    renames = (("model.", ""), ("embed_tokens.", "embed."), ("self_attn.", "attn."), ("mlp.", ""),
               ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."))
    state = {}
    for key, w in hf_model.state_dict().items():
        for old, new in renames:
            key = key.replace(old, new)
        state[key] = w
    if model_type == "llama":
        port.load_state_dict(state)
    return hf_model, port.eval()


def test_a_transformers_llama_gives_the_scores_of_our_port_with_its_weights() -> None:
    hf_model, port = _hf_llama_and_port()
    ids = torch.arange(10).view(2, 5)
    with torch.no_grad():  # the same model (so the weights were mapped right)
        torch.testing.assert_close(hf_model(ids).logits, port(ids), rtol=1e-4, atol=1e-4)
    theirs, ours = composition_scores(hf_model, samples=4), composition_scores(port, samples=4)
    assert theirs.model == "LlamaForCausalLM" and theirs.n_kv_heads == (2, 2, 2)
    _assert_scores(theirs, {p: {k: ours.scores(k, *p) for k in KINDS} for p in ours.pairs})
    assert any("RoPE" in note for note in theirs.notes)


def test_qwen3s_per_head_qk_norms_are_folded_exactly_for_the_linear_part() -> None:
    """Qwen3 normalises each head's q and k (weights over head_dim): its real pre-RoPE q and k point along x / rms(x)
    times the circuits' W_Q^i, W_K^j."""
    hf_model, _ = _hf_llama_and_port("qwen3")
    seen: dict[str, Tensor] = {}
    layer = hf_model.model.layers[2]
    layer.input_layernorm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0]))
    for n in ("q_norm", "k_norm"):
        getattr(layer.self_attn, n).register_forward_hook(lambda _m, _a, out, n=n: seen.__setitem__(n, out))
    with torch.no_grad():
        hf_model(torch.arange(6).view(1, 6))
    x = seen["x"].double()[0]  # (s, D)
    unit = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + hf_model.config.rms_norm_eps)
    circ = circuits(hf_model).layers[2]
    for name, w in (("q_norm", circ.w_q), ("k_norm", circ.w_k)):
        real = torch.nn.functional.normalize(seen[name].double()[0], dim=-1)  # (s, heads, d)
        folded = torch.nn.functional.normalize(torch.einsum("sD,hDd->shd", unit, w), dim=-1)
        torch.testing.assert_close(real, folded, rtol=1e-5, atol=1e-5)
    assert any("q_norm" in note for note in circuits(hf_model).notes)


def test_a_transformers_bert_gives_the_scores_of_our_port_with_its_weights() -> None:
    config = transformers.BertConfig(vocab_size=40, hidden_size=D, num_hidden_layers=3, num_attention_heads=H,
                                     intermediate_size=48, max_position_embeddings=16)
    torch.manual_seed(0)
    hf_model = transformers.BertModel._from_config(config, attn_implementation="eager").eval()
    _randomise_norms(hf_model, torch.Generator().manual_seed(1))
    port = BertEncoder(BertConfig(vocab_size=40, d_model=D, n_layers=3, n_heads=H, ffn_dim=48, max_positions=16))
    theirs = hf_model.state_dict()
    port.load_state_dict({ours: theirs[name] for ours, name in BertEncoder.hf_names(port.config).items()})
    got, expected = composition_scores(hf_model, samples=4), composition_scores(port, samples=4)
    _assert_scores(got, {p: {k: expected.scores(k, *p) for k in KINDS} for p in expected.pairs})
    layers, path = _bert_np(port)
    _assert_scores(got, _oracle(layers, path))


def test_models_it_cannot_read_are_refused_by_name() -> None:
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, ffn_dim=48,
                                                             num_attention_heads=4, vocab_size=40,
                                                             word_embed_proj_dim=32))
    with pytest.raises(MultiheadError, match=r"OPTForCausalLM.*'opt'"):
        composition_scores(opt)
    with pytest.raises(MultiheadError, match="got a Linear"):
        composition_scores(nn.Linear(3, 3))
    port = _llama(2)
    port.layers[1].attn = nn.Linear(D, D)  # type: ignore[assignment]
    with pytest.raises(MultiheadError, match=r"layers\.1\.attn is a Linear"):
        composition_scores(port)


def test_bad_arguments() -> None:
    model = _llama(2)
    with pytest.raises(MultiheadError, match="at least two"):
        composition_scores(_llama(2, n_layers=1))
    with pytest.raises(MultiheadError, match="at least two"):
        composition_scores(model, layers=[1])
    for layers in ([0, 0], [0, 3], [0, True]):
        with pytest.raises(MultiheadError, match=r"distinct layer numbers in 0 \.\. 2"):
            composition_scores(model, layers=layers)
    with pytest.raises(MultiheadError, match="samples"):
        composition_scores(model, samples=0)
    with pytest.raises(MultiheadError, match="dtype"):
        composition_scores(model, dtype=torch.int64)
    with pytest.raises(MultiheadError, match="two matrices"):
        composition_score(torch.zeros(3, 4), torch.zeros(3, 4))
    with pytest.raises(MultiheadError, match="head 4 does not exist"):
        circuits(model).layers[0].qk(4)
    result = composition_scores(model, samples=4)
    with pytest.raises(MultiheadError, match="kind 'x' is unknown"):
        result.scores("x", 0, 1)
    with pytest.raises(MultiheadError, match="writer layer 2 into reader layer 1"):
        result.scores("q", 2, 1)


# ---------------------------------------------------------------------------------------------- baseline and result
@pytest.mark.parametrize("group", [1, 3])
def test_the_random_baseline_matches_independent_draws(group: int) -> None:
    """Our mean against NumPy draws of the (D, D) and (D, r D) matrices themselves, Gaussian and (as the ARENA
    tutorials draw them) uniform: within 4 standard errors of the difference."""
    d_model, d, n = 48, 6, 400
    mean, std = random_baseline(d_model, d, group=group, samples=n, seed=1)
    rng = np.random.default_rng(2)
    for draw in (rng.standard_normal, lambda shape: rng.uniform(-1.0, 1.0, shape)):
        values = [_c(draw((d_model, d)) @ draw((d, d_model)), draw((d_model, d)) @ draw((d, group * d_model)))
                  for _ in range(n)]
        assert abs(mean - np.mean(values)) < 4 * np.hypot(std, np.std(values)) / np.sqrt(n)
    assert random_baseline(d_model, d, group=group, samples=8, seed=1) == random_baseline(d_model, d, group=group,
                                                                                          samples=8, seed=1)


def test_corrected_scores_top_and_json() -> None:
    result = composition_scores(_llama(2), samples=16, seed=3)
    assert result.baseline == random_baseline(D, D_HEAD, samples=16, seed=3)
    assert result.baseline_kv[2] == random_baseline(D, D_HEAD, group=2, samples=16, seed=3)
    np.testing.assert_array_equal(result.corrected("k", 0, 2), result.scores("k", 0, 2) - result.baseline[0])
    np.testing.assert_array_equal(result.corrected("v_kv", 0, 2),
                                  result.scores("v_kv", 0, 2) - result.baseline_kv[2][0])
    top = result.top("k", 3)
    assert [t[4] for t in top] == sorted((t[4] for t in top), reverse=True)
    w, wh, r, rh, value = top[0]
    assert value == pytest.approx(float(result.corrected("k", w, r).max())) == result.corrected("k", w, r)[rh, wh]
    data = json.loads(json.dumps(result.to_json()))
    assert data["n_heads"] == [H] * 3 and data["n_kv_heads"] == [2] * 3
    assert [(p["writer_layer"], p["reader_layer"]) for p in data["pairs"]] == [(0, 1), (0, 2), (1, 2)]
    assert np.array(data["pairs"][1]["k_kv"]).shape == (2, H)
    np.testing.assert_array_equal(np.array(data["pairs"][1]["q"]), result.scores("q", 0, 2))
    assert data["baseline"]["per_kv_head"]["2"]["mean"] == result.baseline_kv[2][0]
