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


def mcnemar(reference: Sequence[bool], other: Sequence[bool]) -> dict[str, Any]:
    """McNemar's exact test of two methods' answers to the same cases: ``b`` cases the reference gets right and the
    other wrong, ``c`` the reverse, and the two-sided p-value of b against c under the null that a discordant case
    falls either way with probability 1/2 (the binomial tail, doubled, at most 1)."""
    if len(reference) != len(other):
        raise ValueError(f"mcnemar: {len(reference)} and {len(other)} answers: the same cases are needed")
    b = sum(1 for x, y in zip(reference, other, strict=True) if x and not y)
    c = sum(1 for x, y in zip(reference, other, strict=True) if y and not x)
    n, low = b + c, min(b, c)
    tail = sum(math.comb(n, i) for i in range(low + 1)) / 2**n if n else 1.0
    return {"reference_only": b, "other_only": c, "p_value": min(1.0, 2 * tail)}


def paired_difference(reference: Sequence[bool], other: Sequence[bool], *, draws: int = 2000, seed: int = 0,
                      level: float = 0.95) -> dict[str, Any]:
    """``other``'s accuracy less ``reference``'s on the same cases, with a percentile bootstrap interval that
    resamples cases (both answers of a case move together)."""
    if len(reference) != len(other):
        raise ValueError(f"paired_difference: {len(reference)} and {len(other)} answers: the same cases are needed")
    if not reference:
        return {"difference": math.nan, "difference95": (math.nan, math.nan)}
    d = np.asarray(other, dtype=float) - np.asarray(reference, dtype=float)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(draws, len(d)))].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {"difference": float(d.mean()), "difference95": (float(lo), float(hi))}


def summarise(results: Sequence[dict[str, Any]], *, draws: int, seed: int = 0) -> dict[str, Any]:
    correct = [bool(r["correct"]) for r in results]
    k, n = sum(correct), len(correct)
    return {"accuracy": k / n if n else math.nan, "correct": k, "cases": n,
            "prompts": len({r["group"] + str(r["length"]) + r["task"] for r in results}),
            "ci95": bootstrap_ci(correct, [f"{r['length']}|{r['task']}|{r['group']}" for r in results],
                                 draws=draws, seed=seed),
            "wilson95": wilson(k, n),
            "answer_logprob": statistics.fmean(r["answer_logprob"] for r in results) if n else math.nan}


__all__ = ["bootstrap_ci", "mcnemar", "paired_difference", "summarise", "wilson"]
