"""CacheSpec: which cache to build, said once, for our models and for transformers models alike.

::

    spec  = CacheSpec(max_len=4096, bits=4)             the kind and its options, checked when made
    cache = spec.build(shape, batch=1, dtype=..., device=...)   the real cache for a model of that CacheShape
    spec.bytes(shape, batch=1, dtype=...)               the bytes that cache holds, its tensors made on the meta
                                                        device: nothing allocated, the same figure as cache.bytes

The kinds (``spec.kind``)::

    full       every key of max_len tokens                             KVCache
    window     sink_tokens sinks and a window of keys                  SinkCache (max_len: the tokens it is for)
    quantized  bits-bit codes in groups, the newest residual in full   QuantizedKVCache (KIVI)
    headwise   each KV head full or the plan's sinks + window          HeadwiseCache (a HeadPlan of the model's shape)
    latent     MLA's latents: one compressed latent and RoPE key a token LatentCache (a shape with ``latent`` widths)

A :class:`CacheShape` is what a model tells the spec: its layers' KV heads (this process's) and attention windows
(None: global; a sliding layer of Gemma 2/3, Mistral or gpt-oss gives its window), n_heads, head_dim and context;
an MLA model gives its latent widths instead (:meth:`CacheShape.mla`), and caches latents only.
Every kind stores what each layer can see: the layers of each window get a part of their own
(:class:`~multihead.cache.HybridCache`), a sliding layer's full cache is a ring of its window, a quantized one a ring
of whole code groups, sinks + window never wider than the layer's own; ``layers="global"`` applies the kind to the
global layers only, the sliding ones keeping their window. Layers of different widths (a pruned model) get one
cache each (:class:`~multihead.cache.LayeredCache`).

:meth:`multihead.models.LlamaModel.new_cache` and :func:`multihead.hf.new_cache` take a spec (``spec=``) or its
options as keywords; the long-context and perplexity trade-offs hold specs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from multihead.cache.base import BaseCache, Cache
from multihead.cache.full import KVCache
from multihead.cache.headwise import HeadwiseCache
from multihead.cache.hybrid import HybridCache
from multihead.cache.latent import LatentCache
from multihead.cache.layered import LayeredCache
from multihead.cache.plan import HeadPlan
from multihead.cache.quantized import QuantizedKVCache
from multihead.cache.sink import SinkCache
from multihead.errors import MultiheadError
from multihead.quant import check_bits

KINDS = ("full", "window", "quantized", "headwise", "latent")
LAYERS = ("all", "global")


def _int(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise MultiheadError(f"{name} ({value!r}) must be an int of at least {least}")


@dataclass(frozen=True)
class CacheShape:
    """What a cache is built for: ``kv_heads`` (each layer's KV heads in this process), ``windows`` (each layer's
    attention window, None for a global layer), ``n_heads`` (query heads), ``head_dim``, ``context`` (the model's
    longest sequence, None: unbounded) and ``split`` (the KV heads are split over processes). ``latent``: an MLA
    model's (kv_lora_rank, rope_dim), whose layers cache one latent of that width a token (:meth:`mla`)."""

    kv_heads: tuple[int, ...]
    windows: tuple[int | None, ...]
    n_heads: int
    head_dim: int
    context: int | None = None
    split: bool = False
    latent: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_heads", tuple(self.kv_heads))
        object.__setattr__(self, "windows", tuple(self.windows))
        if not self.kv_heads:
            raise MultiheadError("a cache shape needs at least one layer")
        if len(self.windows) != len(self.kv_heads):
            raise MultiheadError(f"a cache shape gives {len(self.kv_heads)} layers' KV heads but {len(self.windows)} "
                                 "layers' windows")
        for g in self.kv_heads:
            _int("n_kv_heads of a layer", g, 1)
        for w in self.windows:
            if w is not None:
                _int("a layer's window", w, 2)
        _int("n_heads", self.n_heads, 1)
        _int("head_dim", self.head_dim, 1)
        if self.context is not None:
            _int("context", self.context, 1)
        if self.latent is not None:
            if not isinstance(self.latent, tuple) or len(self.latent) != 2:
                raise MultiheadError(f"latent ({self.latent!r}) must be (kv_lora_rank, rope_dim)")
            _int("kv_lora_rank", self.latent[0], 1)
            _int("rope_dim", self.latent[1], 0)
            if any(w is not None for w in self.windows):
                raise MultiheadError("an MLA model's layers are global: a latent shape takes no windows")

    @property
    def n_layers(self) -> int:
        return len(self.kv_heads)

    @classmethod
    def mla(cls, *, n_layers: int, n_heads: int, kv_lora_rank: int, rope_dim: int,
            context: int | None = None) -> CacheShape:
        """An MLA model's shape: every layer caches one latent of kv_lora_rank + rope_dim values a token (one
        latent head shared by the n_heads query heads)."""
        _int("kv_lora_rank", kv_lora_rank, 1)
        _int("rope_dim", rope_dim, 0)
        return cls(kv_heads=(1,) * n_layers, windows=(None,) * n_layers, n_heads=n_heads,
                   head_dim=kv_lora_rank + rope_dim, context=context, latent=(kv_lora_rank, rope_dim))

    @classmethod
    def uniform(cls, *, n_layers: int, n_kv_heads: int, n_heads: int, head_dim: int, context: int | None = None,
                windows: Sequence[int | None] | None = None) -> CacheShape:
        """Every layer of one width; every layer global unless ``windows`` says otherwise."""
        return cls(kv_heads=(n_kv_heads,) * n_layers, windows=tuple(windows or (None,) * n_layers),
                   n_heads=n_heads, head_dim=head_dim, context=context)


