"""Which KV heads the SmolLM2 head-wise plans keep in full, against the head labels `multihead heads` gives.

    .venv/bin/python benchmarks/plan_labels.py [--heads HEADS.json] [--save-heads HEADS.json]
        [--plans docs/experiments] [--json docs/experiments/smollm2-plan-labels.json]
        [--png docs/experiments/smollm2-plan-labels.png]

The labels and scores are `multihead heads --json` on SmolLM2 (the shipped passage, 3 seeds of 24 repeated random
tokens): read from ``--heads`` when given, else computed here with the same library calls. A plan decides per KV
head, so each KV head takes its query heads' view (``kv_heads`` of that JSON): it *carries* a label when one of its
3 query heads has it, and its score for a pattern is the max over them (as the retrieval score's KV aggregate).

For each plan (retrieval, duo, mass, razor at 25%, 50%, 75% of the 90 KV heads full; mass and razor ship at 50%
only, their 25% and 75% are made here from the same scores with ``HeadPlan.from_scores``, not shipped) and each label
(induction, previous-token, attention-sink, duplicate-token): how many full KV heads carry it, the share against the
base rate over all 90, the odds ratio and Fisher's exact test (two-sided) of the 2 x 2 table full/streaming x
carries/not. For each method: Spearman's rank correlation of the plan's per-KV-head score with each label score
(induction, previous_token, first_token, duplicate_token: the max over the KV head's query heads), with its p-value.
The same table for the KV heads whose retrieval score (Wu et al., ``--scores``) is above 0, without the plans'
tie-break. The figure: the layer x KV head map of each method's 50% plan, the labels marked.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from multihead.cache import HeadPlan

METHODS = ("retrieval", "duo", "mass", "razor")
BUDGETS = (0.25, 0.5, 0.75)
LABELS = {"induction": "I", "previous-token": "P", "attention-sink": "S", "duplicate-token": "D"}  # label: marker
SCORES = ("induction", "previous_token", "first_token", "duplicate_token")


def head_labels(path: str | None) -> dict[str, Any]:
    """`multihead heads --json` on SmolLM2: read from ``path``, or computed (the CLI's calls, default settings)."""
    if path is not None:
        data: dict[str, Any] = json.loads(Path(path).read_text())
        return data
    from multihead.heads.adapters import load_head_model
    from multihead.heads.analysis import analyse
    from multihead.heads.report import result_json

    return result_json(analyse(load_head_model("smollm2"), progress=False))


def kv_view(heads: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per (layer, KV head): {label: carries (L, g) bool} and {score: max over its query heads (L, g)}."""
    n_layers, g = int(heads["n_layers"]), int(heads["n_kv_heads"])
    rows = heads["kv_heads"]
    carries = {label: np.zeros((n_layers, g), dtype=bool) for label in LABELS}
    scores = {name: np.zeros((n_layers, g)) for name in SCORES}
    for r in rows:
        for label in LABELS:
            carries[label][r["layer"], r["kv_head"]] = label in r["labels"]
        for name in SCORES:
            scores[name][r["layer"], r["kv_head"]] = r[name]
    return carries, scores


def plans(folder: Path) -> dict[str, HeadPlan]:
    """The plans by "method-percent": the shipped files, and mass / razor at 25% and 75% from the 50% plan's
    scores (same sinks, window, model and shape)."""
    out = {}
    for method in METHODS:
        half = HeadPlan.load(folder / f"smollm2-{method}-50-plan.json")
        assert half.scores is not None
        for budget in BUDGETS:
            path = folder / f"smollm2-{method}-{round(budget * 100)}-plan.json"
            out[f"{method}-{round(budget * 100)}"] = HeadPlan.load(path) if path.exists() else HeadPlan.from_scores(
                [list(r) for r in half.scores], budget, sinks=half.sinks, window=half.window, model=half.model,
                shape=half.shape, method=method)
    return out


def overlap(full: np.ndarray, carries: np.ndarray) -> dict[str, Any]:
    """The 2 x 2 table full/streaming x carries/not, the share, the base rate, odds ratio and Fisher's p."""
    a = int((full & carries).sum())
    b = int((full & ~carries).sum())
    c = int((~full & carries).sum())
    d = int((~full & ~carries).sum())
    odds, p = stats.fisher_exact([[a, b], [c, d]], alternative="two-sided")  # odds inf: no streaming KV head has it
    return {"full_carrying": a, "full": a + b, "carrying": a + c, "kv_heads": a + b + c + d,
            "share_of_full": round(a / (a + b), 4) if a + b else None,
            "base_rate": round((a + c) / (a + b + c + d), 4),
            "odds_ratio": round(float(odds), 4) if np.isfinite(odds) else "inf", "fisher_p": float(f"{p:.4g}")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", help="`multihead heads --json` output for SmolLM2 (default: computed here)")
    p.add_argument("--plans", default="docs/experiments")
    p.add_argument("--json", default="docs/experiments/smollm2-plan-labels.json")
    p.add_argument("--png", default="docs/experiments/smollm2-plan-labels.png")
    p.add_argument("--scores", default="docs/experiments/retrieval-smollm2.json",
                   help="the retrieval scores the plans were made from (their KV heads above 0 are compared too)")
    p.add_argument("--save-heads", help="also write the labels and scores used (the `multihead heads --json` object)")
    args = p.parse_args()
    heads = head_labels(args.heads)
    if args.save_heads:
        Path(args.save_heads).write_text(json.dumps(heads) + "\n")
    carries, label_scores = kv_view(heads)
    chosen = plans(Path(args.plans))
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct", "date": time.strftime("%Y-%m-%d"),
        "labels_from": "multihead heads --json (shipped passage; 3 seeds of 24 repeated random tokens)",
        "kv_rule": "a KV head carries a label when one of its query heads has it; its score is the max over them",
        "label_counts": {label: {"query_heads": sum(r["label"] == label for r in heads["heads"]),
                                 "kv_heads": int(carries[label].sum())} for label in LABELS},
        "kv_labels": {label: carries[label].astype(int).tolist() for label in LABELS},
        "kv_scores": {name: np.round(label_scores[name], 6).tolist() for name in SCORES},
        "plans": {}, "correlations": {}}
    for key, plan in chosen.items():
        full = np.asarray(plan.full, dtype=bool)
        result["plans"][key] = {"shipped": (Path(args.plans) / f"smollm2-{key}-plan.json").exists(),
                                "full_kv_heads": int(full.sum()),
                                **{label: overlap(full, carries[label]) for label in LABELS}}
    retrieval = np.asarray(json.loads(Path(args.scores).read_text())["kv"], dtype=float)  # (L, g), no tie-break
    hits = retrieval > 0
    result["retrieval_above_0"] = {"kv_heads": int(hits.sum()),
                                   **{label: overlap(hits, carries[label]) for label in LABELS}}
    for method in METHODS:
        plan_scores = np.asarray(chosen[f"{method}-50"].scores, dtype=float).ravel()
        result["correlations"][method] = {}
        for name in SCORES:
            rho, p_value = stats.spearmanr(plan_scores, label_scores[name].ravel())
            result["correlations"][method][name] = {"spearman": round(float(rho), 4), "p": float(f"{p_value:.4g}")}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print("labels per KV head (of 90): " + ", ".join(f"{k} {v['kv_heads']} ({v['query_heads']} query heads)"
                                                      for k, v in result["label_counts"].items()))
    print(f"{'plan':<14}" + "".join(f"{label:>34}" for label in LABELS))
    for key, row in result["plans"].items():
        cells = [f"{r['full_carrying']}/{r['full']} ({r['share_of_full']:.2f} vs {r['base_rate']:.2f}) "
                 f"p={r['fisher_p']:.2g}" for r in (row[label] for label in LABELS)]
        print(f"{key:<14}" + "".join(f"{c:>34}" for c in cells))
    above = result["retrieval_above_0"]
    print(f"the {above['kv_heads']} KV heads with a retrieval score above 0: " + ", ".join(
        f"{label} {above[label]['full_carrying']} (p={above[label]['fisher_p']:.2g})" for label in LABELS))
    print("Spearman (plan score vs label score, 90 KV heads):")
    for method, row in result["correlations"].items():
        print(f"  {method:<10}" + "  ".join(f"{name} {v['spearman']:+.2f} (p={v['p']:.2g})" for name, v in row.items()))
    draw(chosen, carries, args.png)
    print(f"{args.json}, {args.png}")


def draw(chosen: dict[str, HeadPlan], carries: dict[str, np.ndarray], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(METHODS), 1, figsize=(12, 1.45 * len(METHODS) + 0.8), sharex=True)
    for ax, method in zip(axes, METHODS, strict=True):
        full = np.asarray(chosen[f"{method}-50"].full, dtype=float)  # (L, g)
        ax.imshow(full.T, cmap="Greys", vmin=-0.4, vmax=1.4, aspect="auto", origin="lower")
        n_layers, g = full.shape
        for layer in range(n_layers):
            for kv in range(g):
                marks = "".join(m for label, m in LABELS.items() if carries[label][layer, kv])
                ax.text(layer, kv, marks, ha="center", va="center", fontsize=7,
                        color="white" if full[layer, kv] else "black")
        ax.set_yticks(range(g))
        ax.set_ylabel("KV head")
        ax.set_title(f"{method} plan at 50% (dark: full, light: sinks + window)", fontsize=9, loc="left")
    axes[-1].set_xticks(range(0, 30, 2))
    axes[-1].set_xlabel("layer")
    fig.suptitle("SmolLM2-135M: KV heads kept in full vs head labels (one of the KV head's query heads is "
                 "I induction, P previous-token, S attention-sink, D duplicate-token)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
