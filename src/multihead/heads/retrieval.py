"""Retrieval heads at long context: which heads copy the needle, which look past a streaming cache's keys, and what
masking them costs. Computed from hook_q / hook_k captures, block by block: no layer's (b, h, s, t) matrix is made.

Three scores per query head (L layers x h heads), each aggregated per KV head (L x g; a KV head serves h / g query
heads and the cache is per KV head, so a plan decides per KV head):

``query`` / ``kv``: the retrieval score of Wu et al. 2024 ("Retrieval Head Mechanistically Explains Long-Context
    Factuality"). The context is prefilled through a full :class:`~multihead.cache.KVCache` in chunks, then the
    question is one chunk and the answer is teacher-forced one token a step (:func:`multihead.evals.answers.
    answer_steps`). The query that predicts answer token ``a_j`` (the question's last row for j = 0, the step fed
    ``a_{j-1}`` after) is taken against every cached key (q (b, h, 1, d) against k (b, g, t, d): (b, h, 1, t)). An
    answer step is *copyable* when ``a_j`` occurs in the needle span(s) of the case. A head *hits* at a copyable
    step when its most-attended key (top-1 of q.k over all t keys) lies in a needle span and holds ``a_j``. A
    case's score is hits / copyable steps; the head's score is the mean over the cases used (by default the cases
    the model answers exactly right).

    How this matches Wu et al.'s code (nightdessert/Retrieval_Head, ``retrieval_calculate``): the same top-1 over
    all keys of the step's query and the same copy condition (the key lies in the needle span and its token is the
    token produced at this step), and their first scored step is also the prompt's last token. They decode greedily
    and divide the hits by the needle span's length (their answer repeats the whole needle sentence); our answers
    are a needle's value, so we divide by the copyable steps (the tokens actually copied), and we teacher-force
    (equal to greedy while greedy agrees; the used cases are those where it agrees throughout). They keep trials
    with ROUGE-1 recall > 50; we keep exact matches (``correct_only``).

``mass_outside``: the share of a query's attention that falls outside the first ``sinks`` keys and its last
    ``window`` keys (keys ``sinks .. p - window`` of a query at position p: what a sinks + window cache drops),
    averaged over the prefill's query rows at positions p >= sinks + window (the rows a streaming cache changes),
    or over the last ``rows`` of each prefill chunk only. Computed in blocks of ``block`` query rows x t keys.

``razor``: RazorAttention-style training-free scores (Tang et al. 2024): echo (duplicate-token) and induction
    scores of :mod:`multihead.heads.scores`, per KV head.

A KV head's score is the max over its query heads (``kv``, the one a plan should use: one retrieval query head
needs every key of its KV head) and the mean (``kv_mean``, for reading). :meth:`RetrievalScores.plan` makes the
:class:`~multihead.cache.HeadPlan` of a budget from them, with the model's name and shape.

One code path for both engines (:mod:`multihead.heads.engines`): multihead's own models and any transformers causal
LM whose attention runs on multihead (:func:`multihead.hf.enable`; Llama, Qwen2, Qwen3, Mistral, Gemma 2 and 3 are
tested), through the same hook points. A transformers layer's own mask (a sliding window) and its softcap are the
layer's: a query's top-1 key is the top among the keys it may see, its dropped mass is taken from its real weights
(so a sliding layer whose window fits inside the streaming cache's drops nothing).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from multihead.errors import MultiheadError
from multihead.evals.answers import FULL_CACHE, answer_steps, prefill, run_prompt, score
from multihead.evals.needles import Case
from multihead.heads.engines import Site, as_engine
from multihead.layers.hooks import HookPoint, zero_heads
from multihead.models.decoder import as_tokenizer

if TYPE_CHECKING:
    from multihead.cache import HeadPlan


# ---------------------------------------------------------------------------------------------------------- settings
def _integer(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise MultiheadError(f"{name} ({value!r}) must be an integer of at least {least}")
    return value


@dataclass(frozen=True)
class RetrievalSettings:
    """How the scores are taken. ``sinks`` and ``window``: the streaming cache whose dropped mass is measured;
    ``block``: query rows per block of the mass score; ``rows``: None for every prefill row at a position of at
    least sinks + window, or the last ``rows`` rows of each chunk; ``chunk``: prefill tokens per step;
    ``correct_only``: average the retrieval score over the cases the model answers exactly right (Wu et al. keep
    the trials it answers)."""

    sinks: int = 4
    window: int = 256
    block: int = 128
    rows: int | None = None
    chunk: int = 512
    correct_only: bool = True

    def __post_init__(self) -> None:
        _integer("sinks", self.sinks, 0)
        _integer("window", self.window, 1)
        _integer("block", self.block, 1)
        _integer("chunk", self.chunk, 1)
        if self.rows is not None:
            _integer("rows", self.rows, 1)
        if self.window < self.sinks:
            raise MultiheadError(f"window ({self.window}) keeps fewer tokens than the {self.sinks} sinks: use a "
                                 f"window of at least {self.sinks} or fewer sinks")


# ---------------------------------------------------------------------------------------------------------- helpers
def attention_layers(model: Any) -> list[Any]:
    """The model's attention layers in order, the modules holding their hook points: multihead's own layers
    (MultiHeadAttention, with a config.softmax_scale) or a transformers model's attention modules (switched to
    multihead's attention by :func:`multihead.hf.enable`): :meth:`multihead.heads.engines.Engine.sites`."""
    return [site.module for site in as_engine(model).sites()]


