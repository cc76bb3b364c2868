"""Head scores and plans for any transformers model (issue 40 item 2): the retrieval scores, the dropped-mass scores
and the DuoAttention-style gates run through hf.enable's hook points with the same code as on our port.

- On tiny random Llama, Qwen2, Qwen3, Mistral, Gemma 2 and Gemma 3 models (transformers' config classes, nothing from
  a hub): the dropped mass equals the one read from every layer's full pattern (hook_pattern of an uncached forward),
  the retrieval score equals Wu et al.'s count done on that pattern, a sliding layer inside the streaming window drops
  nothing, the gated forward equals transformers' own eager attention under the per-head mask, and the plans carry the
  shape of the config and say what was scored.
- The same weights in our port and in transformers (a tiny Llama; SmolLM2 from its GGUF, slow): equal scores, equal
  distillation loss and gate gradients.
- ``multihead heads --retrieval --model FOLDER`` on a tiny saved Qwen2 folder writes the plans.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from torch import nn

from multihead import MultiheadError
from multihead.cache import HeadPlan, sink_keep
from multihead.evals.needles import Case
from multihead.heads.capture import capture_weights
from multihead.heads.engines import TransformersEngine, as_engine
from multihead.heads.retrieval import RetrievalSettings, copyable_steps, needle_spans, retrieval_scores
from multihead.hf.cache import layer_windows
from multihead.tradeoff import duo
from tiny_checkpoints import write_tiny_hf_qwen2

os.environ.setdefault("HF_HUB_OFFLINE", "1")

V = 97  # vocabulary of the tiny models
SLIDING = 6  # the sliding layers' window


def _decoder(config_cls: str, model_cls: str, **fields: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        base = {"vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
        base.update(fields)
        config = getattr(transformers, config_cls)(**base)
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)._from_config(config, attn_implementation="eager").eval()
        with torch.no_grad():  # scores of a few units (random init gives ~0.01): Gemma 2's softcap of 2 matters
            for name, p in model.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(12.0)
        return model
    return build


# family -> (builder, the layers that slide)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], list[int]]] = {
    "llama": (_decoder("LlamaConfig", "LlamaForCausalLM"), []),
    "qwen2": (_decoder("Qwen2Config", "Qwen2ForCausalLM"), []),
    "qwen3": (_decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=16), []),
    "mistral": (_decoder("MistralConfig", "MistralForCausalLM", sliding_window=SLIDING), [0, 1]),
    "gemma2": (_decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=SLIDING,
                        attn_logit_softcapping=2.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16), [0]),
    "gemma3": (_decoder("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16, sliding_window=SLIDING,
                        query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"]), [0]),
}
SHAPE = (2, 4, 2, 16)  # every family above: n_layers, n_heads, n_kv_heads, head_dim


def _case(n: int = 40, needle: int = 14, seed: int = 0) -> Case:
    """A random context of ``n`` tokens ending in a needle of ``needle`` copies of token 5 (within a sliding
    layer's window of the question), then the question (6, 7) and the answer (5, 5, 5): every key of the needle
    holds the answer's token, so a head whose top key lies in the needle copies (random weights put some there)."""
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(8, V, (n,), generator=gen).tolist()
    start = n - needle
    ctx[start:start + needle] = [5] * needle
    return Case(id=f"c{seed}", task="passkey", length=n + 2, depth=0.5, haystack="random", seed=seed,
                context_ids=tuple(ctx), question_ids=(6, 7), answer_ids=(5, 5, 5), answer="5 5 5",
                needles=((start, start + needle),))


def _patterns(model: nn.Module, ids: list[int]) -> list[torch.Tensor]:
    """Every layer's full (1, h, n, n) pattern of an uncached forward, from hook_pattern."""
    layers = [s.module for s in as_engine(model).sites()]
    return capture_weights(layers, lambda: model(torch.tensor([ids]), use_cache=False))


def _dense_mass(weights: list[torch.Tensor], sinks: int, window: int) -> np.ndarray:
    n = weights[0].shape[-1]
    rows = [p for p in range(n) if p >= sinks + window]
    out = np.zeros((len(weights), weights[0].shape[1]))
    for li, w in enumerate(weights):
        for p in rows:
            out[li] += [float(w[0, h, p, sinks:p - window + 1].double().sum()) for h in range(w.shape[1])]
    return out / len(rows)


def _dense_retrieval(weights: list[torch.Tensor], case: Case) -> np.ndarray:
    """Wu et al.'s count on the uncached patterns: the row predicting answer token j (the question's last for
    j = 0, answer token j - 1 after), its top key in the needle span holding that token."""
    ctx = list(case.context_ids)
    first = len(ctx) + len(case.question_ids) - 1
    steps = copyable_steps(case)
    out = np.zeros((len(weights), weights[0].shape[1]))
    for li, w in enumerate(weights):
        for j in steps:
            top = w[0, :, first + j].argmax(-1)  # (h,)
            for h, key in enumerate(top.tolist()):
                inside = any(a <= key < b for a, b in needle_spans(case))
                out[li, h] += inside and key < len(ctx) and ctx[key] == case.answer_ids[j]
    return out / len(steps)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_scores_equal_a_direct_count_on_the_layers_patterns(family: str) -> None:
    build, sliding = FAMILIES[family]
    model = build()
    case = _case()
    sinks, window = 2, 4
    st = RetrievalSettings(sinks=sinks, window=window, block=5, chunk=16, correct_only=False)
    got = retrieval_scores(model, [case], st)  # switches the model to multihead's attention in place
    assert model.config._attn_implementation == "multihead"
    with torch.no_grad():
        context = _patterns(model, list(case.context_ids))
        whole = _patterns(model, list(case.context_ids + case.question_ids + case.answer_ids))
    np.testing.assert_allclose(got.mass_outside, _dense_mass(context, sinks, window), atol=1e-5, rtol=0)
    want = _dense_retrieval(whole, case)
    np.testing.assert_array_equal(got.query, want)
    assert 0 < want.sum() < want.size, "some heads copy, some do not: the count can fail"
    assert got.mass_outside.shape == (2, 4) and got.kv.shape == (2, 2) and got.shape == SHAPE
    # a sliding layer's window (6) inside a streaming cache's (2 sinks + 8) loses nothing to it; full layers do
    wide = retrieval_scores(model, [case], RetrievalSettings(sinks=2, window=8, chunk=16, correct_only=False))
    for layer in range(2):
        if layer in sliding:
            assert float(np.abs(wide.mass_outside[layer]).max()) == 0.0
        else:
            assert float(wide.mass_outside[layer].min()) > 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_plan_has_the_configs_shape_and_says_what_was_scored(family: str, tmp_path: Path) -> None:
    build, sliding = FAMILIES[family]
    model = build()
    got = retrieval_scores(model, [_case()], RetrievalSettings(sinks=2, window=4, chunk=16, correct_only=False),
                           name=f"tiny-{family}")
    plan = got.plan(0.5)
    assert plan.model == f"tiny-{family}" and plan.shape == SHAPE and (plan.sinks, plan.window) == (2, 4)
    c = model.config
    windows = layer_windows(c, c.num_hidden_layers)
    assert plan.windows == tuple(windows) and plan.hybrid == (family in ("gemma2", "gemma3"))
    if plan.hybrid:  # the sliding layer keeps its window (both KV heads full); half the global layer's 2 heads
        assert plan.full[0] == (True, True) and sum(plan.full[1]) == 1 and plan.global_full_fraction == 0.5
        assert "over the 1 global layers' KV heads, the 1 sliding layers keeping their window" in plan.method
    else:
        assert sum(map(sum, plan.full)) == 2  # half of the 4 KV heads
    plan.check(n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
               head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads, windows=windows)
    assert plan.method.startswith("retrieval: Wu et al.'s retrieval score per KV head")
    assert "in transformers, attention on multihead" in plan.method
    if sliding:
        listed = "-".join(map(str, (sliding[0], sliding[-1]))) if len(sliding) > 1 else str(sliding[0])
        assert f"sliding-window layers {listed} (window {SLIDING}) scored under their own mask" in plan.method
    else:
        assert "sliding" not in plan.method
    assert ("softcapped at 2" in plan.method) == (family == "gemma2")
    assert HeadPlan.load(plan.save(tmp_path / "p.json")) == plan
    # the ranking: the retrieval score per KV head, ties broken by the dropped mass
    mass = got.mass_outside_kv
    np.testing.assert_allclose(plan.scores, got.kv + 1e-3 * mass / mass.max(), rtol=0, atol=1e-12)
    assert got.plan(0.25, "mass").scores == tuple(map(tuple, got.mass_outside_kv.tolist()))


# ---------------------------------------------------------------------------------------------- the gates
REFERENCE = "multihead-test-reference"
_EXTRA: dict[str, torch.Tensor] = {}  # "keep": (h, s, s) bool, narrowing every layer's own mask


def _reference_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         softcap: float | None = None, **kwargs: Any) -> Any:
    """transformers' own eager attention of the module's family, under the layer's mask and _EXTRA["keep"]."""
    s, t = query.shape[2], key.shape[2]
    own = (attention_mask[..., :t] if attention_mask is not None
           else torch.ones(s, t, dtype=torch.bool).tril(t - s)[None, None])  # (b | 1, 1, s, t)
    keep = own & _EXTRA["keep"][None] if "keep" in _EXTRA else own
    bias = torch.zeros(keep.shape, dtype=query.dtype).masked_fill(~keep, float("-inf"))
    eager = importlib.import_module(type(module).__module__).eager_attention_forward
    return eager(module, query, key, value, bias, dropout=0.0, scaling=scaling, softcap=softcap)


