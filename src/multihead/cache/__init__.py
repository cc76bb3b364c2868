"""Caches of past tokens: one protocol (:mod:`multihead.cache.base`), one module per kind.

::

    slots = cache.plan(s)                        once per model step: where the new tokens go, what each layer reads
    k, v  = cache.layer(i).update(k, v, slots)   in every layer, the one verb (a LatentCache's: update(latents, slots))
    cache.advance(s)                             the commit, after the step

Kinds: :class:`KVCache` (every token, at its positions), :class:`SinkCache` (attention sinks + a window),
:class:`QuantizedKVCache` (low-bit codes, KIVI), :class:`LayeredCache` (one cache per layer of its own width),
:class:`LatentCache` (MLA's latents), :class:`HeadwiseCache` (each KV head full or sinks + window, as a
:class:`HeadPlan` says; its layers' verb is ``update_groups``, one (keys, values) per group of KV heads).
"""

from multihead.cache.base import BaseCache, Cache, LayerCache, LayerView, Slots, check_count, write_slots
from multihead.cache.full import KVCache
from multihead.cache.headwise import HeadGroup, HeadwiseCache, HeadwiseLayer
from multihead.cache.latent import LatentCache, LatentLayer
from multihead.cache.layered import LayeredCache
from multihead.cache.plan import HeadPlan
from multihead.cache.quantized import (
    QUANT_BITS,
    QuantizedKVCache,
    check_bits,
    dequantize,
    fake_quantize_keys,
    fake_quantize_values,
    pack,
    quantize,
    quantized_tokens,
    unpack,
)
from multihead.cache.sink import SinkCache, sink_keep

__all__ = ["QUANT_BITS", "BaseCache", "Cache", "HeadGroup", "HeadPlan", "HeadwiseCache", "HeadwiseLayer", "KVCache",
           "LatentCache", "LatentLayer", "LayerCache", "LayerView", "LayeredCache", "QuantizedKVCache", "SinkCache",
           "Slots", "check_bits", "check_count", "dequantize", "fake_quantize_keys", "fake_quantize_values", "pack",
           "quantize", "quantized_tokens", "sink_keep", "unpack", "write_slots"]
