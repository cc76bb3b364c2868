"""What an attention configuration costs: parameters, FLOPs, KV-cache and attention-matrix memory.

Pure functions of an :class:`AttentionConfig`; each docstring carries its formula. Legend: b batch, s query length,
t key length, h = n_heads, g = n_kv_heads, d = head_dim, D = d_model. Query heads and KV heads are counted apart
everywhere: K and V are g heads wide, and g alone sets the size of the cache.

FLOPs count matrix multiplications, 2 per multiply-add (the convention of the FlashAttention and Chinchilla papers
and of ``torch.utils.flop_counter``); biases, scaling, masking and softmax are elementwise and not counted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from multihead.config import AttentionConfig, MLAConfig
from multihead.errors import MultiheadError

# Bytes of one element. int8 and fp8 caches also keep scales in practice; those are not counted here.
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4, "float32": 4,
    "fp16": 2, "float16": 2,
    "bf16": 2, "bfloat16": 2,
    "int8": 1,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a named dtype (fp32, fp16, bf16, int8, fp8; torch spellings such as float16 too)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise MultiheadError(f"dtype {dtype!r} is unknown: choose one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def _attention(config: object, what: str) -> None:
    """``config`` must be an AttentionConfig (a ModelConfig or an MLAConfig raised a bare AttributeError)."""
    if isinstance(config, AttentionConfig):
        return
    hint = {"ModelConfig": "; a ModelConfig's is its .attention (the whole model: multihead.sizing)",
            "MLAConfig": "; an MLA layer is sized by mla_parameters, mla_flops, mla_cache_bytes and mla_report"}
    name = type(config).__name__
    raise MultiheadError(f"cost.{what} takes an AttentionConfig (one layer's attention), got {name}"
                         f"{hint.get(name, '')}")


def _mla(config: object, what: str) -> None:
    if not isinstance(config, MLAConfig):
        raise MultiheadError(f"cost.{what} takes an MLAConfig, got {type(config).__name__}"
                             + ("; MHA/GQA/MQA layers: parameters, flops, kv_cache_bytes"
                                if isinstance(config, AttentionConfig) else ""))


def _dims(config: AttentionConfig) -> tuple[int, int, int, int, int, int]:
    assert config.n_kv_heads is not None and config.head_dim is not None
    assert config.kv_dim is not None and config.value_dim is not None
    return config.n_heads, config.n_kv_heads, config.head_dim, config.d_model, config.kv_dim, config.value_dim


def _check_sizes(**sizes: int | None) -> None:
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MultiheadError(f"{name} ({value!r}) must be a non-negative int")


# ---------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class ParamCount:
    """Parameters of one layer's projections (weights and biases)."""

    q_proj: int
    k_proj: int
    v_proj: int
    o_proj: int
    weights: int
    biases: int

    @property
    def total(self) -> int:
        return self.weights + self.biases


def parameters(config: AttentionConfig) -> ParamCount:
    """Parameters of one attention layer.

    ::

        W_Q: D * h*d  (+ h*d bias)      W_K: kv_dim * g*d  (+ g*d)      W_V: value_dim * g*d  (+ g*d)
        W_O: h*d * D  (+ D bias)

    For MHA with d = D / h and no biases this is 4 D^2 (67,108,864 for D = 4096).
    """
    _attention(config, "parameters")
    h, g, d, D, kv_dim, value_dim = _dims(config)
    qb = h * d if config.bias else 0
    kb = g * d if config.bias else 0
    ob = D if config.out_bias else 0
    wq, wk, wv, wo = D * h * d, kv_dim * g * d, value_dim * g * d, h * d * D
    return ParamCount(q_proj=wq + qb, k_proj=wk + kb, v_proj=wv + kb, o_proj=wo + ob,
                      weights=wq + wk + wv + wo, biases=qb + 2 * kb + ob)


