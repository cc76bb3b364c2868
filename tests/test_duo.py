"""DuoAttention-style gates (multihead.tradeoff.duo): the gated forward against masked models, the optimisation, its
checkpoint, its settings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from multihead import MultiHeadAttention, MultiheadError
from multihead.cache import sink_keep
from multihead.layers.hooks import run_with_cache
from multihead.layers.linear import linear
from multihead.models.llama import LlamaConfig, LlamaModel
from multihead.tradeoff import duo
from multihead.tradeoff import longctx as lc
from test_longctx import CHARS, JARGON, TOK

SINKS, WINDOW, LENGTH = 3, 24, 300  # a tiny model's streaming mask and training prompts (char tokens)


def _model(n_kv_heads: int = 2, n_layers: int = 2, seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(CHARS), d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=n_kv_heads,
                         ffn_dim=64, max_context=512)
    return LlamaModel(config).eval()


def _tokens(n: int = 80) -> torch.Tensor:
    return torch.tensor(JARGON[:n], dtype=torch.long)[None]  # (1, n)


def _stream_keep(n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return sink_keep(pos, pos, window=WINDOW, sink_tokens=SINKS)  # (n, n)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_gates_at_one_give_the_plain_model_and_at_zero_the_streaming_masked_one(n_kv_heads: int) -> None:
    model, x = _model(n_kv_heads), _tokens()
    with torch.no_grad():
        plain = model(x)
        streaming = model(x, mask=_stream_keep(x.shape[1]))  # every head under sinks + window, uncached
        with duo.gated(model, torch.ones(2, n_kv_heads), sinks=SINKS, window=WINDOW):
            ones = model(x)
        with duo.gated(model, torch.zeros(2, n_kv_heads), sinks=SINKS, window=WINDOW):
            zeros = model(x)
        after = model(x)
    torch.testing.assert_close(ones, plain, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(zeros, streaming, atol=1e-5, rtol=1e-5)
    assert (streaming - plain).abs().max() > 1e-3  # the window matters at this length: the test can fail
    torch.testing.assert_close(after, plain, atol=0, rtol=0)  # the hooks are gone


@pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_a_gate_covers_its_kv_heads_query_heads(n_kv_heads: int) -> None:
    """KV head 0 full, the others streaming, in every layer: the model under the per-query-head mask that gives
    KV head 0's query heads the causal mask and the rest sinks + window."""
    model, x = _model(n_kv_heads), _tokens()
    n, per = x.shape[1], 4 // n_kv_heads
    gates = torch.zeros(2, n_kv_heads)
    gates[:, 0] = 1.0
    keep = _stream_keep(n)[None].repeat(4, 1, 1)  # (h, s, s)
    keep[:per] = torch.ones(n, n, dtype=torch.bool).tril()  # query heads 0 .. per - 1 read KV head 0
    with torch.no_grad():
        want = model(x, mask=keep[None])  # (1, h, s, s)
        with duo.gated(model, gates, sinks=SINKS, window=WINDOW):
            got = model(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_layer_mixes_each_heads_full_and_streaming_output_by_its_kv_heads_gate() -> None:
    """One GQA layer, fractional gates: o_proj of the per-head mix of z captured under the causal mask and under the
    streaming mask."""
    torch.manual_seed(1)
    layer = MultiHeadAttention(d_model=48, n_heads=6, n_kv_heads=3, rope=10000.0).eval()
    x = torch.randn(2, 60, 48)
    gates = torch.tensor([[0.25, 1.0, 0.6]])
    with torch.no_grad():
        _, full = run_with_cache(layer, x, causal=True, names="hook_z")
        _, stream = run_with_cache(layer, x, mask=_stream_keep(60), names="hook_z")
        a = gates[0].repeat_interleave(2)[None, :, None, None]  # (1, h, 1, 1): query head i reads KV head i // 2
        z = a * full["hook_z"] + (1 - a) * stream["hook_z"]  # (b, h, s, d)
        want = layer.o_proj(z.transpose(1, 2).reshape(2, 60, -1))
        with duo.gated(layer, gates, sinks=SINKS, window=WINDOW):
            got = layer(x, causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_final_hidden_states_are_the_models_before_its_lm_head() -> None:
    model, x = _model(), _tokens()
    with torch.no_grad():
        torch.testing.assert_close(linear(duo.final_hidden(model, x), model.embed.weight), model(x))


def test_the_distillation_loss_falls_as_the_gates_are_optimised_and_the_weights_stay_frozen() -> None:
    """From every head streaming (gates 0) and no L1: the gates rise and the loss on a fixed prompt falls; only the
    gates change."""
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    settings = duo.DuoSettings(steps=3, lr=0.3, l1=0.0, length=LENGTH, sinks=SINKS, window=WINDOW, init=0.0,
                               warmup=0, tasks=("passkey",))
    sample = duo.training_sample(settings, lc.Haystacks(TOK, JARGON), 0, max_context=512)
    with torch.no_grad():
        start = float(duo.distill_loss(model, torch.zeros(2, 2), sample, settings))
    gates, history = duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, progress=False)
    with torch.no_grad():
        end = float(duo.distill_loss(model, torch.from_numpy(gates), sample, settings))
    assert start > 0 and end < 0.7 * start
    assert gates.shape == (2, 2) and gates.min() >= 0 and gates.max() <= 1 and gates.mean() > 0.3
    assert [h["step"] for h in history] == [1, 2, 3]
    assert not any(p.requires_grad for p in model.parameters())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0)


