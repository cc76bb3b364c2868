"""Compress a full cache into another kind after the prefill: kvpress's protocol, over the one cache protocol.

::

    full = model.new_cache(b, n)                 # the context prefilled once, every key kept
    model(context, cache=full); full.advance(n)
    small = compress(full, model.new_cache(b, window=256, sink_tokens=4))   # what each method keeps of those keys
    model(question, cache=small); small.advance(q)                           # then decoded through the smaller cache

Every kind keeps what its own commit keeps: the context's keys and values go through ``reserve`` / ``update`` /
``advance`` as one chunk, so a sink + window cache keeps the sinks and the last keys, a quantized one quantizes the
whole groups past its residual, a head-wise one keeps every key for its full KV heads and sinks + window for its
streaming ones. Only the keys differ from a prefill through the smaller cache itself (the streaming protocol): here
they were computed by a model that saw every context key (the question is not seen while compressing), which is how
kvpress's presses and DuoAttention's evaluation compress; one prefill then serves every method.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.cache.base import Cache
from multihead.cache.full import KVCache
from multihead.cache.hybrid import HybridCache
from multihead.cache.sink import SinkCache
from multihead.errors import MultiheadError


def compress(full: Cache, into: Cache) -> Cache:
    """Put the tokens ``full`` holds into the empty cache ``into`` as ``into``'s own kind keeps them, and return it.

    ``full`` is a full cache: a :class:`KVCache`, or for a model with sliding layers the
    :class:`~.hybrid.HybridCache` :func:`multihead.hf.cache.new_cache` makes (its global layers' KVCache, each sliding
    window's ring of its last ``window - 1`` keys). It must hold every sequence at one length (a batch of one prompt
    length: the kinds that evict hold one length); ``into`` must be empty and of the same batch, layers, KV heads and
    head_dim. ``full`` is left as it was.

    A sliding layer's ring holds only its last keys: the positions before them, which no later query of the layer
    can see, are given to ``into`` as copies of the first key held (so a quantized ring's group at the window's
    edge is quantized from the held keys alone)."""
    if into is full:
        raise MultiheadError("compress writes into another cache, not the cache itself")
    if not isinstance(into, Cache):
        raise MultiheadError(f"compress writes into a cache of keys and values, not a {type(into).__name__}")
    held = _held_layers(full)
    n = full.used
    if not bool((full.lengths == n).all()):
        raise MultiheadError(f"compress needs every sequence at one length: the full cache holds lengths "
                             f"{full.lengths.tolist()}")
    if into.used:
        raise MultiheadError(f"compress writes into an empty cache: this {type(into).__name__} holds {into.used} "
                             "tokens (reset() it)")
    shape = (full.batch, full.n_layers, full.n_kv_heads, full.head_dim)
    if (into.batch, into.n_layers, into.n_kv_heads, into.head_dim) != shape:
        raise MultiheadError(f"compress: the full cache holds (batch, layers, n_kv_heads, head_dim) {shape} but the "
                             f"{type(into).__name__} holds "
                             f"{(into.batch, into.n_layers, into.n_kv_heads, into.head_dim)}")
    if n == 0:
        return into
    if isinstance(into, HybridCache):  # a step per window: each part reserves its own slots
        by_window = {w: into.reserve(n, attention_window=w) for w in dict.fromkeys(into.windows)}
        slots = [by_window[w] for w in into.windows]
    else:
        slots = [into.reserve(n)] * full.n_layers
    for layer, (keys, values) in enumerate(held):
        into.update(layer, _padded(keys, n), _padded(values, n), slots[layer])  # (b, g, n, d)
    into.advance(n)
    return into


def _held_layers(full: Cache) -> list[tuple[Tensor, Tensor]]:
    """Each layer's held keys and values (b, g, m, d) in position order, the last m of the ``full.used`` tokens."""
    n = full.used
    if isinstance(full, KVCache):
        return [(full.k[layer, :, :, :n], full.v[layer, :, :, :n]) for layer in range(full.n_layers)]
    if not isinstance(full, HybridCache):
        raise MultiheadError(f"compress reads a full cache (a KVCache, or a HybridCache of full layers and sliding "
                             f"rings), not a {type(full).__name__}")
    out: list[tuple[Tensor, Tensor]] = []
    seen: dict[int | None, int] = {}
    for w in full.windows:
        index = seen.get(w, 0)
        seen[w] = index + 1
        part = full.part(w)
        if isinstance(part, KVCache) and w is None:
            out.append((part.k[index, :, :, :n], part.v[index, :, :, :n]))
        elif isinstance(part, SinkCache) and part.sink_tokens == 0 and part.window == w:
            m = min(n, part.capacity)
            order = torch.argsort(part.slot_positions[:m])  # the ring's slots in position order: n - m .. n - 1
            out.append((part.k[index].index_select(2, order), part.v[index].index_select(2, order)))
        else:
            raise MultiheadError(f"compress reads a full cache: its layers of window {w} hold a "
                                 f"{type(part).__name__}, not every key they can see")
    return out


def _padded(x: Tensor, n: int) -> Tensor:
    """``x`` (b, g, m, d), the last m of n positions, as n: the first m positions given the first held row."""
    m = x.shape[2]
    if m == n:
        return x
    return torch.cat([x[:, :, :1].expand(-1, -1, n - m, -1), x], dim=2)
