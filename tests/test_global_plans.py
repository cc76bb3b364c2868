"""Head plans on a model with sliding and global layers (issue 49 item 5): a plan made over the global layers only,
its uniform control of the same bytes on the global layers, and the layer windows a plan records.

The bytes are the real caches' (``cache.bytes`` of what ``hf.new_cache`` allocates on a tiny random Gemma 3), not a
formula: the control's window is computed by :func:`equal_bytes_slots`, and the test checks that the two caches it
makes hold the same bytes to within one slot per global KV head (the rounding of the window)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from multihead import hf
from multihead.cache import HeadPlan
from multihead.errors import MultiheadError
from multihead.hf.cache import layer_windows
from multihead.models.decoder import TransformersDecoder
from multihead.tradeoff import longctx as lc
from multihead.tradeoff.longctx import shared
from multihead.tradeoff.longctx.methods import control_key, equal_bytes_slots

W = 16  # the tiny model's sliding window
TYPES = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
WINDOWS = (W, W, None, W, W, None)
SHAPE = (6, 4, 2, 16)  # n_layers, n_heads, n_kv_heads, head_dim


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           max_position_embeddings=512, sliding_window=W, layer_types=TYPES)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _scores() -> list[list[float]]:
    """Scores that rank every sliding layer's heads above the global ones: a plan over all layers would keep the
    sliding heads and stream the global ones."""
    return [[9.0, 8.0], [7.0, 6.5], [0.2, 0.9], [5.0, 4.0], [3.0, 2.0], [0.7, 0.1]]


def _plan(fraction: float, **kw: Any) -> HeadPlan:
    return HeadPlan.from_scores(_scores(), fraction, sinks=2, window=8, model="tiny-gemma3", shape=SHAPE,
                                method="test", **kw)


def test_a_plan_over_the_global_layers_keeps_every_sliding_head_and_ranks_the_global_ones() -> None:
    plan = _plan(0.5, windows=WINDOWS)
    assert plan.hybrid and plan.global_layers == [2, 5]
    assert plan.full == ((True, True), (True, True), (False, True), (True, True), (True, True), (True, False))
    assert plan.global_full_fraction == 0.5 and plan.budget == 0.5
    assert _plan(0.25, windows=WINDOWS).full[2] == (False, True) and sum(_plan(0.25, windows=WINDOWS).full[5]) == 0
    everywhere = _plan(0.5)  # no windows: every layer ranked, as before
    assert not everywhere.hybrid and everywhere.full[2] == (False, False) and everywhere.full_fraction == 0.5
    # a model whose every layer slides (Mistral) has no global layer to choose among: every layer is ranked
    assert not _plan(0.5, windows=(W,) * 6).hybrid and _plan(0.5, windows=(W,) * 6).full == everywhere.full


def test_a_plan_keeps_its_windows_through_json_and_an_older_file_without_them_loads(tmp_path: Path) -> None:
    plan = _plan(0.5, windows=WINDOWS)
    path = plan.save(tmp_path / "g-plan.json")
    assert json.loads(path.read_text())["windows"] == [W, W, None, W, W, None]
    assert HeadPlan.load(path) == plan
    older = json.loads(path.read_text())
    del older["windows"]
    (tmp_path / "old-plan.json").write_text(json.dumps(older))
    loaded = HeadPlan.load(tmp_path / "old-plan.json")
    assert loaded.windows is None and not loaded.hybrid and loaded.full == plan.full
    older["windows"] = [W, W, None]
    (tmp_path / "bad-plan.json").write_text(json.dumps(older))
    with pytest.raises(MultiheadError, match=r"field 'windows' \(\[16, 16, None\]\) must give each of the 6 layers"):
        HeadPlan.load(tmp_path / "bad-plan.json")


def test_a_model_of_other_windows_refuses_the_plan_naming_both() -> None:
    model = hf.enable(_model())
    other = _plan(0.5, windows=(W, None, None, W, W, None))
    with pytest.raises(MultiheadError, match=r"layer windows \(layers 0 window 16, layers 1-2 global|"
                                             r"layer 0 window 16, layers 1-2 global"):
        hf.new_cache(model, 64, plan=other)
    cache = hf.new_cache(model, 64, plan=_plan(0.5, windows=WINDOWS))  # its own windows: taken
    assert cache.bytes > 0


@pytest.mark.parametrize("length", [40, 200, 300])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_the_control_of_a_global_plan_holds_its_bytes_on_the_global_layers(tmp_path: Path, fraction: float,
                                                                         length: int) -> None:
    """The plan's head-wise cache and its control (sinks + window on the global layers, the sliding layers' rings
    whole) hold the same bytes, to one slot per global KV head: measured on the caches hf.new_cache allocates."""
    decoder = TransformersDecoder(hf.enable(_model()))
    assert layer_windows(decoder.model.config, 6) == list(WINDOWS)
    path = str(_plan(fraction, windows=WINDOWS).save(tmp_path / f"g{fraction}-plan.json"))
    settings = lc.Settings(lengths=(length,), tasks=("passkey",), sinks=2, keep=(), window_keep=(), bits=(),
                           mqa=False, prune=(), plans=(path,))
    methods = {m.name: m for m in settings.methods(2)}
    name = f"2 sinks + window = bytes of {fraction:.0%} of global full, 2 + 8, global layers"
    control = methods[name]
    assert control.layers == "global" and control.equal_to == path
    assert shared.controls_of(list(methods.values())) == {"head-wise g" + str(fraction): name}
    plan_bytes = methods[f"head-wise g{fraction}"].cache(decoder, length, length).bytes
    control_bytes = control.cache(decoder, length, length).bytes
    slot = 2 * 16 * 4 * 2  # K and V of one token of one KV head in float32
    n_global_heads = 2 * 2
    assert abs(plan_bytes - control_bytes) <= slot * n_global_heads
    slots = equal_bytes_slots(HeadPlan.load(path), length)
    assert slots <= length and (fraction < 1 or slots == length)


def test_plans_of_the_same_bytes_share_one_control() -> None:
    a = _plan(0.5, windows=WINDOWS)
    b = HeadPlan(full=((True, True), (True, True), (True, False), (True, True), (True, True), (False, True)),
                 sinks=2, window=8, model="tiny-gemma3", shape=SHAPE, windows=WINDOWS)
    assert control_key(a) == control_key(b)
    streaming_slide = HeadPlan(full=((True, False), (True, True), (True, True), (True, True), (True, True),
                                     (False, False)), sinks=2, window=8, model="tiny-gemma3", shape=SHAPE,
                               windows=WINDOWS)
    assert streaming_slide.global_full_fraction == a.global_full_fraction and control_key(streaming_slide) != \
        control_key(a)
