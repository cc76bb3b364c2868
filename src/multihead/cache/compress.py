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

from multihead.cache.base import Cache
from multihead.cache.full import KVCache
from multihead.errors import MultiheadError


def compress(full: KVCache, into: Cache) -> Cache:
    """Put the tokens ``full`` holds into the empty cache ``into`` as ``into``'s own kind keeps them, and return it.

    ``full`` must hold every sequence at one length (a batch of one prompt length: the kinds that evict hold one
    length); ``into`` must be empty and of the same batch, layers, KV heads and head_dim. ``full`` is left as it
    was."""
    if not isinstance(full, KVCache):
        raise MultiheadError(f"compress reads a full KVCache, not a {type(full).__name__}")
    if into is full:
        raise MultiheadError("compress writes into another cache, not the cache itself")
    if not isinstance(into, Cache):
        raise MultiheadError(f"compress writes into a cache of keys and values, not a {type(into).__name__}")
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
    slots = into.reserve(n)
    for layer in range(full.n_layers):
        into.update(layer, full.k[layer, :, :, :n], full.v[layer, :, :, :n], slots)  # (b, g, n, d) views
    into.advance(n)
    return into
