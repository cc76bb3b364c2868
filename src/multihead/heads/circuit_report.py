"""What ``multihead circuit`` finds and shows: direct logit attribution over prompt pairs, composition between the top
heads, the circuit that edge attribution patching finds (with its faithfulness and an exact check of its top
edges), and a self-contained HTML report with the circuit drawn as an SVG graph.

- **Pairs** (:func:`read_pairs`): a JSON file as ``multihead/data/prompt_pairs.json``: ``{"pairs": [{"clean",
  "corrupt", "answer", "wrong"}, ...]}``; the clean and corrupted prompts of a pair have the same token length and
  the answers are one token each (:func:`encode_pairs`, once the model's tokenizer is known). Pairs of the same
  length run as one batch (each row with its own answers, ``logit_difference(answers, wrongs)``).
- **DLA** (:func:`dla_over_pairs`): :func:`multihead.heads.attribution.direct_logit_attribution` of
  ``logit[answer] - logit[wrong]`` at the last position of each clean prompt, every part (heads, MLPs, embeddings,
  the constant, the remainder) averaged over the pairs: the parts still sum to the mean logit difference.
- **Composition** (:func:`composition_between`): :func:`multihead.heads.composition.composition_scores` over the
  layers of the chosen heads, read out between them (baseline-corrected: the score minus the random score of its
  shape); K and V per KV head as well (GQA, MQA).
- **Circuit** (:func:`circuit_over_pairs`): :func:`multihead.heads.eap.edge_attribution` per batch of pairs, the
  scores averaged over pairs (each batch weighted by its rows), the top ``n`` edges by |score|, the faithfulness of
  that circuit (everything outside it ablated) pooled over pairs as sum(circuit - corrupted) / sum(clean -
  corrupted), and the exact effect of the top edges by path patching (:func:`multihead.heads.eap.check_edges`).
- **Graph** (:func:`circuit_svg`): any list of edges (objects with ``sender``, ``receiver``, ``score``) over the
  node names ``embed``, ``L{l}.H{h}``, ``L{l}.KV{g}.k``, ``L{l}.KV{g}.v``, ``L{l}.MLP``, ``logits``, as SVG: one
  row per layer's attention (its query heads with their KV heads' inputs, group by group) and one per layer's MLP,
  embeddings on top and logits at the bottom, one ``<path>`` per edge, red for a positive score and blue for a
  negative one, its width proportional to |score|.

The page needs no network (script and styles inline, images as data: URIs) and escapes every text it shows (the
prompts of a --pairs file included): nothing in a prompt can run.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from xml.sax.saxutils import quoteattr

import numpy as np
import torch
from torch import Tensor

from multihead.errors import MultiheadError
from multihead.files import save_figure, write_text
from multihead.heads.patching import PromptPair
from multihead.names import head_name

PAIR_KEYS = ("clean", "corrupt", "answer", "wrong")


# ---------------------------------------------------------------------------------------------- prompt pairs
def read_pairs(path: str | Path) -> list[PromptPair]:
    """Prompt pairs from a JSON file shaped as the shipped one (``{"pairs": [{"clean", "corrupt", "answer",
    "wrong"}]}``, other top-level keys such as "about" ignored); a MultiheadError names the file and what is wrong."""
    shown = str(path) if len(str(path)) <= 80 else str(path)[:77] + "..."
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise MultiheadError(f"cannot read the pairs file {shown!r}: {reason}") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        where = f": {err.msg} at line {err.lineno}" if isinstance(err, json.JSONDecodeError) else ""
        raise MultiheadError(f"the pairs file {shown!r} is not JSON{where}") from None
    items = data.get("pairs") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise MultiheadError(f"the pairs file {shown!r} must hold an object with a non-empty list \"pairs\" of "
                             "{\"clean\", \"corrupt\", \"answer\", \"wrong\"} objects (as multihead's "
                             "data/prompt_pairs.json)")
    pairs = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise MultiheadError(f"the pairs file {shown!r}: pair {i} is a {type(item).__name__}, not an object "
                                 "with \"clean\", \"corrupt\", \"answer\", \"wrong\"")
        missing = [k for k in PAIR_KEYS if k not in item]
        extra = sorted(str(k) for k in item if k not in PAIR_KEYS)
        if missing or extra:
            what = (f"lacks {', '.join(missing)}" if missing else "") + ("; " if missing and extra else "") + (
                f"has unknown key(s) {', '.join(repr(k[:30]) for k in extra[:4])}" if extra else "")
            raise MultiheadError(f"the pairs file {shown!r}: pair {i} {what} (its keys are clean, corrupt, answer, "
                                 "wrong)")
        for key in PAIR_KEYS:
            value = item[key]
            if not isinstance(value, str) or (not value.strip(" \t\n\r") and key in ("clean", "corrupt")):
                got = repr(value)[:40] if isinstance(value, str) else type(value).__name__
                raise MultiheadError(f"the pairs file {shown!r}: pair {i}'s {key} is {got}: give non-empty text")
            if not value:
                raise MultiheadError(f"the pairs file {shown!r}: pair {i}'s {key} is empty: give its token's text")
        pairs.append(PromptPair(item["clean"], item["corrupt"], item["answer"], item["wrong"]))
    return pairs


@dataclass(frozen=True)
class EncodedPair:
    """A prompt pair as token ids: the clean and corrupted prompts (equal lengths) and the two answer tokens."""

    pair: PromptPair
    clean: list[int]
    corrupt: list[int]
    answer: int
    wrong: int


def encode_pairs(pairs: Sequence[PromptPair], encode: Callable[[str], list[int]], max_tokens: int
                 ) -> list[EncodedPair]:
    """Each pair tokenized and checked: equal lengths, within the model's context, one-token answers."""
    if not pairs:
        raise MultiheadError("no prompt pairs given")
    found = []
    for i, pair in enumerate(pairs):
        clean, corrupt = encode(pair.clean), encode(pair.corrupt)
        answer, wrong = encode(pair.answer), encode(pair.wrong)
        if not clean or len(clean) != len(corrupt):
            raise MultiheadError(f"pair {i}: the clean prompt has {len(clean)} tokens and the corrupted one "
                                 f"{len(corrupt)}: give prompts of the same, non-zero token length")
        if len(clean) > max_tokens:
            raise MultiheadError(f"pair {i}: {len(clean)} tokens, more than the model's context of {max_tokens}")
        if len(answer) != 1 or len(wrong) != 1:
            raise MultiheadError(f"pair {i}: the answers {pair.answer[:30]!r} and {pair.wrong[:30]!r} must be one "
                                 f"token each (they are {len(answer)} and {len(wrong)})")
        if answer == wrong:
            raise MultiheadError(f"pair {i}: the answer and the wrong answer are the same token ({answer[0]}): the "
                                 "logit difference would be 0")
        found.append(EncodedPair(pair, clean, corrupt, answer[0], wrong[0]))
    return found


