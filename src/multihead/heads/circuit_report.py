"""How ``multihead circuit``'s findings (:mod:`multihead.heads.circuit`) are shown: a self-contained HTML report with
the circuit drawn as an SVG graph, the composition heatmaps and the DLA picture.

- **Graph** (:func:`circuit_svg`): any list of edges (objects with ``sender``, ``receiver``, ``score``) over the
  node names ``embed``, ``L{l}.H{h}``, ``L{l}.KV{g}.k``, ``L{l}.KV{g}.v``, ``L{l}.MLP``, ``logits``, as SVG: one
  row per layer's attention (its query heads with their KV heads' inputs, group by group) and one per layer's MLP,
  embeddings on top and logits at the bottom, one ``<path>`` per edge, its width proportional to |score|.

One colour means one thing on the whole page, and its legend says which: :data:`HELPS_COLOUR` a part or an edge that
raises the logit difference (a positive DLA; an edge whose corruption lowers it, a negative EAP score),
:data:`OPPOSES_COLOUR` one that lowers it, :data:`ABOVE_COLOUR` and :data:`BELOW_COLOUR` a composition score above
or below its random baseline (a heatmap says nothing about the answer), :data:`UNDEFINED_COLOUR` a cell that has no
score.

The page needs no network (script and styles inline, images as data: URIs) and escapes every text it shows (the
prompts of a --pairs file included): nothing in a prompt can run.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import quoteattr

import numpy as np

from multihead.errors import MultiheadError
from multihead.files import save_figure, write_text
from multihead.heads.circuit import CircuitReport, CompositionView, Dla, EdgeLike, node_place

HELPS_COLOUR, OPPOSES_COLOUR = "#1b7837", "#762a83"  # raises / lowers logit[answer] - logit[wrong] (green, purple)
ABOVE_COLOUR, BELOW_COLOUR = "#e66101", "#2166ac"  # composition above / below its random baseline (orange, blue)
UNDEFINED_COLOUR = "#dddddd"  # a composition cell whose writer is not in an earlier layer
LEGEND = (("helps", HELPS_COLOUR, "helps the answer: raises logit[answer] - logit[wrong] (DLA > 0; an edge whose "
                                  "corruption lowers it, EAP score < 0)"),
          ("opposes", OPPOSES_COLOUR, "opposes the answer: lowers it (DLA < 0; EAP score > 0)"),
          ("above", ABOVE_COLOUR, "composition above the random baseline"),
          ("below", BELOW_COLOUR, "composition below the random baseline"),
          ("undefined", UNDEFINED_COLOUR, "no composition: the writer is not in an earlier layer"))


def edge_colour(score: float) -> str:
    """An EAP edge's colour: the score is the change of the logit difference when the edge is corrupted, so a
    negative one marks an edge that carries the behaviour (helps), a positive one an edge that works against it."""
    return HELPS_COLOUR if score < 0 else OPPOSES_COLOUR


def part_colour(dla: float) -> str:
    """A DLA part's colour: a positive direct effect raises logit[answer] - logit[wrong] (helps)."""
    return HELPS_COLOUR if dla >= 0 else OPPOSES_COLOUR


def legend_html() -> str:
    """What each colour of the page means, one swatch each."""
    items = "".join(f"<span class='key'><span class='swatch' data-meaning='{name}' style='background:{colour}'>"
                    f"</span>{html.escape(text)}</span>" for name, colour, text in LEGEND)
    return f"<div id='legend'><b>colours</b> {items}</div>"


