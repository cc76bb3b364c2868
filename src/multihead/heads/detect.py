"""Head scores in the conventions of the field, beside multihead's own (:mod:`multihead.heads.scores`).

All take per-layer weights ``(b, h, n, n)`` (from :func:`multihead.heads.capture.capture_weights` or a
``hook_pattern`` cache) and return ``(n_layers, n_heads)``.

- :func:`induction_score`, TransformerLens's demo convention: on T random tokens repeated twice (optionally after
  a BOS token), the diagonal of each head's pattern at offset 1 - T (destination i, source i - T + 1: the token
  that followed the current token's earlier occurrence), averaged over all its entries and the batch. The
  diagonal includes its two boundary entries (the first copy's last token, and with BOS the BOS row), as the demo's
  ``pattern.diagonal(offset=1 - seq_len).mean()`` does; multihead's own ``induction`` score averages the second
  copy only.
- :func:`prefix_matching_score` (Olsson et al., 2022): on T random tokens repeated k >= 2 times, for each token of
  a later repeat, the attention summed over the tokens that followed its earlier occurrences, averaged over those
  tokens and the batch.
- :func:`detect`: how much of a head's attention falls on a given pattern's cells, ``sum(w * P) / sum(w)`` per
  sequence (TransformerLens's head detector, "mul" measure), optionally leaving out attention to BOS (key 0) and to
  the current token, then averaged over the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from multihead.errors import MultiheadError


def _check(weights: Sequence[Tensor]) -> None:
    if not weights or any(w.ndim != 4 or w.shape[-1] != w.shape[-2] for w in weights):
        raise MultiheadError("weights must be one (b, h, n, n) tensor per layer")


def induction_score(weights: Sequence[Tensor], period: int, *, bos: bool = False) -> np.ndarray:
    """TransformerLens's induction score on ``period`` random tokens repeated twice (after a BOS if ``bos``)."""
    _check(weights)
    n = weights[0].shape[-1]
    if n != 2 * period + int(bos):
        raise MultiheadError(f"{n} positions do not hold {period} tokens repeated twice{' after a BOS' if bos else ''}")
    return np.stack([w.double().diagonal(offset=1 - period, dim1=-2, dim2=-1).mean(dim=(0, 2)).numpy()
                     for w in weights])


def prefix_matching_score(weights: Sequence[Tensor], period: int, *, start: int = 0) -> np.ndarray:
    """Olsson et al.'s prefix matching on ``period`` random tokens repeated k >= 2 times from position ``start``."""
    _check(weights)
    n = weights[0].shape[-1]
    repeats = (n - start) // period
    if repeats < 2 or start + repeats * period != n:
        raise MultiheadError(f"{n} positions from {start} are not {period} tokens repeated at least twice")
    rows = []
    for w in weights:
        w = w.double()
        total = torch.zeros(w.shape[1], dtype=torch.float64)
        count = 0
        for i in range(start + period, n):  # every token of a later repeat
            earlier = torch.arange(i - period + 1, start, -period)  # the tokens after its earlier occurrences
            total += w[:, :, i, earlier].sum(-1).sum(0)
            count += w.shape[0]
        rows.append((total / count).numpy())
    return np.stack(rows)


def detect(weights: Sequence[Tensor], pattern: Tensor, *, exclude_bos: bool = False,
           exclude_current_token: bool = False) -> np.ndarray:
    """The share of each head's attention on the cells of ``pattern`` ((n, n) bool or 0/1), per sequence, averaged."""
    _check(weights)
    n = weights[0].shape[-1]
    if tuple(pattern.shape) != (n, n):
        raise MultiheadError(f"pattern of shape {tuple(pattern.shape)} must be (n, n) = {(n, n)}")
    cells = pattern.to(torch.float64)
    keep = torch.ones(n, n, dtype=torch.float64)
    if exclude_bos:
        keep[:, 0] = 0
    if exclude_current_token:
        keep.fill_diagonal_(0)
    rows = []
    for w in weights:
        w = w.double() * keep  # (b, h, n, n)
        total = w.sum(dim=(-1, -2))
        on = (w * cells).sum(dim=(-1, -2))
        rows.append(torch.where(total > 0, on / total, torch.zeros_like(total)).mean(0).numpy())
    return np.stack(rows)


def induction_pattern(period: int, *, bos: bool = False) -> Tensor:
    """The (n, n) cells an ideal induction head attends to on ``period`` tokens repeated twice: (i, i - T + 1)."""
    n = 2 * period + int(bos)
    cells = torch.zeros(n, n, dtype=torch.bool)
    first = period + int(bos)  # the second copy's first token
    i = torch.arange(first, n)
    cells[i, i - period + 1] = True
    return cells