def test_a_stopped_and_rerun_optimisation_gives_the_gates_of_an_uninterrupted_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = duo.DuoSettings(steps=3, lr=0.1, l1=0.02, length=256, sinks=SINKS, window=WINDOW, every=1,
                               tasks=("passkey",))
    model = _model()
    whole, whole_history = duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, progress=False)
    real_save = duo._save

    def save_then_stop(*args: Any) -> None:
        real_save(*args)
        raise KeyboardInterrupt  # killed right after the first checkpoint (step 1)

    monkeypatch.setattr(duo, "_save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, out=tmp_path, progress=False)
    assert json.loads((tmp_path / "state.json").read_text())["step"] == 1
    monkeypatch.setattr(duo, "_save", real_save)
    # rerun asking for 2 steps (a run goes on to more steps from its checkpoint), then for all 3
    duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, out=tmp_path, progress=False, steps=2)
    resumed, history = duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, out=tmp_path,
                                          progress=False)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert [h["sample"] for h in history] == [h["sample"] for h in whole_history]
    np.testing.assert_allclose(resumed, whole, atol=1e-7, rtol=0)
    assert (whole != settings.init).any()  # the gates moved: the comparison can fail
    saved = json.loads((tmp_path / "gates.json").read_text())
    np.testing.assert_allclose(np.array(saved["gates"]), resumed, atol=0, rtol=0)
    assert saved["settings"] == settings.stamp() and saved["step"] == 3
    np.testing.assert_allclose(duo.read_gates(tmp_path / "gates.json"), resumed, atol=0, rtol=0)
    with pytest.raises(MultiheadError, match="holds 3 steps, more than the 2 asked"):
        duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, out=tmp_path, progress=False, steps=2)
    with pytest.raises(MultiheadError, match="made with other settings"):
        duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, out=tmp_path, progress=False, l1=0.5)
    with pytest.raises(MultiheadError, match=r"shape \[2, 2\] but this model needs \[2, 4\]"):
        duo.optimise_gates(_model(4), settings, tokenizer=TOK, text_ids=JARGON, out=tmp_path, progress=False)


def test_training_prompts_are_never_the_evaluations() -> None:
    sources = lc.Haystacks(TOK, JARGON)
    settings = duo.DuoSettings(length=LENGTH, sinks=SINKS, window=WINDOW)
    evaluation = lc.make_cases(lc.Settings(lengths=(LENGTH,), tasks=("passkey", "single-number"), prompts=20,
                                           keep=(0.5,), windows=()), TOK, JARGON, max_context=512)
    seen = {c.context_ids + c.question_ids for c in evaluation}
    answers = {c.answer for c in evaluation}
    for step in range(20):
        sample = duo.training_sample(settings, sources, step, max_context=512)
        prompt = tuple(sample.tokens[0, :LENGTH].tolist())  # context and question; the answer follows
        assert prompt not in seen
        answer = TOK.decode(sample.tokens[0, LENGTH:].tolist()).strip()
        assert answer not in answers
        assert TOK.decode(sample.tokens[0, sample.scored].tolist()).startswith("\n\nWhat is the")


@pytest.mark.parametrize(("change", "match"), [
    ({"l1": -0.1}, r"l1 \(-0.1\) must be a finite number in \[0.0, 100.0\]"),
    ({"steps": 0}, r"steps \(0\) must be an integer of at least 1"),
    ({"window": 2, "sinks": 4}, r"window \(2\) must not be shorter than the 4 sinks"),
    ({"window": 400, "length": 300}, r"window \(400\) covers the whole prompt of 300 tokens"),
    ({"lr": 0.0}, r"lr \(0.0\) must be a finite number in \(0.0, 1.0\]"),
    ({"init": 1.5}, r"init \(1.5\) must be a finite number in \[0.0, 1.0\]"),
    ({"tasks": ("multikey",)}, "choose from passkey, single-number, single-word"),
])
def test_bad_settings_are_refused_with_the_value_and_the_fix(change: dict[str, Any], match: str) -> None:
    with pytest.raises(MultiheadError, match=match):
        duo.DuoSettings(**change)


