"""Direct logit attribution, the logit lens and the easy patching API: the parts sum to the model's own logit
difference on MHA, GQA and MQA models (our port, transformers models after hf.enable, with and without biases), the
head parts equal a float64 recomputation through the layer's own W_O, the transformers model and our port with its
weights attribute alike, the lens's last layer is the model's logits, and patching takes a model and per-pair answers
and keeps per-pair results."""

from __future__ import annotations

import copy
import os
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from torch import Tensor, nn

from multihead import MultiheadError
from multihead.heads.attribution import direct_logit_attribution, head_logit_lens, logit_lens
from multihead.heads.patching import activation_patching, attribution_patching, find_layers, logit_difference
from multihead.layers.hooks import hooks, run_with_cache
from multihead.models.llama import LlamaConfig, LlamaModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")

V, D, H, S = 50, 32, 4, 6
VARIANTS = pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
ANSWERS, WRONGS = [3, 7], [5, 9]


def _port(n_kv_heads: int = 2, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(LlamaConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=H, n_kv_heads=n_kv_heads, ffn_dim=48,
                                   tie_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def _hf(n_kv_heads: int = 2, *, bias: bool = False) -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=H, num_key_value_heads=n_kv_heads,
                                      max_position_embeddings=64, attention_bias=bias, mlp_bias=bias,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.3)
    from multihead import hf

    return hf.enable(model)


def _port_of(hf_model: nn.Module) -> LlamaModel:
    """Our port with a transformers Llama's weights (no biases)."""
    c: Any = hf_model.config
    port = LlamaModel(LlamaConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=H, n_kv_heads=c.num_key_value_heads,
                                  ffn_dim=48, rms_eps=c.rms_norm_eps, tie_embeddings=False))
    renames = (("model.", ""), ("embed_tokens.", "embed."), ("self_attn.", "attn."), ("mlp.", ""),
               ("input_layernorm.", "attn_norm."), ("post_attention_layernorm.", "ffn_norm."))
    state = {}
    for key, w in hf_model.state_dict().items():
        for old, new in renames:
            key = key.replace(old, new)
        state[key] = w
    port.load_state_dict(state)
    return port.eval()


def _ids(seed: int = 1) -> Tensor:
    return torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(seed))


def _real_diff(model: nn.Module, ids: Tensor) -> Tensor:
    with torch.no_grad():
        out: Any = model(ids)
    logits = (out.logits if hasattr(out, "logits") else out).double()
    rows = torch.arange(2)
    return logits[rows, :, ANSWERS] - logits[rows, :, WRONGS]  # (b, s)


@VARIANTS
@pytest.mark.parametrize("kind", ["port", "transformers", "transformers-biases"])
def test_the_parts_sum_to_the_models_own_logit_difference(n_kv_heads: int, kind: str) -> None:
    model = _port(n_kv_heads) if kind == "port" else _hf(n_kv_heads, bias=kind.endswith("biases"))
    ids = _ids()
    result = direct_logit_attribution(model, ids, ANSWERS, WRONGS)
    real = _real_diff(model, ids)
    assert result.heads.shape == (2, 2, H, S) and result.mlps.shape == (2, 2, S) and result.embed.shape == (2, S)
    assert real.abs().max() > 0.3  # a difference worth attributing
    torch.testing.assert_close(result.logit_diff, real, rtol=0, atol=0)
    torch.testing.assert_close(result.total(), real, rtol=0, atol=1e-4)
    assert float(result.remainder.abs().max()) < 1e-4
    assert float(result.heads.abs().max()) > 1e-2 and float(result.mlps.abs().max()) > 1e-2
    if kind == "transformers-biases":
        assert any("b_O / n_heads" in note for note in result.notes)
    # grouped by KV head: each KV head's figure is its r query heads' sum
    r = H // n_kv_heads
    grouped = result.by_kv_head()
    assert grouped.shape == (2, 2, n_kv_heads, S)
    torch.testing.assert_close(grouped[:, :, 0], result.heads[:, :, :r].sum(2), rtol=0, atol=1e-12)


