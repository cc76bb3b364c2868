"""AttentionConfig: the one source of truth for the widths and head counts of an attention layer.

The layer follows one formula::

    d_k          = head_dim = d_model / n_heads      (unless head_dim is given, as in Gemma)
    head_i       = Attention(X W_Q^i, X W_K^g(i), X W_V^g(i))      g(i) = i // (n_heads / n_kv_heads)
    MultiHead(X) = Concat(head_1, ..., head_h) W_O

The three variants are one integer, ``n_kv_heads``::

    MHA  n_kv_heads == n_heads        q: h h h h h h h h      k/v: g g g g g g g g   (one KV head per query head)
    GQA  1 < n_kv_heads < n_heads     q: h h h h h h h h      k/v: g   g   g   g     (a KV head per group of queries)
    MQA  n_kv_heads == 1              q: h h h h h h h h      k/v: g                 (one KV head for all)

A config validates itself when it is made and never silently rewrites a value that was given: ``None`` fields are
filled with their documented default once, and a contradiction raises :class:`MultiheadError` with the numbers.
Being filled, they are kept by ``dataclasses.replace``: ``replace(config, n_heads=64)`` keeps head_dim and n_kv_heads;
make a new ``AttentionConfig`` to derive them again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from multihead.divisors import divisors
from multihead.errors import MultiheadError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embeddings on q and k, Llama (Hugging Face ``rotate_half``) convention.

    The pair (x_j, x_{j + d/2}) of each head is rotated by the angle ``position * base ** (-2 j / d)``.
    """

    base: float = 10000.0

    def __post_init__(self) -> None:
        if not (isinstance(self.base, (int, float)) and math.isfinite(self.base) and self.base > 1.0):
            raise MultiheadError(f"rope base ({self.base!r}) must be a finite number greater than 1, e.g. 10000.0")


# torch counts a tensor's bytes in int64: with 8-byte elements (float64) a weight may hold at most this many
MAX_ELEMENTS = ((1 << 63) - 1) // 8


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MultiheadError(f"{name} ({value!r}) must be an int")
    if value < 1:
        raise MultiheadError(f"{name} ({value}) must be a positive int")
    if value > MAX_ELEMENTS:
        raise MultiheadError(f"{name} ({_big(value)}) is 2^60 or more: torch counts a tensor's bytes in int64, so no "
                             "weight that wide can be allocated; choose a size below 2^60")


def _big(n: int) -> str:
    return f"{n:,}" if n.bit_length() <= 200 else f"about 2^{n.bit_length() - 1}"


def _check_allocatable(weights: dict[str, tuple[str, int, str, int]]) -> None:
    """Each weight (name -> rows named and counted, columns named and counted) must be allocatable by torch."""
    for weight, (rows, n_rows, cols, n_cols) in weights.items():
        if n_rows * n_cols > MAX_ELEMENTS:
            raise MultiheadError(
                f"{weight} would hold {rows} x {cols} = {n_rows:,} x {n_cols:,} = {_big(n_rows * n_cols)} elements: "
                "2^60 or more, whose float64 bytes pass 2^63, the int64 limit of a torch tensor's size; choose smaller "
                "sizes")