def kv_aggregate(x: np.ndarray, n_kv_heads: int, how: str = "max") -> np.ndarray:
    """(L, h) per query head -> (L, g) per KV head: the mean or max over the h / g query heads of each KV head
    (query head i reads KV head i // (h / g))."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise MultiheadError(f"scores must be (layers, query heads), got shape {x.shape}")
    _integer("n_kv_heads", n_kv_heads, 1)
    if x.shape[1] % n_kv_heads:
        raise MultiheadError(f"{x.shape[1]} query heads cannot be grouped into {n_kv_heads} KV heads: n_kv_heads "
                             "must divide them")
    grouped = x.reshape(x.shape[0], n_kv_heads, x.shape[1] // n_kv_heads)
    if how == "max":
        return np.asarray(grouped.max(-1), dtype=np.float64)
    if how == "mean":
        return np.asarray(grouped.mean(-1), dtype=np.float64)
    raise MultiheadError(f"how {how!r} is unknown: choose max or mean")


def _grouped_logits(q: Tensor, k: Tensor, scale: float, softcap: float | None = None) -> Tensor:
    """q (b, h, r, d) against k (b, g, t, d) -> scores (b, h, r, t), with no repeated K: each KV head's query heads
    are one batched matmul; ``softcap`` (Gemma 2): ``tanh(x / softcap) * softcap``."""
    b, h, r, d = q.shape
    g = k.shape[1]
    if h % g:
        raise MultiheadError(f"{h} query heads cannot read {g} KV heads: g must divide h")
    qg = q.reshape(b, g, h // g, r, d)  # (b, g, h/g, r, d)
    logits = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2))  # (b, g, h/g, r, t)
    logits = logits.reshape(b, h, r, k.shape[2]).mul_(scale)  # (b, h, r, t)
    if softcap is not None:
        logits = logits.div_(softcap).tanh_().mul_(softcap)
    return logits


def mass_outside_block(q: Tensor, k: Tensor, positions: Tensor, *, scale: float, sinks: int, window: int,
                       softcap: float | None = None, keep: Tensor | None = None) -> Tensor:
    """Per head, the summed share of attention outside the sinks and the window over a block of query rows:
    q (b, h, r, d) at ``positions`` (r,), k (b, g, t, d) the keys at positions 0 .. t - 1 (causal: a query sees
    keys up to its own position; ``keep``, broadcastable to (b, h, r, t), True = may attend, narrows it to the
    layer's own mask, e.g. a sliding window). ``softcap`` caps the scores as the layer does. Returns (h,) float64
    sums over b and r."""
    t = k.shape[2]
    j = torch.arange(t, device=k.device)
    logits = _grouped_logits(q.float(), k.float(), scale, softcap)  # (b, h, r, t)
    allowed = j[None, :] <= positions[:, None]  # (r, t)
    if keep is not None:
        allowed = allowed & keep  # (1 | b, 1 | h, r, t)
    w = torch.softmax(logits.masked_fill_(~allowed, float("-inf")), dim=-1)  # (b, h, r, t)
    del logits  # at most two blocks live at once
    dropped = allowed & (j >= sinks) & (j[None, :] <= positions[:, None] - window)  # (.., r, t)
    return w.mul_(dropped).sum(-1).double().sum((0, 2))  # (h,)


# ---------------------------------------------------------------------------------------------------------- the probe
class _Probe:
    """Hooks on every layer's q and k. Mode "mass": each call's rows (all or the chosen ones) add to the dropped
    mass, block by block; mode "top": each call's last query row's top-1 key per head is kept (among the keys the
    layer lets it see); "off": nothing."""

    def __init__(self, layers: Sequence[Site], settings: RetrievalSettings) -> None:
        self.layers = list(layers)
        self.settings = settings
        self.mode = "off"
        self._q: list[Tensor | None] = [None] * len(layers)
        self.mass: list[Tensor] = []
        self.rows = 0
        self.top: list[list[Tensor]] = [[] for _ in layers]  # per layer, per call: (b, h) key indices
        self.heads: int | None = None

    def reset_mass(self) -> None:
        self.mass = [torch.zeros(0, dtype=torch.float64) for _ in self.layers]
        self.rows = 0

    @contextmanager
    def attached(self) -> Iterator[_Probe]:
        with ExitStack() as stack:
            for i, site in enumerate(self.layers):
                stack.enter_context(site.module.hook_q.add(self._keep_q(i)))
                stack.enter_context(site.module.hook_k.add(self._on_k(i, site)))
            yield self

    def _keep_q(self, i: int) -> Callable[[Tensor, HookPoint], None]:
        def hook(q: Tensor, _point: HookPoint) -> None:
            self._q[i] = q.detach() if self.mode != "off" else None
        return hook

    def _on_k(self, i: int, site: Site) -> Callable[[Tensor, HookPoint], None]:
        def hook(k: Tensor, _point: HookPoint) -> None:
            q = self._q[i]
            self._q[i] = None
            if q is None or self.mode == "off":
                return
            k = k.detach()
            self.heads = q.shape[1]
            if self.mode == "top":
                s, t = q.shape[2], k.shape[2]
                row = torch.tensor([s - 1], device=q.device)
                keep = site.keep(row, row + t - s, t)  # the step's query (the last row) sits at t - 1
                last = _grouped_logits(q[:, :, -1:].float(), k.float(), site.scale, site.softcap)  # (b, h, 1, t)
                last = last.masked_fill_(~keep, float("-inf"))
                self.top[i].append(last[:, :, 0].argmax(-1).cpu())  # (b, h)
            else:
                self._mass(i, q, k, site)
        return hook

    def _mass(self, i: int, q: Tensor, k: Tensor, site: Site) -> None:
        s, t = q.shape[2], k.shape[2]
        st = self.settings
        rows = torch.arange(s, device=q.device)
        if st.rows is not None:
            rows = rows[-st.rows:]
        positions = t - s + rows  # bottom-right causal: query i of s sits at t - s + i
        chosen = positions >= st.sinks + st.window
        rows, positions = rows[chosen], positions[chosen]
        total = torch.zeros(q.shape[1], dtype=torch.float64)
        for start in range(0, rows.numel(), st.block):
            r, p = rows[start:start + st.block], positions[start:start + st.block]
            total += mass_outside_block(q[:, :, r], k, p, scale=site.scale, sinks=st.sinks, window=st.window,
                                        softcap=site.softcap, keep=site.keep(r, p, t)).cpu()
        self.mass[i] = total if self.mass[i].numel() == 0 else self.mass[i] + total  # (h,)
        if i == 0:
            self.rows += int(rows.numel()) * q.shape[0]


# ---------------------------------------------------------------------------------------------------------- the scores
@dataclass
class RetrievalScores:
    """Retrieval and streaming scores of every head. Arrays are (L, h) per query head and (L, g) per KV head;
    ``kv`` (max over a KV head's query heads) is what :class:`HeadPlan.from_scores`-style plans take."""

    model: str
    n_kv_heads: int
    query: np.ndarray  # (L, h) retrieval score per query head
    mass_outside: np.ndarray  # (L, h) attention share a sinks + window cache drops
    cases: list[dict[str, Any]]  # per case: id, task, length, correct, copyable steps, used
    settings: dict[str, Any]
    mass_rows: int = 0
    razor: dict[str, np.ndarray] = field(default_factory=dict)  # name -> (L, h) (induction, echo)
    ablation: dict[str, Any] | None = None
    shape: tuple[int, int, int, int] | None = None  # the model's (n_layers, n_heads, n_kv_heads, head_dim)
    scored: str = ""  # what the scores were taken on (the engine, sliding layers ...), for a plan's method
    windows: tuple[int | None, ...] | None = None  # each layer's attention window (None: global), for a plan

    @property
    def kv(self) -> np.ndarray:
        """(L, g) retrieval score per KV head: the max over its query heads."""
        return kv_aggregate(self.query, self.n_kv_heads, "max")

    @property
    def kv_mean(self) -> np.ndarray:
        return kv_aggregate(self.query, self.n_kv_heads, "mean")

    @property
    def mass_outside_kv(self) -> np.ndarray:
        """(L, g): the max over a KV head's query heads of the mass a streaming cache would drop."""
        return kv_aggregate(self.mass_outside, self.n_kv_heads, "max")

    @property
    def razor_kv(self) -> dict[str, np.ndarray]:
        """(L, g) per razor score (max over query heads), and ``razor``: the max of echo and induction."""
        out = {name: kv_aggregate(x, self.n_kv_heads, "max") for name, x in self.razor.items()}
        if out:
            out["razor"] = np.maximum.reduce(list(out.values()))
        return out

    def for_plan(self, kind: str = "retrieval") -> np.ndarray:
        """The (L, g) array a head-wise cache plan ranks KV heads by (higher: keep every key): "retrieval" (Wu et
        al., :attr:`kv`), "mass" (the attention a streaming cache would drop, :attr:`mass_outside_kv`) or "razor"
        (the max of echo and induction, :attr:`razor_kv`)."""
        if kind == "retrieval":
            return self.kv
        if kind == "mass":
            return self.mass_outside_kv
        if kind == "razor":
            if not self.razor:
                raise MultiheadError("these scores carry no razor scores: attach razor_scores(...) as .razor")
            return self.razor_kv["razor"]
        raise MultiheadError(f"kind {kind!r} is unknown: choose retrieval, mass or razor")

    def plan(self, fraction: float, by: str = "retrieval") -> HeadPlan:
        """The :class:`~multihead.cache.HeadPlan` that keeps every key for the top ``fraction`` of KV heads by ``by``
        (:meth:`for_plan`'s kinds) and the scores' sinks + window for the rest, with the model's name and shape.
        "retrieval" breaks its ties (most heads copy nothing) by the dropped mass: the ranked score is ``kv +
        1e-3 * mass_outside_kv / max(mass_outside_kv)``, so a tie goes to the head a streaming cache would hurt
        more. The plan's ``method`` says what was scored: the score, the cases used, the model and its engine."""
        from multihead.cache import HeadPlan

        if self.shape is None:
            raise MultiheadError("these scores carry no model shape (n_layers, n_heads, n_kv_heads, head_dim): "
                                 "score with retrieval_scores, which records it")
        ranked = self.for_plan(by)
        if by == "retrieval":
            mass = self.mass_outside_kv
            ranked = ranked + 1e-3 * mass / max(float(mass.max()), 1e-12)
        st = self.settings
        used = sum(1 for c in self.cases if c["used"])
        lengths = sorted({int(c["length"]) for c in self.cases if c["used"]})
        tasks = sorted({str(c["task"]) for c in self.cases if c["used"]})
        what = {"retrieval": "Wu et al.'s retrieval score per KV head (max over its query heads), ties by the "
                             f"attention a {st['sinks']} sinks + {st['window']} cache drops",
                "mass": f"the attention a {st['sinks']} sinks + {st['window']} cache drops per KV head (max over "
                        f"its query heads, over {self.mass_rows} prefill rows)",
                "razor": "RazorAttention's echo / induction score per KV head (max of the two, max over its query "
                         "heads)"}[by]
        drawn = (f", {st['split']} split, seed {st.get('seed', 0)}, passkey prompt {st.get('passkey_prompt', 'cue')}"
                 if "split" in st else "")
        method = (f"{by}: {what}; on {used} of {len(self.cases)} needle cases ({', '.join(tasks)} at "
                  f"{', '.join(map(str, lengths))} tokens{drawn}); {self.scored or self.model}")
        windows = self.windows
        if windows is not None and None in windows and any(w is not None for w in windows):
            n_global = sum(w is None for w in windows)
            method += (f"; over the {n_global} global layers' KV heads, the {len(windows) - n_global} sliding "
                       "layers keeping their window")
        return HeadPlan.from_scores(ranked.tolist(), fraction, sinks=int(st["sinks"]), window=int(st["window"]),
                                    model=self.model, shape=self.shape, method=method, windows=windows)

    def top(self, k: int = 10, *, kind: str = "kv") -> list[tuple[int, int, float]]:
        """The k heads with the highest score: (layer, head, score); ``kind`` "kv", "query" or "mass_outside"."""
        table = {"kv": self.kv, "query": self.query, "mass_outside": self.mass_outside}
        if kind not in table:
            raise MultiheadError(f"kind {kind!r} is unknown: choose from {', '.join(table)}")
        x = table[kind]
        order = np.argsort(-x.ravel(), kind="stable")[:k]
        return [(int(o // x.shape[1]), int(o % x.shape[1]), float(x.ravel()[o])) for o in order]

    def to_json(self) -> dict[str, Any]:
        def r(x: np.ndarray) -> list[list[float]]:
            return np.round(np.asarray(x, dtype=np.float64), 6).tolist()  # type: ignore[no-any-return]

        out: dict[str, Any] = {
            "model": self.model, "n_layers": int(self.query.shape[0]), "n_heads": int(self.query.shape[1]),
            "n_kv_heads": self.n_kv_heads, "settings": self.settings,
            **({} if self.shape is None else {"shape": dict(zip(("n_layers", "n_heads", "n_kv_heads", "head_dim"),
                                                                  self.shape, strict=True))}),
            **({"scored": self.scored} if self.scored else {}),
            **({} if self.windows is None else {"windows": list(self.windows)}),
            "cases": self.cases, "cases_used": sum(1 for c in self.cases if c["used"]),
            "query": r(self.query), "kv": r(self.kv), "kv_mean": r(self.kv_mean),
            "mass_outside": r(self.mass_outside), "mass_outside_kv": r(self.mass_outside_kv),
            "mass_outside_kv_mean": r(kv_aggregate(self.mass_outside, self.n_kv_heads, "mean")),
            "mass_rows": self.mass_rows,
            "top_kv": [{"layer": a, "kv_head": b, "score": round(c, 6)} for a, b, c in self.top(10)],
            "top_query": [{"layer": a, "head": b, "score": round(c, 6)} for a, b, c in self.top(10, kind="query")],
        }
        if self.razor:
            out["razor"] = {name: r(x) for name, x in self.razor.items()}
            out["razor_kv"] = {name: r(x) for name, x in self.razor_kv.items()}
        if self.ablation is not None:
            out["ablation"] = self.ablation
        return out


def needle_spans(case: Case) -> tuple[tuple[int, int], ...]:
    """The spans a case's answer copies from: every needle for multivalue (the answer lists them all), else the
    asked one (the first)."""
    if not case.needles:
        raise MultiheadError(f"case {case.id} has no needle spans (cases read back from JSON lines do not keep "
                             "them): build the cases with make_cases")
    return case.needles if case.task == "multivalue" else case.needles[:1]


def copyable_steps(case: Case) -> list[int]:
    """The answer steps whose token occurs in the case's needle span(s)."""
    tokens = {case.context_ids[p] for a, b in needle_spans(case) for p in range(a, b)}
    steps = [j for j, tok in enumerate(case.answer_ids) if tok in tokens]
    if not steps:
        raise MultiheadError(f"no answer token of case {case.id} (answer {case.answer!r}, ids "
                             f"{list(case.answer_ids)}) occurs in its needle span(s) {list(needle_spans(case))} of "
                             "the context: a retrieval score needs a needle to copy")
    return steps


def _prompt_groups(cases: Sequence[Case]) -> list[list[Case]]:
    by: dict[tuple[int, ...], list[Case]] = {}
    for c in cases:
        by.setdefault(c.context_ids, []).append(c)
    return list(by.values())


def retrieval_scores(model: Any, cases: Sequence[Case], settings: RetrievalSettings | None = None, *,
                     name: str = "", progress: bool = False) -> RetrievalScores:
    """Wu et al.'s retrieval score and the dropped-mass score of every head of ``model`` on ``cases``
    (:func:`multihead.evals.needles.make_cases`). ``model``: multihead's own causal model (``model(ids, cache=)``,
    caches from ``new_cache(b, max_len)``, as the Llama port), a transformers causal LM (its attention switched to
    multihead's by :func:`multihead.hf.enable`, cached in transformers' own DynamicCache) or an
    :class:`~multihead.heads.engines.Engine`: the same hook points and code for both. Each prompt is prefilled once
    through a full cache (the mass score is taken then, block by block), each of its questions answered from a
    copy. A layer's own mask (a sliding window) and softcap count: a query's top key is the top among the keys it
    may see, its weights are the layer's."""
    from tqdm import tqdm

    st = settings or RetrievalSettings()
    if not cases:
        raise MultiheadError("no cases: give at least one needle case (multihead.evals.needles.make_cases)")
    plans = {c.id: copyable_steps(c) for c in cases}
    engine = as_engine(model, name)
    layers = engine.sites()
    for group in _prompt_groups(cases):
        n = len(group[0].context_ids)
        if n < st.sinks + st.window + 1 and st.rows is None:
            raise MultiheadError(f"case {group[0].id} has {n} context tokens, too few for the mass outside "
                                 f"{st.sinks} sinks + a window of {st.window}: use a smaller window or longer cases")
    probe = _Probe(layers, st)
    probe.reset_mass()
    hits_sum: np.ndarray | None = None
    records: list[dict[str, Any]] = []
    used = 0
    groups = _prompt_groups(cases)
    with engine.reading(), probe.attached(), torch.no_grad():
        for group in tqdm(groups, desc="retrieval scores", unit="prompt", disable=not progress, leave=False):
            context = group[0].context_ids
            room = max(len(context) + len(c.question_ids) + len(c.answer_ids) for c in group)
            cache = engine.new_cache(1, room)
            probe.mode = "mass"
            prefill(engine, context, cache, st.chunk)
            for i, case in enumerate(group):
                mine = cache if i + 1 == len(group) else copy.deepcopy(cache)
                probe.mode = "top"
                probe.top = [[] for _ in layers]
                steps = answer_steps(engine, mine, case.question_ids, case.answer_ids)
                probe.mode = "off"
                result = score(case, steps)
                top = np.stack([torch.stack(t).numpy() for t in probe.top])  # (L, steps, b, h)
                assert top.shape[1] == len(case.answer_ids), "one top-1 per answer step"
                hits = np.zeros((len(layers), top.shape[-1]))
                spans = needle_spans(case)
                for j in plans[case.id]:
                    want = case.answer_ids[j]
                    at = top[:, j, 0]  # (L, h) top-1 key of the query predicting answer token j
                    inside = np.zeros_like(at, dtype=bool)
                    for a, b in spans:
                        inside |= (at >= a) & (at < b)
                    ctx = np.asarray(context)
                    holds = ctx[np.clip(at, 0, len(ctx) - 1)] == want
                    hits += inside & holds
                take = bool(result["correct"]) or not st.correct_only
                if take:
                    case_score = hits / len(plans[case.id])
                    hits_sum = case_score if hits_sum is None else hits_sum + case_score
                    used += 1
                records.append({"id": case.id, "task": case.task, "length": case.length, "depth": case.depth,
                                "correct": bool(result["correct"]), "copyable_steps": len(plans[case.id]),
                                "used": take})
    if probe.rows == 0:
        raise MultiheadError(f"no prefill row of the cases sits at a position of at least sinks + window "
                             f"({st.sinks} + {st.window}): the mass a streaming cache drops is not defined; use a "
                             "smaller window or more rows")
    if used == 0 or hits_sum is None:
        raise MultiheadError(f"the model answers none of the {len(cases)} cases exactly right, so no case is used "
                             "(correct_only): use easier cases or RetrievalSettings(correct_only=False)")
    mass = np.stack([m.numpy() for m in probe.mass]) / probe.rows  # (L, h)
    shape = engine.shape
    return RetrievalScores(model=engine.name, n_kv_heads=shape[2], query=hits_sum / used, mass_outside=mass,
                           cases=records, settings=dataclasses.asdict(st), mass_rows=probe.rows, shape=shape,
                           scored=engine.scored, windows=engine.windows)


# ---------------------------------------------------------------------------------------------------- RazorAttention
def razor_scores(model: Any, *, vocab: tuple[int, int], repeat_len: int = 24, seeds: int = 3,
                 seed: int = 0) -> dict[str, np.ndarray]:
    """RazorAttention's training-free scores per query head (L, h): ``echo`` (attention to the earlier copy of the
    current token: :func:`multihead.heads.scores.repeat_scores`' duplicate_token) and ``induction`` (to the token
    that followed it), on ``seeds`` sequences of ``repeat_len`` random token ids in [vocab[0], vocab[1]) repeated
    once. Aggregate per KV head with :meth:`RetrievalScores.razor_kv` or :func:`kv_aggregate`."""
    from multihead.heads.capture import capture_weights
    from multihead.heads.scores import repeat_scores

    _integer("repeat_len", repeat_len, 2)
    _integer("seeds", seeds, 1)
    low, high = vocab
    if not 0 <= low < high or high - low < repeat_len:
        raise MultiheadError(f"vocab range [{low}, {high}) must hold at least repeat_len ({repeat_len}) ids")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([low + torch.randperm(high - low, generator=gen)[:repeat_len] for _ in range(seeds)])
    engine = as_engine(model)
    weights = capture_weights([s.module for s in engine.sites()],
                              lambda: engine.forward(torch.cat([ids, ids], dim=1).to(engine.device)))
    found = repeat_scores(weights, repeat_len)
    return {"echo": found["duplicate_token"], "induction": found["induction"]}


def razor_from_head_scores(scores: Any) -> dict[str, np.ndarray]:
    """The razor scores (L, h) from a head analysis' :class:`~multihead.heads.scores.HeadScores`."""
    return {"echo": np.asarray(scores.scores["duplicate_token"]), "induction": np.asarray(scores.scores["induction"])}


# ---------------------------------------------------------------------------------------------------------- ablation
def _zeroed(layers: Sequence[Any], heads: Sequence[tuple[int, int]]) -> ExitStack:
    by: dict[int, list[int]] = {}
    for layer, head in heads:
        by.setdefault(layer, []).append(head)
    stack = ExitStack()
    for layer, hs in by.items():
        stack.enter_context(layers[layer].hook_z.add(zero_heads(sorted(hs))))
    return stack


def accuracy(model: Any, cases: Sequence[Case], *, chunk: int = 512,
             heads: Sequence[tuple[int, int]] = ()) -> float:
    """Exact-match accuracy on ``cases`` through a full cache, with the z of ``heads`` ((layer, query head)) zeroed
    (their output never reaches W_O)."""
    engine = as_engine(model)
    with _zeroed(attention_layers(engine), heads):
        results = [r for group in _prompt_groups(cases) for r in run_prompt(engine, FULL_CACHE, group, chunk)]
    return sum(bool(r["correct"]) for r in results) / len(results)


def ablation(model: Any, cases: Sequence[Case], ranking: np.ndarray, k: int, *, draws: int = 5, seed: int = 0,
             chunk: int = 512, progress: bool = False) -> dict[str, Any]:
    """Needle accuracy with the top-``k`` query heads of ``ranking`` (L, h; e.g. :attr:`RetrievalScores.query`)
    zeroed, against ``draws`` sets of k random heads drawn (seeded) from the other heads, and the unablated
    model. Returns the accuracies, their drops from the baseline and the heads each run zeroed."""
    from tqdm import tqdm

    ranking = np.asarray(ranking, dtype=np.float64)
    if ranking.ndim != 2:
        raise MultiheadError(f"ranking must be (layers, query heads), got shape {ranking.shape}")
    n_layers, n_heads = ranking.shape
    model = as_engine(model)
    if len(attention_layers(model)) != n_layers:
        raise MultiheadError(f"ranking has {n_layers} layers but the model has {len(attention_layers(model))}")
    total = n_layers * n_heads
    _integer("k", k, 1)
    _integer("draws", draws, 1)
    if k >= total:
        raise MultiheadError(f"k ({k}) must be smaller than the {total} heads, so random heads can be drawn from "
                             "the others")
    if not cases:
        raise MultiheadError("no cases to measure the ablation on")
    order = np.argsort(-ranking.ravel(), kind="stable")
    top = [(int(o // n_heads), int(o % n_heads)) for o in order[:k]]
    rest = [(int(o // n_heads), int(o % n_heads)) for o in order[k:]]
    rng = random.Random(seed)
    randoms = [sorted(rng.sample(rest, k)) for _ in range(draws)]
    runs = [("baseline", []), ("top", top)] + [(f"random {i}", r) for i, r in enumerate(randoms)]
    acc = {}
    for label, heads in tqdm(runs, desc="ablation", unit="run", disable=not progress, leave=False):
        acc[label] = accuracy(model, cases, chunk=chunk, heads=heads)
    base = acc["baseline"]
    random_acc = [acc[f"random {i}"] for i in range(draws)]
    return {"k": k, "draws": draws, "seed": seed, "cases": len(cases), "baseline": base, "top_k": acc["top"],
            "top_k_drop": base - acc["top"], "random": random_acc,
            "random_drop_mean": base - float(np.mean(random_acc)), "random_drop_max": base - min(random_acc),
            "top_heads": [list(h) for h in top], "random_heads": [[list(h) for h in r] for r in randoms]}


# ---------------------------------------------------------------------------------------------------------- real models
def long_cases(tokenizer: Any, max_context: int, *, lengths: Sequence[int] = (2048,),
               tasks: Sequence[str] = ("passkey", "single-number"), prompts: int = 2, seed: int = 0,
               text_path: str | None = None, split: str = "test", passkey_prompt: str = "cue") -> list[Case]:
    """Needle cases of :mod:`multihead.evals.needles` (its generator and seeds, both haystacks taking turns) for the
    retrieval scores: with ``split`` "test" and seed 0 the same cases the long-context trade-off
    (:mod:`multihead.tradeoff.longctx`) measures at these lengths and tasks; "train" (with another seed) cases
    disjoint from them, to choose a plan on. ``passkey_prompt``: the passkey task's wording."""
    from multihead.evals.needles import CaseSettings, make_cases
    from multihead.evals.text import read_text, token_splits

    if split not in ("test", "train"):
        raise MultiheadError(f"split {split!r}: the cases come from the text's test or train split")
    settings = CaseSettings(lengths=tuple(lengths), tasks=tuple(tasks), prompts=prompts, seed=seed,
                            passkey_prompt=passkey_prompt)
    jargon = getattr(token_splits(tokenizer.encode(read_text(text_path)), least=2), split)
    return make_cases(settings, tokenizer, jargon, max_context=max_context)


def analyse_retrieval(model: Any, tokenizer: Any, *, lengths: Sequence[int] = (2048,),
                      tasks: Sequence[str] = ("passkey", "single-number"), prompts: int = 2, seed: int = 0,
                      settings: RetrievalSettings | None = None, text_path: str | None = None,
                      razor: dict[str, np.ndarray] | None = None, ablate_top: int = 0, draws: int = 5,
                      name: str = "", progress: bool = True, split: str = "test",
                      passkey_prompt: str = "cue") -> RetrievalScores:
    """The retrieval scores of a causal model (ours, e.g. SmolLM2 from :func:`multihead.models.load_llama`, or a
    transformers one: :func:`retrieval_scores`) on :func:`long_cases` made with ``tokenizer`` (ours or a
    transformers tokenizer), with ``razor`` scores attached (default: :func:`razor_scores` on random tokens) and,
    when ``ablate_top`` is k > 0, the top-k against random-k ablation (:func:`ablation`) on the same cases."""
    st = settings or RetrievalSettings()
    engine = as_engine(model, name)
    tokenizer = as_tokenizer(tokenizer)
    cases = long_cases(tokenizer, engine.max_context, lengths=lengths, tasks=tasks, prompts=prompts,
                       seed=seed, text_path=text_path, split=split, passkey_prompt=passkey_prompt)
    scores = retrieval_scores(engine, cases, st, progress=progress)
    if razor is None:
        low = max(17, max(getattr(tokenizer, "stop_ids", set()) | {0}) + 1)
        razor = razor_scores(engine, vocab=(low, engine.vocab_size))
    scores.razor = dict(razor)
    scores.settings.update(lengths=list(lengths), tasks=list(tasks), prompts=prompts, seed=seed, split=split,
                           passkey_prompt=passkey_prompt)
    if ablate_top:
        scores.ablation = ablation(engine, cases, scores.query, ablate_top, draws=draws, seed=seed,
                                   chunk=st.chunk, progress=progress)
    return scores


# ---------------------------------------------------------------------------------------------------------- picture
def write_png(scores: RetrievalScores, path: Any) -> str:
    """Layer x head heatmaps: the retrieval score per query head and per KV head, the dropped mass per query head,
    and the razor score per KV head when present."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from multihead.files import save_figure

    panels = [("retrieval score, query heads", scores.query), ("retrieval score, KV heads (max)", scores.kv),
              (f"mass outside {scores.settings['sinks']} sinks + window {scores.settings['window']}",
               scores.mass_outside)]
    if scores.razor:
        panels.append(("razor (max of echo, induction), KV heads", scores.razor_kv["razor"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 1, 0.18 * scores.query.shape[0] + 2.5),
                             dpi=90, squeeze=False)
    for ax, (title, x) in zip(axes[0], panels, strict=True):
        im = ax.imshow(x, cmap="viridis", vmin=0, vmax=max(1e-9, float(np.max(x))), aspect="auto",
                       interpolation="nearest")
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax, shrink=0.8)
    used = sum(1 for c in scores.cases if c["used"])
    fig.suptitle(f"{scores.model}: {used} of {len(scores.cases)} cases used", fontsize=9)
    fig.tight_layout()
    out = save_figure(fig, path)
    plt.close(fig)
    return str(out)


__all__ = [
    "RetrievalScores",
    "RetrievalSettings",
    "ablation",
    "accuracy",
    "analyse_retrieval",
    "attention_layers",
    "copyable_steps",
    "kv_aggregate",
    "long_cases",
    "mass_outside_block",
    "needle_spans",
    "razor_from_head_scores",
    "razor_scores",
    "retrieval_scores",
    "write_png",
]
