"""What the long-context benchmarks share (``benchmarks/headwise.py``, ``benchmarks/longctx_speed.py``): SmolLM2's
shape with random weights, the caches made directly at any length, and one chunked prefill followed by timed
decode steps through multihead's cache.

The caches are made directly, not through ``model.new_cache``: their decode steps may run past the model's
context (the time of a step does not depend on the positions' values).
"""

from __future__ import annotations

import time

import torch

from multihead.cache import Cache, HeadPlan, HeadwiseCache, KVCache, QuantizedKVCache, SinkCache
from multihead.errors import MultiheadError
from multihead.models import LlamaConfig, LlamaModel

SMOLLM2 = {"vocab_size": 49152, "d_model": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "ffn_dim": 1536,
           "rope_base": 100000.0, "max_context": 8192}
CACHE_KINDS = ("full", "sink", "int4", "int8", "headwise")


def load(random: bool, dtype: torch.dtype = torch.float32) -> LlamaModel:
    """SmolLM2-135M-Instruct (multihead.models.load_llama), or random weights of its shape (``random``)."""
    if random:
        torch.manual_seed(0)
        return LlamaModel(LlamaConfig(**SMOLLM2), dtype=dtype).eval()  # type: ignore[arg-type]
    from multihead.models import load_llama

    return load_llama(dtype=dtype)[0]


def make_cache(model: LlamaModel, kind: str, max_len: int, *, plan: HeadPlan | None = None, window: int = 256,
               sinks: int = 4, group: int = 32, residual: int = 128) -> Cache:
    """A cache of ``kind`` (:data:`CACHE_KINDS`) for one sequence of up to ``max_len`` tokens, in the model's
    dtype: every token (full), ``sinks`` + ``window`` (sink), 4 or 8 bits (int4, int8: ``group``, ``residual`` as
    :class:`~multihead.cache.QuantizedKVCache`), or each KV head as ``plan`` says (headwise)."""
    a = model.config.attention()
    assert a.n_kv_heads is not None and a.head_dim is not None
    shape = {"batch": 1, "n_kv_heads": a.n_kv_heads, "head_dim": a.head_dim, "n_layers": model.config.n_layers,
             "dtype": model.dtype}
    if kind == "full":
        return KVCache(max_len=max_len, **shape)
    if kind == "sink":
        return SinkCache(window=window, sink_tokens=sinks, **shape)
    if kind in ("int4", "int8"):
        return QuantizedKVCache(max_len=max_len, bits=int(kind[3:]), group=group, residual=residual, **shape)
    if kind == "headwise":
        if plan is None:
            raise MultiheadError("a head-wise cache needs a plan")
        return HeadwiseCache(plan, batch=1, max_len=max_len, dtype=model.dtype)
    raise MultiheadError(f"unknown cache kind {kind!r}: choose from {', '.join(CACHE_KINDS)}")


@torch.no_grad()
def prefill_decode(model: LlamaModel, cache: Cache, tokens: torch.Tensor, chunk: int, steps: int
                   ) -> tuple[float, list[float]]:
    """Prefill ``tokens`` (1, n) into ``cache`` in chunks of ``chunk`` (0: in one call), then ``steps`` greedy decode
    steps: (prefill seconds, each decode step's seconds)."""
    n = tokens.shape[1]
    chunk = chunk or n
    start = time.perf_counter()
    for at in range(0, n, chunk):
        part = tokens[:, at:at + chunk]
        logits = model(part, cache=cache, logits_to_keep=1)  # as transformers' generate: the last position only
        cache.advance(part.shape[1])
    prefill = time.perf_counter() - start
    nxt = logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(nxt, cache=cache)
        cache.advance(1)
        times.append(time.perf_counter() - t)
        nxt = logits[:, -1:].argmax(-1)
    return prefill, times

