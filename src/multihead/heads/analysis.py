"""The whole head analysis of one model on one text: capture, scores, labels, and optionally ablation and GQA
conversion."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np
import torch

from multihead.divisors import divisors
from multihead.errors import MultiheadError
from multihead.heads.adapters import Batch, HeadModel, ablate_edit, pool_edits, split_sentences
from multihead.heads.capture import capture_reduced, capture_weights
from multihead.heads.patching import PromptPair, patch_pairs
from multihead.heads.scores import HeadScores, label_heads, layer_pattern_sums, repeat_scores, scores_from_sums


def default_passage() -> str:
    """The public-domain passage shipped with multihead (the opening of A Tale of Two Cities)."""
    return resources.files("multihead").joinpath("data/passage.txt").read_text(encoding="utf-8").strip()


@dataclass
class HeadReport:
    model: str
    causal: bool
    n_layers: int
    n_heads: int
    n_kv_heads: int
    text: str
    tokens: list[str]  # the displayed tokens (the first display_tokens of the text)
    patterns: list[np.ndarray]  # per layer (n_heads, n, n) float32 weights over the displayed tokens
    scores: HeadScores
    metric_name: str = ""
    engine: str = ""
    baseline: float | None = None
    ablation: list[dict[str, Any]] = field(default_factory=list)
    conversion: list[dict[str, Any]] = field(default_factory=list)
    patching: dict[str, Any] | None = None  # method, point, pairs, clean, corrupted, effects (n_layers, heads)
    retrieval: Any = None  # multihead.heads.retrieval.RetrievalScores, when asked for (long-context needle cases)

    def ablation_summary(self, threshold: float = 0.01) -> dict[str, Any]:
        """The most important heads and the share whose removal changes the metric by less than 1% (relative)."""
        if not self.ablation:
            return {}
        ranked = sorted(self.ablation, key=lambda r: -abs(r["delta"]))
        small = sum(1 for r in self.ablation if abs(r["relative"]) < threshold)
        return {"baseline": self.baseline, "metric": self.metric_name, "most_important": ranked[:10],
                "share_below_1_percent": small / len(self.ablation)}


def analyse(
    model: HeadModel,
    text: str | None = None,
    *,
    repeat_len: int = 24,
    seeds: int = 3,
    display_tokens: int = 64,
    ablate: bool = False,
    convert: bool = False,
    pairs: Sequence[PromptPair] | None = None,
    progress: bool = True,
) -> HeadReport:
    """Scores and labels of every head of ``model`` on ``text`` (default: the shipped passage)."""
    text = default_passage() if text is None else text
    if not text.strip():
        raise MultiheadError("the text is empty: give some text to analyse")
    if repeat_len < 20:
        raise MultiheadError(f"repeat_len ({repeat_len}) must be at least 20 random tokens")
    layers = model.layers()
    batch = model.encode([text])
    n = min(display_tokens, batch.lengths[0])

    def reduce(_layer: int, w: torch.Tensor) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """A layer's score sums and its pattern over the displayed tokens; its full weights are dropped."""
        return (layer_pattern_sums(w, batch.lengths, causal=model.causal),
                w[0, :, :n, :n].numpy().astype(np.float32, copy=True))

    reduced = capture_reduced(layers, lambda: model.run(batch), reduce)
    scores = scores_from_sums([sums for sums, _ in reduced], batch.lengths, causal=model.causal)

    gen = torch.Generator().manual_seed(0)
    random = torch.stack([model.random_token_ids(repeat_len, gen) for _ in range(seeds)])  # (seeds, T)
    repeated, offset = model.wrap_repeat(torch.cat([random, random], dim=1))  # (seeds, 2T (+ wrapping))
    rep_batch = Batch(repeated, torch.ones_like(repeated, dtype=torch.bool), [repeated.shape[1]] * seeds)
    rep_weights = capture_weights(layers, lambda: model.run(rep_batch))
    core = [w[:, :, offset:offset + 2 * repeat_len, offset:offset + 2 * repeat_len] for w in rep_weights]
    scores.update(repeat_scores(core, repeat_len))
    head_scores = HeadScores(scores=scores, n_kv_heads=model.n_kv_heads, labels=label_heads(scores))

    tokens = model.token_strings(batch.ids[0, :n].tolist())
    patterns = [pattern for _, pattern in reduced]
    report = HeadReport(model=model.name, causal=model.causal, n_layers=len(layers), n_heads=model.n_heads,
                        n_kv_heads=model.n_kv_heads, text=text, tokens=tokens, patterns=patterns,
                        scores=head_scores, metric_name=model.metric_name, engine=model.engine)
    if ablate or convert:
        metric_batch = batch if model.causal else model.encode(split_sentences(text))
        report.baseline = model.metric(metric_batch)
    if ablate:
        report.ablation = ablation(model, metric_batch, report.baseline or 0.0, progress=progress)
    if convert:
        report.conversion = conversion(model, metric_batch, report.baseline or 0.0)
    if pairs is not None:
        if not model.causal:
            raise MultiheadError(f"{model.name} is not a causal language model: patching compares next-token logits")
        result = patch_pairs(model.logits, model.layers(), model.token_ids, pairs, attribution=False,
                             prompt=model.prompt_ids)
        assert result.patching is not None
        report.patching = {"method": "activation patching", "point": result.point, "pairs": result.pairs,
                           "clean": result.clean, "corrupted": result.corrupted,
                           "effects": np.round(result.patching, 6).tolist()}
    return report


def ablation(model: HeadModel, batch: Any, baseline: float, *, progress: bool = True) -> list[dict[str, Any]]:
    """The metric with each head zeroed in turn (before W_O); each run starts from the cached input of its layer."""
    from multihead.heads.progress import progress_bar

    states = model.hidden_states(batch)
    layers = model.layers()
    pairs = [(layer, head) for layer in range(model.n_layers) for head in range(model.n_heads)]
    rows = []
    for layer, head in progress_bar(pairs, desc=f"ablating {len(pairs)} heads", unit="head", progress=progress):
        value = model.metric(batch, edits=[ablate_edit(layers[layer], head)], start=layer, states=states)
        delta = value - baseline
        rows.append({"layer": layer, "head": head, "metric": value, "delta": delta,
                     "relative": model.relative(value, baseline)})
    return rows


def conversion(model: HeadModel, batch: Any, baseline: float) -> list[dict[str, Any]]:
    """The metric after mean-pooling K and V into fewer KV heads (through the hook points k and v of every layer),
    for every count that divides the current one."""
    rows = []
    for g in sorted(divisors(model.n_kv_heads), reverse=True)[1:]:
        value = model.metric(batch, edits=pool_edits(model.layers(), g))
        rows.append({"n_kv_heads": g, "metric": value, "delta": value - baseline,
                     "relative": model.relative(value, baseline)})
    return rows