def _reference(model: nn.Module) -> nn.Module:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(REFERENCE, _reference_attention)
    AttentionMaskInterface.register(REFERENCE, sdpa_mask)
    ref = copy.deepcopy(model)
    ref.set_attn_implementation(REFERENCE)
    return ref


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_gated_forward_equals_eager_attention_under_the_per_head_mask(family: str) -> None:
    """KV head 0 streaming (gate 0), KV head 1 full (gate 1), in every layer: transformers' eager attention with
    query heads 0, 1 (KV head 0's) under sinks + window inside the layer's own mask, heads 2, 3 under that mask."""
    model = FAMILIES[family][0]()
    ref = _reference(model)
    sinks, window = 2, 4
    x = torch.tensor([list(_case().context_ids)])  # (1, 40)
    n = x.shape[1]
    pos = torch.arange(n)
    keep = torch.ones(4, n, n, dtype=torch.bool)
    keep[:2] = sink_keep(pos, pos, window=window, sink_tokens=sinks)
    gates = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    try:
        with torch.no_grad():
            plain = ref.base_model(input_ids=x, use_cache=False).last_hidden_state
            _EXTRA["keep"] = keep
            want = ref.base_model(input_ids=x, use_cache=False).last_hidden_state
            with duo.gated(model, gates, sinks=sinks, window=window):
                got = duo.final_hidden(model, x)
            with duo.gated(model, torch.ones(2, 2), sinks=sinks, window=window):
                ones = duo.final_hidden(model, x)
    finally:
        _EXTRA.clear()
    scale = float(plain.abs().max())
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5)
    torch.testing.assert_close(ones, plain, atol=1e-5 * scale, rtol=1e-5)
    assert float((want - plain).abs().max()) > 1e-3 * scale  # the streaming heads change the result: can fail
    plan = duo.plan_from_gates(model, gates.numpy(), 0.5, sinks=sinks, window=window, name="tiny")
    assert plan.shape == SHAPE and plan.full == ((False, True), (False, True))
    assert plan.method.startswith("duo: DuoAttention-style gates per KV head")


