"""Caches of past tokens: one protocol (:mod:`multihead.cache.base`), one module per kind. Caches only store.

::

    slots = cache.reserve(s)                      once per model step: where the new tokens go, what each layer reads
    view  = cache.layer(i).update(k, v, slots)    in every layer, the one verb (a LatentCache's: update(latents, slots))
    cache.advance(s)                              the commit, after the step

``update`` returns a view (:mod:`multihead.cache.view`) of what the layer attends to, in the form the kind stores it;
:func:`multihead.kernels.attend` alone decides how to compute over it. :func:`compress` puts a full cache's prefill
into another kind as that kind keeps it (the shared-prefill protocol: one prefill, then each method's cache).

Kinds: :class:`KVCache` (every token, at its positions), :class:`SinkCache` (attention sinks + a window),
:class:`QuantizedKVCache` (low-bit codes, KIVI), :class:`LayeredCache` (one cache per layer of its own width),
:class:`LatentCache` (MLA's latents), :class:`HeadwiseCache` (each KV head full or sinks + window, as a
:class:`HeadPlan` says: its view has one group of keys per kind of KV head), :class:`HybridCache` (the layers of each
attention window in a part of their own: a sliding layer stores what it can see). :class:`CacheSpec` says which kind
to build, once, for our models and transformers models alike (:mod:`multihead.cache.spec`).
"""

from multihead.cache.base import BaseCache, BaseLayerCache, Cache, LayerCache, Slots, check_count, write_slots
from multihead.cache.compress import compress
from multihead.cache.full import KVCache
from multihead.cache.headwise import HeadwiseCache
from multihead.cache.hybrid import HybridCache
from multihead.cache.latent import LatentCache, LatentLayer
from multihead.cache.layered import LayeredCache
from multihead.cache.plan import HeadPlan
from multihead.cache.quantized import QuantizedKVCache, quantized_tokens
from multihead.cache.sink import SinkCache, sink_keep
from multihead.cache.spec import CacheShape, CacheSpec
from multihead.cache.view import DenseKV, GroupedKV, KVGroup, KVView, LatentKV, QuantizedKV
from multihead.quant import (
    QUANT_BITS,
    check_bits,
    dequantize,
    fake_quantize_keys,
    fake_quantize_values,
    pack,
    quantize,
    unpack,
)

__all__ = ["QUANT_BITS", "BaseCache", "BaseLayerCache", "Cache", "CacheShape", "CacheSpec", "DenseKV", "GroupedKV",
           "HeadPlan", "HeadwiseCache", "HybridCache", "KVCache", "KVGroup", "KVView", "LatentCache", "LatentKV",
           "LatentLayer", "LayerCache", "LayeredCache", "QuantizedKV", "QuantizedKVCache", "SinkCache", "Slots",
           "check_bits", "check_count", "compress", "dequantize", "fake_quantize_keys", "fake_quantize_values",
           "pack", "quantize", "quantized_tokens", "sink_keep", "unpack", "write_slots"]
