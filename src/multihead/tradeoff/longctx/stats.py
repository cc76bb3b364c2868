"""The statistics of a retrieval accuracy: a bootstrap interval over prompts (cases of one prompt move together) and
Wilson's interval over cases."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np


def bootstrap_ci(correct: Sequence[bool], groups: Sequence[str], *, draws: int, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the accuracy, resampling prompts (cases of one prompt move together)."""
    if not correct:
        return (math.nan, math.nan)
    by: dict[str, list[bool]] = {}
    for c, g in zip(correct, groups, strict=True):
        by.setdefault(g, []).append(bool(c))
    hits = np.array([sum(v) for v in by.values()], dtype=float)
    sizes = np.array([len(v) for v in by.values()], dtype=float)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(hits), size=(draws, len(hits)))
    acc = hits[pick].sum(1) / sizes[pick].sum(1)
    lo, hi = np.quantile(acc, [(1 - level) / 2, (1 + level) / 2])
    return (float(lo), float(hi))


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of k successes in n (not degenerate at 0 or n, unlike the bootstrap)."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def summarise(results: Sequence[dict[str, Any]], *, draws: int, seed: int = 0) -> dict[str, Any]:
    correct = [bool(r["correct"]) for r in results]
    k, n = sum(correct), len(correct)
    return {"accuracy": k / n if n else math.nan, "correct": k, "cases": n,
            "prompts": len({r["group"] + str(r["length"]) + r["task"] for r in results}),
            "ci95": bootstrap_ci(correct, [f"{r['length']}|{r['task']}|{r['group']}" for r in results],
                                 draws=draws, seed=seed),
            "wilson95": wilson(k, n),
            "answer_logprob": statistics.fmean(r["answer_logprob"] for r in results) if n else math.nan}


__all__ = ["bootstrap_ci", "summarise", "wilson"]
