"""A model's answer to a needle case, read through a real cache.

The prompt is prefilled through the cache in chunks (a server's chunked prefill); the answer is teacher-forced one
token at a time. The greedy answer equals the expected one exactly when every teacher-forced step's argmax is the
expected token (greedy decoding follows the same prefix as long as it agrees), so one pass gives the exact match,
the answer tokens' log-likelihood and the decode step time. Cases that share a prompt share its prefill (the cache is
copied after the prompt's context).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from multihead.errors import MultiheadError
from multihead.evals.needles import Case


class CacheMaker(Protocol):
    """A way of caching by name: the cache it makes for a prompt of ``length`` tokens (room for ``max_len`` where a
    cache holds every token), as :class:`multihead.tradeoff.longctx.methods.Method` does for each KV-saving method."""

    @property
    def name(self) -> str: ...

    def cache(self, model: Any, length: int, max_len: int) -> Any: ...


@dataclass(frozen=True)
class FullCache:
    """The full cache: every key and value of the prompt and the answer."""

    name: str = "full cache"

    def cache(self, model: Any, length: int, max_len: int) -> Any:
        return model.new_cache(1, max_len)


FULL_CACHE = FullCache()


@torch.no_grad()
def prefill(model: Any, ids: Sequence[int], cache: Any, chunk: int) -> Tensor:
    """Feed ``ids`` through ``cache`` in chunks (a server's chunked prefill); the last position's logits (vocab,)."""
    tokens = torch.tensor(list(ids), dtype=torch.long, device=getattr(model, "device", None))[None]  # (1, n)
    out = None
    for start in range(0, tokens.shape[1], chunk):
        part = tokens[:, start:start + chunk]
        out = model(part, cache=cache, logits_to_keep=1)  # the next token's logits only
        cache.advance(part.shape[1])
    if out is None:
        raise MultiheadError("nothing to prefill: the context is empty")
    last: Tensor = out[0, -1]
    return last


@torch.no_grad()
def answer_steps(model: Any, cache: Any, question: Sequence[int], answer: Sequence[int]) -> dict[str, Any]:
    """After the context is in ``cache``: the question as one chunk, then the answer teacher-forced one token a
    step. Returns per answer token its log-probability and argmax, and the seconds of each single-token step."""
    device = getattr(model, "device", None)
    q = torch.tensor(list(question), dtype=torch.long, device=device)[None]  # (1, s)
    logits = model(q, cache=cache)[0, -1]
    cache.advance(q.shape[1])
    logps, picks, steps = [], [], []
    for i, token in enumerate(answer):
        logp = torch.log_softmax(logits.float(), dim=-1)
        logps.append(float(logp[token]))
        picks.append(int(logits.argmax()))
        if i + 1 == len(answer):
            break
        began = time.perf_counter()
        logits = model(torch.tensor([[token]], dtype=torch.long, device=device), cache=cache)[0, -1]
        cache.advance(1)
        steps.append(time.perf_counter() - began)
    return {"logprobs": logps, "argmax": picks, "step_seconds": steps}


def score(case: Case, steps: dict[str, Any]) -> dict[str, Any]:
    """Exact match and log-likelihood of one case from :func:`answer_steps`. ``greedy_ids``: the greedy answer as
    far as it is known (up to and including its first wrong token)."""
    expected = list(case.answer_ids)
    picks = steps["argmax"]
    wrong = next((i for i, (a, b) in enumerate(zip(picks, expected, strict=True)) if a != b), None)
    greedy = picks if wrong is None else picks[:wrong + 1]
    return {"correct": wrong is None, "first_wrong": wrong, "greedy_ids": greedy,
            "answer_logprob": float(sum(steps["logprobs"])), "answer_tokens": len(expected),
            "decode_step_seconds": statistics.median(steps["step_seconds"]) if steps["step_seconds"] else None}


def run_prompt(model: Any, method: CacheMaker, cases: Sequence[Case], chunk: int) -> list[dict[str, Any]]:
    """Every case of one prompt (they share ``context_ids``) under one method: one prefill, the cache copied for
    each question but the last."""
    context = cases[0].context_ids
    if any(c.context_ids != context for c in cases):
        raise MultiheadError("run_prompt takes the cases of one prompt: their context_ids differ")
    room = max(len(context) + len(c.question_ids) + len(c.answer_ids) for c in cases)
    cache = method.cache(model, cases[0].length, room)
    began = time.perf_counter()
    prefill(model, context, cache, chunk)
    seconds = time.perf_counter() - began
    out = []
    for i, case in enumerate(cases):
        mine = cache if i + 1 == len(cases) else copy.deepcopy(cache)
        result = score(case, answer_steps(model, mine, case.question_ids, case.answer_ids))
        result.update(id=case.id, method=method.name, task=case.task, length=case.length, depth=case.depth,
                      haystack=case.haystack, group=case.group, prefill_seconds=round(seconds, 4),
                      prefill_tokens=len(context), cache_bytes=int(mine.bytes))
        out.append(result)
    return out


__all__ = ["FULL_CACHE", "CacheMaker", "FullCache", "answer_steps", "prefill", "run_prompt", "score"]
