"""Perplexity beside retrieval: the last tokens of long held-out windows, fed through each method's real cache."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from multihead.errors import MultiheadError
from multihead.tradeoff.longctx.methods import Method


@torch.no_grad()
def long_perplexity(model: Any, method: Method, tokens: Sequence[int], *, context: int, scored: int,
                    windows: int, chunk: int) -> dict[str, Any]:
    """Perplexity of the last ``scored`` tokens of ``windows`` windows of ``context`` held-out tokens, each fed
    through the method's real cache in chunks (windowed caches hold their share of ``context``)."""
    if len(tokens) < context + 1:
        raise MultiheadError(f"the held-out text has {len(tokens):,} tokens, fewer than one perplexity window of "
                             f"{context:,}: use a shorter ppl_context")
    stride = max(1, (len(tokens) - context) // windows)
    total, count = 0.0, 0
    for w in range(windows):
        ids = torch.tensor(list(tokens[w * stride:w * stride + context]), dtype=torch.long)[None]  # (1, context)
        cache = method.cache(model, context, context)
        parts = []
        for start in range(0, context, chunk):
            parts.append(model(ids[:, start:start + chunk], cache=cache)[0, :, :])
            cache.advance(parts[-1].shape[0])
        logits = torch.cat(parts)[-scored - 1:-1]  # (scored, vocab): predictions of the last `scored` tokens
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = -logp.gather(-1, ids[0, -scored:, None]).squeeze(-1)
        total += float(nll.double().sum())
        count += scored
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count, "context": context,
            "windows": windows}


__all__ = ["long_perplexity"]