def test_a_length_over_the_models_context_and_bad_gates_are_refused() -> None:
    model = _model()
    with pytest.raises(MultiheadError, match=r"length 500 exceeds the model's context of 512 tokens"):
        duo.optimise_gates(model, tokenizer=TOK, text_ids=JARGON, length=500, window=WINDOW, progress=False)
    with pytest.raises(MultiheadError, match="unknown gate optimisation setting"):
        duo.optimise_gates(model, tokenizer=TOK, text_ids=JARGON, windows=3, progress=False)
    shape = r"gates have shape \(2, 3\) but the model needs .* \(2, 2\)"
    with pytest.raises(MultiheadError, match=shape), duo.gated(model, torch.ones(2, 3), sinks=SINKS, window=WINDOW):
        pass
    bad = torch.full((2, 2), 1.5)
    with pytest.raises(MultiheadError, match=r"gates must lie in \[0, 1\]"), duo.gated(model, bad, sinks=1, window=4):
        pass
    cache = model.new_cache(1, 64)
    with torch.no_grad(), duo.gated(model, torch.ones(2, 2), sinks=SINKS, window=WINDOW):
        model(_tokens(8), cache=cache)
        cache.advance(8)
        with pytest.raises(MultiheadError, match="the gated forward is for uncached calls"):
            model(_tokens(1), cache=cache)


def test_top_heads_and_the_command_lines_user_errors() -> None:
    assert duo.top_heads(np.array([[0.1, 0.9], [0.5, 0.9]]), 3) == [(0, 1, 0.9), (1, 1, 0.9), (1, 0, 0.5)]
    assert duo.main(["--steps", "0"]) == 2


def test_averaged_gates_are_the_mean_of_the_steps_after_average_from_and_survive_a_stop(tmp_path: Path) -> None:
    """The gates after each step, read from a run taken one step at a time (every step a checkpoint), against a
    run of all steps averaging from step 2: its gates are the mean of steps 3-5, its plans are made from them, and a
    run stopped after step 3 and resumed gives the same average."""
    settings = duo.DuoSettings(steps=5, lr=0.1, l1=0.02, length=256, sinks=SINKS, window=WINDOW, every=1,
                               tasks=("passkey",))
    model = _model()
    each = []
    for k in range(1, 6):  # the plain run, step by step: no average
        duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, out=tmp_path / "plain", progress=False,
                           steps=k)
        each.append(np.array(json.loads((tmp_path / "plain" / "gates.json").read_text())["gates"]))
    assert not np.allclose(each[2], each[4])  # the gates still move: a mean differs from the last
    averaged, _ = duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, progress=False,
                                     average_from=2)
    np.testing.assert_allclose(averaged, np.mean(each[2:], axis=0), atol=1e-6, rtol=0)
    # stopped after step 3 (one step averaged), resumed to 5
    duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, out=tmp_path / "avg", progress=False,
                       steps=3, average_from=2)
    saved = json.loads((tmp_path / "avg" / "gates.json").read_text())
    assert saved["average"]["after"] == 2 and saved["average"]["steps"] == 1
    resumed, _ = duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, out=tmp_path / "avg",
                                    progress=False, average_from=2)
    np.testing.assert_allclose(resumed, averaged, atol=1e-6, rtol=0)
    # a run past step 2 that did not average cannot average from 2; from its own step on it can (the plain run)
    with pytest.raises(MultiheadError, match=r"is at step 5, past average_from 2, and did not average those steps"):
        duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, out=tmp_path / "plain", progress=False,
                           steps=6, average_from=2)
    more, _ = duo.optimise_gates(model, settings, tokenizer=TOK, text_ids=JARGON, out=tmp_path / "plain",
                                 progress=False, steps=6, average_from=5)
    np.testing.assert_allclose(more, json.loads((tmp_path / "plain" / "gates.json").read_text())["gates"], atol=1e-6)
    plan = duo.plan_from_gates(model, averaged, 0.5, sinks=SINKS, window=WINDOW,
                               settings=dataclasses.replace(settings, average_from=2))
    assert "gates averaged over steps 3-5" in plan.method
    with pytest.raises(MultiheadError, match=r"average_from \(5\) must be below the 5 steps"):
        duo.DuoSettings(steps=5, average_from=5)