def circuit_svg(edges: Sequence[EdgeLike], *, n_heads: int | None = None, n_kv_heads: int | None = None,
                title: str = "") -> str:
    """The edges as an SVG graph (see the module): nodes in rows by layer, one ``<path class="edge">`` per edge
    (sign by colour, |score| by width, a <title> naming it), valid XML."""
    if not edges:
        raise MultiheadError("no edges to draw")
    group = (n_heads // n_kv_heads) if n_heads and n_kv_heads else None
    names: dict[str, tuple[int, int, tuple[int, ...]]] = {}
    for e in edges:
        for name in (e.sender, e.receiver):
            if name not in names:
                names[name] = node_place(name)
    for name in ("embed", "logits"):
        names.setdefault(name, node_place(name))

    def order(name: str) -> tuple[int, ...]:
        key = names[name][2]
        if len(key) == 2 and key[1] == 2 and group:  # a query head: after its KV head's inputs
            return (key[0] // group, 2, key[0])
        return (key[0], key[1], -1) if len(key) == 2 else key

    rows = sorted({place[0] for place in names.values()})
    by_row = {row: sorted((n for n, p in names.items() if p[0] == row), key=order) for row in rows}
    dx, dy, left, top = 74, 56, 74, 40
    width = left + max(len(v) for v in by_row.values()) * dx + 100  # room for the curves aside
    height = top + (len(rows) - 1) * dy + 46
    xy: dict[str, tuple[float, float]] = {}
    for r, row in enumerate(rows):
        nodes = by_row[row]
        start = left + (width - left - 20 - len(nodes) * dx) / 2
        for i, name in enumerate(nodes):
            xy[name] = (start + (i + 0.5) * dx, top + r * dy)
    scale = max(abs(float(e.score)) for e in edges) or 1.0
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="circuit" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f"<title>{html.escape(title or 'circuit')}</title>",
           '<rect x="0" y="0" width="100%" height="100%" fill="#fff"/>']
    for r, row in enumerate(rows):
        layer = names[by_row[row][0]][1]
        label = "embed" if row == 0 else "logits" if row == 1 << 30 else (
            f"L{layer} attn" if row % 2 else f"L{layer} MLP")
        y = top + r * dy
        out.append(f'<text x="6" y="{y + 4:.1f}" fill="#666">{html.escape(label)}</text>')
        out.append(f'<line x1="{left - 8}" y1="{y:.1f}" x2="{width - 10}" y2="{y:.1f}" stroke="#eee"/>')
    out.append('<g class="edges" fill="none" stroke-linecap="round">')
    for e in sorted(edges, key=lambda e: abs(float(e.score))):  # the strongest drawn last, on top
        (x1, y1), (x2, y2) = xy[e.sender], xy[e.receiver]
        span = round(abs(y2 - y1) / dy)  # rows crossed: an edge over more than one bulges aside, clear of the nodes
        bulge = 0.0 if span <= 1 else (1 if (x1 + x2) / 2 >= width / 2 else -1) * min(40.0 * span, 260.0)
        # a cubic's control points pull it 3/4 of the way to them: keep the curve inside the picture
        bulge = min(bulge, (width - 6 - max(x1, x2)) / 0.75) if bulge > 0 else max(bulge, (min(x1, x2) - left) / -0.75)
        y1, y2 = y1 + 11, y2 - 11
        c1, c2 = y1 + (y2 - y1) / 3, y2 - (y2 - y1) / 3
        score = float(e.score)
        colour = edge_colour(score)
        stroke = 0.8 + 6.2 * abs(score) / scale
        tip = f"{e.sender} \u2192 {e.receiver}: {score:+.4g}"
        kind = "helps" if colour == HELPS_COLOUR else "opposes"
        out.append(f'<path class="edge {kind}" data-sender={quoteattr(e.sender)} '
                   f'data-receiver={quoteattr(e.receiver)} data-score="{score:.6g}" '
                   f'd="M{x1:.1f},{y1:.1f} C{x1 + bulge:.1f},{c1:.1f} {x2 + bulge:.1f},{c2:.1f} {x2:.1f},{y2:.1f}" '
                   f'stroke="{colour}" stroke-width="{stroke:.2f}" stroke-opacity="0.75">'
                   f"<title>{html.escape(tip)}</title></path>")
    out.append("</g>")
    out.append('<g class="nodes">')
    for name, (nx, ny) in xy.items():
        short = name.split(".", 1)[1] if name.startswith("L") else name
        wide = 60 if name in ("embed", "logits") else 52
        fill = "#fff3c4" if ".H" in name else "#e4e4e4" if ".KV" in name else "#f4f4f4"  # head, KV input, other
        out.append(f'<g class="node" data-node={quoteattr(name)}><rect x="{nx - wide / 2:.1f}" y="{ny - 11:.1f}" '
                   f'width="{wide}" height="22" rx="6" fill="{fill}" stroke="#555"/>'
                   f'<text x="{nx:.1f}" y="{ny + 4:.1f}" text-anchor="middle">{html.escape(short)}</text>'
                   f"<title>{html.escape(name)}</title></g>")
    out.append("</g></svg>")
    return "".join(out)


def _colour(value: float | None, limit: float) -> str:
    if value is None or not math.isfinite(value):
        return UNDEFINED_COLOUR
    t = min(1.0, abs(value) / limit) if limit > 0 else 0.0
    full = ABOVE_COLOUR if value >= 0 else BELOW_COLOUR
    r, g, b = (int(full[i:i + 2], 16) for i in (1, 3, 5))
    mix = [round(255 + (c - 255) * t) for c in (r, g, b)]
    return f"rgb({mix[0]},{mix[1]},{mix[2]})"


def heatmap_svg(readers: Sequence[str], writers: Sequence[str], matrix: Sequence[Sequence[float | None]],
                title: str) -> str:
    """A reader x writer heatmap as SVG (valid XML): a cell per pair with its value in a <title>, grey where the
    writer is not before the reader."""
    cell, left, top = 30, 66, 56
    width, height = left + len(writers) * cell + 12, top + len(readers) * cell + 12
    values = [abs(v) for row in matrix for v in row if v is not None and math.isfinite(v)]
    limit = max(values, default=0.0) or 1.0
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="heatmap" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="10">',
           f'<text x="4" y="13" font-size="12">{html.escape(title)}</text>']
    for j, w in enumerate(writers):
        x = left + (j + 0.5) * cell
        out.append(f'<text x="{x:.1f}" y="{top - 6}" text-anchor="start" transform="rotate(-45 {x:.1f} {top - 6})">'
                   f"{html.escape(w)}</text>")
    for i, r in enumerate(readers):
        y = top + i * cell
        out.append(f'<text x="{left - 4}" y="{y + cell / 2 + 3:.1f}" text-anchor="end">{html.escape(r)}</text>')
        for j, w in enumerate(writers):
            v = matrix[i][j]
            tip = f"{w} \u2192 {r}: " + ("n/a (not an earlier layer)" if v is None else f"{v:+.4f}")
            out.append(f'<rect x="{left + j * cell}" y="{y}" width="{cell - 1}" height="{cell - 1}" '
                       f'fill="{_colour(v, limit)}"><title>{html.escape(tip)}</title></rect>')
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------- pictures
def _plt() -> Any:
    from multihead.errors import require

    matplotlib = require("matplotlib", "plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def dla_figure(dla: Dla, model: str, top: int = 20) -> Any:
    """Three panels: each head's DLA (layer x head), attention and MLP per layer (bars), the top parts (bars)."""
    plt = _plt()
    n_layers, h = dla.heads.shape
    fig, axes = plt.subplots(1, 3, figsize=(16, max(4.5, 0.16 * n_layers + 2.5)), dpi=90,
                             gridspec_kw={"width_ratios": [max(2.0, h / 4), 3, 3]})
    limit = float(np.abs(dla.heads).max()) or 1.0
    im = axes[0].imshow(dla.heads, cmap="PRGn", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    axes[0].set_title("each head (layer x head): green helps, purple opposes", fontsize=9)
    axes[0].set_xlabel("head")
    axes[0].set_ylabel("layer")
    step = max(1, n_layers // 15)
    axes[0].set_yticks(range(0, n_layers, step))
    axes[0].set_xticks(range(0, h, max(1, h // 12)))
    fig.colorbar(im, ax=axes[0], shrink=0.8)
    layers = np.arange(n_layers)
    axes[1].barh(layers - 0.2, dla.heads.sum(1), height=0.4, color="#555555", label="attention (sum of heads)")
    axes[1].barh(layers + 0.2, dla.mlps, height=0.4, color="#aaaaaa", label="MLP")
    axes[1].set_yticks(range(0, n_layers, step))
    axes[1].invert_yaxis()
    axes[1].axvline(0, color="#888", lw=0.8)
    axes[1].set_ylabel("layer")
    axes[1].set_title("per layer", fontsize=9)
    axes[1].legend(fontsize=7, loc="best")
    parts = dla.top(top)
    names = [n for n, _ in parts]
    values = [v for _, v in parts]
    axes[2].barh(range(len(parts)), values, color=[part_colour(v) for v in values])
    axes[2].set_yticks(range(len(parts)), names, fontsize=7)
    axes[2].invert_yaxis()
    axes[2].axvline(0, color="#888", lw=0.8)
    axes[2].set_title(f"the {len(parts)} largest parts: green helps, purple opposes", fontsize=9)
    for ax in axes[1:]:
        ax.set_xlabel("logit difference")
    fig.suptitle(f"{model}: direct logit attribution of logit[answer] - logit[wrong] = {dla.logit_diff:.3f} "
                 f"(mean over {len(dla.per_pair)} pair(s)) = embed {dla.embed:.3f} + heads {dla.heads.sum():.3f} + "
                 f"MLPs {dla.mlps.sum():.3f} + constant {dla.constant:.3f} + remainder {dla.remainder:.1e}",
                 fontsize=9)
    fig.tight_layout()
    return fig


def png_bytes(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _json_for_html(data: Any) -> str:
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def report_html(report: CircuitReport, dla_png: bytes) -> str:
    """The whole page (see the module)."""
    e = html.escape
    d = report.dla
    parts = "".join(f"<tr><td class='l'>{e(n)}</td><td style='color:{part_colour(v)}'>{v:+.4f}</td></tr>"
                    for n, v in d.top(15))
    sections = [
        f"<h1>multihead circuit: {e(report.model)}</h1>",
        f"<div class='note'>{report.n_layers} layers, {report.n_heads} query heads, {report.n_kv_heads} KV heads; "
        f"{len(report.pairs)} prompt pair(s); engine: {e(report.engine)}</div>",
        legend_html(),
        "<h2>direct logit attribution</h2>",
        f"<div class='note'>Each part's direct effect on logit[answer] - logit[wrong] at the clean prompt's last "
        f"token, mean over the pairs (+ helps the answer, - opposes it): embed {d.embed:+.4f} + heads "
        f"{d.heads.sum():+.4f} + MLPs {d.mlps.sum():+.4f} + "
        f"constant {d.constant:+.4f} + remainder {d.remainder:+.2e} = {d.logit_diff:.4f}, the model's own logit "
        f"difference. Notes: {e('; '.join(d.notes))}.</div>",
        f"<img id='dla' alt='direct logit attribution' src='data:image/png;base64,"
        f"{base64.b64encode(dla_png).decode('ascii')}'>",
        f"<table id='dla-top'><tr><th>part</th><th>DLA</th></tr>{parts}</table>",
    ]
    sections += _circuit_section(report)
    sections += _composition_section(report.composition, report.n_kv_heads < report.n_heads)
    rows = "".join(f"<tr><td>{i}</td><td class='l'>{e(p.pair.clean)}</td><td class='l'>{e(p.pair.corrupt)}</td>"
                   f"<td class='l'>{e(repr(p.pair.answer))}</td><td class='l'>{e(repr(p.pair.wrong))}</td>"
                   f"<td>{len(p.clean)}</td><td>{d.per_pair[i]:+.3f}</td></tr>" for i, p in enumerate(report.pairs))
    sections += ["<h2>prompt pairs</h2>", "<table id='pairs'><tr><th>#</th><th>clean</th><th>corrupted</th>"
                 f"<th>answer</th><th>wrong</th><th>tokens</th><th>logit diff (clean)</th></tr>{rows}</table>"]
    seconds = ", ".join(f"{k} {v:.1f} s" for k, v in report.seconds.items())
    sections.append(f"<div class='note'>time: {e(seconds)}</div>")
    body = "\n".join(sections)
    data = _json_for_html(report.to_json())
    head, _, rest = _TEMPLATE.replace("/*CSP*/", _CSP).partition("/*BODY*/")
    middle, _, tail = rest.partition("/*DATA*/")
    return head + body + middle + data + tail  # one pass: a prompt holding a marker's text stays text


def _circuit_section(report: CircuitReport) -> list[str]:
    e = html.escape
    c = report.circuit
    if c is None or not report.edges:
        return ["<h2>the circuit</h2>", "<div class='note'>No edge attribution in this report.</div>"]
    f = c["faithfulness"]
    checks = "".join(f"<tr><td class='l'>{e(k['sender'])} \u2192 {e(k['receiver'])}</td>"
                     f"<td style='color:{edge_colour(k['score'])}'>{k['score']:+.4f}</td>"
                     f"<td style='color:{edge_colour(k['exact'])}'>{k['exact']:+.4f}</td></tr>" for k in c["checks"])
    svg = circuit_svg(report.edges, n_heads=report.n_heads, n_kv_heads=report.n_kv_heads,
                      title=f"{len(report.edges)} edges by |{c['method']} score| ({c['select']})")
    side = [
        f"<p><b>faithfulness</b> of these {f['n_edges']} edges ({e(str(f['ablation']))}-ablation of every other "
        f"edge): <span id='kept'>{f['kept']:.3f}</span> of the logit difference kept (circuit "
        f"{f['circuit_metric']:.3f}, clean {f['clean_metric']:.3f}, corrupted {f['corrupted_metric']:.3f}).</p>",
        f"<p>{c['method']} scores{' with ' + str(c['steps']) + ' steps' if c['method'] == 'eap-ig' else ''}, "
        f"mean over {len(report.pairs)} pair(s), {c['n_scored']} edges scored; "
        + ("chosen greedily from the logits back, the strongest edge into the circuit so far each time, and only "
           "the edges on a path from the embeddings kept (Hanna et al. 2024)" if c["select"] == "greedy" else
           "the edges of largest |score|") + ". A score is the change of the logit "
        "difference when the edge carries the corrupted prompt's write instead of the clean one: a negative score "
        "(green) marks an edge that carries the behaviour, a positive one (purple) an edge that works against it; "
        "width: |score|. Hover a node to see its "
        "edges.</p>",
        f"<p><b>exact check</b> of the top {len(c['checks'])} edges (path patching, a second forward):</p>",
        f"<table id='checks'><tr><th>edge</th><th>{e(c['method'])}</th><th>exact</th></tr>{checks}</table>",
    ]
    edges = "".join(f"<tr><td>{i + 1}</td><td class='l'>{e(x['sender'])}</td><td class='l'>{e(x['receiver'])}</td>"
                    f"<td style='color:{edge_colour(x['score'])}'>{x['score']:+.4f}</td></tr>"
                    for i, x in enumerate(c["edges"]))
    return ["<h2>the circuit</h2>",
            f"<div class='row'><div id='graph'>{svg}</div><div class='side'>{''.join(side)}</div></div>",
            f"<details><summary>the {len(c['edges'])} edges</summary><table id='edges'><tr><th>#</th>"
            f"<th>sender</th><th>receiver</th><th>score</th></tr>{edges}</table></details>"]


def _composition_section(view: CompositionView, grouped: bool) -> list[str]:
    e = html.escape
    out = ["<h2>composition between the top heads</h2>"]
    if view.reason is not None:
        return [*out, f"<div class='note'>{e(view.reason)}.</div>"]
    base = view.baseline["per_query_head"]
    out.append(f"<div class='note'>Composition scores ||A B||_F / (||A||_F ||B||_F) of each writer head (columns) "
               f"into each reader (rows) of a later layer, minus the random baseline of their shape (per query head "
               f"{base['mean']:.4f} \u00b1 {base['std']:.4f}); orange: above the baseline, blue: below, each map "
               "scaled to its largest |value| (hover a cell for it); grey: the writer is not in an earlier layer. "
               f"Notes: {e('; '.join(view.notes))}.</div>")
    names = {"q": "Q-composition", "k": "K-composition", "v": "V-composition", "k_kv": "K-composition per KV head",
             "v_kv": "V-composition per KV head"}
    shown = ("q", "k", "v", "k_kv", "v_kv") if grouped else ("q", "k", "v")
    maps = [heatmap_svg(*view.kinds[k], title=names[k]) for k in shown if view.kinds[k][0]]
    out.append(f"<div class='row' id='composition'>{''.join(maps)}</div>")
    if not grouped:
        out.append("<div class='note'>Every KV head serves one query head here (MHA): the per-KV-head scores are the "
                   "per-head ones.</div>")
    return out


_CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"
_TEMPLATE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="/*CSP*/">
<title>multihead: the circuit</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:18px 0 6px}
.row{display:flex;gap:18px;flex-wrap:wrap;align-items:flex-start} .side{max-width:420px}
table{border-collapse:collapse;font-size:12px;background:#fff}
th,td{border:1px solid #ddd;padding:2px 6px;text-align:right} th{background:#eee} td.l{text-align:left}
.note{color:#666;font-size:12px;max-width:1100px} img{max-width:100%;background:#fff;border:1px solid #ccc}
svg{background:#fff;border:1px solid #ccc} .dim{opacity:0.12}
#legend{margin:10px 0;font-size:12px;display:flex;flex-wrap:wrap;gap:4px 16px;align-items:center;max-width:1200px}
#legend .key{display:inline-flex;align-items:center;gap:5px}
#legend .swatch{display:inline-block;width:14px;height:14px;border:1px solid #888;flex:none}
</style></head><body>
/*BODY*/
<script type="application/json" id="data">/*DATA*/</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const edges = Array.from(document.querySelectorAll("svg.circuit path.edge"));
document.querySelectorAll("svg.circuit g.node").forEach((node) => {
  const name = node.getAttribute("data-node");
  node.addEventListener("mouseenter", () => edges.forEach((p) => {
    const on = p.getAttribute("data-sender") === name || p.getAttribute("data-receiver") === name;
    p.classList.toggle("dim", !on); }));
  node.addEventListener("mouseleave", () => edges.forEach((p) => p.classList.remove("dim")));
});
const shown = D.circuit ? D.circuit.edges.length : 0;
if (edges.length !== shown) throw new Error("the graph has " + edges.length + " edges, the data " + shown);
document.body.setAttribute("data-ready", "1");
</script></body></html>
"""


def write_report(report: CircuitReport, out: Path, html_path: Path | None = None) -> dict[str, str]:
    """The DLA picture, the page and the JSON into ``out`` (the page at ``html_path`` if given), each whole or
    not at all."""
    plt = _plt()
    fig = dla_figure(report.dla, report.model)
    png = png_bytes(fig)
    path = save_figure(fig, out / "dla.png")
    plt.close(fig)
    page = write_text(html_path or out / "circuit.html", report_html(report, png))
    data = write_text(out / "circuit.json", json.dumps(report.to_json(), indent=1))
    return {"html": str(page), "dla_png": str(path), "json": str(data)}
