"""Every head tool on every family `hf.enable` takes (issue 49): each cell of the support matrix
(:data:`multihead.heads.support.SUPPORT`) run on a tiny random model of the family built from transformers' config
class. A supported cell is held to an independent reference (transformers' own forward with its eager attention,
its hidden states, a second exact computation); a refused cell must raise the MultiheadError whose reason the
table states. The README's matrix is the table's own rendering."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from torch import Tensor, nn

from multihead import MultiheadError, hf
from multihead.heads.attribution import direct_logit_attribution, head_logit_lens, logit_lens
from multihead.heads.composition import circuits
from multihead.heads.eap import edge_attribution
from multihead.heads.patching import activation_patching, attribution_patching, logit_difference
from multihead.heads.paths import path_patching
from multihead.heads.support import FAMILIES, SUPPORT, TOOLS, markdown

os.environ.setdefault("HF_HUB_OFFLINE", "1")

V, D, S, H = 61, 32, 7, 4
TINY = {"vocab_size": V, "hidden_size": D, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": H,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False}
ANSWERS, WRONGS = torch.tensor([3, 5]), torch.tensor([7, 2])


def _config(family: str) -> Any:
    t = transformers
    return {
        "llama": lambda: t.LlamaConfig(**TINY),
        "mistral": lambda: t.MistralConfig(**TINY),
        "qwen2": lambda: t.Qwen2Config(**TINY),  # q, k, v biases
        "qwen3": lambda: t.Qwen3Config(**TINY, head_dim=8),  # q/k norms
        "smollm3": lambda: t.SmolLM3Config(**TINY, pad_token_id=0),
        "olmo": lambda: t.OlmoConfig(**TINY, pad_token_id=0),  # LayerNorms without parameters
        "phi3": lambda: t.Phi3Config(**TINY, pad_token_id=0, eos_token_id=0, bos_token_id=0),  # fused qkv, gate_up
        "gpt_oss": lambda: t.GptOssConfig(**TINY, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=4),  # sinks, biases, experts, sliding layers
        "gemma": lambda: t.GemmaConfig(**TINY, head_dim=8),  # (1 + w) norms, embedding scale
        "gemma2": lambda: t.Gemma2Config(**TINY, head_dim=8, sliding_window=4),  # post-norms, softcaps
        "gemma3_text": lambda: t.Gemma3TextConfig(**TINY, head_dim=8, sliding_window=4, sliding_window_pattern=2),
        "gpt2": lambda: t.GPT2Config(vocab_size=V, n_embd=D, n_layer=2, n_head=H, n_positions=64,
                                     tie_word_embeddings=False),
    }[family]()


_MODELS: dict[str, nn.Module] = {}


def _model(family: str) -> nn.Module:
    """A tiny random model of the family on multihead's attention (norm weights in [0.5, 1.5), others N(0, 0.3^2)
    so every part matters), built once per session."""
    if family not in _MODELS:
        config = _config(family)
        assert config.model_type == family
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.rand_like(p) + 0.5 if "norm" in name or "ln_" in name else torch.randn_like(p) * 0.3)
        _MODELS[family] = hf.enable(model)
    return _MODELS[family]


def _ids(seed: int = 1) -> Tensor:
    return torch.randint(8, V, (2, S), generator=torch.Generator().manual_seed(seed))


def _eager_logits(model: nn.Module, ids: Tensor) -> Tensor:
    """transformers' own forward (its eager attention, none of multihead's), float64."""
    hf_model: Any = model
    hf_model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = hf_model(ids, use_cache=False).logits.double()
    finally:
        hf.enable(model)
    return out


CELLS = [(f, t) for f in FAMILIES for t in TOOLS]


def _refused(family: str, tool: str) -> Any:
    cell = SUPPORT[family][tool]
    assert not cell.why or len(cell.why) > 20
    return pytest.raises(MultiheadError, match=re.escape(cell.why))


def test_the_readme_matrix_is_the_tables_own() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    assert markdown() in readme
    assert set(SUPPORT) == set(FAMILIES) == set(hf.LAYOUTS)


@pytest.mark.parametrize("family", FAMILIES)
def test_residual_points_are_transformers_own_stream(family: str) -> None:
    """resid_pre and resid_post are transformers' hidden states; resid_mid = resid_pre + attn_out and resid_post =
    resid_mid + mlp_out, so attn_out and mlp_out are what the layer adds (Gemma 2/3: after the post-norms)."""
    assert SUPPORT[family]["resid"].ok
    model = _model(family)
    blocks = list(hf.decoder_layers(model).values())
    assert len(blocks) == 2
    seen: dict[str, Tensor] = {}
    handles = [getattr(b, p).add(lambda x, _p, k=f"{p}{i}": seen.__setitem__(k, x.detach()))
               for i, b in enumerate(blocks) for p in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid",
                                                       "hook_mlp_out", "hook_resid_post")]
    try:
        with torch.no_grad():
            out = model(_ids(), output_hidden_states=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    states = out.hidden_states
    torch.testing.assert_close(seen["hook_resid_pre0"], states[0])
    torch.testing.assert_close(seen["hook_resid_post0"], states[1])
    torch.testing.assert_close(seen["hook_resid_pre1"], states[1])
    for i in range(2):
        torch.testing.assert_close(seen[f"hook_resid_mid{i}"], seen[f"hook_resid_pre{i}"] + seen[f"hook_attn_out{i}"])
        torch.testing.assert_close(seen[f"hook_resid_post{i}"], seen[f"hook_resid_mid{i}"] + seen[f"hook_mlp_out{i}"])


@pytest.mark.parametrize("family", FAMILIES)
def test_dla_parts_sum_to_transformers_own_logit_difference(family: str) -> None:
    model, ids = _model(family), _ids()
    if not SUPPORT[family]["dla"].ok:
        with _refused(family, "dla"):
            direct_logit_attribution(model, ids, ANSWERS, WRONGS)
        return
    result = direct_logit_attribution(model, ids, ANSWERS, WRONGS)
    logits = _eager_logits(model, ids)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:  # Gemma 2: the logits before the softcap are attributed (and the notes say so)
        assert any("before the final softcap" in n for n in result.notes)
        logits = torch.atanh(logits / cap) * cap
    rows = torch.arange(2)
    real = logits[rows, :, ANSWERS] - logits[rows, :, WRONGS]
    torch.testing.assert_close(result.logit_diff, real, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(result.total(), real, atol=1e-4, rtol=1e-4)
    assert result.heads.abs().amax() > 1e-2 and result.mlps.abs().amax() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_the_last_layers_lens_is_transformers_own_logits(family: str) -> None:
    assert SUPPORT[family]["logit_lens"].ok
    model, ids = _model(family), _ids()
    lens = logit_lens(model, ids, k=3, answers=ANSWERS, wrongs=WRONGS)
    logits = _eager_logits(model, ids)
    assert torch.equal(lens.top_ids[-1], logits.topk(3, dim=-1).indices)
    rows = torch.arange(2)
    assert lens.logit_diff is not None
    torch.testing.assert_close(lens.logit_diff[-1], logits[rows, :, ANSWERS] - logits[rows, :, WRONGS], atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_heads_lens_push_is_its_attribution(family: str) -> None:
    """The logit a head's write alone pushes toward its top token is that head's DLA part on that token."""
    model, ids = _model(family), _ids()
    if not SUPPORT[family]["head_lens"].ok:
        with _refused(family, "head_lens"):
            head_logit_lens(model, ids)
        return
    biases = [p for n, p in model.named_parameters() if n.endswith(("o_proj.bias", "attn.c_proj.bias"))]
    kept = [b.detach().clone() for b in biases]
    with torch.no_grad():  # W_O's bias is no head's in the lens; DLA shares it among the heads: left out of both
        for b in biases:
            b.zero_()
    try:
        lens = head_logit_lens(model, ids, position=-1, k=1)
        for layer, head in ((0, 1), (1, 3)):
            token = lens.top_ids[:, layer, head, 0]  # (b,)
            dla = direct_logit_attribution(model, ids, token)
            torch.testing.assert_close(lens.top_logits[:, layer, head, 0].double(), dla.heads[:, layer, head, -1],
                                       atol=1e-4, rtol=1e-4)
    finally:
        with torch.no_grad():
            for b, k in zip(biases, kept, strict=True):
                b.copy_(k)


def _sigma(x: Tensor, center: bool, eps: float) -> Tensor:
    x = x.double()
    return ((x.var(-1, unbiased=False) if center else x.pow(2).mean(-1)) + eps).sqrt()


@pytest.mark.parametrize("family", FAMILIES)
def test_composition_reads_the_weights_the_forward_uses(family: str) -> None:
    """The folded W_V (read norm included) gives the model's values up to the norm's per-token scale, and the
    folded W_O (a post-attention norm's weight included) its attention write: differences between positions
    (constants such as biases cancel), against hook_v and hook_attn_out of a real run."""
    assert SUPPORT[family]["composition"].ok
    model, ids = _model(family), _ids()
    circ = circuits(model)
    layout = hf.block_layout(model)
    block = list(hf.decoder_layers(model).values())[1]
    attn = getattr(block, layout.attention)
    seen: dict[str, Tensor] = {}
    points = {"x": block.hook_resid_pre, "v": attn.hook_v, "z": attn.hook_z, "a": attn.hook_out,
              "w": block.hook_attn_out}
    handles = [p.add(lambda x, _p, k=k: seen.__setitem__(k, x.detach().double())) for k, p in points.items()]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    norm = getattr(block, layout.attn_norm)
    center = family in ("olmo", "gpt2")
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-5)))
    layer = circ.layers[1]
    x, sigma = seen["x"], _sigma(seen["x"], center, eps)  # (b, s, D), (b, s)
    v = torch.einsum("bsD,gDd->bgsd", x, layer.w_v) / sigma[:, None, :, None]
    torch.testing.assert_close(v - v[:, :, :1], seen["v"] - seen["v"][:, :, :1], atol=1e-4, rtol=1e-4)
    write = torch.einsum("bhsd,hdD->bsD", seen["z"], layer.w_o)
    if layout.attn_write != layout.attention:
        write = write / _sigma(seen["a"], False, float(getattr(block, layout.attn_write).eps))[..., None]
    torch.testing.assert_close(write - write[:, :1], seen["w"] - seen["w"][:, :1], atol=1e-4, rtol=1e-4)


def _silenced(family: str) -> nn.Module:
    """The family's tiny model with every MLP writing zero (its down projections zeroed; a post-norm of zero is
    zero): a sender's paths are then the later heads' q, k, v and the logits."""
    model = _model(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name and ("down_proj" in name or "c_proj" in name):
                p.zero_()
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_path_patching_along_every_path_equals_activation_patching(family: str) -> None:
    assert SUPPORT[family]["path_patching"].ok
    model = _silenced(family)
    clean, corrupted = _ids(1), _ids(2)
    metric = logit_difference(ANSWERS, WRONGS)
    full = activation_patching(model, clean, corrupted, metric)
    every = [[*((1, h) for h in range(H)), "logits"]]
    for head in (1, 2):
        paths = path_patching(model, clean, corrupted, metric, sender=(0, head), receivers=every)
        assert paths.effects[0] == pytest.approx(float(full.effects[0, head]), abs=1e-4)
        last = path_patching(model, clean, corrupted, metric, sender=(1, head), receivers=["logits"])
        assert last.effects[0] == pytest.approx(float(full.effects[1, head]), abs=1e-4)
    assert abs(full.effects[0]).max() > 1e-2
    _MODELS.pop(family)  # the silenced copy is not the family's model


@pytest.mark.parametrize("family", FAMILIES)
def test_a_senders_edges_sum_to_its_attribution_patching_estimate(family: str) -> None:
    model = _model(family)
    clean, corrupted = _ids(1), _ids(2)
    metric = logit_difference(ANSWERS, WRONGS)
    if not SUPPORT[family]["eap"].ok:
        with _refused(family, "eap"):
            edge_attribution(model, clean, corrupted, metric)
        return
    if hf.block_layout(model).attn_write != hf.block_layout(model).attention:
        _eap_is_exact_patching_to_first_order(family)
        return
    scores = edge_attribution(model, clean, corrupted, metric)
    reference = attribution_patching(model, corrupted, clean, metric)  # the gradient at `clean`
    span = scores.corrupted_metric - scores.clean_metric
    total = np.zeros((2, H))
    for e in scores.edges:
        if e.sender.startswith("L") and ".H" in e.sender:
            layer, head = (int(v) for v in e.sender[1:].split(".H"))
            total[layer, head] += e.score
    np.testing.assert_allclose(total / span, reference.effects, rtol=1e-3, atol=1e-5)
    assert reference.effects.abs().max() > 1e-2


def _eap_is_exact_patching_to_first_order(family: str) -> None:
    """Gemma 2/3: a head's write passes its layer's post-attention norm (scale 1 / rms of the heads' summed output
    in each run), so a sender's edges no longer sum to attribution patching's estimate at its z (that moves the
    norm's scale for every head). Held instead against exact path patching of single edges (check_edges): corrupted
    embeddings = clean + eps * direction, the EAP score / eps against the measured change / eps, the error shrinking
    with eps as a first-order estimate's does."""
    from multihead.heads.eap import check_edges

    model = _model(family)
    embed: Any = model.get_input_embeddings()
    half = V // 2
    clean = torch.randint(0, half, (2, S), generator=torch.Generator().manual_seed(3))
    direction = torch.randn(half, D, generator=torch.Generator().manual_seed(5))
    metric = logit_difference(ANSWERS, WRONGS)
    errors, picked = [], None
    try:
        for eps in (1e-1, 1e-2):
            with torch.no_grad():
                embed.weight[half:2 * half] = embed.weight[:half] + eps * direction
            corrupted = clean + half
            scores = edge_attribution(model, clean, corrupted, metric)
            estimate = {(e.sender, e.receiver): e.score for e in scores.edges}
            if picked is None:  # the top edges from each kind of sender: heads of both layers, the MLPs, embed
                picked = [next(e for e in scores.edges if e.sender.startswith(p)) for p in ("L0.H", "L1.H", "L0.MLP",
                                                                                            "embed")]
            exact = check_edges(model, clean, corrupted, metric, picked)
            first = np.array([estimate[(e.sender, e.receiver)] for e, _ in exact]) / eps
            measured = np.array([v for _, v in exact]) / eps
            errors.append(np.abs(first - measured).max() / np.abs(measured).max())
    finally:
        _MODELS.pop(family)  # its embeddings were changed
    assert errors[1] < 0.05 and errors[1] < errors[0] / 4, errors


@pytest.mark.parametrize("family", FAMILIES)
def test_circuit_runs_or_refuses_by_name(family: str) -> None:
    """`multihead circuit`'s analysis on a head model of the family: DLA (exact), EAP with its exact checks and
    composition, or the table's refusal before anything runs."""
    from multihead.heads.adapters import head_model
    from multihead.heads.circuit import analyse_circuit
    from multihead.heads.patching import PromptPair

    class Words:  # a tokenizer of numbered words: "w12" is token 12
        all_special_ids: tuple[int, ...] = ()

        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            return {"input_ids": [int(w[1:]) if w[1:].isdigit() else 1 for w in text.split()]}

        def decode(self, ids: list[int]) -> str:
            return " ".join(f"w{i}" for i in ids)

    heads = head_model(_model(family), Words(), family)
    pairs = [PromptPair("w10 w11 w12 w13 w14", "w10 w11 w20 w13 w14", "w3", "w7")]
    if not SUPPORT[family]["circuit"].ok:
        with _refused(family, "circuit"):
            analyse_circuit(heads, pairs, edges=4, top=2, check=1, samples=4)
        return
    report = analyse_circuit(heads, pairs, edges=4, top=2, check=1, samples=4)
    assert report.circuit is not None and report.dla is not None
