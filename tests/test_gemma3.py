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
