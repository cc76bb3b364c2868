"""The long-context result for people: its table (:func:`table`) and its picture (:func:`plot`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _pct(x: float | None) -> str:
    return "  -  " if x is None or math.isnan(x) else f"{x:5.0%}"


def _cell(text: str, width: int) -> str:
    return f" {text:>{width}} "


def table(result: dict[str, Any]) -> str:
    """Per method and length: the KV cache's MiB at that length, accuracy over the compared cells with its 95%
    interval, prefill and decode step time; then perplexity on the long windows and the KV MiB at that window's
    length. Then the cells left out and the per-task accuracies. Method names are shown whole, every column
    lines up with its header."""
    lengths = [str(n) for n in result["settings"]["lengths"]]
    s = result["settings"]
    rows = result["rows"]
    name = max([len("method"), *(len(r["method"]) for r in rows)])
    cols = (("KV MiB", 6), ("acc", 5), ("[95% CI]", 11), ("prefill", 7), ("decode", 6))
    block = sum(w + 2 for _, w in cols)
    ppl_cols = (("ppl", 8), ("KV MiB", 6))
    ppl_block = sum(w + 2 for _, w in ppl_cols)
    ppl_head = f"perplexity, {s['ppl_context']} tokens"
    ppl_block = max(ppl_block, len(ppl_head) + 2)
    lines = [f"long-context retrieval: {result['cases']} cases ({result['prompts']} prompts); acc = exact match of "
             f"the greedy answer over the cells the full cache passes (>= {s['threshold']:.0%}), [bootstrap 95%]; "
             f"KV MiB: the cache after a prompt of that length; ppl: the last {s['ppl_scored']} of "
             f"{s['ppl_context']}-token windows, with the KV MiB of a {s['ppl_context']}-token window"]
    head = (f"{'':<{name}} " + "".join(f"|{' ' + n + ' tokens':<{block}}" for n in lengths)
            + f"|{' ' + ppl_head:<{ppl_block}}")
    sub = (f"{'method':<{name}} " + ("|" + "".join(_cell(c, w) for c, w in cols)) * len(lengths)
           + f"|{''.join(_cell(c, w) for c, w in ppl_cols):<{ppl_block}}")
    lines += [head, sub, "-" * len(sub)]
    for row in rows:
        cells = []
        for n in lengths:
            c = row["lengths"][n]
            cmp = c["compared"]
            values = (f"{c['kv_bytes'] / 2**20:.1f}",
                      "-" if cmp is None else _pct(cmp["accuracy"]).strip(),
                      "-" if cmp is None else f"[{cmp['ci95'][0]:4.0%},{cmp['ci95'][1]:4.0%}]",
                      "-" if c["prefill_seconds"] is None else f"{c['prefill_seconds']:.1f}s",
                      "-" if c["decode_step_seconds"] is None else f"{c['decode_step_seconds'] * 1000:.0f}ms")
            cells.append("|" + "".join(_cell(v, w) for v, (_, w) in zip(values, cols, strict=True)))
        p = row["perplexity"]
        ppl = (f"{p['perplexity']:.2f}", f"{p['kv_bytes'] / 2**20:.1f}")
        lines.append(f"{row['method']:<{name}} " + "".join(cells)
                     + f"|{''.join(_cell(v, w) for v, (_, w) in zip(ppl, ppl_cols, strict=True)):<{ppl_block}}")
    for e in result["excluded"]:
        lines.append(f"left out: {e['task']} at {e['length']} tokens (full cache {e['accuracy']:.0%} of "
                     f"{e['cases']} cases)")
    tasks = s["tasks"]
    width = max(8, *(len(t) for t in tasks))
    lines += ["", "per task (correct / cases):", f"{'':<{name}} " + "".join(
        f"|{' ' + n + ' tokens':<{len(tasks) * (width + 2)}}" for n in lengths),
        f"{'method':<{name}} " + ("|" + "".join(_cell(t, width) for t in tasks)) * len(lengths)]
    for row in rows:
        cells = []
        for n in lengths:
            t = row["lengths"][n]["tasks"]
            marks = [f"{t[k]['correct']}/{t[k]['cases']}" if k in t else "-" for k in tasks]
            cells.append("|" + "".join(_cell(m, width) for m in marks))
        lines.append(f"{row['method']:<{name}} " + "".join(cells))
    return "\n".join(line.rstrip() for line in lines)


_MARKERS = "*vosDP^Xh<>p"


def _scale(ax: Any, axis: str, values: list[float]) -> None:
    """A log axis where the values span more than 3x (ticks at 1, 2, 5 x 10^k, written plainly, no minor labels),
    else a linear one."""
    from matplotlib import ticker

    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if not positive or max(positive) / min(positive) <= 3:
        return
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    target.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    target.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
    target.set_minor_formatter(ticker.NullFormatter())


def _place_numbers(fig: Any, ax: Any, points: list[tuple[float, float, str]]) -> None:
    """Each point's number beside it, at the first of a ring of offsets where it stays inside the axes and covers
    no other number or point (the least crowded offset where none is free)."""
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    shown = [ax.transData.transform((x, y)) for x, y, _ in points]
    radius = 4.5 * fig.dpi / 72  # a marker's half width, in pixels
    marks = [(px - radius, py - radius, px + radius, py + radius) for px, py in shown]
    taken: list[tuple[float, float, float, float]] = []
    rings = [(dx * r, dy * r) for r in (5, 9, 14, 20) for dx, dy in
             ((1, 0.5), (1, -0.5), (-1, 0.5), (-1, -0.5), (0, 1), (0, -1), (1, 0), (-1, 0))]

    def clash(box: tuple[float, float, float, float]) -> int:
        inside = bool(frame.x0 <= box[0] and box[2] <= frame.x1 and frame.y0 <= box[1] and box[3] <= frame.y1)
        hits: int = sum(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in taken + marks)
        return hits + (0 if inside else 100)

    for x, y, text in points:
        best = None
        for dx, dy in rings:
            label = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=7,
                                ha="left" if dx > 0 else "right" if dx < 0 else "center",
                                va="bottom" if dy > 0 else "top" if dy < 0 else "center", annotation_clip=False)
            label.set_in_layout(False)
            e = label.get_window_extent(renderer)
            box = (e.x0, e.y0, e.x1, e.y1)
            crowd = clash(box)
            if best is None or crowd < best[0]:
                if best is not None:
                    best[1].remove()
                best = (crowd, label, box)
            else:
                label.remove()
            if crowd == 0:
                break
        assert best is not None
        taken.append(best[2])


def figure(result: dict[str, Any]) -> Any:
    """The picture of :func:`plot` as a matplotlib Figure: a panel per length on top (accuracy over the compared
    cells, 95% bootstrap bars, against the KV MiB at that length), perplexity against the KV MiB of its window below,
    a series (marker and colour) per method family, every point numbered as the key on the right lists it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    lengths = [str(n) for n in result["settings"]["lengths"]]
    rows = result["rows"]
    s = result["settings"]
    series = list(dict.fromkeys(r["series"] for r in rows))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    style = {name: (_MARKERS[i % len(_MARKERS)], colours[i % len(colours)]) for i, name in enumerate(series)}
    number = {r["method"]: str(i + 1) for i, r in enumerate(rows)}
    fig = plt.figure(figsize=(max(11.0, 4.2 * len(lengths) + 3.6), 9.0), layout="constrained", dpi=100)
    grid = fig.add_gridspec(2, len(lengths))
    labelled: list[tuple[Any, list[tuple[float, float, str]]]] = []
    for i, n in enumerate(lengths):
        ax = fig.add_subplot(grid[0, i])
        points: list[tuple[float, float, str]] = []
        for name in series:
            pts = sorted((r for r in rows if r["series"] == name and r["lengths"][n]["compared"] is not None),
                         key=lambda r: r["lengths"][n]["kv_bytes"])
            if not pts:
                continue
            xs = [r["lengths"][n]["kv_bytes"] / 2**20 for r in pts]
            ys = [r["lengths"][n]["compared"]["accuracy"] for r in pts]
            lo = [y - r["lengths"][n]["compared"]["ci95"][0] for y, r in zip(ys, pts, strict=True)]
            hi = [r["lengths"][n]["compared"]["ci95"][1] - y for y, r in zip(ys, pts, strict=True)]
            marker, colour = style[name]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker=marker, color=colour, linestyle="-" if len(pts) > 1 else "none",
                        markersize=7, capsize=3)
            points += [(x, y, number[r["method"]]) for x, y, r in zip(xs, ys, pts, strict=True)]
        _scale(ax, "x", [r["lengths"][n]["kv_bytes"] / 2**20 for r in rows])
        ax.set_ylim(-0.08, 1.08)
        ax.set_xlabel(f"KV cache at {n} tokens, MiB ({result['dtype']})")
        ax.set_ylabel("retrieval accuracy (exact match)" if i == 0 else "")
        ax.set_title(f"{n} tokens", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        labelled.append((ax, points))
    ax = fig.add_subplot(grid[1, :])
    points = []
    for name in series:
        pts = sorted((r for r in rows if r["series"] == name), key=lambda r: r["perplexity"]["kv_bytes"])
        xs = [r["perplexity"]["kv_bytes"] / 2**20 for r in pts]
        ys = [r["perplexity"]["perplexity"] for r in pts]
        marker, colour = style[name]
        ax.plot(xs, ys, marker=marker, color=colour, linestyle="-" if len(pts) > 1 else "none", markersize=7)
        points += [(x, y, number[r["method"]]) for x, y, r in zip(xs, ys, pts, strict=True)]
    _scale(ax, "x", [x for x, _, _ in points])
    _scale(ax, "y", [y for _, y, _ in points])
    ax.margins(x=0.08, y=0.12)
    ax.set_xlabel(f"KV cache at {s['ppl_context']} tokens, MiB ({result['dtype']})")
    ax.set_ylabel(f"perplexity, last {s['ppl_scored']} of {s['ppl_context']} tokens")
    ax.grid(True, which="both", alpha=0.3)
    labelled.append((ax, points))
    key = [Line2D([], [], marker=style[r["series"]][0], color=style[r["series"]][1], linestyle="none", markersize=6)
           for r in rows]
    fig.legend(key, [f"{number[r['method']]:>2}  {r['method']}" for r in rows], loc="outside right upper",
               fontsize=7, title="methods (numbered on the points)", title_fontsize=8, frameon=False)
    fig.suptitle("Retrieval accuracy (top) and perplexity (bottom) against the KV cache's bytes", fontsize=11)
    fig.canvas.draw()  # the layout is settled before the numbers are placed against it
    fig.set_layout_engine("none")
    for axes, pts in labelled:
        _place_numbers(fig, axes, pts)
    return fig


def plot(result: dict[str, Any], path: str | Path) -> str:
    """:func:`figure` saved to ``path`` (whole or not at all)."""
    import matplotlib.pyplot as plt

    from multihead.files import save_figure

    fig = figure(result)
    save_figure(fig, path)
    plt.close(fig)
    return str(path)


__all__ = ["figure", "plot", "table"]
