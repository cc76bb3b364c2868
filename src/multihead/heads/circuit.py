"""What ``multihead circuit`` computes: direct logit attribution over prompt pairs, composition between the top
heads, and the circuit that edge attribution patching finds (with its faithfulness and an exact check of its top
edges). :mod:`multihead.heads.circuit_report` renders it (the SVG graph, the heatmaps, the DLA picture, the page).

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
- **Nodes** (:func:`node_place`): ``embed``, ``L{l}.H{h}``, ``L{l}.KV{g}.k``, ``L{l}.KV{g}.v``, ``L{l}.MLP``,
  ``logits``, each with its row (embeddings first, then each layer's attention and its MLP, logits last).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from multihead.errors import MultiheadError
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


def encode_pairs(pairs: Sequence[PromptPair], encode: Callable[[str], list[int]], max_tokens: int, *,
                 prompt: Callable[[str], list[int]] | None = None) -> list[EncodedPair]:
    """Each pair tokenized and checked: equal lengths, within the model's context, one-token answers. ``encode``
    tokenizes the answers; ``prompt`` (default ``encode``) the prompts as the model reads them (its BOS first)."""
    if not pairs:
        raise MultiheadError("no prompt pairs given")
    found = []
    for i, pair in enumerate(pairs):
        clean, corrupt = (prompt or encode)(pair.clean), (prompt or encode)(pair.corrupt)
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
    from multihead.heads.progress import progress_bar

    bar = progress_bar(total=total, desc=desc, unit=unit, progress=progress)
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


# ---------------------------------------------------------------------------------------------- nodes and edges
class EdgeLike(Protocol):
    """An edge of the circuit: its sender and receiver nodes and its score (:class:`multihead.heads.eap.Edge`)."""

    @property
    def sender(self) -> str: ...

    @property
    def receiver(self) -> str: ...

    @property
    def score(self) -> float: ...


_NODE = re.compile(r"L(\d+)\.(?:H(\d+)|KV(\d+)\.([kv])|(MLP))")


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
    if method is not None:  # a model edge attribution refuses is refused before the DLA runs
        from multihead.heads.eap import check_model

        check_model(model)
    encoded = encode_pairs(pairs, model.token_ids, int(model.max_tokens), prompt=getattr(model, "prompt_ids", None))
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
