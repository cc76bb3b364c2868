"""benchmarks/tl_compare.py's multihead side (TransformerLens lives in out/tl-venv and is never imported here): the
tiny GPT-2 is the same model on every build and survives the save the two tools read it back from, the prompt batch
is well formed, and the DLA, patching and composition figures it hands to the comparison are multihead's own, in
TransformerLens's layout ([writer layer, writer head, reader layer, reader head])."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from multihead.heads.composition import circuits, composition_score, composition_scores

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tl_compare as bench

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = {"n_layer": 2, "n_embd": 32, "n_positions": 16}


def test_the_tiny_gpt2_is_deterministic_and_reads_back_from_its_folder(tmp_path: Path) -> None:
    a, b = bench.tiny_gpt2(), bench.tiny_gpt2()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    ln = a.transformer.h[0].ln_1
    assert not torch.allclose(ln.weight, torch.ones_like(ln.weight)) and float(ln.bias.detach().abs().max()) > 0
    folder = bench.prepare("tiny-gpt2", tmp_path)
    model, tokenizer = bench.load(folder)
    ids = torch.arange(10)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, a(ids).logits, rtol=0, atol=0)
    assert tokenizer.vocab_size == bench.TINY["vocab_size"] and tokenizer.encode("t5 t7") == [5, 7]


def test_the_prompt_batch_is_pairs_of_equal_shape_with_distinct_answers() -> None:
    model = bench.tiny_gpt2()

    class Words:
        vocab_size = model.config.vocab_size

    clean, corrupt, answers, wrongs = bench.prompt_batch("tiny-gpt2", Words())
    assert clean.shape == corrupt.shape == (4, 8) and answers.shape == wrongs.shape == (4,)
    assert bool((answers != wrongs).all()) and bool((clean[:, 1:4] != corrupt[:, 1:4]).any())
    torch.testing.assert_close(clean[:, 4:], corrupt[:, 4:], rtol=0, atol=0)


def test_the_multihead_side_hands_multiheads_figures_in_tl_layout() -> None:
    model = bench.tiny_gpt2(**SMALL)

    class Words:
        vocab_size = model.config.vocab_size

    clean, corrupt, answers, wrongs = bench.prompt_batch("tiny-gpt2", Words())
    mh = bench.mh_prepare(model)
    assert mh is not model and not hasattr(model.transformer.h[0].attn, "hook_z")  # the original stays plain
    dla = bench.mh_dla(mh, clean, answers, wrongs)
    assert dla["heads"].shape == (4, 2, 4) and dla["mlps"].shape == (4, 2) and dla["embed"].shape == (4,)
    with torch.no_grad():
        last = model(clean).logits[:, -1].double()
    rows = torch.arange(4)
    np.testing.assert_allclose(dla["logit_diff"], (last[rows, answers] - last[rows, wrongs]).numpy(), atol=1e-5)
    assert float(np.abs(dla["remainder"]).max()) < 1e-4
    effects = bench.mh_patching(mh, clean, corrupt, answers, wrongs)
    assert effects.shape == (2, 4) and np.isfinite(effects).all()
    grid = bench.mh_composition(model)
    comp = composition_scores(model, samples=1)
    assert set(grid) == {"q", "k", "v"} and grid["q"].shape == (2, 4, 2, 4)
    layers = circuits(model).layers
    for writer_head in range(4):
        for reader_head in range(4):  # [writer layer, writer head, reader layer, reader head], as TL's
            ov = layers[0].ov(writer_head)
            assert grid["q"][0, writer_head, 1, reader_head] == pytest.approx(
                composition_score(ov, layers[1].qk(reader_head)), rel=1e-9)
            assert grid["v"][0, writer_head, 1, reader_head] == pytest.approx(
                composition_score(ov, layers[1].ov(reader_head)), rel=1e-9)
    np.testing.assert_array_equal(grid["k"][0, :, 1, :], comp.scores("k", 0, 1).T)
    for kind in grid:  # a writer never composes into its own or an earlier layer
        assert not grid[kind][1, :, :, :].any() and not grid[kind][0, :, 0, :].any()