@dataclass(frozen=True, init=False)
class AttentionConfig:
    """Widths, head counts and options of one attention layer, every value resolved.

    Args (keyword-only):
        d_model: width of the input (and of the output, after W_O).
        n_heads: number of query heads ``h``.
        n_kv_heads: number of key/value heads ``g``; ``None`` means ``n_heads`` (MHA), 1 is MQA. Must divide n_heads.
        head_dim: width of each head ``d``; ``None`` means ``d_model // n_heads`` (which must then divide exactly).
        kv_dim: width of the context that keys (and values) are projected from in cross-attention;
            ``None`` means ``d_model``.
        value_dim: width of a separate value input (as torch's ``vdim``); ``None`` means ``kv_dim``.
        bias: whether the projections have biases (all four, unless out_bias says otherwise for W_O).
        out_bias: whether W_O has a bias; ``None`` means ``bias`` (Qwen2 has q/k/v biases and none on W_O).
        dropout: dropout probability on the attention weights, applied in training only; in [0, 1).
        scale: the factor on q·k; ``None`` means ``head_dim ** -0.5``.
        rope: rotary embeddings on q and k (a :class:`RopeConfig`, or its base as a float); ``None`` for none.
        window: sliding window, a causal query sees at most the last ``window`` keys (itself included).

    The defaults are resolved once, here: ``config.n_kv_heads``, ``head_dim``, ``kv_dim``, ``value_dim``,
    and ``out_bias`` are always plain values afterwards; ``scale`` stays None for "head_dim ** -0.5" (so a config
    derived with another head_dim gets its own), and :attr:`softmax_scale` gives the number.
    """

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    kv_dim: int
    value_dim: int
    bias: bool
    out_bias: bool
    dropout: float
    scale: float | None
    rope: RopeConfig | None
    window: int | None

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        kv_dim: int | None = None,
        value_dim: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        dropout: float = 0.0,
        scale: float | None = None,
        rope: RopeConfig | float | None = None,
        window: int | None = None,
    ) -> None:
        _check_positive_int("d_model", d_model)
        _check_positive_int("n_heads", n_heads)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        _check_positive_int("n_kv_heads", n_kv_heads)
        if n_kv_heads > n_heads or n_heads % n_kv_heads != 0:
            raise MultiheadError(
                f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads}): "
                f"choose n_kv_heads in {', '.join(map(str, divisors(n_heads)))}"
            )
        if head_dim is None:
            if d_model % n_heads != 0:
                choices = divisors(d_model)
                raise MultiheadError(
                    f"d_model ({d_model}) must be divisible by n_heads ({n_heads}) to give head_dim = "
                    f"d_model / n_heads: choose n_heads in {', '.join(map(str, choices[:16]))}"
                    f"{', ...' if len(choices) > 16 else ''}, or pass head_dim explicitly"
                )
            head_dim = d_model // n_heads
        _check_positive_int("head_dim", head_dim)
        kv_dim = d_model if kv_dim is None else kv_dim
        _check_positive_int("kv_dim", kv_dim)
        value_dim = kv_dim if value_dim is None else value_dim
        _check_positive_int("value_dim", value_dim)
        if not isinstance(bias, bool):
            raise MultiheadError(f"bias ({bias!r}) must be True or False")
        if out_bias is not None and not isinstance(out_bias, bool):
            raise MultiheadError(f"out_bias ({out_bias!r}) must be True or False")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
            raise MultiheadError(f"dropout ({dropout!r}) must be a float in [0, 1)")
        if not 0.0 <= dropout < 1.0:
            raise MultiheadError(f"dropout ({dropout}) must be in [0, 1)")
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0
        ):
            raise MultiheadError(f"scale ({scale!r}) must be a positive finite float, or None for head_dim ** -0.5")
        if rope is not None:
            if isinstance(rope, (int, float)) and not isinstance(rope, bool):
                rope = RopeConfig(base=float(rope))
            if not isinstance(rope, RopeConfig):
                raise MultiheadError(f"rope ({rope!r}) must be None, a base such as 10000.0, or a RopeConfig")
            if head_dim % 2 != 0:
                raise MultiheadError(f"rope needs an even head_dim (got head_dim {head_dim}): rotary embeddings "
                                     "rotate pairs of dimensions")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise MultiheadError(f"window ({window!r}) must be a positive int (the number of keys a query "
                                 "may see), or None for no window")
        _check_allocatable({"W_Q": ("d_model", d_model, "n_heads * head_dim", n_heads * head_dim),
                            "W_K": ("kv_dim", kv_dim, "n_kv_heads * head_dim", n_kv_heads * head_dim),
                            "W_V": ("value_dim", value_dim, "n_kv_heads * head_dim", n_kv_heads * head_dim),
                            "W_O": ("n_heads * head_dim", n_heads * head_dim, "d_model", d_model)})
        resolved = {
            "d_model": d_model, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim,
            "kv_dim": kv_dim, "value_dim": value_dim, "bias": bias,
            "out_bias": bias if out_bias is None else out_bias, "dropout": float(dropout),
            "scale": None if scale is None else float(scale), "rope": rope, "window": window,
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_kwargs(cls, fields: dict[str, Any]) -> AttentionConfig:
        """A config from keyword arguments, with a clear error for a name that is not a field."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [name for name in fields if name not in known]
        if unknown:
            raise MultiheadError(f"unknown attention option(s) {', '.join(map(repr, unknown))}: the options are "
                                 f"{', '.join(known)}")
        return cls(**fields)

    # Derived values, named as the formula names them.
    @property
    def q_dim(self) -> int:
        """Width of all query heads together: n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def k_dim(self) -> int:
        """Width of all key (and of all value) heads together: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        """The factor on q·k: scale, or head_dim ** -0.5."""
        return self.scale if self.scale is not None else self.head_dim ** -0.5

    @property
    def variant(self) -> str:
        """'MHA', 'GQA' or 'MQA'."""
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def build(self, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
              ) -> torch.nn.Module:
        """Make the layer this config describes (a :class:`multihead.layers.attention.MultiHeadAttention`, which names
        itself the builder of this config: :func:`register_layer`)."""
        make = _LAYERS.get(type(self))
        if make is None:
            raise MultiheadError(f"no layer is registered for {type(self).__name__}: import multihead first")
        return make(self, device=device, dtype=dtype)


@dataclass(frozen=True, init=False)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2, 2024): keys and values are up-projections of one compressed latent
    per token, and one RoPE key is shared by all heads, so a token caches ``kv_lora_rank + qk_rope_head_dim``
    values per layer (576 for DeepSeek-V3) instead of ``2 * n_heads * head_dim``::

        c_KV  = RMSNorm(x W_DKV)                 (b, t, kv_lora_rank)      cached, with k_pe
        k_pe  = RoPE(x W_KR)                      (b, t, qk_rope_head_dim)  one for all heads
        k_i   = [c_KV W_UK^i, k_pe]               (b, t, qk_nope_head_dim + qk_rope_head_dim)
        v_i   = c_KV W_UV^i                       (b, t, v_head_dim)
        q_i   = [q_nope_i, RoPE(q_pe_i)]          from x W_Q, or RMSNorm(x W_DQ) W_UQ with q_lora_rank
        MLA(X) = Concat(softmax(q_i k_i^T * scale) v_i) W_O

    Args (keyword-only): d_model, n_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim (even), v_head_dim,
    q_lora_rank (None: a full W_Q), rope (a base or RopeConfig; default 10000.0), norm_eps (of the two RMSNorms),
    bias (on W_DQ, W_DKV and W_O, as DeepSeek's attention_bias), scale (default (qk_nope + qk_rope) ** -0.5),
    dropout, head_dim (optional: the query/key head width, which must equal qk_nope + qk_rope).
    """

    d_model: int
    n_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    rope: RopeConfig
    norm_eps: float
    bias: bool
    scale: float | None
    dropout: float

    def __init__(self, *, d_model: int, n_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None,
                 rope: RopeConfig | float = 10000.0, norm_eps: float = 1e-6, bias: bool = False,
                 scale: float | None = None, dropout: float = 0.0, head_dim: int | None = None) -> None:
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("kv_lora_rank", kv_lora_rank),
                            ("qk_nope_head_dim", qk_nope_head_dim), ("qk_rope_head_dim", qk_rope_head_dim),
                            ("v_head_dim", v_head_dim)):
            _check_positive_int(name, value)
        if q_lora_rank is not None:
            _check_positive_int("q_lora_rank", q_lora_rank)
        if qk_rope_head_dim % 2:
            raise MultiheadError(f"qk_rope_head_dim ({qk_rope_head_dim}) must be even: rotary embeddings rotate "
                                 "pairs of dimensions")
        if head_dim is not None and head_dim != qk_nope_head_dim + qk_rope_head_dim:
            raise MultiheadError(f"head_dim ({head_dim}) must equal qk_nope_head_dim + qk_rope_head_dim "
                                 f"({qk_nope_head_dim} + {qk_rope_head_dim} = {qk_nope_head_dim + qk_rope_head_dim})")
        q_width = ("n_heads * (qk_nope_head_dim + qk_rope_head_dim)", n_heads * (qk_nope_head_dim + qk_rope_head_dim))
        _check_allocatable({
            **({"W_Q": ("d_model", d_model, *q_width)} if q_lora_rank is None else
               {"W_DQ": ("d_model", d_model, "q_lora_rank", q_lora_rank),
                "W_UQ": ("q_lora_rank", q_lora_rank, *q_width)}),
            "W_DKV": ("d_model", d_model, "kv_lora_rank + qk_rope_head_dim", kv_lora_rank + qk_rope_head_dim),
            "W_UKV": ("kv_lora_rank", kv_lora_rank, "n_heads * (qk_nope_head_dim + v_head_dim)",
                      n_heads * (qk_nope_head_dim + v_head_dim)),
            "W_O": ("n_heads * v_head_dim", n_heads * v_head_dim, "d_model", d_model)})
        expanded = n_heads * (qk_nope_head_dim + v_head_dim)
        if kv_lora_rank >= expanded:
            raise MultiheadError(f"kv_lora_rank ({kv_lora_rank}) must be smaller than the keys and values it expands "
                                 f"to, n_heads * (qk_nope_head_dim + v_head_dim) = {expanded}: a latent that wide "
                                 "compresses nothing")
        if isinstance(rope, (int, float)) and not isinstance(rope, bool):
            rope = RopeConfig(base=float(rope))
        if not isinstance(rope, RopeConfig):
            raise MultiheadError(f"rope ({rope!r}) must be a base such as 10000.0 or a RopeConfig")
        if not (isinstance(norm_eps, (int, float)) and math.isfinite(norm_eps) and norm_eps > 0):
            raise MultiheadError(f"norm_eps ({norm_eps!r}) must be a positive finite number")
        if not isinstance(bias, bool):
            raise MultiheadError(f"bias ({bias!r}) must be True or False")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale) or scale <= 0):
            raise MultiheadError(f"scale ({scale!r}) must be a positive finite float, or None")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise MultiheadError(f"dropout ({dropout!r}) must be a float in [0, 1)")
        values: dict[str, Any] = {"d_model": d_model, "n_heads": n_heads, "kv_lora_rank": kv_lora_rank,
                                  "qk_nope_head_dim": qk_nope_head_dim, "qk_rope_head_dim": qk_rope_head_dim,
                                  "v_head_dim": v_head_dim, "q_lora_rank": q_lora_rank, "rope": rope,
                                  "norm_eps": float(norm_eps), "bias": bias,
                                  "scale": None if scale is None else float(scale), "dropout": float(dropout)}
        for field_name, field_value in values.items():
            object.__setattr__(self, field_name, field_value)

    @classmethod
    def from_kwargs(cls, fields: dict[str, Any]) -> MLAConfig:
        known = [f.name for f in dataclasses.fields(cls)] + ["head_dim"]
        unknown = [name for name in fields if name not in known]
        if unknown:
            raise MultiheadError(f"unknown MLA option(s) {', '.join(map(repr, unknown))}: the options are "
                                 f"{', '.join(known)}")
        return cls(**fields)

    @property
    def qk_head_dim(self) -> int:
        """Width of each query and key head: qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.qk_head_dim ** -0.5

    @property
    def variant(self) -> str:
        return "MLA"

    @property
    def window(self) -> None:
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ConfigT = TypeVar("ConfigT", AttentionConfig, "MLAConfig")

# the layer each config type builds (``config.build()``): the layer's module registers it, so that data flows one way,
# config -> layer, and this module imports no layer (as transformers' AutoModel.register(config_class, model_class))
_LAYERS: dict[type, Callable[..., torch.nn.Module]] = {}


def register_layer(config_type: type, make: Callable[..., torch.nn.Module]) -> None:
    """Name the layer ``config_type.build()`` makes: ``make(config, device=..., dtype=...)``."""
    _LAYERS[config_type] = make


def config_or_keywords(cls: type[ConfigT], config: object, options: dict[str, Any]) -> ConfigT:
    """A layer's config: the one given, or one made of its fields given as keywords (``cls.from_kwargs``), never
    both."""
    if config is None:
        made: ConfigT = cls.from_kwargs(options)
        return made
    if not isinstance(config, cls):
        raise MultiheadError(f"config must be an {cls.__name__}, got {type(config).__name__}")
    if options:
        raise MultiheadError(f"give a config or its fields as keywords, not both (got a config and "
                             f"{', '.join(options)})")
    return config
