"""Gemma 3 270M (the second real model: transformers reads its GGUF) with multihead's caches: after the same prefill
a full multihead cache holds the bytes of transformers' own DynamicCache and `multihead count --config` gives the
same figure; the quantized kinds hold fewer; greedy decoding through each kind that keeps every visible key gives
transformers' own tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import DynamicCache

from multihead import hf
from multihead.cache import HybridCache
from multihead.cli import main
from tests_support import attention

PASSAGE = (Path(__file__).parents[1] / "src" / "multihead" / "data" / "passage.txt").read_text()


def _prompt(tokenizer, n: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """n tokens of the shipped passage (repeated), with the tokenizer's BOS first."""
    ids = tokenizer(PASSAGE * (1 + 2 * n // len(PASSAGE.split())))["input_ids"][:n]
    assert len(ids) == n and ids[0] == tokenizer.bos_token_id
    return torch.tensor([ids])


def test_a_full_multihead_cache_holds_transformers_bytes_and_count_says_so(gemma3, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = gemma3
    n, new = 700, 6  # past the sliding window (512): the rings matter
    ids = _prompt(tokenizer, n)
    theirs = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=theirs, logits_to_keep=1)  # (the 262k-word head on one position, not 700)
        want = model.generate(ids, max_new_tokens=new, do_sample=False)
    their_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in theirs.layers)
    with attention(model, "multihead"), torch.no_grad():
        exact = hf.new_cache(model, n)
        model(ids, cache=exact, logits_to_keep=1)
        room = hf.new_cache(model, n + new)  # room for the decode steps
        got = model.generate(ids, cache=room, max_new_tokens=new, do_sample=False)
        quantized = {bits: hf.new_cache(model, n, bits=bits) for bits in (8, 4)}
        for cache in quantized.values():
            model(ids, cache=cache, logits_to_keep=1)
    assert isinstance(exact.inner, HybridCache)
    assert exact.bytes == their_bytes  # 15 sliding layers of 511 keys and 3 global ones of 700, float32
    assert abs(room.bytes - their_bytes) <= 0.02 * their_bytes
    assert torch.equal(got, want)
    assert quantized[4].bytes < quantized[8].bytes < exact.bytes
    config = tmp_path / "config.json"
    model.config.to_json_file(config)
    assert main(["count", "--config", str(config), "--seq", str(n), "--dtype", "fp32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kv_cache_bytes_total"] == report["kv_cache_bytes_as_cached"] == their_bytes


def test_the_shipped_plans_fit_gemma3_and_their_controls_hold_their_bytes(gemma3) -> None:  # type: ignore[no-untyped-def]
    """docs/experiments/gemma3-retrieval-{33,67}-plan.json (issue 49 item 5: chosen over the 3 global layers from
    retrieval scores on training cases) fit the real model's shape and windows, keep every sliding layer (its
    window ring), and the long-context run's uniform control of each (sinks + window on the global layers) holds the
    plan's bytes to one slot per global layer at 4,096 tokens: the caches are the real ones hf.new_cache makes."""
    from multihead.cache import HeadPlan, HeadwiseCache
    from multihead.hf.cache import layer_windows
    from multihead.models.decoder import TransformersDecoder
    from multihead.tradeoff.longctx.methods import Method

    model, _ = gemma3
    windows = layer_windows(model.config, 18)
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17]
    with attention(model, "multihead"):
        decoder = TransformersDecoder(model)
        for share, whole in ((33, [5]), (67, [5, 11])):
            path = str(Path(__file__).parents[1] / "docs" / "experiments" / f"gemma3-retrieval-{share}-plan.json")
            plan = HeadPlan.load(path)
            assert plan.windows == tuple(windows) and plan.hybrid
            assert [i for i in plan.global_layers if plan.full[i][0]] == whole
            assert all(plan.full[i] == (True,) for i, w in enumerate(windows) if w is not None)
            headwise = Method("plan", "x", plan=path).cache(decoder, 4096, 4096)
            control = Method("control", "x", sinks=4, equal_to=path, layers="global").cache(decoder, 4096, 4096)
            assert isinstance(headwise.inner, HeadwiseCache) and isinstance(control.inner, HybridCache)
            slot = 2 * 256 * 4  # K and V of one token of the one KV head (head_dim 256), float32
            assert abs(headwise.bytes - control.bytes) <= 3 * slot