# ---------------------------------------------------------------------------------------------- the same weights
def _same_tiny_llama(tmp_path: Path) -> tuple[Any, nn.Module]:
    """The tiny Llama of tiny_checkpoints in our port (its GGUF) and in transformers (its folder): the same weights."""
    from multihead import hf
    from multihead.models import load_llama
    from tiny_checkpoints import write_tiny_gguf, write_tiny_hf_llama

    ours, _ = load_llama(write_tiny_gguf(tmp_path / "ours.gguf"))
    theirs = hf.load(write_tiny_hf_llama(tmp_path / "hf"))
    return ours, theirs


def _tiny_case(n: int = 90) -> Case:
    gen = torch.Generator().manual_seed(4)
    ctx = torch.randint(10, 250, (n,), generator=gen).tolist()
    ctx[40:52] = [7] * 12
    return Case(id="t", task="passkey", length=n + 2, depth=0.5, haystack="random", seed=0, context_ids=tuple(ctx),
                question_ids=(8, 9), answer_ids=(7, 7), answer="7 7", needles=((40, 52),))


def test_the_same_weights_score_the_same_in_our_port_and_in_transformers(tmp_path: Path) -> None:
    ours, theirs = _same_tiny_llama(tmp_path)
    st = RetrievalSettings(sinks=2, window=16, block=7, chunk=32, correct_only=False)
    a = retrieval_scores(ours, [_tiny_case()], st)
    b = retrieval_scores(theirs, [_tiny_case()], st)
    np.testing.assert_array_equal(b.query, a.query)
    np.testing.assert_allclose(b.mass_outside, a.mass_outside, atol=1e-6, rtol=0)
    assert b.shape == a.shape == (2, 4, 2, 4) and a.mass_rows == b.mass_rows == 90 - 18
    assert a.mass_outside.min() > 1e-3  # the dropped mass is not trivially zero
    # the gates: the same distillation loss and the same gradient on the gates
    settings = duo.DuoSettings(length=90, sinks=2, window=16)
    sample = duo.Sample("s", torch.tensor([list(_tiny_case().context_ids)]), slice(60, 90))
    grads = []
    for model in (ours, theirs):
        gates = torch.tensor([[0.2, 0.9], [0.6, 0.4]], requires_grad=True)
        loss = duo.distill_loss(model, gates, sample, settings)
        grads.append((loss.detach(), torch.autograd.grad(loss, gates)[0]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-3, atol=1e-7)
    assert float(grads[0][1].abs().max()) > 0


def test_a_model_that_is_not_a_decoder_is_refused_by_name() -> None:
    config = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=48)
    with pytest.raises(MultiheadError, match="BertModel is not a causal language model"):
        TransformersEngine(transformers.BertModel(config))
    with pytest.raises(MultiheadError, match="is not a model"):
        as_engine(object())
    with pytest.raises(MultiheadError, match=r"gates have shape \(3, 2\) but the model needs"):
        duo.plan_from_gates(FAMILIES["llama"][0](), np.zeros((3, 2)), 0.5, sinks=2, window=4)
    scores = retrieval_scores(FAMILIES["llama"][0](), [_case()],
                              RetrievalSettings(sinks=2, window=4, chunk=16, correct_only=False))
    with pytest.raises(MultiheadError, match="kind 'best' is unknown"):
        scores.plan(0.5, "best")
    scores.shape = None
    with pytest.raises(MultiheadError, match="carry no model shape"):
        scores.plan(0.5)


