"""Head-wise cache plans for SmolLM2 from measured scores: the files docs/experiments/*-plan.json.

    .venv/bin/python benchmarks/make_plans.py [--scores docs/experiments/retrieval-smollm2.json]
        [--gates docs/experiments/duo-smollm2-gates.json] [--out docs/experiments] [--sinks 4] [--window 256]
        [--only duo --label duo1024]  (one score's plans, under another name)

Each plan keeps every key for the top 25%, 50% or 75% of the 90 KV heads by one score and sinks + window for the
rest (:meth:`multihead.cache.HeadPlan.from_scores`):

- retrieval: Wu et al.'s copy score per KV head (max over its query heads; `multihead heads --retrieval`), ties
  (most KV heads score 0) broken by the attention mass a sinks + window cache would drop (more dropped: full first);
- mass: that dropped mass alone (training-free: a head whose attention leaves the window needs its keys);
- razor: RazorAttention's echo / induction score (max of the two);
- duo: DuoAttention-style gates optimised per KV head (`python -m multihead.tradeoff.duo`).

The best plan at 50% (``--best``, duo-50 on the measured cases) is also saved as smollm2-0-best-plan.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from multihead.cache import HeadPlan

MODEL = "SmolLM2-135M-Instruct"
SHAPE = (30, 9, 3, 64)  # n_layers, n_heads, n_kv_heads, head_dim
BUDGETS = {"retrieval": (0.25, 0.5, 0.75), "mass": (0.25, 0.5), "razor": (0.25, 0.5), "duo": (0.25, 0.5, 0.75)}


def scores_of(kind: str, retrieval: dict, gates: dict | None) -> np.ndarray:
    if kind == "retrieval":
        mass = np.asarray(retrieval["mass_outside_kv"])
        return np.asarray(retrieval["kv"]) + 1e-3 * mass / max(float(mass.max()), 1e-12)  # ties by dropped mass
    if kind == "mass":
        return np.asarray(retrieval["mass_outside_kv"])
    if kind == "razor":
        return np.asarray(retrieval["razor_kv"]["razor"])
    assert gates is not None
    return np.asarray(gates["gates"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scores", default="docs/experiments/retrieval-smollm2.json")
    p.add_argument("--gates", default="docs/experiments/duo-smollm2-gates.json")
    p.add_argument("--out", default="docs/experiments")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--png", default="docs/experiments/smollm2-plans.png", help="the maps of the 50%% plans")
    p.add_argument("--only", choices=tuple(BUDGETS), default=None, help="only the plans of this score")
    p.add_argument("--label", default=None, help="the files' name for the score (default the score's: "
                   "smollm2-<label>-<pct>-plan.json), e.g. to keep gates of another training beside the shipped")
    p.add_argument("--best", default="duo-50", help="the plan also saved as smollm2-0-best-plan.json (first by "
                   "name): the best at 50%% of KV heads in docs/experiments/head-wise-cache.md")
    args = p.parse_args()
    retrieval = json.loads(Path(args.scores).read_text())
    gates = json.loads(Path(args.gates).read_text()) if Path(args.gates).exists() else None
    maps: dict[str, np.ndarray] = {}
    for kind, budgets in BUDGETS.items():
        if args.only is not None and kind != args.only:
            continue
        label = args.label or kind
        if kind == "duo" and gates is None:
            print(f"no gates at {args.gates}: no duo plans")
            continue
        scores = scores_of(kind, retrieval, gates)
        for budget in budgets:
            plan = HeadPlan.from_scores(scores.tolist(), budget, sinks=args.sinks, window=args.window, model=MODEL,
                                        shape=SHAPE, method=kind)
            path = plan.save(Path(args.out) / f"smollm2-{label}-{round(budget * 100)}-plan.json")
            if f"{label}-{round(budget * 100)}" == args.best:
                plan.save(Path(args.out) / "smollm2-0-best-plan.json")
            chosen = [f"L{i}KV{j}" for i, row in enumerate(plan.full) for j, f in enumerate(row) if f]
            if budget == 0.5:
                maps[kind] = np.asarray(plan.full, dtype=float)
            more = " ..." if len(chosen) > 12 else ""
            print(f"{path}: {len(chosen)} of 90 KV heads full: {' '.join(chosen[:12])}{more}")
    if args.png and maps:
        draw(maps, args.png)
        print(f"maps: {args.png}")


def draw(maps: dict[str, np.ndarray], path: str) -> None:
    """One panel per plan: layer (rows) x KV head (columns), dark = keeps every key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(maps), figsize=(1.6 * len(maps) + 1, 6.5), sharey=True)
    for ax, (kind, full) in zip(np.atleast_1d(axes), maps.items(), strict=True):
        ax.imshow(full, cmap="Greys", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set_title(f"{kind}, 50%", fontsize=9)
        ax.set_xticks(range(full.shape[1]))
        ax.set_xlabel("KV head")
    np.atleast_1d(axes)[0].set_ylabel("layer")
    fig.suptitle("SmolLM2 head-wise plans: dark = full (every key), light = 4 sinks + 256", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
