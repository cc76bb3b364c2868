"""Head scores: what share of its attention a head puts on which key. Each is a mean over query rows.

For a head's weights w (s queries x t keys) of one sequence of n real tokens:

- ``previous_token``: mean over i >= 1 of w[i, i-1]
- ``first_token``:    mean over i >= 1 of w[i, 0]   (attention sinks)
- ``self``:           mean over i of w[i, i]
- ``next_token``:     mean over i < n-1 of w[i, i+1]   (bidirectional models; 0 for causal ones)
- ``local``:          mean over i of the sum of w[i, j] over |i - j| <= 3
- ``entropy``:        mean over rows with k >= 2 allowed keys of H(w[i]) / log(k)   (1 = uniform, 0 = one key)
- ``duplicate_token`` and ``induction``: on T random tokens repeated once (2T tokens), mean over i in the second
  half (i >= T) of w[i, i-T] (the earlier copy of the current token) and w[i, i-T+1] (the token that followed it)

Rows of a batch are pooled: every real query row of every sequence counts once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

SCORE_NAMES = ("previous_token", "first_token", "self", "next_token", "local", "entropy", "duplicate_token",
               "induction")

# What each score is, in the words a report shows beside its column (the module's formulas).
SCORE_DEFINITIONS = {
    "previous_token": "mean over query rows i >= 1 of the weight on key i - 1 (the previous token)",
    "first_token": "mean over query rows i >= 1 of the weight on key 0 (the first token: an attention sink)",
    "self": "mean over query rows i of the weight on key i (the token itself)",
    "next_token": "mean over query rows i < n - 1 of the weight on key i + 1 (bidirectional models; 0 for causal "
                  "ones)",
    "local": "mean over query rows i of the weight on the keys within 3 positions of i",
    "entropy": "mean over rows with k >= 2 allowed keys of the row's entropy divided by log k (1: uniform over "
               "the keys, 0: all on one key)",
    "duplicate_token": "on T random tokens repeated once: mean over the second copy's rows i of the weight on "
                       "key i - T (the earlier copy of the current token)",
    "induction": "on T random tokens repeated once: mean over the second copy's rows i of the weight on key "
                 "i - T + 1 (the token that followed the earlier copy)",
}

# A head's label is the first of these whose score reaches its threshold; otherwise "mixed".
LABEL_RULES: tuple[tuple[str, str, float], ...] = (
    ("induction", "induction", 0.30),
    ("duplicate_token", "duplicate-token", 0.30),
    ("previous_token", "previous-token", 0.40),
    ("next_token", "next-token", 0.40),
    ("self", "self", 0.40),
    ("first_token", "attention-sink", 0.50),
    ("local", "local", 0.70),
    ("entropy", "broad", 0.85),
)


def _sums(w: Tensor, n: int, causal: bool) -> dict[str, Tensor]:
    """Per-head sums (not yet means) of each pattern score over the rows of one sequence: w (h, s, t)."""
    w = w[:, :n, :n].double()  # (h, n, n)
    i = torch.arange(n)
    zero = torch.zeros(w.shape[0], dtype=torch.float64)
    out: dict[str, Tensor] = {}
    out["previous_token"] = w[:, i[1:], i[1:] - 1].sum(-1) if n > 1 else zero
    out["first_token"] = w[:, 1:, 0].sum(-1) if n > 1 else zero
    out["self"] = w[:, i, i].sum(-1)
    out["next_token"] = w[:, i[:-1], i[:-1] + 1].sum(-1) if n > 1 else zero
    band = (i[:, None] - i[None, :]).abs() <= 3  # (n, n)
    out["local"] = (w * band).sum((-1, -2))
    allowed = torch.ones(n, n, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    k = allowed.sum(-1)  # allowed keys per row
    rows = k >= 2
    entropy = -(w * w.clamp_min(1e-30).log()).sum(-1)  # (h, n)
    out["entropy"] = (entropy[:, rows] / k[rows].double().log()).sum(-1)
    return out


def _counts(n: int, causal: bool) -> dict[str, int]:
    """How many rows each score averages over, for one sequence of n tokens."""
    entropy_rows = max(0, n - 1) if causal else (n if n >= 2 else 0)
    return {"previous_token": n - 1, "first_token": n - 1, "self": n, "next_token": n - 1, "local": n,
            "entropy": entropy_rows}


def layer_pattern_sums(w: Tensor, lengths: list[int], *, causal: bool) -> dict[str, np.ndarray]:
    """One layer's per-head sums (not yet means) of the natural-text scores over the sequences of a batch:
    w (b, h, s, t). :func:`pattern_scores` divides by the row counts; taking the sums layer by layer lets a caller
    drop each layer's weights before the next (a long text's weights do not fit in memory all at once)."""
    out = {name: np.zeros(w.shape[1]) for name in _counts(2, causal)}
    for b, n in enumerate(lengths):
        for name, value in _sums(w[b], n, causal).items():
            out[name] += value.numpy()
    return out


def pattern_scores(weights: list[Tensor], lengths: list[int], *, causal: bool) -> dict[str, np.ndarray]:
    """Scores of every (layer, head) from weights [(b, h, s, t) per layer] of sequences of the given real lengths.

    Returns {score name: array (n_layers, n_heads)} for the scores defined on natural text (all but duplicate_token
    and induction).
    """
    return scores_from_sums([layer_pattern_sums(w, lengths, causal=causal) for w in weights], lengths, causal=causal)


def scores_from_sums(sums: list[dict[str, np.ndarray]], lengths: list[int], *, causal: bool) -> dict[str, np.ndarray]:
    """The means of :func:`layer_pattern_sums` of every layer: {score name: (n_layers, n_heads)}."""
    names = list(_counts(2, causal))
    counts = dict.fromkeys(names, 0)
    for n in lengths:
        for name, c in _counts(n, causal).items():
            counts[name] += c
    out = {name: np.stack([layer[name] for layer in sums]) / counts[name] if counts[name]
           else np.zeros((len(sums), len(sums[0][name]))) for name in names}
    if causal:
        out["next_token"] = np.zeros_like(out["next_token"])
    return out


def repeat_scores(weights: list[Tensor], period: int) -> dict[str, np.ndarray]:
    """duplicate_token and induction from weights [(b, h, 2T, 2T) per layer] on sequences of T random tokens
    repeated once (no padding): mean over b and i >= T of w[i, i-T] and w[i, i-T+1]."""
    n_layers, n_heads = len(weights), weights[0].shape[1]
    dup = np.zeros((n_layers, n_heads))
    ind = np.zeros((n_layers, n_heads))
    i = torch.arange(period, 2 * period)
    for layer, w in enumerate(weights):
        w = w.double()
        dup[layer] = w[:, :, i, i - period].mean(dim=(0, 2)).numpy()
        ind[layer] = w[:, :, i, i - period + 1].mean(dim=(0, 2)).numpy()
    return {"duplicate_token": dup, "induction": ind}


@dataclass
class HeadScores:
    """Every score of every head, with labels; query heads are grouped under their KV head."""

    scores: dict[str, np.ndarray]  # name -> (n_layers, n_heads)
    n_kv_heads: int
    labels: list[list[str]]

    @property
    def n_layers(self) -> int:
        return int(next(iter(self.scores.values())).shape[0])

    @property
    def n_heads(self) -> int:
        return int(next(iter(self.scores.values())).shape[1])

    def kv_head(self, head: int) -> int:
        """The KV head a query head reads: head // (n_heads / n_kv_heads)."""
        return head // (self.n_heads // self.n_kv_heads)

    def records(self) -> list[dict[str, object]]:
        """One record per (layer, head): layer, head, kv_head, label and every score."""
        rows: list[dict[str, object]] = []
        for layer in range(self.n_layers):
            for head in range(self.n_heads):
                row: dict[str, object] = {"layer": layer, "head": head, "kv_head": self.kv_head(head),
                                          "label": self.labels[layer][head]}
                row.update({name: round(float(self.scores[name][layer, head]), 6) for name in SCORE_NAMES})
                rows.append(row)
        return rows

    def top(self, name: str, k: int = 5) -> list[tuple[int, int, float]]:
        """The k heads with the highest score: (layer, head, score)."""
        flat = self.scores[name].ravel()
        order = np.argsort(-flat, kind="stable")[:k]
        return [(int(o // self.n_heads), int(o % self.n_heads), float(flat[o])) for o in order]


def label_heads(scores: dict[str, np.ndarray]) -> list[list[str]]:
    """The label of each head: the first rule of LABEL_RULES whose score reaches its threshold, else 'mixed'."""
    n_layers, n_heads = next(iter(scores.values())).shape
    labels = []
    for layer in range(n_layers):
        row = []
        for head in range(n_heads):
            label = "mixed"
            for name, text, threshold in LABEL_RULES:
                if name in scores and scores[name][layer, head] >= threshold:
                    label = text
                    break
            row.append(label)
        labels.append(row)
    return labels