# ---------------------------------------------------------------------------------------------- FLOPs
def attended_pairs(s: int, t: int, *, causal: bool = False, window: int | None = None,
                   chunk: int | None = None) -> int:
    """The number of (query, key) pairs that may attend, for one sequence and one head.

    Causal attention is aligned bottom-right: query i sits at position p = t - s + i and sees keys
    max(0, p - window + 1) .. p, that is min(p + 1, window) keys when p >= 0 and none otherwise; with ``chunk``
    (Llama 4's chunked attention) the keys of its own chunk up to itself, floor(p / chunk) chunk .. p, that is
    p mod chunk + 1 keys. So::

        pairs = s * t                                        (not causal)
        pairs = F(t) - F(max(0, t - s)),  F(n) = sum_{u=1..n} min(u, window)    (causal)
        pairs = G(t) - G(max(0, t - s)),  G(n) = sum_{p=0..n-1} (p mod chunk + 1)    (causal, chunked)

    For s == t without a window, F(t) = t (t + 1) / 2: slightly more than half of s * t, never exactly half.
    """
    _check_sizes(s=s, t=t)
    if chunk is not None:
        if not causal or window is not None:
            raise MultiheadError(f"chunk ({chunk}) is causal chunked attention: pass causal=True and no window "
                                 f"(got causal={causal}, window={window})")
        _check_sizes(chunk=chunk)
        if chunk < 1:
            raise MultiheadError(f"chunk ({chunk}) must be at least 1")

        def g(n: int) -> int:
            whole, r = divmod(n, chunk)
            return whole * (chunk * (chunk + 1) // 2) + r * (r + 1) // 2

        return g(t) - g(max(0, t - s))
    if not causal:
        if window is not None:
            raise MultiheadError(f"window ({window}) is a causal sliding window: pass causal=True with it")
        return s * t
    w = math.inf if window is None else window

    def f(n: int) -> int:
        if n <= w:
            return n * (n + 1) // 2
        wi = int(w)
        return wi * (wi + 1) // 2 + (n - wi) * wi

    return f(t) - f(max(0, t - s))


@dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs of one attention layer, by matmul."""

    q_proj: int
    k_proj: int
    v_proj: int
    scores: int
    values: int
    o_proj: int

    @property
    def projections(self) -> int:
        return self.q_proj + self.k_proj + self.v_proj + self.o_proj

    @property
    def attention(self) -> int:
        """The attention core: Q K^T and P V."""
        return self.scores + self.values

    @property
    def forward(self) -> int:
        return self.projections + self.attention

    @property
    def backward(self) -> int:
        """Two matmuls of the same size per forward matmul (gradients of both operands): 2x forward.

        Fused kernels that recompute the scores in the backward pass (FlashAttention) spend one more Q K^T,
        i.e. 2.5x the forward attention core.
        """
        return 2 * self.forward


def flops(
    config: AttentionConfig,
    *,
    s: int,
    t: int | None = None,
    batch: int = 1,
    causal: bool = False,
    exact_mask: bool = True,
    chunk: int | None = None,
) -> FlopCount:
    """Forward FLOPs of one layer for ``batch`` sequences of s queries over t keys (t = s for self-attention);
    ``chunk``: a chunked-attention layer's chunk (Llama 4), for a config without a window.

    ::

        q_proj = 2 b s D (h d)          k_proj = 2 b t kv_dim (g d)      v_proj = 2 b t value_dim (g d)
        scores = 2 b h d P              values = 2 b h d P               o_proj = 2 b s (h d) D

    where P = attended_pairs(s, t, causal, window, chunk): causal, sliding-window and chunked attention are counted
    exactly, pair by pair. With ``exact_mask=False``, P = s t: what a dense kernel multiplies (and what torch's
    FlopCounterMode reports, since it does not see masks). Each query head does its own Q K^T, so the core scales
    with h, not g.
    """
    _attention(config, "flops")
    t = s if t is None else t
    _check_sizes(s=s, t=t, batch=batch)
    h, g, d, D, kv_dim, value_dim = _dims(config)
    if config.window is not None and not causal:
        raise MultiheadError(f"this config has a sliding window ({config.window}), which is causal: pass causal=True")
    pairs = attended_pairs(s, t, causal=causal, window=config.window, chunk=chunk) if exact_mask else s * t
    return FlopCount(
        q_proj=2 * batch * s * D * h * d,
        k_proj=2 * batch * t * kv_dim * g * d,
        v_proj=2 * batch * t * value_dim * g * d,
        scores=2 * batch * h * d * pairs,
        values=2 * batch * h * d * pairs,
        o_proj=2 * batch * s * h * d * D,
    )


# ---------------------------------------------------------------------------------------------- memory
def kv_cache_bytes_per_token_per_layer(config: AttentionConfig, dtype: str = "bf16") -> int:
    """Bytes one token adds to one layer's cache: 2 (K and V) * g * d * bytes(dtype).

    It depends on n_kv_heads, not n_heads: GQA with g = h / 8 caches 8x less than MHA.
    """
    _attention(config, "kv_cache_bytes_per_token_per_layer")
    _, g, d, *_ = _dims(config)
    return 2 * g * d * dtype_bytes(dtype)


def cached_tokens(config: AttentionConfig, context: int) -> int:
    """Tokens each sequence keeps in the cache between steps: the context, or with a sliding window of w the last
    min(context, w - 1) (the next token joins them: it sees w keys, itself included), as transformers'
    DynamicSlidingWindowLayer and :class:`multihead.cache.SinkCache` keep them."""
    _attention(config, "cached_tokens")
    _check_sizes(context=context)
    return LayerAttention.of(config).cached_tokens(context)


def kv_cache_bytes(
    config: AttentionConfig, *, context: int, batch: int = 1, n_layers: int = 1, dtype: str = "bf16"
) -> int:
    """The KV cache: per-token bytes * min(context, window) * batch * n_layers."""
    _attention(config, "kv_cache_bytes")
    _check_sizes(batch=batch, n_layers=n_layers)
    return kv_cache_bytes_per_token_per_layer(config, dtype) * cached_tokens(config, context) * batch * n_layers


def sink_cache_bytes(config: AttentionConfig, *, window: int, sink_tokens: int, batch: int = 1, n_layers: int = 1,
                     dtype: str = "bf16") -> int:
    """A cache of attention sinks and a sliding window (:class:`multihead.cache.SinkCache`), the same for any
    context: per-token bytes * (sink_tokens + window - 1) * batch * n_layers (the next token joins them)."""
    _attention(config, "sink_cache_bytes")
    _check_sizes(window=window, sink_tokens=sink_tokens, batch=batch, n_layers=n_layers)
    if window < 1:
        raise MultiheadError(f"window ({window}) must be at least 1")
    return kv_cache_bytes_per_token_per_layer(config, dtype) * (sink_tokens + window - 1) * batch * n_layers


def quantized_cache_bytes(config: AttentionConfig, *, context: int, bits: int, group: int = 32, residual: int = 128,
                          batch: int = 1, n_layers: int = 1, dtype: str = "bf16") -> int:
    """A KV cache quantized to ``bits`` bits (:class:`multihead.cache.QuantizedKVCache`) holding ``context``
    tokens, per KV head of each layer and sequence::

        codes          2 * rows * d * bits / 8                rows = context (a sliding layer: its ring's)
        key scales     2 * ceil(rows / group) * d * 2         (float16 scale and minimum per channel per token group)
        value scales   2 * rows * (d / group) * 2             (float16 scale and minimum per token per channel group)
        residual       2 * (residual + group) * d * bytes(dtype)   (the newest tokens, in full precision)

    A layer of ``config.window`` W (a sliding layer) keeps its codes in a ring of whole groups that covers the W - 1
    keys it can see beside the residual: rows = group * min(ceil(context / group), ceil((W - 1 - residual) /
    group)), so its bytes stop growing at the window (:func:`multihead.cache.quantized.ring_groups`); where that
    is no smaller than the window itself in full precision (2 * min(context, W - 1) * d * bytes(dtype): a window
    within KIVI's full-precision residual, as gpt-oss's 128), the layer keeps the window in full precision, as
    :func:`multihead.hf.cache.new_cache` builds it.
    """
    _attention(config, "quantized_cache_bytes")
    _check_sizes(context=context, bits=bits, group=group, residual=residual, batch=batch, n_layers=n_layers)
    _, g, d, *_ = _dims(config)
    if bits not in (2, 4, 8):
        raise MultiheadError(f"bits ({bits}) is not a supported cache width: choose one of 2, 4, 8")
    if group < 1 or d % group:
        raise MultiheadError(f"group ({group}) must divide head_dim ({d})")
    groups = -(-context // group)
    rows = context
    if config.window is not None:
        from multihead.cache.quantized import ring_groups

        groups = min(groups, ring_groups(config.window, group=group, residual=residual))
        rows = groups * group
    codes = 2 * rows * d * bits // 8
    scales = 2 * groups * d * 2 + 2 * rows * (d // group) * 2
    full = 2 * (residual + group) * d * dtype_bytes(dtype)
    per_head = codes + scales + full
    if config.window is not None:
        per_head = min(per_head, 2 * min(context, config.window - 1) * d * dtype_bytes(dtype))
    return per_head * g * batch * n_layers


def max_context(
    config: AttentionConfig, *, memory_bytes: int, batch: int = 1, n_layers: int = 1, dtype: str = "bf16"
) -> int | None:
    """The longest context whose KV cache fits in memory_bytes; None when any context fits (a window caps it)."""
    _attention(config, "max_context")
    _check_sizes(memory_bytes=memory_bytes, batch=batch, n_layers=n_layers)
    per_token = kv_cache_bytes_per_token_per_layer(config, dtype) * batch * n_layers
    if per_token == 0:
        return None
    fits = memory_bytes // per_token
    if config.window is not None and fits >= config.window - 1:
        return None
    return fits


def attention_matrix_bytes(config: AttentionConfig, *, s: int, t: int | None = None, batch: int = 1,
                           dtype: str = "fp32") -> int:
    """The score/weight matrix the math path materialises for one layer: b * h * s * t * bytes(dtype).

    It grows with the square of the context: the reason fused kernels exist.
    """
    _attention(config, "attention_matrix_bytes")
    t = s if t is None else t
    _check_sizes(s=s, t=t, batch=batch)
    return batch * config.n_heads * s * t * dtype_bytes(dtype)


def fused_attention_bytes(config: AttentionConfig, *, s: int, batch: int = 1) -> int:
    """What a fused (flash) kernel keeps instead: one float32 log-sum-exp per query and head, b * h * s * 4."""
    _attention(config, "fused_attention_bytes")
    _check_sizes(s=s, batch=batch)
    return batch * config.n_heads * s * 4


# ---------------------------------------------------------------------------------------------- layer by layer
LAYER_KINDS = ("full", "sliding", "chunked", "latent")


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention sees and caches: ``full`` (every earlier key), ``sliding`` (the last ``window``
    keys, itself included: min(context, window - 1) cached between steps), ``chunked`` (Llama 4: the keys of its
    own chunk of ``window`` tokens, up to itself; cached as transformers caches it, in the same sliding layer as a
    window of that size: min(context, window - 1) tokens) or ``latent`` (an MLA layer: one latent and one RoPE key
    per token). A model is a tuple of these, one per layer (Gemma 2 alternates sliding and full;
    :meth:`multihead.hf.config.HFConfig.layer_kinds` reads them from a config)."""

    kind: str = "full"
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise MultiheadError(f"layer kind {self.kind!r} is unknown: choose one of {', '.join(LAYER_KINDS)}")
        if self.kind in ("sliding", "chunked"):
            if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
                what = "window" if self.kind == "sliding" else "chunk (window)"
                raise MultiheadError(f"a {self.kind} layer needs a {what} of at least 1 token, got {self.window!r}")
        elif self.window is not None:
            raise MultiheadError(f"a {self.kind} layer has no window (got {self.window!r}): use kind 'sliding'")

    @classmethod
    def of(cls, config: AttentionConfig) -> LayerAttention:
        """The kind of a layer built from ``config`` (sliding when it has a window)."""
        return cls("full") if config.window is None else cls("sliding", config.window)

    def cached_tokens(self, context: int) -> int:
        """Tokens of one sequence this layer holds after ``context`` tokens (a chunked layer as transformers keeps
        it, a sliding layer of its chunk: the current chunk alone would need only context mod chunk of them)."""
        if self.kind in ("sliding", "chunked"):
            assert self.window is not None
            return min(context, self.window - 1)
        return context

    def describe(self) -> str:
        return f"{self.kind} {self.window}" if self.kind in ("sliding", "chunked") else self.kind

    def flops(self, config: AttentionConfig, *, s: int, t: int | None = None, batch: int = 1, causal: bool = True,
              exact_mask: bool = True) -> FlopCount:
        """:func:`flops` of ``config`` as a layer of this kind (its window or chunk; not for a latent layer)."""
        if self.kind == "latent":
            raise MultiheadError("a latent (MLA) layer is counted by mla_flops(), not LayerAttention.flops()")
        chunked = self.kind == "chunked"
        c = dataclasses.replace(config, window=None if chunked else self.window)
        return flops(c, s=s, t=t, batch=batch, causal=causal, exact_mask=exact_mask,
                     chunk=self.window if chunked else None)

    def pairs(self, s: int, t: int, *, causal: bool = True) -> int:
        """:func:`attended_pairs` of one head of a layer of this kind."""
        chunked = self.kind == "chunked"
        return attended_pairs(s, t, causal=causal, window=None if chunked else self.window,
                              chunk=self.window if chunked else None)


def layers_summary(layers: Sequence[LayerAttention]) -> str:
    """'21 sliding 4096 + 21 full', in the order first seen."""
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.describe()] = counts.get(layer.describe(), 0) + 1
    return " + ".join(f"{n} {kind}" for kind, n in counts.items())


def layer_cache_bytes_per_token(config: AttentionConfig, layer: LayerAttention, *, dtype: str = "bf16",
                                mla: MLAConfig | None = None) -> int:
    """Bytes one cached token costs in one layer: 2 g d bytes(dtype), or (kv_lora_rank + rope) bytes(dtype) for a
    latent layer."""
    _attention(config, "layer_cache_bytes_per_token")
    if layer.kind == "latent":
        if mla is None:
            raise MultiheadError("a latent (MLA) layer needs its MLAConfig to be sized")
        return mla.latent_dim * dtype_bytes(dtype)
    return kv_cache_bytes_per_token_per_layer(config, dtype)


def layers_kv_bytes(config: AttentionConfig, layers: Sequence[LayerAttention], *, context: int, batch: int = 1,
                    dtype: str = "bf16", mla: MLAConfig | None = None) -> int:
    """The whole cache summed layer by layer: sum over layers of per-token bytes * cached_tokens(context) * batch
    (a full layer holds the context, a sliding one min(context, window - 1), a latent one the context's latents)."""
    _attention(config, "layers_kv_bytes")
    _check_sizes(context=context, batch=batch)
    return sum(layer_cache_bytes_per_token(config, layer, dtype=dtype, mla=mla) * layer.cached_tokens(context)
               for layer in layers) * batch


def layers_flops(config: AttentionConfig, layers: Sequence[LayerAttention], *, s: int, batch: int = 1,
                 causal: bool = True, exact_mask: bool = True) -> dict[str, FlopCount]:
    """Forward FLOPs of one layer of each kind the model has (``{"full": ..., "sliding": ...}``), each kind's window
    counted pair by pair (:func:`flops`); a latent layer is counted by :func:`mla_flops` instead."""
    _attention(config, "layers_flops")
    out: dict[str, FlopCount] = {}
    for layer in layers:
        if layer.kind != "latent" and layer.describe() not in out:
            out[layer.describe()] = layer.flops(config, s=s, batch=batch, causal=causal, exact_mask=exact_mask)
    return out


# ---------------------------------------------------------------------------------------------- one report
def report(
    config: AttentionConfig,
    *,
    n_layers: int = 1,
    seq: int = 2048,
    batch: int = 1,
    dtype: str = "bf16",
    causal: bool = True,
    layers: Sequence[LayerAttention] | None = None,
) -> dict[str, Any]:
    """Every figure above for one configuration, as one JSON-ready dict (what ``multihead count --json`` prints).

    ``layers``: the kind of each layer (:class:`LayerAttention`; n_layers is then their number). FLOPs and the cache
    are summed layer by layer; the ``*_per_layer`` figures and ``attended_pairs`` are those of a full-attention layer
    where the model has one (each kind's under ``by_layer_kind``). Without ``layers``: n_layers layers of ``config``.
    """
    _attention(config, "report")
    if layers is None:
        _check_sizes(n_layers=n_layers)
        layers = (LayerAttention.of(config),) * n_layers
    n_layers = len(layers)
    if any(layer.kind == "latent" for layer in layers):
        raise MultiheadError("report() sizes MHA/GQA/MQA layers: a latent (MLA) layer is reported by mla_report()")
    p = parameters(config)
    by_kind = layers_flops(config, layers, s=seq, batch=batch, causal=causal)
    dense = layers_flops(config, layers, s=seq, batch=batch, causal=causal, exact_mask=False)
    count = {kind: sum(1 for layer in layers if layer.describe() == kind) for kind in by_kind}
    main_kind = "full" if "full" in by_kind else next(iter(by_kind))
    f = by_kind[main_kind]
    main_layer = next(layer for layer in layers if layer.describe() == main_kind)

    def total(of: Any) -> int:
        return sum(of(by_kind[k]) * n for k, n in count.items())

    per_token = kv_cache_bytes_per_token_per_layer(config, dtype)
    out = {
        "config": config.to_dict(),
        "variant": config.variant,
        "head_dim": config.head_dim,
        "n_heads": config.n_heads,
        "n_kv_heads": config.n_kv_heads,
        "n_layers": n_layers,
        "seq": seq,
        "batch": batch,
        "dtype": dtype,
        "causal": causal,
        "params_per_layer": p.total,
        "params_per_layer_by_projection": {k: v for k, v in asdict(p).items() if k.endswith("proj")},
        "params_total": p.total * n_layers,
        "flops_forward": total(lambda c: c.forward),
        "flops_forward_per_layer": f.forward,
        "flops_forward_by_part_per_layer": asdict(f),
        "flops_attention_core": total(lambda c: c.attention),
        "flops_backward": total(lambda c: c.backward),
        "flops_forward_dense_mask": sum(dense[k].forward * n for k, n in count.items()),
        "attended_pairs": main_layer.pairs(seq, seq, causal=causal),
        "kv_cache_bytes_per_token_per_layer": per_token,
        "kv_cache_bytes_per_token": per_token * n_layers,
        "kv_cache_tokens": max(layer.cached_tokens(seq) for layer in layers),
        "kv_cache_bytes_total": layers_kv_bytes(config, layers, context=seq, batch=batch, dtype=dtype),
        "attention_matrix_bytes_per_layer": attention_matrix_bytes(config, s=seq, batch=batch, dtype=dtype),
        "fused_attention_bytes_per_layer": fused_attention_bytes(config, s=seq, batch=batch),
        "layer_kinds": layers_summary(layers),
    }
    if len(count) > 1:
        out["by_layer_kind"] = {k: {"layers": n, "flops_forward_per_layer": by_kind[k].forward,
                                    "kv_cache_tokens": next(la.cached_tokens(seq) for la in layers
                                                            if la.describe() == k)}
                                for k, n in count.items()}
    return out


# ---------------------------------------------------------------------------------------------- MLA
@dataclass(frozen=True)
class MLAParamCount:
    """Parameters of one multi-head latent attention layer (weights, biases and the two RMSNorm scales)."""

    q_proj: int  # W_Q, or W_DQ + its norm + W_UQ with q_lora_rank
    kv_a_proj: int  # W_DKV and W_KR: d_model -> kv_lora_rank + rope
    kv_a_norm: int
    kv_b_proj: int  # W_UK and W_UV: kv_lora_rank -> n_heads * (qk_nope + v)
    o_proj: int

    @property
    def total(self) -> int:
        return self.q_proj + self.kv_a_proj + self.kv_a_norm + self.kv_b_proj + self.o_proj


def mla_parameters(config: MLAConfig) -> MLAParamCount:
    """::

        q_proj    D * h * qk                          or  D * q_rank (+ q_rank bias) + q_rank + q_rank * h * qk
        kv_a_proj D * (r + rope)  (+ bias)            kv_a_norm  r
        kv_b_proj r * h * (qk_nope + v)               o_proj     h * v * D  (+ D bias)
    """
    _mla(config, "mla_parameters")
    D, h, r, rope = config.d_model, config.n_heads, config.kv_lora_rank, config.qk_rope_head_dim
    qk, nope, v, bias = config.qk_head_dim, config.qk_nope_head_dim, config.v_head_dim, int(config.bias)
    if config.q_lora_rank is None:
        q = D * h * qk
    else:
        qr = config.q_lora_rank
        q = D * qr + bias * qr + qr + qr * h * qk
    return MLAParamCount(q_proj=q, kv_a_proj=D * (r + rope) + bias * (r + rope), kv_a_norm=r,
                         kv_b_proj=r * h * (nope + v), o_proj=h * v * D + bias * D)


@dataclass(frozen=True)
class MLAFlopCount:
    """Forward FLOPs of one MLA layer on one path, by matmul."""

    q_proj: int
    kv_a_proj: int
    kv_b_proj: int  # expanded: the t latents up-projected; absorbed: W_UK into q and W_UV after the sum
    scores: int
    values: int
    o_proj: int

    @property
    def attention(self) -> int:
        return self.scores + self.values

    @property
    def forward(self) -> int:
        return self.q_proj + self.kv_a_proj + self.kv_b_proj + self.scores + self.values + self.o_proj


def mla_flops(config: MLAConfig, *, s: int, t: int | None = None, batch: int = 1, causal: bool = False,
              path: str = "expanded") -> MLAFlopCount:
    """Forward FLOPs of s new queries over t keys (the s new tokens among them; t = s without a cache)::

        q_proj    2 b s D h qk  (or 2 b s (D q_rank + q_rank h qk))      kv_a_proj  2 b s D (r + rope)
        expanded: kv_b_proj 2 b t r h (nope + v)   scores 2 b h P qk         values 2 b h P v
        absorbed: kv_b_proj 2 b s h r (nope + v)   scores 2 b h P (r + rope) values 2 b h P r
        o_proj    2 b s h v D

    P = attended_pairs(s, t, causal). The absorbed path pays r + rope per pair instead of qk, and never
    up-projects the cached latents: cheaper for a few queries over many keys (decode), dearer for a prefill.
    """
    _mla(config, "mla_flops")
    t = s if t is None else t
    _check_sizes(s=s, t=t, batch=batch)
    if path not in ("expanded", "absorbed"):
        raise MultiheadError(f"path {path!r} must be 'expanded' or 'absorbed'")
    D, h, r, rope = config.d_model, config.n_heads, config.kv_lora_rank, config.qk_rope_head_dim
    qk, nope, v = config.qk_head_dim, config.qk_nope_head_dim, config.v_head_dim
    pairs = attended_pairs(s, t, causal=causal)
    q = 2 * batch * s * (D * h * qk if config.q_lora_rank is None
                         else D * config.q_lora_rank + config.q_lora_rank * h * qk)
    common = {"q_proj": q, "kv_a_proj": 2 * batch * s * D * (r + rope), "o_proj": 2 * batch * s * h * v * D}
    if path == "expanded":
        return MLAFlopCount(kv_b_proj=2 * batch * t * r * h * (nope + v), scores=2 * batch * h * pairs * qk,
                            values=2 * batch * h * pairs * v, **common)
    return MLAFlopCount(kv_b_proj=2 * batch * s * h * r * (nope + v), scores=2 * batch * h * pairs * (r + rope),
                        values=2 * batch * h * pairs * r, **common)


def mla_cache_bytes(config: MLAConfig, *, context: int, batch: int = 1, n_layers: int = 1,
                    dtype: str = "bf16") -> int:
    """The latent cache: (kv_lora_rank + rope) * bytes(dtype) * context * batch * n_layers; one latent and one
    RoPE key per token, whatever n_heads (:class:`multihead.cache.LatentCache`)."""
    _mla(config, "mla_cache_bytes")
    _check_sizes(context=context, batch=batch, n_layers=n_layers)
    return config.latent_dim * dtype_bytes(dtype) * context * batch * n_layers


# ---------------------------------------------------------------------------------------------- MLA against MHA
def mla_as_mha(config: MLAConfig) -> AttentionConfig:
    """The same query heads as plain MHA, each key and value head v_head_dim wide: what an MLA layer's latent cache
    is compared with."""
    _mla(config, "mla_as_mha")
    return AttentionConfig(d_model=config.d_model, n_heads=config.n_heads, head_dim=config.v_head_dim)


def mla_report(config: MLAConfig, *, n_layers: int, seq: int, batch: int = 1, dtype: str = "bf16",
               causal: bool = True) -> dict[str, Any]:
    """An MLA model's attention figures, as :func:`report` gives them for MHA/GQA/MQA: parameters, the latent cache
    (per token and for ``seq`` x ``batch``; ``cache_vs_mha`` against :func:`mla_as_mha`'s KV cache), the expanded
    forward's FLOPs and one decode step's FLOPs after ``seq`` tokens on each path."""
    _mla(config, "mla_report")
    params = mla_parameters(config).total
    total = mla_cache_bytes(config, context=seq, batch=batch, n_layers=n_layers, dtype=dtype)
    mha = kv_cache_bytes(mla_as_mha(config), context=seq, batch=batch, n_layers=n_layers, dtype=dtype)
    return {
        "kv_lora_rank": config.kv_lora_rank, "qk_rope_head_dim": config.qk_rope_head_dim,
        "q_lora_rank": config.q_lora_rank, "qk_nope_head_dim": config.qk_nope_head_dim,
        "v_head_dim": config.v_head_dim, "latent_dim": config.latent_dim,
        "params_per_layer": params, "params_total": params * n_layers,
        "cache_bytes_per_token": mla_cache_bytes(config, context=1, n_layers=n_layers, dtype=dtype),
        "cache_bytes_total": total, "cache_vs_mha": total / mha,
        "flops_forward_expanded": mla_flops(config, s=seq, batch=batch, causal=causal).forward,
        "decode_flops_absorbed": mla_flops(config, s=1, t=seq + 1, batch=batch, causal=True, path="absorbed").forward,
        "decode_flops_expanded": mla_flops(config, s=1, t=seq + 1, batch=batch, causal=True).forward,
    }


# ---------------------------------------------------------------------------------------------- head-wise cache


class PlanShape(Protocol):
    """What :func:`headwise_cache_bytes` reads of a :class:`multihead.cache.HeadPlan` (a protocol, so this module
    imports no cache: the plan's file reader imports hf.config, which imports this module)."""

    @property
    def full(self) -> Sequence[Sequence[bool]]: ...
    @property
    def shape(self) -> tuple[int, int, int, int]: ...
    @property
    def sinks(self) -> int: ...
    @property
    def window(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...


def headwise_cache_bytes(plan: PlanShape, *, batch: int, max_len: int, dtype: str = "bf16",
                         windows: Sequence[int | None] | None = None) -> int:
    """A head-wise cache (:class:`multihead.cache.HeadwiseCache`) of ``plan``: each full KV head holds max_len
    tokens, each streaming one sinks + window - 1 (the next token joins them), whatever the context::

        2 * batch * head_dim * bytes(dtype) * sum over layers l of (|F_l| * max_len + |S_l| * (sinks + window - 1))

    F_l and S_l are layer l's full and streaming KV heads. In a sliding layer of window W_l (``windows``: each
    layer's own, None for a global one) a full head holds W_l - 1 tokens and a streaming one sinks + min(window, W_l)
    - 1; no ring holds more than max_len (a run shorter than the ring). ``dtype`` a name (bf16, fp32, ...;
    ``str(torch dtype)`` works too)."""
    _check_sizes(batch=batch, max_len=max_len)
    d = plan.shape[3]
    layer_windows = [None] * plan.n_layers if windows is None else list(windows)
    tokens = 0
    for row, w in zip(plan.full, layer_windows, strict=True):
        full = sum(row)
        streaming = len(row) - full
        tokens += full * (max_len if w is None else min(w - 1, max_len))
        tokens += streaming * min(plan.sinks + (plan.window if w is None else min(plan.window, w)) - 1, max_len)
    return 2 * batch * d * dtype_bytes(dtype) * tokens