# ---------------------------------------------------------------------------------------------- SmolLM2 (slow)
def test_smollm2_through_transformers_scores_and_gates_as_our_port(smollm2, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    """SmolLM2 from its GGUF in our port and in transformers' LlamaForCausalLM (same weights, same kernels): the same
    retrieval scores and dropped mass on the same needle cases, the same distillation loss and gate gradients."""
    from multihead.heads.retrieval import long_cases

    ours, tok = smollm2
    theirs, _ = hf_smollm2
    cases = long_cases(tok, ours.config.max_context, lengths=(400,), tasks=("passkey", "single-number"), prompts=1)
    st = RetrievalSettings(sinks=4, window=64, block=64, chunk=128, correct_only=False)
    try:
        a = retrieval_scores(ours, cases, st)
        b = retrieval_scores(theirs, cases, st)
        settings = duo.DuoSettings(length=256, sinks=4, window=64)
        sample = duo.Sample("s", torch.tensor([list(cases[0].context_ids[:256])]), slice(200, 256))
        grads = []
        for model in (ours, theirs):
            gates = torch.linspace(0, 1, 90).reshape(30, 3).requires_grad_()
            loss = duo.distill_loss(model, gates, sample, settings)
            grads.append((loss.detach(), torch.autograd.grad(loss, gates)[0]))
    finally:
        theirs.set_attn_implementation("sdpa")  # the session's reference model, as the other tests use it
    assert [c["correct"] for c in b.cases] == [c["correct"] for c in a.cases]
    assert any(c["correct"] for c in a.cases)
    np.testing.assert_array_equal(b.query, a.query)
    assert a.query.max() > 0  # some heads copy the needle: the equality is not of zeros
    np.testing.assert_allclose(b.mass_outside, a.mass_outside, atol=1e-6, rtol=0)  # measured: 1.2e-7
    assert b.shape == a.shape == (30, 9, 3, 64)
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=0)  # measured: 5.7e-7 relative
    scale = float(grads[0][1].abs().max())
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=0, atol=1e-5 * scale)  # measured: 1.7e-6 of the max
    assert scale > 0