@dataclass(frozen=True)
class Batch:
    """Pairs of one token length run together: ``rows`` their indices among the pairs, ids (b, s), answers (b,)."""

    rows: tuple[int, ...]
    clean: Tensor
    corrupt: Tensor
    answers: Tensor
    wrongs: Tensor


def batches(pairs: Sequence[EncodedPair]) -> list[Batch]:
    """The pairs grouped by token length, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(pairs):
        groups.setdefault(len(p.clean), []).append(i)
    return [Batch(tuple(rows), torch.tensor([pairs[i].clean for i in rows]),
                  torch.tensor([pairs[i].corrupt for i in rows]), torch.tensor([pairs[i].answer for i in rows]),
                  torch.tensor([pairs[i].wrong for i in rows])) for rows in groups.values()]


@contextmanager
def _bar(total: int, desc: str, unit: str, progress: bool) -> Iterator[Any]:
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, disable=not progress, leave=True)
    try:
        yield bar
    finally:
        bar.close()


# ---------------------------------------------------------------------------------------------- DLA
@dataclass
class Dla:
    """Direct logit attribution of logit[answer] - logit[wrong] at each clean prompt's last token, averaged over the
    pairs: ``heads`` (n_layers, n_heads), ``mlps`` (n_layers,), ``embed``, ``constant``, ``remainder`` and the mean
    real ``logit_diff`` (the parts sum to it); ``per_pair`` (n_pairs,) each pair's real logit difference."""

    heads: np.ndarray
    mlps: np.ndarray
    embed: float
    constant: float
    remainder: float
    logit_diff: float
    per_pair: np.ndarray
    n_kv_heads: int
    notes: tuple[str, ...]

    def by_kv_head(self) -> np.ndarray:
        """(n_layers, n_kv_heads): each KV head's group of query heads summed."""
        n_layers, h = self.heads.shape
        summed: np.ndarray = self.heads.reshape(n_layers, self.n_kv_heads, h // self.n_kv_heads).sum(-1)
        return summed

    def parts(self) -> list[tuple[str, float]]:
        """Every part by name: 'embed', 'L3H5', 'MLP3', 'constant', 'remainder'."""
        rows = [("embed", self.embed)]
        for layer in range(self.heads.shape[0]):
            rows += [(head_name(layer, h), float(self.heads[layer, h])) for h in range(self.heads.shape[1])]
            rows.append((f"MLP{layer}", float(self.mlps[layer])))
        return [*rows, ("constant", self.constant), ("remainder", self.remainder)]

    def top(self, n: int) -> list[tuple[str, float]]:
        """The n components (heads, MLPs, embed) of largest |value|."""
        rows = [r for r in self.parts() if r[0] not in ("constant", "remainder")]
        return sorted(rows, key=lambda r: -abs(r[1]))[:n]

    def top_heads(self, n: int) -> list[tuple[int, int, float]]:
        order = np.argsort(-np.abs(self.heads), axis=None, kind="stable")[:n]
        h = self.heads.shape[1]
        return [(int(o // h), int(o % h), float(self.heads.flat[o])) for o in order]

    def to_json(self) -> dict[str, Any]:
        return {"metric": "logit[answer] - logit[wrong] at the clean prompt's last token, mean over pairs",
                "logit_diff": self.logit_diff, "embed": self.embed, "heads": self.heads.tolist(),
                "mlps": self.mlps.tolist(), "constant": self.constant, "remainder": self.remainder,
                "kv_heads": self.by_kv_head().tolist(), "per_pair_logit_diff": self.per_pair.tolist(),
                "sum_of_parts": self.embed + float(self.heads.sum()) + float(self.mlps.sum()) + self.constant,
                "notes": list(self.notes)}


def dla_over_pairs(model: Any, groups: Sequence[Batch], *, progress: bool = False) -> Dla:
    """DLA (see the module) of every batch of pairs, averaged over pairs."""
    from multihead.heads.attribution import direct_logit_attribution

    n = sum(len(g.rows) for g in groups)
    totals: dict[str, Any] = {}
    per_pair = np.zeros(n)
    notes: tuple[str, ...] = ()
    kv = 1
    with _bar(n, f"direct logit attribution over {n} prompt pair(s)", "pair", progress) as bar:
        for g in groups:
            a = direct_logit_attribution(model, g.clean, g.answers, g.wrongs)
            last = {"heads": a.heads[..., -1], "mlps": a.mlps[..., -1], "embed": a.embed[:, -1],
                    "constant": a.constant[:, -1], "remainder": a.remainder[:, -1]}
            for key, value in last.items():
                totals[key] = totals.get(key, 0.0) + value.sum(0).numpy()
            per_pair[list(g.rows)] = a.logit_diff[:, -1].numpy()
            notes, kv = a.notes, a.n_kv_heads
            bar.update(len(g.rows))
    mean = {k: v / n for k, v in totals.items()}
    return Dla(mean["heads"], mean["mlps"], float(mean["embed"]), float(mean["constant"]), float(mean["remainder"]),
               float(per_pair.mean()), per_pair, kv, notes)


# ---------------------------------------------------------------------------------------------- composition
@dataclass
class CompositionView:
    """Composition between chosen heads (baseline-corrected): ``kinds[kind]`` = (readers, writers, matrix) with
    readers as rows ('L5H2', or 'L5KV1' for k_kv and v_kv), writers ('L2H0') as columns, None where the writer's
    layer is not before the reader's."""

    heads: list[tuple[int, int]]
    kinds: dict[str, tuple[list[str], list[str], list[list[float | None]]]]
    baseline: dict[str, Any]
    notes: list[str]
    reason: str | None = None  # why nothing was computed (fewer than two layers among the heads)

    def to_json(self) -> dict[str, Any]:
        return {"heads": [head_name(*h) for h in self.heads], "corrected": "score - random baseline of its shape",
                "kinds": {k: {"readers": r, "writers": w, "scores": m} for k, (r, w, m) in self.kinds.items()},
                "baseline": self.baseline, "notes": self.notes, "reason": self.reason}


def composition_between(model: Any, heads: Sequence[tuple[int, int]], *, samples: int = 200) -> CompositionView:
    """Q-, K-, V-composition (and K, V per KV head) between ``heads`` (layer, head), from the composition scores of
    their layers."""
    from multihead.heads.composition import composition_scores

    heads = sorted(dict.fromkeys(heads))
    layers = sorted({layer for layer, _ in heads})
    if len(layers) < 2:
        return CompositionView(heads, {}, {}, [], f"the heads {', '.join(head_name(*h) for h in heads)} lie in "
                               f"{len(layers)} layer(s): composition pairs heads of different layers")
    comp = composition_scores(model, layers=layers, samples=samples)
    kinds: dict[str, tuple[list[str], list[str], list[list[float | None]]]] = {}
    writers = [h for h in heads if h[0] < layers[-1]]
    for kind in ("q", "k", "v", "k_kv", "v_kv"):
        kv = kind.endswith("_kv")
        readers = sorted(dict.fromkeys((lr, h // (comp.n_heads[lr] // comp.n_kv_heads[lr]) if kv else h)
                                       for lr, h in heads if lr > layers[0]))
        matrix: list[list[float | None]] = []
        for lr, unit in readers:
            row: list[float | None] = []
            for lw, hw in writers:
                row.append(float(comp.corrected(kind, lw, lr)[unit, hw]) if lw < lr else None)
            matrix.append(row)
        kinds[kind] = ([head_name(lr, u, kv=kv) for lr, u in readers], [head_name(*w) for w in writers], matrix)
    baseline = {"per_query_head": {"mean": comp.baseline[0], "std": comp.baseline[1]},
                "per_kv_head": {str(r): {"mean": m, "std": s} for r, (m, s) in sorted(comp.baseline_kv.items())},
                "samples": comp.samples}
    return CompositionView(heads, kinds, baseline, list(comp.notes))


# ---------------------------------------------------------------------------------------------- the graph
class EdgeLike(Protocol):
    @property
    def sender(self) -> str: ...

    @property
    def receiver(self) -> str: ...

    @property
    def score(self) -> float: ...


_NODE = re.compile(r"L(\d+)\.(?:H(\d+)|KV(\d+)\.([kv])|(MLP))")
POSITIVE_COLOUR, NEGATIVE_COLOUR = "#c62828", "#1565c0"


def node_place(name: str) -> tuple[int, int, tuple[int, ...]]:
    """Where a node is drawn: (row, layer, order within the row). Rows: embed -1 -> 0; layer l's attention 2 l + 1
    (KV inputs and query heads), its MLP 2 l + 2; logits last."""
    if name == "embed":
        return 0, -1, (0,)
    if name == "logits":
        return 1 << 30, 1 << 30, (0,)
    m = _NODE.fullmatch(name)
    if m is None:
        raise MultiheadError(f"node {name[:40]!r} is not a circuit node: the nodes are embed, L<l>.H<h>, "
                             "L<l>.KV<g>.k, L<l>.KV<g>.v, L<l>.MLP and logits")
    layer = int(m.group(1))
    if m.group(5):
        return 2 * layer + 2, layer, (0,)
    if m.group(2) is not None:
        return 2 * layer + 1, layer, (int(m.group(2)), 2)
    return 2 * layer + 1, layer, (int(m.group(3)), 0 if m.group(4) == "k" else 1)


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
        colour = POSITIVE_COLOUR if score >= 0 else NEGATIVE_COLOUR
        stroke = 0.8 + 6.2 * abs(score) / scale
        tip = f"{e.sender} \u2192 {e.receiver}: {score:+.4g}"
        out.append(f'<path class="edge {"pos" if score >= 0 else "neg"}" data-sender={quoteattr(e.sender)} '
                   f'data-receiver={quoteattr(e.receiver)} data-score="{score:.6g}" '
                   f'd="M{x1:.1f},{y1:.1f} C{x1 + bulge:.1f},{c1:.1f} {x2 + bulge:.1f},{c2:.1f} {x2:.1f},{y2:.1f}" '
                   f'stroke="{colour}" stroke-width="{stroke:.2f}" stroke-opacity="0.75">'
                   f"<title>{html.escape(tip)}</title></path>")
    out.append("</g>")
    out.append('<g class="nodes">')
    for name, (nx, ny) in xy.items():
        short = name.split(".", 1)[1] if name.startswith("L") else name
        wide = 60 if name in ("embed", "logits") else 52
        fill = "#fff3c4" if ".H" in name else "#e3f2e1" if ".KV" in name else "#e8eaf6"
        out.append(f'<g class="node" data-node={quoteattr(name)}><rect x="{nx - wide / 2:.1f}" y="{ny - 11:.1f}" '
                   f'width="{wide}" height="22" rx="6" fill="{fill}" stroke="#555"/>'
                   f'<text x="{nx:.1f}" y="{ny + 4:.1f}" text-anchor="middle">{html.escape(short)}</text>'
                   f"<title>{html.escape(name)}</title></g>")
    out.append("</g></svg>")
    return "".join(out)


def _colour(value: float | None, limit: float) -> str:
    if value is None or not math.isfinite(value):
        return "#eeeeee"
    t = min(1.0, abs(value) / limit) if limit > 0 else 0.0
    r, g, b = (198, 40, 40) if value >= 0 else (21, 101, 192)
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
    im = axes[0].imshow(dla.heads, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    axes[0].set_title("each head (layer x head)", fontsize=9)
    axes[0].set_xlabel("head")
    axes[0].set_ylabel("layer")
    step = max(1, n_layers // 15)
    axes[0].set_yticks(range(0, n_layers, step))
    axes[0].set_xticks(range(0, h, max(1, h // 12)))
    fig.colorbar(im, ax=axes[0], shrink=0.8)
    layers = np.arange(n_layers)
    axes[1].barh(layers - 0.2, dla.heads.sum(1), height=0.4, color="#d08c00", label="attention (sum of heads)")
    axes[1].barh(layers + 0.2, dla.mlps, height=0.4, color="#5c6bc0", label="MLP")
    axes[1].set_yticks(range(0, n_layers, step))
    axes[1].invert_yaxis()
    axes[1].axvline(0, color="#888", lw=0.8)
    axes[1].set_ylabel("layer")
    axes[1].set_title("per layer", fontsize=9)
    axes[1].legend(fontsize=7, loc="best")
    parts = dla.top(top)
    names = [n for n, _ in parts]
    values = [v for _, v in parts]
    axes[2].barh(range(len(parts)), values, color=[POSITIVE_COLOUR if v >= 0 else NEGATIVE_COLOUR for v in values])
    axes[2].set_yticks(range(len(parts)), names, fontsize=7)
    axes[2].invert_yaxis()
    axes[2].axvline(0, color="#888", lw=0.8)
    axes[2].set_title(f"the {len(parts)} largest parts", fontsize=9)
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


# ---------------------------------------------------------------------------------------------- the result
@dataclass
class CircuitReport:
    """Everything ``multihead circuit`` found (see the module); ``circuit`` None when edge attribution did not run."""

    model: str
    engine: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    pairs: list[EncodedPair]
    dla: Dla
    composition: CompositionView
    circuit: dict[str, Any] | None
    edges: list[Any] = field(default_factory=list)  # the top edges (objects with sender, receiver, score)
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "engine": self.engine, "n_layers": self.n_layers, "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "pairs": [{"clean": p.pair.clean, "corrupt": p.pair.corrupt, "answer": p.pair.answer,
                       "wrong": p.pair.wrong, "tokens": len(p.clean), "logit_diff": float(self.dla.per_pair[i])}
                      for i, p in enumerate(self.pairs)],
            "dla": self.dla.to_json(), "composition": self.composition.to_json(), "circuit": self.circuit,
            "seconds": self.seconds,
        }


def _json_for_html(data: Any) -> str:
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def report_html(report: CircuitReport, dla_png: bytes) -> str:
    """The whole page (see the module)."""
    e = html.escape
    d = report.dla
    parts = "".join(f"<tr><td class='l'>{e(n)}</td><td>{v:+.4f}</td></tr>" for n, v in d.top(15))
    sections = [
        f"<h1>multihead circuit: {e(report.model)}</h1>",
        f"<div class='note'>{report.n_layers} layers, {report.n_heads} query heads, {report.n_kv_heads} KV heads; "
        f"{len(report.pairs)} prompt pair(s); engine: {e(report.engine)}</div>",
        "<h2>direct logit attribution</h2>",
        f"<div class='note'>Each part's direct effect on logit[answer] - logit[wrong] at the clean prompt's last "
        f"token, mean over the pairs: embed {d.embed:+.4f} + heads {d.heads.sum():+.4f} + MLPs {d.mlps.sum():+.4f} + "
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
    checks = "".join(f"<tr><td class='l'>{e(k['sender'])} \u2192 {e(k['receiver'])}</td><td>{k['score']:+.4f}</td>"
                     f"<td>{k['exact']:+.4f}</td></tr>" for k in c["checks"])
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
        "difference when the edge carries the corrupted prompt's write instead of the clean one: blue (negative) "
        "edges carry the behaviour, red (positive) ones work against it; width: |score|. Hover a node to see its "
        "edges.</p>",
        f"<p><b>exact check</b> of the top {len(c['checks'])} edges (path patching, a second forward):</p>",
        f"<table id='checks'><tr><th>edge</th><th>{e(c['method'])}</th><th>exact</th></tr>{checks}</table>",
    ]
    edges = "".join(f"<tr><td>{i + 1}</td><td class='l'>{e(x['sender'])}</td><td class='l'>{e(x['receiver'])}</td>"
                    f"<td>{x['score']:+.4f}</td></tr>" for i, x in enumerate(c["edges"]))
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
               f"{base['mean']:.4f} \u00b1 {base['std']:.4f}); red: above the baseline, blue: below, each map "
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


# ---------------------------------------------------------------------------------------------- choosing the circuit
def node_inputs(sender: str, group: int) -> list[str]:
    """The receivers a sender node reads the stream through: a query head its q and its KV head's k and v, an MLP
    its input, the embeddings none."""
    if sender == "embed":
        return []
    m = _NODE.fullmatch(sender)
    if m is None or (m.group(2) is None and not m.group(5)):
        raise MultiheadError(f"{sender[:40]!r} is not a sender: the senders are embed, L<l>.H<h> and L<l>.MLP")
    layer = int(m.group(1))
    if m.group(5):
        return [f"L{layer}.MLP"]
    h = int(m.group(2))
    return [f"L{layer}.H{h}", f"L{layer}.KV{h // group}.k", f"L{layer}.KV{h // group}.v"]


def receiver_outputs(receiver: str, group: int) -> list[str]:
    """The sender nodes whose write depends on a receiver's input: a query head's q its own, a KV head's k or v every
    query head of its group, an MLP's input its own output, the logits none."""
    if receiver == "logits":
        return []
    m = _NODE.fullmatch(receiver)
    if m is None:
        raise MultiheadError(f"{receiver[:40]!r} is not a receiver: the receivers are L<l>.H<h>, L<l>.KV<g>.k, "
                             "L<l>.KV<g>.v, L<l>.MLP and logits")
    layer = int(m.group(1))
    if m.group(5):
        return [f"L{layer}.MLP"]
    if m.group(2) is not None:
        return [f"L{layer}.H{m.group(2)}"]
    g = int(m.group(3))
    return [f"L{layer}.H{h}" for h in range(g * group, (g + 1) * group)]


def from_embed(edges: Sequence[EdgeLike], group: int) -> list[Any]:
    """The edges whose sender is reached from the embeddings along the edges themselves: only they carry the
    prompts' difference once everything outside the circuit is corrupt-ablated (an edge from an unreached sender
    then carries that sender's corrupted write, the ablated value)."""
    live = {"embed"}
    rows = {name: node_place(name)[0] for e in edges for name in (e.sender, e.receiver)}
    for e in sorted(edges, key=lambda e: rows[e.sender]):  # a sender's inputs come from earlier rows: one pass
        if e.sender in live:
            live.update(receiver_outputs(e.receiver, group))
    return [e for e in edges if e.sender in live]


def greedy_order(scores: dict[tuple[str, str], float], group: int) -> list[tuple[str, str, float]]:
    """Every edge reachable backwards from the logits, in greedy order (Hanna et al. 2024): start from the logits;
    repeatedly take the edge of largest |score| into a receiver of the circuit so far, its sender joining it."""
    import heapq

    incoming: dict[str, list[tuple[str, float]]] = {}
    for (u, r), score in scores.items():
        incoming.setdefault(r, []).append((u, score))
    heap: list[tuple[float, str, str, float]] = []
    opened: set[str] = set()
    joined: set[str] = set()

    def open_receiver(r: str) -> None:
        if r not in opened:
            opened.add(r)
            for u, score in incoming.get(r, []):
                heapq.heappush(heap, (-abs(score), u, r, score))

    open_receiver("logits")
    order = []
    while heap:
        _, u, r, score = heapq.heappop(heap)
        order.append((u, r, score))
        if u not in joined:
            joined.add(u)
            for receiver in node_inputs(u, group):
                open_receiver(receiver)
    return order


def select_edges(scores: dict[tuple[str, str], float], n: int, *, select: str, group: int) -> list[Any]:
    """The circuit's edges: ``select="top"`` the n edges of largest |score|; ``"greedy"`` the edges of the shortest
    greedy prefix (:func:`greedy_order`) with at least n edges reached from the embeddings, those edges only (n, or a
    few more where the last edge connects several)."""
    from multihead.heads.eap import Edge

    if select == "top":
        ranked = sorted(scores.items(), key=lambda kv: -abs(kv[1]))
        return [Edge(u, r, s) for (u, r), s in ranked[:n]]
    if select != "greedy":
        raise MultiheadError(f"select {select!r} is unknown: choose greedy or top")
    order = [Edge(u, r, s) for u, r, s in greedy_order(scores, group)]
    low, high = min(n, len(order)), len(order)
    if len(from_embed(order, group)) < n:
        return sorted(from_embed(order, group), key=lambda e: -abs(e.score))
    while low < high:  # the shortest prefix whose edges reached from embed number n or more
        mid = (low + high) // 2
        if len(from_embed(order[:mid], group)) >= n:
            high = mid
        else:
            low = mid + 1
    return sorted(from_embed(order[:low], group), key=lambda e: -abs(e.score))


def chosen_heads(dla: Dla, edges: Sequence[EdgeLike], n: int) -> list[tuple[int, int]]:
    """The heads composition is shown between: the query heads of the circuit's edges (strongest edge first), then
    the heads of largest |DLA|, ``n`` in all."""
    found: dict[tuple[int, int], None] = {}
    for e in edges:
        for name in (e.sender, e.receiver):
            m = _NODE.fullmatch(name)
            if m is not None and m.group(2) is not None:
                found.setdefault((int(m.group(1)), int(m.group(2))))
    for layer, head, _ in dla.top_heads(n):
        found.setdefault((layer, head))
    return list(found)[:n]


def analyse_circuit(model: Any, pairs: Sequence[PromptPair], *, method: str | None = "eap", steps: int = 5,
                    edges: int = 20, top: int = 10, check: int = 5, ablation: str = "corrupt", samples: int = 200,
                    select: str = "greedy", progress: bool = False) -> CircuitReport:
    """DLA, the circuit (``method`` "eap" or "eap-ig", None for none) and composition of a causal model
    (a :class:`multihead.heads.adapters.HeadModel`) on prompt pairs; see the module."""
    for name, value, low in (("steps", steps, 1), ("edges", edges, 1), ("top", top, 1), ("check", check, 0),
                             ("samples", samples, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise MultiheadError(f"{name} ({value!r}) must be an int >= {low}")
    if method not in (None, "eap", "eap-ig"):
        raise MultiheadError(f"method {method!r} is unknown: choose eap or eap-ig")
    if not getattr(model, "causal", False):
        raise MultiheadError(f"{getattr(model, 'name', type(model).__name__)} is not a causal language model: a "
                             "circuit is traced to next-token logits")
    encoded = encode_pairs(pairs, model.token_ids, int(model.max_tokens))
    groups = batches(encoded)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    dla = dla_over_pairs(model, groups, progress=progress)
    seconds["dla"] = time.perf_counter() - start
    circuit: dict[str, Any] | None = None
    kept: list[Any] = []
    if method is not None:
        circuit, kept = circuit_over_pairs(model, groups, method=method, steps=steps, edges=edges, check=check,
                                           ablation=ablation, seconds=seconds, select=select, progress=progress)
    start = time.perf_counter()
    with _bar(1, "composition scores", "run", progress) as bar:
        composition = composition_between(model, chosen_heads(dla, kept, top), samples=samples)
        bar.update(1)
    seconds["composition"] = time.perf_counter() - start
    return CircuitReport(str(model.name), str(model.engine), int(model.n_layers), int(model.n_heads),
                         int(model.n_kv_heads), encoded, dla, composition, circuit, kept, seconds)


def circuit_over_pairs(model: Any, groups: Sequence[Batch], *, method: str, steps: int, edges: int, check: int,
                       ablation: str, seconds: dict[str, float], select: str = "greedy", progress: bool = False
                       ) -> tuple[dict[str, Any], list[Any]]:
    """Edge attribution over the batches of pairs, the top ``edges`` edges, their faithfulness and the exact check
    of the top ``check`` (see the module): the JSON record and the kept edges."""
    from multihead.heads.eap import check_edges, edge_attribution, faithfulness
    from multihead.heads.patching import logit_difference

    n = sum(len(g.rows) for g in groups)
    weight = [len(g.rows) / n for g in groups]
    metrics = [logit_difference(g.answers, g.wrongs) for g in groups]
    totals: dict[tuple[str, str], float] = {}
    clean = corrupted = 0.0
    start = time.perf_counter()
    what = method + (f", {steps} steps" if method == "eap-ig" else "")
    with _bar(n, f"edge attribution ({what}) over {n} prompt pair(s)", "pair", progress) as bar:
        for g, w, metric in zip(groups, weight, metrics, strict=True):
            scores = edge_attribution(model, g.clean, g.corrupt, metric, method=method, steps=steps)
            for e in scores.edges:
                totals[(e.sender, e.receiver)] = totals.get((e.sender, e.receiver), 0.0) + w * e.score
            clean += w * scores.clean_metric
            corrupted += w * scores.corrupted_metric
            notes = scores.notes
            bar.update(len(g.rows))
    seconds["eap"] = time.perf_counter() - start
    kept = select_edges(totals, edges, select=select, group=int(model.n_heads) // int(model.n_kv_heads))
    start = time.perf_counter()
    circuit_metric = span = 0.0
    with _bar(n, f"faithfulness of the circuit ({len(kept)} edges)", "pair", progress) as bar:
        for g, w, metric in zip(groups, weight, metrics, strict=True):
            f = faithfulness(model, g.clean, g.corrupt, metric, kept, ablation=ablation)
            circuit_metric += w * f.circuit_metric
            span += w * (f.clean_metric - f.corrupted_metric)
            bar.update(len(g.rows))
    seconds["faithfulness"] = time.perf_counter() - start
    start = time.perf_counter()
    checked = kept[:check]
    exact = [0.0] * len(checked)
    if checked:
        with _bar(n, f"exact check of the top {len(checked)} edges", "pair", progress) as bar:
            for g, w, metric in zip(groups, weight, metrics, strict=True):
                for i, (_, effect) in enumerate(check_edges(model, g.clean, g.corrupt, metric, checked)):
                    exact[i] += w * effect
                bar.update(len(g.rows))
    seconds["check"] = time.perf_counter() - start
    record = {
        "method": method, "steps": steps if method == "eap-ig" else 1, "n_scored": len(totals), "select": select,
        "score": "the estimated change of the logit difference when the edge carries the corrupted prompt's write "
                 "instead of the clean one (corrupted - clean), mean over the pairs",
        "clean_metric": clean, "corrupted_metric": corrupted, "notes": list(notes),
        "edges": [{"sender": e.sender, "receiver": e.receiver, "score": e.score} for e in kept],
        "faithfulness": {"kept": (circuit_metric - corrupted) / span if span else float("nan"),
                         "circuit_metric": circuit_metric, "clean_metric": clean, "corrupted_metric": corrupted,
                         "n_edges": len(kept), "ablation": ablation,
                         "pooled": "sum over pairs of (circuit - corrupted) / sum of (clean - corrupted)"
                                   + ("; the mean is over the corrupted prompts of one token length (the pairs "
                                      "batched together)" if ablation == "mean" else "")},
        "checks": [{"sender": e.sender, "receiver": e.receiver, "score": e.score, "exact": x}
                   for e, x in zip(checked, exact, strict=True)],
    }
    return record, kept
