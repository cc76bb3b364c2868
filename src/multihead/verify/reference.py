"""The float64 oracle: multi-head attention in NumPy, written head by head as the formula reads.

    head_i       = softmax(Q_i K_g(i)^T * scale + mask) V_g(i)        Q_i = X W_Q^i, K_g = C W_K^g, V_g = C W_V^g
    MultiHead(X) = Concat(head_1, ..., head_h) W_O                      g(i) = i // (n_heads / n_kv_heads)

Nothing here is used at run time: it is the tests' ground truth and a teaching aid. It shares no code with the layer
beyond the config (the numbers), so a bug in the layer cannot hide in both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from multihead.config import AttentionConfig

Array = np.ndarray


@dataclass
class Weights:
    """The four projections as float64 arrays, in nn.Linear's layout: weight (out, in), bias (out,) or None."""

    wq: Array
    wk: Array
    wv: Array
    wo: Array
    bq: Array | None = None
    bk: Array | None = None
    bv: Array | None = None
    bo: Array | None = None

    @classmethod
    def of(cls, layer: Any) -> Weights:
        """Copy the weights of a MultiHeadAttention (anything with q_proj, k_proj, v_proj, o_proj Linear layers)."""

        def arr(t: Any) -> Array | None:
            return None if t is None else t.detach().cpu().double().numpy()

        names = ("q", "k", "v", "o")
        ws = {f"w{n}": arr(getattr(layer, f"{n}_proj").weight) for n in names}
        bs = {f"b{n}": arr(getattr(layer, f"{n}_proj").bias) for n in names}
        return cls(**ws, **bs)  # type: ignore[arg-type]


def _linear(x: Array, w: Array, b: Array | None) -> Array:
    y: Array = x @ w.T
    return y if b is None else y + b


def _rope(x: Array, positions: Array, base: float) -> Array:
    """Rotate each pair (x_j, x_{j+d/2}) of x (b, n, d) by positions (b, n) * base ** (-2j/d)."""
    d = x.shape[-1]
    half = d // 2
    out = np.empty_like(x)
    for j in range(half):
        theta = positions * base ** (-2.0 * j / d)  # (b, n)
        c, s = np.cos(theta), np.sin(theta)
        out[..., j] = x[..., j] * c - x[..., j + half] * s
        out[..., j + half] = x[..., j + half] * c + x[..., j] * s
    return out


def multihead_attention(
    config: AttentionConfig,
    weights: Weights,
    x: Array,
    context: Array | None = None,
    *,
    value: Array | None = None,
    mask: Array | None = None,
    key_padding_mask: Array | None = None,
    causal: bool = False,
    positions: Array | None = None,
    edit_pattern: Callable[[int, Array], Array] | None = None,
    softcap: float | None = None,
    sinks: Array | None = None,
) -> tuple[Array, Array]:
    """(output (b, s, d_model), weights (b, n_heads, s, t)) in float64.

    ``mask`` is bool (True = may attend) or float (added to the scores), broadcastable to (b, n_heads, s, t);
    ``key_padding_mask`` is (b, t) bool with True = a real token; causal is aligned bottom-right (query i sees keys
    up to t - s + i); the config's window lets query i see only keys j > t - s + i - window. A row with no allowed
    key gives zeros. ``edit_pattern(i, w)`` may replace head i's weights w (b, s, t) before they multiply its values
    (the returned weights are the edited ones). ``softcap`` caps the scaled scores as softcap * tanh(score / softcap)
    before the mask is added; ``sinks`` (n_heads,) adds one logit per head to each row's softmax denominator only.
    """
    x = np.asarray(x, dtype=np.float64)
    c = x if context is None else np.asarray(context, dtype=np.float64)
    vin = c if value is None else np.asarray(value, dtype=np.float64)
    b, s, _ = x.shape
    t = c.shape[1]
    h, g, d = config.n_heads, config.n_kv_heads, config.head_dim
    per_group = h // g
    scale = config.scale if config.scale is not None else 1.0 / np.sqrt(d)

    allowed = np.ones((b, h, s, t), dtype=bool)
    added = np.zeros((b, h, s, t))
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == bool:
            allowed &= np.broadcast_to(mask, (b, h, s, t))
        else:
            added = added + np.broadcast_to(mask.astype(np.float64), (b, h, s, t))
            allowed &= added != -np.inf
    if key_padding_mask is not None:
        allowed &= np.asarray(key_padding_mask, dtype=bool)[:, None, None, :]
    for i in range(s):
        p = t - s + i  # the query's position among the keys
        for j in range(t):
            if causal and j > p:
                allowed[:, :, i, j] = False
            if config.window is not None and j <= p - config.window:
                allowed[:, :, i, j] = False
    if positions is None:
        pos = np.broadcast_to(np.arange(s, dtype=np.float64), (b, s))
    else:
        pos = np.broadcast_to(np.asarray(positions, dtype=np.float64), (b, s))

    heads = []
    all_weights = np.zeros((b, h, s, t))
    for i in range(h):
        kv = i // per_group
        qs, ks = slice(i * d, (i + 1) * d), slice(kv * d, (kv + 1) * d)  # rows of head i and of its KV head
        q_i = _linear(x, weights.wq[qs], None if weights.bq is None else weights.bq[qs])  # (b, s, d)
        k_i = _linear(c, weights.wk[ks], None if weights.bk is None else weights.bk[ks])  # (b, t, d)
        v_i = _linear(vin, weights.wv[ks], None if weights.bv is None else weights.bv[ks])  # (b, t, d)
        if config.rope is not None:
            q_i = _rope(q_i, pos, config.rope.base)
            k_i = _rope(k_i, pos, config.rope.base)
        scores = np.einsum("bsd,btd->bst", q_i, k_i) * scale
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        scores = scores + np.where(allowed[:, i], added[:, i], 0.0)
        w = np.zeros_like(scores)
        for bi in range(b):
            for si in range(s):
                ok = allowed[bi, i, si]
                if ok.any():
                    row = scores[bi, si, ok]
                    top = row.max() if sinks is None else max(row.max(), float(sinks[i]))
                    e = np.exp(row - top)
                    denominator = e.sum() + (0.0 if sinks is None else np.exp(float(sinks[i]) - top))
                    w[bi, si, ok] = e / denominator
        if edit_pattern is not None:
            w = np.asarray(edit_pattern(i, w), dtype=np.float64)
        all_weights[:, i] = w
        heads.append(w @ v_i)  # (b, s, d)
    concat = np.concatenate(heads, axis=-1)  # (b, s, h*d)
    return _linear(concat, weights.wo, weights.bo), all_weights