# ---------------------------------------------------------------------------------------------- the command
def test_heads_retrieval_on_a_hugging_face_folder_writes_its_plans(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from multihead.cli import main
    from multihead.evals import text

    real = text.read_text()
    monkeypatch.setattr(text, "read_text", lambda path=None: real[:40_000])  # the byte-level toy encodes it slowly
    folder = write_tiny_hf_qwen2(tmp_path / "tiny-qwen2")
    out = tmp_path / "h"
    argv = ["heads", "--model", str(folder), "--text", "the cat sat on the mat", "--out", str(out), "--retrieval",
            "--lengths", "300", "--tasks", "passkey", "--prompts", "1", "--sinks", "2", "--window", "16",
            "--all-cases", "--budget", "0.25,0.5", "--plan-by", "retrieval,mass", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["engine"] == "transformers, attention on multihead"
    r = data["retrieval"]
    assert np.array(r["query"]).shape == (2, 4) and r["shape"] == {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                                                    "head_dim": 8}
    assert "Qwen2ForCausalLM in transformers, attention on multihead" in r["scored"]
    want = [str(out / f"tiny-qwen2-{by}-{pct}-plan.json") for by in ("retrieval", "mass") for pct in (25, 50)]
    assert data["plans"] == want
    for path, (by, budget) in zip(want, [(b, f) for b in ("retrieval", "mass") for f in (0.25, 0.5)], strict=True):
        plan = HeadPlan.load(path)
        assert plan.model == "tiny-qwen2" and plan.shape == (2, 4, 2, 8) and plan.budget == budget
        assert (plan.sinks, plan.window) == (2, 16) and plan.method.startswith(f"{by}: ")
        assert sum(map(sum, plan.full)) == round(4 * budget)
        ranked = np.array(plan.scores).ravel()
        kept = np.array(plan.full).ravel()
        assert ranked[kept].min() >= ranked[~kept].max()  # the full heads are the best ranked
    np.testing.assert_allclose(HeadPlan.load(want[2]).scores, r["mass_outside_kv"], atol=1e-6)
    # the plan and the scores come from the model as transformers runs it: its own cache, its config's shape
    # (a plan fits it; a 2-KV-head plan of another model does not)
    with pytest.raises(MultiheadError, match="made for tiny-qwen2 of shape"):
        HeadPlan.load(want[0]).check(n_layers=2, n_heads=4, n_kv_heads=1, head_dim=8)
    assert main(["heads", "--model", str(folder), "--budget", "0.5", "--out", str(tmp_path / "g")]) == 2
    assert "--budget is for --retrieval: add --retrieval" in capsys.readouterr().err


def test_duo_gates_of_a_hugging_face_folder_and_their_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m multihead.tradeoff.duo --model FOLDER --budget 0.5` optimises the gates of a transformers model
    through hf.enable's hook points and writes the plan with the folder's name and its config's shape."""
    from multihead.evals import text

    real = text.read_text()
    monkeypatch.setattr(text, "read_text", lambda path=None: real[:40_000])
    folder = write_tiny_hf_qwen2(tmp_path / "tiny-qwen2")
    out = tmp_path / "duo"
    assert duo.main(["--model", str(folder), "--steps", "2", "--every", "1", "--length", "300", "--sinks", "2",
                     "--window", "16", "--lr", "0.2", "--budget", "0.5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"plan: {out / 'plan-duo-50.json'}" in printed
    gates = duo.read_gates(out / "gates.json")
    plan = HeadPlan.load(out / "plan-duo-50.json")
    assert gates.shape == (2, 2) and float(np.abs(gates - 1.0).max()) > 0  # the gates moved from their start
    assert plan.model == "tiny-qwen2" and plan.shape == (2, 4, 2, 8) and (plan.sinks, plan.window) == (2, 16)
    np.testing.assert_allclose(plan.scores, gates, rtol=0, atol=1e-6)
    assert "2 steps on 300-token prompts with 2 sinks + 16" in plan.method and "Qwen2ForCausalLM" in plan.method
    assert duo.main(["--model", str(folder), "--budget", "1.5", "--out", str(tmp_path / "x")]) == 2
    assert "--budget 1.5 must be a fraction" in capsys.readouterr().err
