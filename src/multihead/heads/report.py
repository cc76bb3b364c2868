"""Pictures and a self-contained HTML report of a head analysis.

The HTML page needs no network: its script and styles are inline, the data is one JSON block. Text from the
analysed passage only ever reaches the page through ``textContent`` or canvas ``fillText``, and the JSON block
escapes ``<``, ``>`` and ``&``, so a passage containing ``<script>`` is shown as text and never runs.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np

from multihead.errors import MultiheadError
from multihead.files import save_figure, write_text
from multihead.heads.analysis import HeadReport
from multihead.heads.scores import LABEL_RULES, SCORE_DEFINITIONS, SCORE_NAMES, HeadScores
from multihead.names import head_name


def prepare_out_dir(out: str | Path) -> Path:
    """The output folder, created if needed; a clear error when it cannot be written."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".multihead-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        shown = str(path) if len(str(path)) <= 100 else str(path)[:97] + "..."
        raise MultiheadError(f"cannot write to the output folder {shown!r}: {err.strerror or err}") from None
    return path


def _plt() -> Any:
    from multihead.errors import require

    matplotlib = require("matplotlib", "plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_grid_png(report: HeadReport, path: Path) -> Path:
    """Every head's pattern over the displayed tokens: one mosaic of layers (rows) x heads (columns)."""
    plt = _plt()
    rows, cols = report.n_layers, report.n_heads
    n = len(report.tokens)
    gap = max(2, n // 16)
    mosaic = np.full((rows * (n + gap) - gap, cols * (n + gap) - gap), np.nan, dtype=np.float32)
    for layer in range(rows):
        for head in range(cols):
            y, x = layer * (n + gap), head * (n + gap)
            mosaic[y:y + n, x:x + n] = report.patterns[layer][head]
    fig, ax = plt.subplots(figsize=(cols * 1.25 + 1.5, rows * 1.0 + 1.2), dpi=80)
    ax.imshow(mosaic, cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_xticks([h * (n + gap) + n / 2 for h in range(cols)],
                  [f"H{h} (kv {report.scores.kv_head(h)})" for h in range(cols)], fontsize=7)
    ax.xaxis.tick_top()
    ax.set_yticks([layer * (n + gap) + n / 2 for layer in range(rows)], [f"L{layer}" for layer in range(rows)],
                  fontsize=7)
    for layer in range(rows):
        for head in range(cols):
            ax.text(head * (n + gap) + n - 1, layer * (n + gap) + 1, report.scores.labels[layer][head],
                    fontsize=5, color="white", ha="right", va="top")
    ax.set_title(f"{report.model}: attention pattern of every head over {n} tokens (query rows, key columns)",
                 fontsize=10, pad=18)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def write_patching_png(result: Any, model: str, out: str | Path) -> dict[str, str]:
    """Layer x head heatmaps of a :class:`multihead.heads.patching.PairsResult` (activation patching and/or
    attribution), whole or not at all (:mod:`multihead.files`)."""
    plt = _plt()
    folder = prepare_out_dir(out)
    panels = [(name, e) for name, e in (("activation patching", result.patching),
                                        ("attribution patching", result.attribution)) if e is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1, 6), dpi=90, squeeze=False)
    limit = max(float(np.abs(e).max()) for _, e in panels) or 1.0
    for ax, (name, e) in zip(axes[0], panels, strict=True):
        im = ax.imshow(e, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
        ax.set_title(f"{name}\n{result.point} per head, recovered fraction", fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    fig.colorbar(im, ax=list(axes[0]), shrink=0.8)
    fig.suptitle(f"{model}: {result.pairs} prompt pair(s), logit difference {result.clean:.2f} clean, "
                 f"{result.corrupted:.2f} corrupted", fontsize=10)
    path = save_figure(fig, folder / "patching.png")
    plt.close(fig)
    return {"png": str(path)}


def chosen_heads(report: HeadReport) -> list[tuple[str, int, int, float]]:
    """The strongest head of each score that has a clear one: (score, layer, head, value)."""
    chosen = []
    for name in ("previous_token", "induction", "duplicate_token", "first_token", "next_token", "local"):
        layer, head, value = report.scores.top(name, 1)[0]
        if value > 0.2:
            chosen.append((name, layer, head, value))
    return chosen


def write_heads_png(report: HeadReport, path: Path, max_tokens: int = 32) -> Path:
    """The chosen heads over the tokens, with the tokens on the axes."""
    plt = _plt()
    chosen = chosen_heads(report)
    n = min(max_tokens, len(report.tokens))
    labels = [t.replace("\n", "\\n") for t in report.tokens[:n]]
    fig, axes = plt.subplots(1, max(1, len(chosen)), figsize=(5.2 * max(1, len(chosen)), 5.6), dpi=80,
                             squeeze=False)
    for ax, (name, layer, head, value) in zip(axes[0], chosen, strict=False):
        ax.imshow(report.patterns[layer][head][:n, :n], cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"{name} {value:.2f}: {head_name(layer, head)} (layer {layer}, head {head})", fontsize=9)
        ax.set_xticks(range(n), labels, rotation=90, fontsize=6)
        ax.set_yticks(range(n), labels, fontsize=6)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path


def _json_for_html(data: Any) -> str:
    """JSON that is safe inside a <script> element: no '<', '>' or '&' survive as themselves."""
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


COLUMN_DEFINITIONS = {
    "layer": "the layer (L in LxHy)",
    "head": "the query head (H in LxHy)",
    "kv_head": "the KV head it reads: head // (n_heads / n_kv_heads)",
    "label": "the first rule of the table below whose score the head reaches, else mixed",
    **SCORE_DEFINITIONS,
}


def report_data(report: HeadReport, retrieval_png: bytes | None = None) -> dict[str, Any]:
    """What the page shows, as one JSON object (the retrieval scores and their picture when the report has them)."""
    patterns = np.stack(report.patterns)  # (L, H, n, n)
    quantised = np.clip(np.rint(patterns * 255.0), 0, 255).astype(np.uint8)
    return {
        "model": report.model,
        "causal": report.causal,
        "n_layers": report.n_layers,
        "n_heads": report.n_heads,
        "n_kv_heads": report.n_kv_heads,
        "tokens": report.tokens,
        "text": report.text,
        "score_names": list(SCORE_NAMES),
        "heads": report.scores.records(),
        "patterns_u8": base64.b64encode(quantised.tobytes()).decode("ascii"),
        "ablation": report.ablation,
        "ablation_summary": report.ablation_summary(),
        "conversion": report.conversion,
        "metric": report.metric_name,
        "baseline": report.baseline,
        "patching": report.patching,
        "columns": [{"name": name, "means": COLUMN_DEFINITIONS[name]}
                    for name in ("layer", "head", "kv_head", "label", *SCORE_NAMES)],
        "label_rules": [{"label": label, "score": score, "threshold": threshold}
                        for score, label, threshold in LABEL_RULES],
        "retrieval": None if report.retrieval is None else report.retrieval.to_json(),
        "retrieval_png": None if retrieval_png is None else base64.b64encode(retrieval_png).decode("ascii"),
    }


def write_html(report: HeadReport, path: Path, retrieval_png: bytes | None = None) -> Path:
    html = _TEMPLATE.replace("/*DATA*/", _json_for_html(report_data(report, retrieval_png)))
    return write_text(path, html)


def write_all(report: HeadReport, out: str | Path) -> dict[str, str]:
    """The page, the pictures and the JSON into ``out``; with retrieval scores their picture too (shown on the
    page as well)."""
    folder = prepare_out_dir(out)
    files: dict[str, str] = {}
    png = None
    if report.retrieval is not None:
        from multihead.heads.retrieval import write_png

        files["retrieval_png"] = write_png(report.retrieval, folder / "retrieval.png")
        png = Path(files["retrieval_png"]).read_bytes()
    return {
        "html": str(write_html(report, folder / "report.html", png)),
        "grid_png": str(write_grid_png(report, folder / "heads-grid.png")),
        "heads_png": str(write_heads_png(report, folder / "chosen-heads.png")),
        "json": str(_write_json(report, folder / "heads.json")),
        **files,
    }


def _write_json(report: HeadReport, path: Path) -> Path:
    return write_text(path, json.dumps(result_json(report), indent=1))


def kv_records(scores: HeadScores) -> list[dict[str, Any]]:
    """One record per (layer, KV head), the unit a KV cache (and a head-wise plan) decides on: its query heads,
    their labels, and each score as the max over those query heads (a KV head serves a pattern if one of its query
    heads does)."""
    group = scores.n_heads // scores.n_kv_heads
    rows: list[dict[str, Any]] = []
    for layer in range(scores.n_layers):
        for kv in range(scores.n_kv_heads):
            heads = list(range(kv * group, (kv + 1) * group))
            row: dict[str, Any] = {"layer": layer, "kv_head": kv, "query_heads": heads,
                                   "labels": [scores.labels[layer][h] for h in heads]}
            row.update({name: round(float(scores.scores[name][layer, heads].max()), 6) for name in SCORE_NAMES})
            rows.append(row)
    return rows


def result_json(report: HeadReport) -> dict[str, Any]:
    return {"model": report.model, "engine": report.engine, "n_layers": report.n_layers, "n_heads": report.n_heads,
            "n_kv_heads": report.n_kv_heads, "tokens": len(report.tokens), "heads": report.scores.records(),
            "kv_heads": kv_records(report.scores),
            "ablation": report.ablation, "ablation_summary": report.ablation_summary(),
            "conversion": report.conversion, "metric": report.metric_name, "baseline": report.baseline,
            "patching": report.patching,
            **({"retrieval": report.retrieval.to_json()} if report.retrieval is not None else {})}


_TEMPLATE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<title>multihead: what each head does</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:18px 0 6px}
#controls label{margin-right:12px} select{font-size:14px}
.row{display:flex;gap:18px;flex-wrap:wrap;align-items:flex-start}
canvas{background:#fff;border:1px solid #ccc}
table{border-collapse:collapse;font-size:12px;background:#fff}
th,td{border:1px solid #ddd;padding:2px 6px;text-align:right} th{cursor:pointer;background:#eee}
td.l,th.l{text-align:left} tr.sel{background:#ffe9a8}
#tokens span{display:inline-block;margin:1px;padding:0 2px;border-radius:3px;white-space:pre}
.note{color:#666;font-size:12px}
</style></head><body>
<h1 id="title"></h1><div class="note" id="subtitle"></div>
<div id="controls"><label>layer <select id="layer"></select></label><label>head <select id="head"></select></label>
<span id="headinfo"></span></div>
<div class="row"><div><h2>pattern over the tokens</h2><canvas id="pattern" width="620" height="620"></canvas></div>
<div><h2>every head (click one)</h2><canvas id="grid"></canvas></div></div>
<h2>tokens, shaded by the weight the last selected query puts on them</h2><div id="tokens"></div>
<h2>ablation</h2><div class="note" id="ablnote"></div><canvas id="ablation" width="900" height="220"></canvas>
<h2>activation patching</h2><div class="note" id="patchnote"></div><canvas id="patching"></canvas>
<h2>retrieval heads at long context</h2><div id="retrieval"></div>
<h2>the text</h2><div id="text" style="white-space:pre-wrap;background:#fff;border:1px solid #ddd;padding:6px"></div>
<h2>scores</h2><div class="note">Click a column to sort; click a row to select the head. Each score is a share of
the head's attention, averaged over query rows (entropy: of its spread); the columns are defined below.</div>
<table id="scores"></table>
<h2>what the columns mean</h2><table id="columns"></table>
<h2>labels</h2><div class="note">A head's label is the first rule of this table whose score it reaches (score &gt;=
threshold); a head that reaches none is "mixed".</div><table id="label-rules"></table>
<script type="application/json" id="data">/*DATA*/</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const raw = atob(D.patterns_u8); const P = new Uint8Array(raw.length);
for (let i = 0; i < raw.length; i++) P[i] = raw.charCodeAt(i);
const n = D.tokens.length, L = D.n_layers, H = D.n_heads;
let layer = 0, head = 0, query = n - 1;
function w(l, h, i, j) { return P[((l * H + h) * n + i) * n + j] / 255; }
function color(v) { const c = Math.round(255 * (1 - v)); return "rgb(" + c + "," + Math.round(c * 0.9 + 25) + ",255)"; }
function rec(l, h) { return D.heads[l * H + h]; }
function el(tag, text) { const e = document.createElement(tag); if (text !== undefined) e.textContent = text; return e; }
document.getElementById("text").textContent = D.text;
document.getElementById("title").textContent = "multihead: what each head of " + D.model + " does";
document.getElementById("subtitle").textContent = L + " layers, " + H + " query heads, " + D.n_kv_heads +
  " KV heads, " + n + " tokens shown" + (D.causal ? ", causal" : ", bidirectional");
const ls = document.getElementById("layer"), hs = document.getElementById("head");
for (let l = 0; l < L; l++) ls.appendChild(el("option", String(l)));
for (let h = 0; h < H; h++) hs.appendChild(el("option", h + " (kv " + Math.floor(h / (H / D.n_kv_heads)) + ")"));
ls.onchange = () => select(+ls.value, head); hs.onchange = () => select(layer, hs.selectedIndex);
function drawPattern() {
  const c = document.getElementById("pattern"), g = c.getContext("2d"), m = 90, cell = (c.width - m) / n;
  g.clearRect(0, 0, c.width, c.height);
  for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) { g.fillStyle = color(w(layer, head, i, j)); g.fillRect(m + j * cell, m + i * cell, cell, cell); }
  g.fillStyle = "#222"; g.font = Math.max(6, Math.min(11, cell)) + "px monospace"; g.textBaseline = "middle";
  for (let i = 0; i < n; i++) {
    const t = D.tokens[i].replace(/\n/g, "\\n").slice(0, 10);
    g.textAlign = "right"; g.fillText(t, m - 3, m + (i + 0.5) * cell);
    g.save(); g.translate(m + (i + 0.5) * cell, m - 3); g.rotate(-Math.PI / 2); g.textAlign = "left"; g.fillText(t, 0, 0); g.restore();
  }
}
function drawGrid() {
  const c = document.getElementById("grid"), s = 26, g = c.getContext("2d");
  c.width = H * s + 30; c.height = L * s + 16; g.clearRect(0, 0, c.width, c.height);
  for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) {
    const x0 = 30 + h * s, y0 = 16 + l * s, k = (s - 2) / n;
    for (let i = 0; i < n; i += Math.max(1, Math.floor(n / 24))) for (let j = 0; j < n; j += Math.max(1, Math.floor(n / 24))) {
      g.fillStyle = color(w(l, h, i, j)); g.fillRect(x0 + j * k, y0 + i * k, Math.max(1, k * Math.max(1, Math.floor(n / 24))), Math.max(1, k * Math.max(1, Math.floor(n / 24))));
    }
    if (l === layer && h === head) { g.strokeStyle = "#e33"; g.lineWidth = 2; g.strokeRect(x0 - 1, y0 - 1, s, s); }
  }
  g.fillStyle = "#222"; g.font = "9px sans-serif"; g.textAlign = "right";
  for (let l = 0; l < L; l++) g.fillText("L" + l, 26, 16 + l * s + s / 2);
  g.textAlign = "center"; for (let h = 0; h < H; h++) g.fillText("H" + h, 30 + h * s + s / 2, 10);
  c.onclick = (e) => { const r = c.getBoundingClientRect(); const h = Math.floor((e.clientX - r.left - 30) / s), l = Math.floor((e.clientY - r.top - 16) / s);
    if (l >= 0 && l < L && h >= 0 && h < H) select(l, h); };
}
function drawTokens() {
  const box = document.getElementById("tokens"); box.textContent = "";
  for (let j = 0; j < n; j++) { const sp = el("span", D.tokens[j]); sp.style.background = color(w(layer, head, query, j));
    sp.title = "weight " + w(layer, head, query, j).toFixed(3); sp.onclick = () => { query = j; drawTokens(); }; box.appendChild(sp); }
}
function drawAblation() {
  const c = document.getElementById("ablation"), g = c.getContext("2d"), note = document.getElementById("ablnote");
  g.clearRect(0, 0, c.width, c.height);
  if (!D.ablation.length) { note.textContent = "No ablation in this report (run with --ablate)."; c.style.display = "none"; return; }
  const S = D.ablation_summary; note.textContent = "Change in " + D.metric + " when one head's output is zeroed (baseline " +
    Number(D.baseline).toFixed(4) + "); " + (100 * S.share_below_1_percent).toFixed(0) + "% of heads change it by less than 1%. Bars: every head, layer by layer; the selected head is red.";
  const maxd = Math.max(1e-9, ...D.ablation.map(r => Math.abs(r.delta))), bw = c.width / D.ablation.length, mid = c.height / 2;
  D.ablation.forEach((r, k) => { g.fillStyle = (r.layer === layer && r.head === head) ? "#e33" : (r.layer % 2 ? "#58a" : "#8bd");
    const hgt = (r.delta / maxd) * (mid - 4); g.fillRect(k * bw, mid - Math.max(0, hgt), Math.max(1, bw - 0.5), Math.abs(hgt)); });
  g.strokeStyle = "#999"; g.beginPath(); g.moveTo(0, mid); g.lineTo(c.width, mid); g.stroke();
}
function drawPatching() {
  const c = document.getElementById("patching"), note = document.getElementById("patchnote"), P = D.patching;
  if (!P) { note.textContent = "No patching in this report (run with --patch, causal models)."; c.style.display = "none"; return; }
  const E = P.effects, L = E.length, H = E[0].length, cell = Math.max(6, Math.min(28, Math.floor(620 / H)));
  c.width = H * cell + 40; c.height = L * cell + 20; const g = c.getContext("2d");
  const lim = Math.max(1e-9, ...E.flat().map(Math.abs));
  note.textContent = P.method + " of each head's " + P.point + " from clean into corrupted prompts (" + P.pairs +
    " pair(s); logit difference " + Number(P.clean).toFixed(2) + " clean, " + Number(P.corrupted).toFixed(2) +
    " corrupted): the fraction of the clean behaviour each head alone recovers; red restores, blue opposes. Selected head: " +
    (E[layer] && E[layer][head] !== undefined ? E[layer][head].toFixed(3) : "-") + ".";
  g.clearRect(0, 0, c.width, c.height);
  for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) {
    const v = E[l][h] / lim, a = Math.min(1, Math.abs(v));
    g.fillStyle = v >= 0 ? "rgba(200,40,40," + a + ")" : "rgba(40,80,200," + a + ")";
    g.fillRect(30 + h * cell, l * cell, cell - 1, cell - 1);
  }
  g.strokeStyle = "#000"; g.lineWidth = 2; g.strokeRect(30 + head * cell, layer * cell, cell - 1, cell - 1);
  g.fillStyle = "#444"; g.font = "10px sans-serif"; for (let l = 0; l < L; l += Math.max(1, Math.floor(L / 10))) g.fillText("L" + l, 0, l * cell + cell - 2);
}
function drawDefinitions() {
  const c = document.getElementById("columns"), r = document.getElementById("label-rules");
  let hr = el("tr"); ["column", "what it is"].forEach(k => { const th = el("th", k); th.className = "l";
    hr.appendChild(th); }); c.appendChild(hr);
  D.columns.forEach(k => { const tr = el("tr"), a = el("td", k.name), b = el("td", k.means); a.className = "l";
    b.className = "l"; tr.appendChild(a); tr.appendChild(b); c.appendChild(tr); });
  hr = el("tr"); ["label", "score", "threshold"].forEach(k => hr.appendChild(el("th", k))); r.appendChild(hr);
  D.label_rules.forEach(k => { const tr = el("tr"), a = el("td", k.label), b = el("td", k.score);
    a.className = "l"; b.className = "l"; tr.appendChild(a); tr.appendChild(b);
    tr.appendChild(el("td", ">= " + k.threshold.toFixed(2))); r.appendChild(tr); });
}
function drawRetrieval() {
  const box = document.getElementById("retrieval"), R = D.retrieval;
  const note = el("div"); note.className = "note"; box.appendChild(note);
  if (!R) { note.textContent = "No retrieval scores in this report (run with --retrieval: causal language models)."; return; }
  const S = R.settings, used = R.cases_used;
  note.textContent = "Retrieval score (Wu et al. 2024): the share of a case's copyable answer steps at which the " +
    "head's most-attended key is the needle token being copied, averaged over the " + used + " of " + R.cases.length +
    " needle cases used" + (S.correct_only ? " (those the model answers exactly right)" : "") + "; a KV head's is " +
    "the max over its query heads (what a head-wise cache plan keeps). Mass outside: the share of a query's " +
    "attention that a cache of " + S.sinks + " sinks + a window of " + S.window + " would drop, over " + R.mass_rows +
    " prefill rows. Razor: the max of echo (duplicate-token) and induction scores, per KV head.";
  const t = el("table"); t.id = "retrieval-top"; const hr = el("tr");
  ["KV head", "retrieval (max)", "retrieval (mean)", "mass outside (max)", "razor"].forEach(k => hr.appendChild(el("th", k)));
  t.appendChild(hr);
  R.top_kv.forEach(k => { const tr = el("tr"), l = k.layer, g = k.kv_head, name = el("td", "L" + l + "KV" + g);
    name.className = "l"; tr.appendChild(name);
    [R.kv[l][g], R.kv_mean[l][g], R.mass_outside_kv[l][g], R.razor_kv ? R.razor_kv.razor[l][g] : null].forEach(
      v => tr.appendChild(el("td", v === null ? "-" : v.toFixed(3))));
    t.appendChild(tr); });
  box.appendChild(t);
  const q = el("div", "top query heads: " + R.top_query.map(k => "L" + k.layer + "H" + k.head + " = " +
    k.score.toFixed(3)).join("  ")); q.className = "note"; q.id = "retrieval-query"; box.appendChild(q);
  if (R.ablation) { const A = R.ablation, a = el("div", "ablation: needle accuracy " + (100 * A.baseline).toFixed(0) +
      "% -> " + (100 * A.top_k).toFixed(0) + "% without the top " + A.k + " retrieval heads; " +
      (100 * A.random.reduce((x, y) => x + y, 0) / A.random.length).toFixed(0) + "% on average without " + A.k +
      " random others (" + A.draws + " draws)."); a.className = "note"; box.appendChild(a); }
  if (D.retrieval_png) { const img = el("img"); img.alt = "retrieval scores per layer and head";
    img.src = "data:image/png;base64," + D.retrieval_png; img.style.maxWidth = "100%"; box.appendChild(img); }
}
let sortKey = "layer", sortDir = 1;
function drawTable() {
  const t = document.getElementById("scores"); t.textContent = "";
  const cols = ["layer", "head", "kv_head", "label"].concat(D.score_names);
  const hr = el("tr"); cols.forEach(k => { const th = el("th", k); th.onclick = () => { sortDir = sortKey === k ? -sortDir : (k === "layer" || k === "head" ? 1 : -1); sortKey = k; drawTable(); }; hr.appendChild(th); }); t.appendChild(hr);
  const rows = D.heads.slice().sort((a, b) => (a[sortKey] > b[sortKey] ? 1 : a[sortKey] < b[sortKey] ? -1 : 0) * sortDir);
  rows.forEach(r => { const tr = el("tr"); if (r.layer === layer && r.head === head) tr.className = "sel";
    cols.forEach(k => { const v = r[k]; const td = el("td", typeof v === "number" && !Number.isInteger(v) ? v.toFixed(3) : String(v)); if (k === "label") td.className = "l"; tr.appendChild(td); });
    tr.onclick = () => select(r.layer, r.head); t.appendChild(tr); });
}
function select(l, h) {
  layer = l; head = h; ls.value = String(l); hs.selectedIndex = h; const r = rec(l, h);
  document.getElementById("headinfo").textContent = "L" + l + "H" + h + " (KV head " + r.kv_head + ") | label: " +
    r.label + " | previous " + r.previous_token.toFixed(2) +
    " | induction " + r.induction.toFixed(2) + " | first " + r.first_token.toFixed(2) + " | entropy " + r.entropy.toFixed(2);
  drawPattern(); drawGrid(); drawTokens(); drawAblation(); drawPatching(); drawTable();
}
let best = 0; D.heads.forEach((r, k) => { if (r.previous_token > D.heads[best].previous_token) best = k; });
drawDefinitions(); drawRetrieval();
select(D.heads[best].layer, D.heads[best].head);
document.body.setAttribute("data-ready", "1");
</script></body></html>
"""
