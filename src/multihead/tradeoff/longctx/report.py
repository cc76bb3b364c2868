"""The long-context result for people: its table (:func:`table`) and its picture (:func:`plot`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _pct(x: float | None) -> str:
    return "  -  " if x is None or math.isnan(x) else f"{x:5.0%}"


def table(result: dict[str, Any]) -> str:
    """Per method and length: KV MiB, accuracy over the compared cells with its 95% interval, prefill and decode
    step time; perplexity on the long windows. Then the cells left out and the per-task accuracies."""
    lengths = [str(n) for n in result["settings"]["lengths"]]
    s = result["settings"]
    lines = [f"long-context retrieval: {result['cases']} cases ({result['prompts']} prompts); accuracy = exact match "
             f"of the greedy answer over the cells the full cache passes (>= {s['threshold']:.0%}), "
             "[bootstrap 95%]; ppl: last "
             f"{s['ppl_scored']} of {s['ppl_context']}-token windows"]
    head = f"{'method':<30}" + "".join(f"| {n + ' tokens':<38}" for n in lengths) + "| ppl     MiB"
    lines += [head, f"{'':<30}" + "| MiB     acc   [95% CI]     prefill decode " * len(lengths), "-" * len(head)]
    for row in result["rows"]:
        cells = []
        for n in lengths:
            c = row["lengths"][n]
            cmp = c["compared"]
            acc = "  -  " if cmp is None else _pct(cmp["accuracy"])
            ci = "           " if cmp is None else f"[{cmp['ci95'][0]:4.0%},{cmp['ci95'][1]:4.0%}]"
            pre = "   -  " if c["prefill_seconds"] is None else f"{c['prefill_seconds']:5.1f}s"
            dec = "   -  " if c["decode_step_seconds"] is None else f"{c['decode_step_seconds'] * 1000:4.0f}ms"
            cells.append(f"| {c['kv_bytes'] / 2**20:6.1f} {acc} {ci} {pre} {dec} ")
        p = row["perplexity"]
        lines.append(f"{row['method'][:30]:<30}" + "".join(cells) + f"| {p['perplexity']:7.2f} "
                     f"{p['kv_bytes'] / 2**20:6.1f}")
    for e in result["excluded"]:
        lines.append(f"left out: {e['task']} at {e['length']} tokens (full cache {e['accuracy']:.0%} of "
                     f"{e['cases']} cases)")
    tasks = s["tasks"]
    lines += ["", "per task (correct / cases):", f"{'method':<30}" + "".join(
        f"| {n:<6}" + "".join(f"{t[:11]:>12}" for t in tasks) + " " for n in lengths)]
    for row in result["rows"]:
        cells = []
        for n in lengths:
            t = row["lengths"][n]["tasks"]
            marks = [f"{t[k]['correct']}/{t[k]['cases']}" if k in t else "-" for k in tasks]
            cells.append(f"| {'':<6}" + "".join(f"{m:>12}" for m in marks) + " ")
        lines.append(f"{row['method'][:30]:<30}" + "".join(cells))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> str:
    """Top: accuracy (compared cells, 95% bootstrap bars) against KV MiB, a panel per length, a series per method
    family. Bottom: perplexity on the long windows against the KV MiB at that window length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from multihead.files import save_figure

    lengths = [str(n) for n in result["settings"]["lengths"]]
    rows = result["rows"]
    series = list(dict.fromkeys(r["series"] for r in rows))
    markers = {name: "*vosDP^Xh<>"[i % 11] for i, name in enumerate(series)}
    fig = plt.figure(figsize=(4.2 * len(lengths) + 0.5, 8.4))
    grid = fig.add_gridspec(2, len(lengths))
    for i, n in enumerate(lengths):
        ax = fig.add_subplot(grid[0, i])
        for name in series:
            pts = [r for r in rows if r["series"] == name and r["lengths"][n]["compared"] is not None]
            pts.sort(key=lambda r: r["lengths"][n]["kv_bytes"])
            if not pts:
                continue
            xs = [r["lengths"][n]["kv_bytes"] / 2**20 for r in pts]
            ys = [r["lengths"][n]["compared"]["accuracy"] for r in pts]
            lo = [y - r["lengths"][n]["compared"]["ci95"][0] for y, r in zip(ys, pts, strict=True)]
            hi = [r["lengths"][n]["compared"]["ci95"][1] - y for y, r in zip(ys, pts, strict=True)]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker=markers[name], linestyle="-" if len(pts) > 1 else "none",
                        label=name, markersize=7, capsize=3)
        ax.set_xscale("log")
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel(f"KV cache at {n} tokens, MiB ({result['dtype']})")
        ax.set_ylabel("retrieval accuracy (exact match)")
        ax.set_title(f"{n} tokens", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7, loc="lower right")
    ax = fig.add_subplot(grid[1, :])
    for name in series:
        pts = sorted((r for r in rows if r["series"] == name), key=lambda r: r["perplexity"]["kv_bytes"])
        ax.plot([r["perplexity"]["kv_bytes"] / 2**20 for r in pts], [r["perplexity"]["perplexity"] for r in pts],
                marker=markers[name], linestyle="-" if len(pts) > 1 else "none", label=name, markersize=7)
        for r in pts:
            ax.annotate(r["method"], (r["perplexity"]["kv_bytes"] / 2**20, r["perplexity"]["perplexity"]),
                        textcoords="offset points", xytext=(5, 3), fontsize=7)
    s = result["settings"]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"KV cache at {s['ppl_context']} tokens, MiB ({result['dtype']})")
    ax.set_ylabel(f"perplexity, last {s['ppl_scored']} of {s['ppl_context']} tokens")
    ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("Retrieval against KV bytes (top) and perplexity against KV bytes (bottom)", fontsize=11)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return str(path)


__all__ = ["plot", "table"]