@VARIANTS
def test_the_head_parts_equal_a_float64_recomputation_through_the_layers_own_w_o(n_kv_heads: int) -> None:
    model, ids = _port(n_kv_heads), _ids()
    result = direct_logit_attribution(model, ids, ANSWERS, WRONGS)
    exact = copy.deepcopy(model).double()
    with torch.no_grad():
        _, cache = run_with_cache(exact, ids, names=["*.attn.hook_z", "layers.1.hook_resid_post"])
        x = cache["layers.1.hook_resid_post"]  # (b, s, D): the stream the final norm reads
        gamma = exact.norm.weight
        rms = (x.pow(2).mean(-1, keepdim=True) + exact.norm.eps).sqrt()
        u = exact.lm_head.weight[ANSWERS] - exact.lm_head.weight[WRONGS]  # (b, D)
        for layer, block in enumerate(exact.layers):
            z = cache[f"layers.{layer}.attn.hook_z"]  # (b, h, s, d)
            for head in range(H):
                alone = torch.zeros_like(z)
                alone[:, head] = z[:, head]
                write = block.attn.o_proj(alone.transpose(1, 2).flatten(2))  # (b, s, D): head alone through W_O
                by_hand = ((write * gamma / rms) * u[:, None]).sum(-1)
                torch.testing.assert_close(result.heads[:, layer, head], by_hand, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_a_transformers_model_and_our_port_with_its_weights_attribute_alike(n_kv_heads: int) -> None:
    hf_model = _hf(n_kv_heads)
    port, ids = _port_of(hf_model), _ids()
    theirs = direct_logit_attribution(hf_model, ids, ANSWERS, WRONGS)
    ours = direct_logit_attribution(port, ids, ANSWERS, WRONGS)
    for part in ("heads", "mlps", "embed", "logit_diff"):
        torch.testing.assert_close(getattr(theirs, part), getattr(ours, part), rtol=1e-4, atol=1e-4)


def test_something_writing_outside_the_parts_is_caught_not_attributed() -> None:
    model, ids = _port(), _ids()
    with hooks(model, {"layers.0.hook_resid_mid": lambda x, p: x + 0.5}), \
            pytest.raises(MultiheadError, match="not a part"):
        direct_logit_attribution(model, ids, ANSWERS, WRONGS)
    one = direct_logit_attribution(model, ids, 3)  # a single answer: its logit itself
    with torch.no_grad():
        torch.testing.assert_close(one.logit_diff, model(ids)[..., 3].double(), rtol=0, atol=0)
    assert float(one.remainder.abs().max()) < 1e-4
    with pytest.raises(MultiheadError, match="3 token ids for a batch of 2"):
        direct_logit_attribution(model, ids, [1, 2, 3])
    with pytest.raises(MultiheadError, match="outside the vocabulary"):
        direct_logit_attribution(model, ids, [1, V])
    with pytest.raises(MultiheadError, match="LlamaModel and transformers"):
        direct_logit_attribution(nn.Linear(2, 2), ids, 1)


@pytest.mark.parametrize("kind", ["port", "transformers"])
def test_the_logit_lens_of_the_last_layer_is_the_models_logits(kind: str) -> None:
    model = _port() if kind == "port" else _hf()
    ids = _ids()
    lens = logit_lens(model, ids, k=4, answers=ANSWERS, wrongs=WRONGS)
    with torch.no_grad():
        out: Any = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    top = logits.topk(4, dim=-1)
    assert lens.top_ids.shape == (2, 2, S, 4)
    torch.testing.assert_close(lens.top_ids[-1], top.indices, rtol=0, atol=0)
    torch.testing.assert_close(lens.top_logits[-1], top.values, rtol=1e-5, atol=1e-5)
    assert lens.logit_diff is not None
    torch.testing.assert_close(lens.logit_diff[-1], _real_diff(model, ids), rtol=1e-5, atol=1e-5)


def test_the_head_lens_pushes_are_the_heads_attribution() -> None:
    model, ids = _port(2), _ids()
    result = direct_logit_attribution(model, ids, ANSWERS, WRONGS)
    lens = head_logit_lens(model, ids, position=-1, k=V)  # every token, sorted
    assert lens.top_ids.shape == (2, 2, H, V)
    for row in range(2):
        for layer in range(2):
            for head in range(H):
                ids_, values = lens.top_ids[row, layer, head], lens.top_logits[row, layer, head]
                push = dict(zip(ids_.tolist(), values.tolist(), strict=True))
                diff = push[ANSWERS[row]] - push[WRONGS[row]]
                assert diff == pytest.approx(float(result.heads[row, layer, head, -1]), abs=1e-5)


# ---------------------------------------------------------------------------------------------- the patching API
def _pairs() -> tuple[Tensor, Tensor]:
    clean = _ids(3)
    corrupted = clean.clone()
    corrupted[:, 2] = (clean[:, 2] + 7) % V
    return clean, corrupted


@pytest.mark.parametrize("kind", ["port", "transformers"])
def test_patching_takes_a_model_and_per_pair_answers_and_keeps_each_pairs_result(kind: str) -> None:
    model = _port() if kind == "port" else _hf()
    clean, corrupted = _pairs()
    metric = logit_difference(ANSWERS, WRONGS)
    both = activation_patching(model, clean, corrupted, metric, chunk=3)
    forward, layers = find_layers(model)
    assert len(layers) == 2
    explicit = activation_patching(forward, layers, clean, corrupted, metric, chunk=3)  # the old call
    np.testing.assert_array_equal(both.effects, explicit.effects)
    assert both.per_pair is not None and both.per_pair.shape == (2, H, 2)
    assert both.clean_per_pair is not None and both.corrupted_per_pair is not None
    for r in range(2):  # each pair's own result is patching that pair alone
        alone = activation_patching(model, clean[r:r + 1], corrupted[r:r + 1],
                                    logit_difference(ANSWERS[r], WRONGS[r]), chunk=5)
        np.testing.assert_allclose(both.per_pair[..., r], alone.effects, rtol=1e-4, atol=1e-5)
        assert both.clean_per_pair[r] == pytest.approx(alone.clean, abs=1e-5)
    # the pooled effect is (mean patched - mean corrupted) / (mean clean - mean corrupted)
    spans = both.clean_per_pair - both.corrupted_per_pair
    pooled = (both.per_pair * spans).mean(-1) / spans.mean()
    np.testing.assert_allclose(both.effects, pooled, rtol=1e-4, atol=1e-5)
    first = attribution_patching(model, clean, corrupted, metric)
    assert first.per_pair is not None and first.per_pair.shape == (2, H, 2)
    np.testing.assert_allclose((first.per_pair * spans).mean(-1) / spans.mean(), first.effects, rtol=1e-5,
                               atol=1e-7)


def test_a_per_pair_metric_knows_row_r_belongs_to_pair_r_mod_b() -> None:
    logits = torch.randn(6, S, V)  # 3 copies of a batch of 2 pairs
    metric = logit_difference(ANSWERS, WRONGS)
    values = metric(logits)
    for r in range(6):
        p = r % 2
        assert float(values[r]) == pytest.approx(float(logits[r, -1, ANSWERS[p]] - logits[r, -1, WRONGS[p]]))
    with pytest.raises(MultiheadError, match="multiple of 2"):
        metric(torch.randn(3, S, V))


def test_hook_points_that_do_not_fire_raise_a_clear_error() -> None:
    model = _hf()
    clean, corrupted = _pairs()
    metric = logit_difference(ANSWERS, WRONGS)
    model.set_attn_implementation("eager")  # transformers' attention switched away: the points are never reached
    with pytest.raises(MultiheadError, match=r"fired 0 time\(s\).*hf\.enable"):
        activation_patching(model, clean, corrupted, metric)
    with pytest.raises(MultiheadError, match=r"did not fire.*hf\.enable"):
        direct_logit_attribution(model, clean, ANSWERS, WRONGS)
    unhooked = transformers.LlamaForCausalLM._from_config(model.config, attn_implementation="eager")
    with pytest.raises(MultiheadError, match=r"no attention layers with hook points \(call multihead\.hf\.enable"):
        activation_patching(unhooked, clean, corrupted, metric)


# ---------------------------------------------------------------------------------------------- path patching
def _mlps_silenced(model: nn.Module) -> nn.Module:
    """The model with every MLP writing zero: a sender's paths are then the later heads' q, k, v and the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "down_proj" in name:
                p.zero_()
    return model


@pytest.mark.parametrize("kind", ["port-mha", "port-gqa", "transformers-gqa"])
def test_path_patching_along_every_path_the_sender_has_equals_activation_patching(kind: str) -> None:
    from multihead.heads.paths import path_patching

    model = _mlps_silenced(_port(4 if kind == "port-mha" else 2) if kind.startswith("port") else _hf(2))
    clean, corrupted = _pairs()
    metric = logit_difference(ANSWERS, WRONGS)
    full = activation_patching(model, clean, corrupted, metric)
    assert full.per_pair is not None
    every = [[*((1, h) for h in range(H)), "logits"]]
    for head in (1, 2):
        paths = path_patching(model, clean, corrupted, metric, sender=(0, head), receivers=every)
        assert paths.effects[0] == pytest.approx(float(full.effects[0, head]), abs=1e-5)
        np.testing.assert_allclose(paths.per_pair[0], full.per_pair[0, head], rtol=1e-4, atol=1e-5)
        # a last-layer sender has one path, into the final stream
        last = path_patching(model, clean, corrupted, metric, sender=(1, head), receivers=["logits"])
        assert last.effects[0] == pytest.approx(float(full.effects[1, head]), abs=1e-5)
    assert abs(full.effects[0]).max() > 1e-2  # layer 0's heads matter, so the test can fail


def test_path_patching_batched_over_receivers_equals_one_receiver_at_a_time() -> None:
    from multihead.heads.paths import path_patching

    model = _port(2)
    clean, corrupted = _pairs()
    metric = logit_difference(ANSWERS, WRONGS)
    batched = path_patching(model, clean, corrupted, metric, sender=(0, 1), chunk=3)  # every layer-1 head alone
    assert batched.receivers == [[(1, h)] for h in range(H)]
    alone = path_patching(model, clean, corrupted, metric, sender=(0, 1), receivers=[[r] for r in [(1, 3), (1, 0)]])
    assert alone.effects == pytest.approx([batched.effects[3], batched.effects[0]], abs=1e-6)
    one = path_patching(model, clean, corrupted, metric, sender=(0, 1), receivers=[(1, 2)], chunk=1)
    assert one.effects[0] == pytest.approx(batched.effects[2], abs=1e-6)
    assert np.abs(batched.effects).max() > 1e-4
    with pytest.raises(MultiheadError, match="must come after the sender"):
        path_patching(model, clean, corrupted, metric, sender=(1, 0), receivers=[(0, 1)])
    with pytest.raises(MultiheadError, match="a path enters a head through"):
        path_patching(model, clean, corrupted, metric, sender=(0, 0), points="hook_z")


def test_patch_pairs_keeps_each_pairs_figures() -> None:
    from multihead.heads.patching import PromptPair, patch_pairs

    model = _port()
    forward, layers = find_layers(model)
    pairs = [PromptPair("1 2 3 4 5", "1 2 9 4 5", "3", "5"), PromptPair("6 7 8 1 2", "6 7 8 11 2", "7", "9")]
    result = patch_pairs(forward, layers, lambda text: [int(t) for t in text.split()], pairs)
    assert result.per_pair_patching is not None and result.per_pair_patching.shape == (2, 2, H)
    assert result.per_pair_attribution is not None and result.clean_per_pair is not None
    assert result.corrupted_per_pair is not None and result.patching is not None
    spans = result.clean_per_pair - result.corrupted_per_pair
    pooled = (result.per_pair_patching * spans[:, None, None]).sum(0) / spans.sum()
    np.testing.assert_allclose(result.patching, pooled, rtol=1e-9, atol=1e-12)
    first = activation_patching(model, torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[1, 2, 9, 4, 5]]),
                                logit_difference(3, 5))
    np.testing.assert_allclose(result.per_pair_patching[0], first.effects, rtol=1e-6, atol=1e-7)
    with pytest.raises(MultiheadError, match="nothing to compute"):
        patch_pairs(forward, layers, lambda text: [int(t) for t in text.split()], pairs, patching=False,
                    attribution=False)


def test_printing_an_attribution_is_a_short_summary_not_every_tensor() -> None:
    """Issue 52 item 10: printing the result dumped every tensor; it is one line with the top heads, and the last
    position's logit difference is the model's own (read from its logits here)."""
    model = _port(2)
    ids = _ids()
    result = direct_logit_attribution(model, ids, ANSWERS, WRONGS)
    shown = repr(result)
    assert "tensor(" not in shown and "\n" not in shown and len(shown) < 500, shown
    assert f"logit_diff {float(_real_diff(model, ids)[:, -1].mean()):+.3f}" in shown
    parts = {"embed": float(result.embed[:, -1].mean())}
    parts |= {f"L{la}H{h}": float(result.heads[:, la, h, -1].mean()) for la in range(2) for h in range(H)}
    parts |= {f"MLP{la}": float(result.mlps[:, la, -1].mean()) for la in range(2)}
    largest = sorted(parts, key=lambda name: -abs(parts[name]))[:5]
    assert shown.split("top: ", 1)[1] == ", ".join(f"{n} {parts[n]:+.3f}" for n in largest) + ")"
    assert f"2 layers x {H} heads" in shown
