"""Have DuoAttention-style gates settled? Snapshots of one run's ``gates.json`` (``python -m multihead.tradeoff.duo``
writes it at every checkpoint; copy it aside as the run goes) read against the last one.

For each snapshot: the step, the mean gate, how many gates sit at 0 and at 1 (within 0.001: the optimiser clamps
them to [0, 1], where Adam's last steps leave them a hair inside), and for each budget (a share of KV heads kept
full) how many of the plan's full heads the last snapshot's plan keeps too (``HeadPlan.from_scores``' top fraction,
the rule that makes the plans) and the Spearman correlation of all the gates with the last ones. A run has
settled, for a budget, when its plans stop changing: the overlap with the last plan reaches the plan's size a
while before the end. With ``--halves-after STEP`` it also averages the snapshots after STEP in two halves (by step)
and says how many full heads the two halves' plans share: whether the *mean* gates have settled where single
snapshots keep wandering (what ``python -m multihead.tradeoff.duo --average-from`` then makes the plans from).

    .venv/bin/python benchmarks/duo_settling.py out/duo-gates-snaps/step-*.json --budget 0.25 --budget 0.5 \\
        --json docs/experiments/duo-gates-1024-settling.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from multihead import MultiheadError
from multihead.cache import HeadPlan

SETTLED = 1e-3  # a gate this close to 0 or 1 has settled there


def read_snapshot(path: Path) -> tuple[int, np.ndarray]:
    """(step, gates) of one copy of ``gates.json``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        step, gates = int(data["step"]), np.asarray(data["gates"], dtype=float)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise MultiheadError(f"{path}: not a gates.json snapshot (step and gates): {err}") from None
    if gates.ndim != 2 or not np.isfinite(gates).all():
        raise MultiheadError(f"{path}: gates must be a finite (n_layers, n_kv_heads) array, got shape {gates.shape}")
    return step, gates


def full_heads(gates: np.ndarray, budget: float) -> set[tuple[int, int]]:
    """The KV heads a plan keeping ``budget`` of them full keeps full (the rule of ``HeadPlan.from_scores``)."""
    n_layers, n_kv = gates.shape
    plan = HeadPlan.from_scores(gates.tolist(), budget, sinks=4, window=4, model="gates",
                                shape=(n_layers, n_kv, n_kv, 1), method="settling")
    return {(layer, head) for layer in range(n_layers) for head in range(n_kv) if plan.full[layer][head]}


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of all the gates (scipy's, as benchmarks/plan_labels.py uses)."""
    from scipy import stats

    return float(stats.spearmanr(a.ravel(), b.ravel()).statistic)


def settling(snapshots: Sequence[tuple[int, np.ndarray]], budgets: Sequence[float]) -> dict[str, Any]:
    """Every snapshot against the last (by step)."""
    if not snapshots:
        raise MultiheadError("no snapshot to read")
    snaps = sorted(snapshots, key=lambda s: s[0])
    shapes = {g.shape for _, g in snaps}
    if len(shapes) != 1:
        raise MultiheadError(f"the snapshots hold gates of different shapes {sorted(shapes)}: not one run")
    steps = [s for s, _ in snaps]
    if len(set(steps)) != len(steps):
        raise MultiheadError(f"two snapshots of the same step in {steps}")
    last_step, last = snaps[-1]
    last_plans = {b: full_heads(last, b) for b in budgets}
    rows = []
    for step, gates in snaps:
        row: dict[str, Any] = {"step": step, "mean_gate": float(gates.mean()), "at_0": int((gates <= SETTLED).sum()),
                               "at_1": int((gates >= 1 - SETTLED).sum()), "spearman_with_last": spearman(gates, last)}
        for b in budgets:
            mine = full_heads(gates, b)
            row[f"full_{b:g}"] = len(mine)
            row[f"same_full_{b:g}"] = len(mine & last_plans[b])
        rows.append(row)
    return {"last_step": last_step, "gates": int(last.size), "budgets": list(budgets), "snapshots": rows}


def halves(snapshots: Sequence[tuple[int, np.ndarray]], budgets: Sequence[float], after: int) -> dict[str, Any]:
    """The snapshots after step ``after``, by step, in two halves: each half's mean gates and, per budget, how many
    full heads the two means' plans share."""
    later = sorted((s for s in snapshots if s[0] > after), key=lambda s: s[0])
    if len(later) < 2:
        raise MultiheadError(f"{len(later)} snapshot(s) after step {after}: two halves need at least 2")
    first, second = later[: len(later) // 2], later[len(later) // 2:]
    means = [np.mean([g for _, g in half], axis=0) for half in (first, second)]
    out: dict[str, Any] = {"after": after, "spearman": spearman(*means)}
    for name, half in (("first", first), ("second", second)):
        out[name] = {"snapshots": len(half), "steps": [half[0][0], half[-1][0]]}
    for b in budgets:
        a, c = full_heads(means[0], b), full_heads(means[1], b)
        out[f"same_full_{b:g}"] = {"shared": len(a & c), "of": len(a)}
    return out


def table(result: dict[str, Any]) -> str:
    budgets = result["budgets"]
    head = ["step", "mean gate", "at 0", "at 1", "Spearman with last"] + [
        f"{b:.0%} plan: heads also in the last" for b in budgets]
    lines = [" | ".join(head)]
    for r in result["snapshots"]:
        cells = [str(r["step"]), f"{r['mean_gate']:.3f}", str(r["at_0"]), str(r["at_1"]),
                 f"{r['spearman_with_last']:.3f}"]
        cells += [f"{r[f'same_full_{b:g}']} of {r[f'full_{b:g}']}" for b in budgets]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshots", nargs="+", help="copies of one run's gates.json, taken at different steps")
    p.add_argument("--budget", type=float, action="append", default=None, metavar="FRACTION",
                   help="a share of KV heads kept full (repeatable; default 0.25 and 0.5)")
    p.add_argument("--every", type=int, default=1, help="keep every N-th snapshot in the table (the last always)")
    p.add_argument("--halves-after", type=int, default=None, metavar="STEP",
                   help="also the plans of the mean gates of the snapshots after STEP, first half against second")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    budgets = args.budget or [0.25, 0.5]
    try:
        for b in budgets:
            if not 0 < b < 1:
                raise MultiheadError(f"--budget {b!r} must be a share of the KV heads in (0, 1)")
        if args.every < 1:
            raise MultiheadError(f"--every {args.every} must be at least 1")
        snaps = [read_snapshot(Path(f)) for f in args.snapshots]
        result = settling(snaps, budgets)
        if args.halves_after is not None:
            result["halves"] = halves(snaps, budgets, args.halves_after)
    except MultiheadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = result["snapshots"]
    shown = dict(result, snapshots=[r for i, r in enumerate(rows) if i % args.every == 0 or i == len(rows) - 1])
    print(table(shown))
    if "halves" in result:
        h = result["halves"]
        shared = ", ".join(f"{b:.0%} plan {h[f'same_full_{b:g}']['shared']} of {h[f'same_full_{b:g}']['of']}"
                           for b in budgets)
        print(f"mean gates of steps {h['first']['steps'][0]}-{h['first']['steps'][1]} ({h['first']['snapshots']} "
              f"snapshots) against {h['second']['steps'][0]}-{h['second']['steps'][1]} ({h['second']['snapshots']}): "
              f"{shared} full heads shared, Spearman {h['spearman']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