@dataclass(frozen=True)
class CacheSpec:
    """One cache kind and its options (the module docstring lists the kinds): ``max_len`` tokens (the full,
    quantized and head-wise kinds need it; a windowed cache takes it as the tokens it is for), ``window`` with
    ``sink_tokens`` (sinks + a window), ``bits`` with ``group`` and ``residual`` (quantized), ``plan`` (head-wise),
    ``latent`` (MLA's latents, for a model whose shape has latent widths), ``layers`` ("all", or "global": a hybrid
    model's global layers only). Checked when made: a bad option or a
    mix of kinds raises a MultiheadError saying what to give."""

    max_len: int | None = None
    window: int | None = None
    sink_tokens: int = 0
    bits: int | None = None
    group: int = 32
    residual: int = 128
    plan: HeadPlan | None = None
    layers: str = "all"
    latent: bool = False

    def __post_init__(self) -> None:
        if self.layers not in LAYERS:
            raise MultiheadError(f"layers={self.layers!r} is not a choice: 'all' (the kind on every layer) or "
                                 "'global' (on the global layers only, the sliding ones keeping their window)")
        if self.max_len is not None:
            _int("max_len", self.max_len, 1)
        _int("sink_tokens", self.sink_tokens, 0)
        _int("group", self.group, 1)
        _int("residual", self.residual, 0)
        if not isinstance(self.latent, bool):
            raise MultiheadError(f"latent must be True or False, got {self.latent!r}")
        if self.latent:
            others = [name for name, given in (("window", self.window is not None), ("bits", self.bits is not None),
                                               ("plan", self.plan is not None), ("sink_tokens", bool(self.sink_tokens)),
                                               ("layers", self.layers != "all")) if given]
            if others:
                raise MultiheadError(f"a latent cache holds every token's latent: give CacheSpec(max_len, latent=True) "
                                     f"without {', '.join(name + '=' for name in others)}")
            if self.max_len is None:
                raise MultiheadError("a latent cache needs max_len (the tokens it holds)")
            return
        if self.plan is not None:
            if not isinstance(self.plan, HeadPlan):
                raise MultiheadError(f"plan must be a HeadPlan (HeadPlan.load(path)), got {type(self.plan).__name__}")
            if self.layers == "global":
                raise MultiheadError("a head plan says what each layer keeps, sliding ones included: give plan= "
                                     "without layers='global'")
            if self.window is not None or self.sink_tokens or self.bits is not None:
                raise MultiheadError("a head plan brings its own sinks and window and stores keys in full: give "
                                     "new_cache(b, max_len, plan=plan) without window=, sink_tokens= or bits=")
            if self.max_len is None:
                raise MultiheadError("new_cache(b, max_len, plan=plan) needs max_len (the tokens a full KV head "
                                     "holds)")
            return
        if self.window is not None:
            _int("window", self.window, 1)
            if self.bits is not None:
                raise MultiheadError(f"a sinks + window cache stores its keys in full precision: give window= (with "
                                     f"sink_tokens=) or bits={self.bits}, not both")
            return
        if self.max_len is None:
            raise MultiheadError("new_cache needs max_len (the tokens it holds), or window= for a windowed cache")
        if self.sink_tokens:
            raise MultiheadError(f"sink_tokens ({self.sink_tokens}) go with a window: new_cache(b, window=w, "
                                 "sink_tokens=n)")
        if self.bits is not None:
            check_bits(self.bits)

    @property
    def kind(self) -> str:
        """full, window, quantized, headwise or latent."""
        if self.latent:
            return "latent"
        if self.plan is not None:
            return "headwise"
        if self.window is not None:
            return "window"
        return "quantized" if self.bits is not None else "full"

    def with_max_len(self, max_len: int | None) -> CacheSpec:
        """The same kind for ``max_len`` tokens."""
        return replace(self, max_len=max_len)

    def options(self) -> dict[str, Any]:
        """The keyword options that make this spec (``CacheSpec(**spec.options()) == spec``), defaults left out."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    # ------------------------------------------------------------------ building
    def build(self, shape: CacheShape, *, batch: int = 1, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> BaseCache:
        """The cache of this kind for a model of ``shape``: ``batch`` sequences of one length, tensors of ``dtype``
        on ``device`` (the model's). Refuses (naming the values) a max_len past the model's context, a plan of
        another shape or windows, a head-wise cache over split KV heads or layers of several widths, and
        ``layers='global'`` on a model whose every layer slides."""
        if self.max_len is not None and shape.context is not None and self.max_len > shape.context:
            raise MultiheadError(f"max_len ({self.max_len}) exceeds the model's context ({shape.context})")
        sliding = [w for w in shape.windows if w is not None]
        if self.layers == "global" and len(sliding) == shape.n_layers:
            raise MultiheadError(f"layers='global' but every layer of this model slides (windows "
                                 f"{sorted(set(sliding))}): there is no global layer to apply the kind to")
        where: dict[str, Any] = {"batch": batch, "dtype": dtype, "device": device}
        if shape.latent is not None or self.latent:
            return self._latent(shape, where)
        if self.plan is not None:
            return self._headwise(shape, where)
        widths = set(shape.kv_heads)
        windows = shape.windows
        if len(widths) > 1:
            if sliding:
                raise MultiheadError("layers of several widths with sliding windows: no cache holds both (a pruned "
                                     "hybrid model)")
            return LayeredCache([self._part(None, 1, g, shape.head_dim, where) for g in shape.kv_heads])
        g = shape.kv_heads[0]
        counts: dict[int | None, int] = {}
        for w in windows:
            counts[w] = counts.get(w, 0) + 1
        if set(counts) == {None}:
            return self._part(None, shape.n_layers, g, shape.head_dim, where)
        return HybridCache({w: self._part(w, n, g, shape.head_dim, where) for w, n in counts.items()}, windows)

    def bytes(self, shape: CacheShape, *, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """The bytes :meth:`build` allocates for ``shape`` (its tensors made on the meta device: nothing held)."""
        return int(self.build(shape, batch=batch, dtype=dtype, device="meta").bytes)

    def _latent(self, shape: CacheShape, where: dict[str, Any]) -> LatentCache:
        if shape.latent is None:
            raise MultiheadError("latent=True is for a multi-head latent attention model (CacheShape.mla): this model "
                                 "caches keys and values")
        if not self.latent:
            raise MultiheadError(f"an MLA model caches latents: give CacheSpec(max_len, latent=True), not a "
                                 f"{self.kind} cache")
        assert self.max_len is not None
        rank, rope = shape.latent
        return LatentCache(kv_lora_rank=rank, rope_dim=rope, max_len=self.max_len, n_layers=shape.n_layers, **where)

    def _headwise(self, shape: CacheShape, where: dict[str, Any]) -> HeadwiseCache:
        plan = self.plan
        assert plan is not None and self.max_len is not None
        if shape.split:
            raise MultiheadError("a head-wise cache runs in one process: this model's KV heads are split over "
                                 "processes")
        if len(set(shape.kv_heads)) > 1:
            raise MultiheadError(f"this model's layers hold different numbers of KV heads ({list(shape.kv_heads)}): "
                                 "a head plan is for a model of one shape")
        plan.check(n_layers=shape.n_layers, n_heads=shape.n_heads, n_kv_heads=shape.kv_heads[0],
                   head_dim=shape.head_dim, windows=shape.windows)
        windows = None if all(w is None for w in shape.windows) else shape.windows
        return HeadwiseCache(plan, max_len=self.max_len, windows=windows, **where)

    def _part(self, layer_window: int | None, n: int, g: int, d: int, where: dict[str, Any]) -> Cache:
        """The cache of ``n`` layers of attention window ``layer_window`` (None: global), ``g`` KV heads each."""
        shape = {"n_kv_heads": g, "head_dim": d, "n_layers": n, **where}
        max_len = self.max_len
        if layer_window is not None and self.layers == "global":  # the whole window, as the full kind keeps it
            return SinkCache(window=layer_window, sink_tokens=0, max_len=max_len, **shape)
        if self.window is not None:  # sinks + a window: within a sliding layer's own window
            if layer_window is not None and self.window >= layer_window:
                return SinkCache(window=layer_window, sink_tokens=0, max_len=max_len, **shape)
            return SinkCache(window=self.window, sink_tokens=self.sink_tokens, max_len=max_len, **shape)
        assert max_len is not None
        if layer_window is not None:
            ring = SinkCache(window=layer_window, sink_tokens=0, max_len=max_len, **shape)
            if self.bits is None:
                return ring
            codes = QuantizedKVCache(bits=self.bits, group=self.group, residual=self.residual, max_len=max_len,
                                     window=layer_window, **shape)
            return codes if codes.bytes < ring.bytes else ring  # a window within the residual: the window as it is
        if self.bits is not None:
            return QuantizedKVCache(bits=self.bits, group=self.group, residual=self.residual, max_len=max_len,
                                    **shape)
        return KVCache(max_len=max_len, **shape)


def spec_of(spec: CacheSpec | None, max_len: int | None, options: dict[str, Any]) -> CacheSpec:
    """The spec a ``new_cache(b, max_len, spec=..., **options)`` call asks for: ``spec`` (then neither options nor
    another max_len), or one made of ``max_len`` and the options."""
    if spec is None:
        return CacheSpec(max_len, **options)
    if not isinstance(spec, CacheSpec):
        raise MultiheadError(f"spec must be a CacheSpec, got {type(spec).__name__}")
    given = {k: v for k, v in options.items() if v != CacheSpec.__dataclass_fields__[k].default}
    if given or (max_len is not None and max_len != spec.max_len):
        named = ", ".join([*(f"{k}=" for k in given), *(["max_len"] if max_len is not None else [])])
        raise MultiheadError(f"give spec= alone or the cache's options, not both (got spec= with {named})")
    return spec


__all__ = ["KINDS", "LAYERS", "CacheShape", "CacheSpec", "spec_of"]
