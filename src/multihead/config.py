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

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from multihead.errors import MultiheadError, divisors

if TYPE_CHECKING:
    import torch

    from multihead.attention import MultiHeadAttention


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embeddings on q and k, Llama (Hugging Face ``rotate_half``) convention.

    The pair (x_j, x_{j + d/2}) of each head is rotated by the angle ``position * base ** (-2 j / d)``.
    """

    base: float = 10000.0

    def __post_init__(self) -> None:
        if not (isinstance(self.base, (int, float)) and math.isfinite(self.base) and self.base > 1.0):
            raise MultiheadError(f"rope base ({self.base!r}) must be a finite number greater than 1, e.g. 10000.0")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MultiheadError(f"{name} ({value!r}) must be an int")
    if value < 1:
        raise MultiheadError(f"{name} ({value}) must be a positive int")


@dataclass(frozen=True)
class AttentionConfig:
    """Widths, head counts and options of one attention layer.

    Args:
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
    """

    d_model: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    kv_dim: int | None = None
    value_dim: int | None = None
    bias: bool = True
    out_bias: bool | None = None
    dropout: float = 0.0
    scale: float | None = None
    rope: RopeConfig | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        _check_positive_int("d_model", self.d_model)
        _check_positive_int("n_heads", self.n_heads)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        _check_positive_int("n_kv_heads", self.n_kv_heads)
        assert self.n_kv_heads is not None
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads != 0:
            raise MultiheadError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads}): "
                f"choose n_kv_heads in {', '.join(map(str, divisors(self.n_heads)))}"
            )
        if self.head_dim is None:
            if self.d_model % self.n_heads != 0:
                raise MultiheadError(
                    f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) to give head_dim = "
                    f"d_model / n_heads: choose n_heads in {', '.join(map(str, divisors(self.d_model)[:16]))}"
                    f"{', ...' if len(divisors(self.d_model)) > 16 else ''}, or pass head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        _check_positive_int("head_dim", self.head_dim)
        if self.kv_dim is None:
            object.__setattr__(self, "kv_dim", self.d_model)
        _check_positive_int("kv_dim", self.kv_dim)
        if self.value_dim is None:
            object.__setattr__(self, "value_dim", self.kv_dim)
        _check_positive_int("value_dim", self.value_dim)
        for name in ("bias", "out_bias"):
            if not isinstance(getattr(self, name), bool) and not (name == "out_bias" and self.out_bias is None):
                raise MultiheadError(f"{name} ({getattr(self, name)!r}) must be True or False")
        if self.out_bias is None:
            object.__setattr__(self, "out_bias", self.bias)
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise MultiheadError(f"dropout ({self.dropout!r}) must be a float in [0, 1)")
        if not 0.0 <= self.dropout < 1.0:
            raise MultiheadError(f"dropout ({self.dropout}) must be in [0, 1)")
        if self.scale is not None and (
            isinstance(self.scale, bool)
            or not isinstance(self.scale, (int, float))
            or not math.isfinite(self.scale)
            or self.scale <= 0
        ):
            raise MultiheadError(
                f"scale ({self.scale!r}) must be a positive finite float, or None for head_dim ** -0.5"
            )
        if self.rope is not None:
            if isinstance(self.rope, (int, float)) and not isinstance(self.rope, bool):
                object.__setattr__(self, "rope", RopeConfig(base=float(self.rope)))
            if not isinstance(self.rope, RopeConfig):
                raise MultiheadError(f"rope ({self.rope!r}) must be None, a base such as 10000.0, or a RopeConfig")
            if self.head_dim is not None and self.head_dim % 2 != 0:
                raise MultiheadError(f"rope needs an even head_dim (got head_dim {self.head_dim}): rotary embeddings "
                                     "rotate pairs of dimensions")
        if self.window is not None and (
            isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1
        ):
            raise MultiheadError(f"window ({self.window!r}) must be a positive int (the number of keys a query "
                                     "may see), or None for no window")

    # Derived values, named as the formula names them.
    @property
    def n_groups(self) -> int:
        """Query heads per KV head: n_heads / n_kv_heads."""
        assert self.n_kv_heads is not None
        return self.n_heads // self.n_kv_heads

    @property
    def q_dim(self) -> int:
        """Width of all query heads together: n_heads * head_dim."""
        assert self.head_dim is not None
        return self.n_heads * self.head_dim

    @property
    def k_dim(self) -> int:
        """Width of all key (and of all value) heads together: n_kv_heads * head_dim."""
        assert self.head_dim is not None and self.n_kv_heads is not None
        return self.n_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        """The factor on q·k: scale, or head_dim ** -0.5."""
        assert self.head_dim is not None
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
              ) -> MultiHeadAttention:
        """Make the layer this config describes."""
        from multihead.attention import MultiHeadAttention

        return MultiHeadAttention.from_config(self, device=device, dtype=dtype)
