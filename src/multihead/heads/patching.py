"""Causal evidence for what a head does: activation patching, attribution patching and head importance, all through
the hook points (so they serve our ports and any transformers model on multihead's attention alike).

``forward(ids) -> logits (b, s, vocab)`` runs the model; ``layers`` are its attention layers (anything with the six
hook points); a metric maps logits to one value per sequence (b,).

- :func:`activation_patching` (Meng et al. 2022; Wang et al. 2022): run the clean and the corrupted prompt, then
  re-run the corrupted one with one head's activation at ``point`` (z by default; q, k, v, pattern as options)
  copied from the clean run, and report the recovered fraction
  ``(m(patched) - m(corrupted)) / (m(clean) - m(corrupted))``: 1 means that head alone restores the clean behaviour.
  Many heads are patched in one forward: the corrupted batch is repeated, one copy per head. On ``hook_k`` and
  ``hook_v`` the unit is a KV head, shared by n_heads / n_kv_heads query heads.
- :func:`attribution_patching` (Nanda 2023; Syed et al. 2023): the same effects to first order from one forward and
  one backward on the corrupted prompt: ``sum(grad_m(act_corrupted) * (act_clean - act_corrupted))`` per head, in
  the same recovered-fraction units.
- :func:`head_importance` (Michel et al. 2019): ``I_h = E_x |dL/d xi_h|`` for a gate xi_h = 1 on each head's output
  z (so dL/d xi_h = sum over positions and width of z_h * dL/dz_h), from one forward and one backward, normalised
  per layer by the L2 norm over its heads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from multihead.errors import MultiheadError
from multihead.layers.hooks import HookedAttention, HookHandle, HookPoint

Forward = Callable[[Tensor], Tensor]  # ids (b, s) -> logits (b, s, vocab)
Metric = Callable[[Tensor], Tensor]  # logits (b, s, vocab) -> one value per sequence (b,)
POINTS = ("hook_z", "hook_q", "hook_k", "hook_v", "hook_pattern")


def logit_difference(answers: int | Sequence[int] | Tensor, wrongs: int | Sequence[int] | Tensor,
                     position: int = -1) -> Metric:
    """logit[answer] - logit[wrong] at ``position`` (default the last), per sequence: the usual patching metric.

    One answer and one wrong token for every row, or one per pair (``answers`` and ``wrongs`` of length b, for a
    batch of b prompt pairs): patching repeats the batch (k copies of b rows, one copy per patched head), and row r
    of the logits belongs to pair r % b, as this metric knows (the logits' rows must be a multiple of b)."""
    if isinstance(answers, int) and isinstance(wrongs, int):
        answer, wrong = answers, wrongs

        def metric(logits: Tensor) -> Tensor:
            return logits[:, position, answer].float() - logits[:, position, wrong].float()
        return metric
    right, other = (torch.as_tensor(t).reshape(-1) for t in (answers, wrongs))
    if right.is_floating_point() or other.is_floating_point() or right.numel() != other.numel() or not right.numel():
        raise MultiheadError(f"answers ({right.numel()}) and wrongs ({other.numel()}) must be token ids, as many of "
                             "each: one per prompt pair")
    right, other = right.long(), other.long()
    n = right.numel()

    def per_pair(logits: Tensor) -> Tensor:
        rows = logits.shape[0]
        if rows % n:
            raise MultiheadError(f"the metric has answers for {n} pairs but the logits have {rows} rows: row r "
                                 f"belongs to pair r % {n}, so the rows must be a multiple of {n}")
        pair = torch.arange(rows, device=logits.device) % n
        last = logits[:, position].float()
        a, w = right.to(logits.device)[pair], other.to(logits.device)[pair]
        return last.gather(1, a[:, None])[:, 0] - last.gather(1, w[:, None])[:, 0]
    return per_pair


def next_token_loss(ids: Tensor, valid: Tensor | None = None) -> Metric:
    """Mean next-token cross-entropy of each sequence of ``ids`` over its real tokens (``valid`` (b, s) bool, or
    all), per sequence (b,)."""

    def metric(logits: Tensor) -> Tensor:
        target = ids[:, 1:].to(logits.device)
        per_token = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), target,
                                                      reduction="none")  # (b, s-1)
        keep = torch.ones_like(per_token, dtype=torch.bool) if valid is None else valid[:, 1:].to(per_token.device)
        return (per_token * keep).sum(-1) / keep.sum(-1).clamp(min=1)
    return metric


@dataclass
class Patching:
    """Effects per (layer, head) at one hook point; ``per_position`` adds the query position as a last axis.

    ``effects`` pools the batch: (mean patched - mean corrupted) / (mean clean - mean corrupted). ``per_pair`` keeps
    each row's own recovered fraction (TransformerLens's ``reduce="none"``), the row as a last axis:
    (patched_r - corrupted_r) / (clean_r - corrupted_r), NaN for a row whose clean and corrupted metrics are equal;
    ``clean_per_pair`` and ``corrupted_per_pair`` (b,) are the rows' metrics. All are float64 CPU tensors, as the
    other head tools return torch."""

    point: str
    clean: float  # the metric on the clean prompt (mean over the batch)
    corrupted: float
    effects: Tensor  # (n_layers, heads) recovered fraction, or (n_layers, heads, s) per position
    per_pair: Tensor | None = None  # (n_layers, heads, b) or (n_layers, heads, s, b)
    clean_per_pair: Tensor | None = None  # (b,)
    corrupted_per_pair: Tensor | None = None  # (b,)

    def top(self, n: int = 10) -> list[tuple[int, int, float]]:
        """The n heads with the largest |effect| (summed over positions if per position): (layer, head, effect)."""
        return _top(self.effects if self.effects.ndim == 2 else self.effects.sum(-1), n)


def _top(effects: np.ndarray | Tensor, n: int) -> list[tuple[int, int, float]]:
    """The n (layer, head, effect) of largest |effect| in a (n_layers, heads) array."""
    effects = np.asarray(effects)
    order = np.argsort(-np.abs(effects), axis=None)[:n]
    return [(int(o // effects.shape[1]), int(o % effects.shape[1]), float(effects.flat[o])) for o in order]


def _check(clean: Tensor, corrupted: Tensor, point: str, layers: Sequence[HookedAttention]) -> None:
    if point not in POINTS:
        raise MultiheadError(f"point {point!r} cannot be patched per head: choose one of {', '.join(POINTS)}")
    if not layers:
        raise MultiheadError("no attention layers to patch")
    if not isinstance(clean, Tensor) or not isinstance(corrupted, Tensor):
        raise MultiheadError(f"clean and corrupted must be token id tensors (b, s), got {type(clean).__name__} and "
                             f"{type(corrupted).__name__}")
    if clean.shape != corrupted.shape:
        raise MultiheadError(f"the clean ids {tuple(clean.shape)} and the corrupted ids {tuple(corrupted.shape)} "
                             "must have the same shape (equal token lengths): patching copies position by position")


def _as_logits(out: Any) -> Tensor:
    """A model's output as logits: a tensor, or the ``logits`` of a transformers output."""
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    raise MultiheadError(f"the forward returned a {type(out).__name__}, not logits (b, s, vocab) or an output with "
                         ".logits")


def find_layers(model: Any) -> tuple[Forward, list[HookedAttention]]:
    """The forward (ids -> logits) and the attention layers (with hook points) of a supported model: our ports
    (:class:`~multihead.models.llama.LlamaModel`), a head-analysis adapter (``load_head_model``), a
    :class:`~multihead.models.decoder.Decoder` of either engine, a transformers model after
    :func:`multihead.hf.enable`, or any module whose attention layers carry the six hook points."""
    from torch import nn

    from multihead.heads.adapters import HeadModel
    from multihead.models.decoder import Decoder
    from multihead.models.llama import LlamaModel

    if isinstance(model, HeadModel):
        return model.logits, list(model.layers())
    if isinstance(model, Decoder):
        return model, list(model.attention_layers())
    if isinstance(model, LlamaModel):
        return model, [block.attn for block in model.layers]  # type: ignore[misc]
    if not isinstance(model, nn.Module):
        raise MultiheadError(f"cannot find the attention layers of a {type(model).__name__}: pass a model (our "
                             "port, a transformers model after hf.enable) or forward and layers")
    layers: list[Any] = [m for m in model.modules()
                         if all(isinstance(getattr(m, p, None), HookPoint) for p in (*POINTS, "hook_out"))]
    if not layers:
        hint = (" (call multihead.hf.enable(model) first)" if hasattr(model, "_can_set_attn_implementation")
                else "")
        raise MultiheadError(f"{type(model).__name__} has no attention layers with hook points{hint}")
    transformers = hasattr(model, "_can_set_attn_implementation")

    def forward(ids: Tensor) -> Tensor:
        return _as_logits(model(ids, use_cache=False) if transformers else model(ids))
    return forward, layers


def _arguments(forward: Any, layers: Any, clean: Any, corrupted: Any, metric: Any
               ) -> tuple[Forward, list[HookedAttention], Tensor, Tensor, Metric]:
    """(forward, layers, clean, corrupted, metric), or (model, clean, corrupted, metric) with the layers found."""
    if isinstance(layers, Tensor):  # called as (model, clean, corrupted, metric)
        if metric is not None:
            raise MultiheadError("give (model, clean, corrupted, metric) or (forward, layers, clean, corrupted, "
                                 "metric), not both")
        layers, clean, corrupted, metric = None, layers, clean, corrupted
    if clean is None or corrupted is None or metric is None:
        raise MultiheadError("give the clean ids, the corrupted ids and a metric (e.g. logit_difference(answers, "
                             "wrongs))")
    if layers is None:
        forward, found = find_layers(forward)
        return forward, found, clean, corrupted, metric
    model = forward

    def run(ids: Tensor) -> Tensor:
        return _as_logits(model(ids))
    return run, list(layers), clean, corrupted, metric


def _not_fired(layers: Sequence[HookedAttention], point: str, fired: int) -> MultiheadError:
    names = [getattr(layer, point).name or f"layer {i}" for i, layer in enumerate(layers)]
    return MultiheadError(f"{point} was hooked on {len(layers)} attention layer(s) but fired {fired} time(s) in one "
                          f"forward ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}): the model's attention "
                          "does not run through multihead (for a transformers model, attn_implementation was switched "
                          "away from 'multihead': call multihead.hf.enable(model) again), or the layers are not the "
                          "forward's")


def _record(layers: Sequence[HookedAttention], point: str, forward: Forward, ids: Tensor, *,
            keep_graph: bool = False) -> tuple[Tensor, list[Tensor]]:
    """logits and each layer's activation at ``point`` for one run."""
    seen: list[Tensor] = []

    def keep(x: Tensor, _p: HookPoint) -> None:
        seen.append(x if keep_graph else x.detach())

    handles = [getattr(layer, point).add(keep) for layer in layers]
    try:
        logits = forward(ids)
    finally:
        for h in handles:
            h.remove()
    if len(seen) != len(layers):
        raise _not_fired(layers, point, len(seen))
    return logits, seen


def recovered_fraction(delta: Tensor, span: Tensor) -> np.ndarray:
    """delta / span per row (delta = patched - corrupted, span = clean - corrupted), NaN where a row's span is 0."""
    out = delta.double() / span.double()
    return torch.where(span == 0, torch.full_like(out, float("nan")), out).cpu().numpy()


def activation_patching(forward: Forward | Any, layers: Sequence[HookedAttention] | Tensor | None = None,
                        clean: Tensor | None = None, corrupted: Tensor | Metric | None = None,
                        metric: Metric | None = None, *, point: str = "hook_z", per_position: bool = False,
                        chunk: int = 16) -> Patching:
    """Patch each head's activation at ``point`` from the clean run into the corrupted one (see the module).

    Called as ``(forward, layers, clean, corrupted, metric)``, or as ``(model, clean, corrupted, metric)`` with the
    forward and the layers found from the model (:func:`find_layers`: our ports, transformers models after
    ``hf.enable``)."""
    forward, layers, clean, corrupted, metric = _arguments(forward, layers, clean, corrupted, metric)
    _check(clean, corrupted, point, layers)
    if chunk < 1:
        raise MultiheadError(f"chunk ({chunk}) must be a positive int")
    b, s = corrupted.shape
    with torch.no_grad():
        clean_logits, clean_acts = _record(layers, point, forward, clean)
        clean_rows = metric(clean_logits).detach()
        corrupt_rows = metric(forward(corrupted)).detach()
        m_clean, m_corrupt = float(clean_rows.mean()), float(corrupt_rows.mean())
        span = m_clean - m_corrupt
        if span == 0:
            raise MultiheadError(f"the metric is {m_clean:.6g} on both prompts: nothing to recover by patching")
        n_heads = clean_acts[0].shape[1]
        units = [(h, p) for h in range(n_heads) for p in (range(s) if per_position else [None])]
        effects = np.zeros((len(layers), n_heads, s) if per_position else (len(layers), n_heads))
        per_pair = np.zeros((*effects.shape, b))
        for li, layer in enumerate(layers):
            source = clean_acts[li]
            for start in range(0, len(units), chunk):
                group = units[start:start + chunk]
                k = len(group)
                heads = torch.tensor([h for h, _ in group])
                positions = [p for _, p in group]

                fired: list[bool] = []

                def patch(x: Tensor, _p: HookPoint, heads: Tensor = heads, positions: list[int | None] = positions,
                          k: int = k, source: Tensor = source, fired: list[bool] = fired) -> Tensor:
                    fired.append(True)
                    out = x.clone().view(k, b, *x.shape[1:])  # (k, b, H, s, .): copy j patches head heads[j]
                    src = source.to(x.dtype)
                    if positions[0] is None:
                        out[torch.arange(k), :, heads] = src[:, heads].transpose(0, 1)
                    else:
                        for j, (h, p) in enumerate(zip(heads.tolist(), positions, strict=True)):
                            out[j, :, h, p] = src[:, h, p]
                    return out.view(x.shape)

                handle: HookHandle = getattr(layer, point).add(patch)
                try:
                    rows = metric(forward(corrupted.repeat(k, 1))).view(k, b)
                finally:
                    handle.remove()
                if not fired:
                    raise _not_fired([layer], point, 0)
                fractions = recovered_fraction(rows.double() - corrupt_rows.double(),
                                               clean_rows - corrupt_rows)  # (k, b)
                for j, ((h, p), value) in enumerate(zip(group, rows.mean(1).tolist(), strict=True)):
                    recovered = (value - m_corrupt) / span
                    if p is None:
                        effects[li, h], per_pair[li, h] = recovered, fractions[j]
                    else:
                        effects[li, h, p], per_pair[li, h, p] = recovered, fractions[j]
    return Patching(point, m_clean, m_corrupt, torch.from_numpy(effects), torch.from_numpy(per_pair),
                    clean_rows.double().cpu(), corrupt_rows.double().cpu())


def attribution_patching(forward: Forward | Any, layers: Sequence[HookedAttention] | Tensor | None = None,
                         clean: Tensor | None = None, corrupted: Tensor | Metric | None = None,
                         metric: Metric | None = None, *, point: str = "hook_z") -> Patching:
    """First-order estimate of :func:`activation_patching` for every head at once (one forward and one backward on
    the corrupted prompt, one forward on the clean one). Called as activation_patching is."""
    forward, layers, clean, corrupted, metric = _arguments(forward, layers, clean, corrupted, metric)
    _check(clean, corrupted, point, layers)
    with torch.no_grad():
        clean_logits, clean_acts = _record(layers, point, forward, clean)
        clean_rows = metric(clean_logits).detach()
        m_clean = float(clean_rows.mean())
    with torch.enable_grad():
        logits, acts = _record(layers, point, forward, corrupted, keep_graph=True)
        if not all(a.requires_grad for a in acts):
            raise MultiheadError("attribution patching needs gradients through the activations: the model's "
                                 "parameters must require grad (they do unless frozen)")
        values = metric(logits)
        grads = torch.autograd.grad(values.sum(), acts)
    m_corrupt = float(values.detach().mean())
    span = m_clean - m_corrupt
    if span == 0:
        raise MultiheadError(f"the metric is {m_clean:.6g} on both prompts: nothing to recover by patching")
    b = corrupted.shape[0]
    rows = torch.stack([(g * (c.to(g.dtype) - a.detach())).flatten(2).sum(-1)
                        for g, c, a in zip(grads, clean_acts, acts, strict=True)])  # (n_layers, b, heads)
    effects = (rows.sum(1) / b / span).double().cpu()  # (n_layers, heads)
    corrupt_rows = values.detach()
    per_pair = recovered_fraction(rows.transpose(1, 2), clean_rows - corrupt_rows)  # (n_layers, heads, b)
    return Patching(point, m_clean, m_corrupt, effects, torch.from_numpy(per_pair), clean_rows.double().cpu(),
                    corrupt_rows.double().cpu())


def head_importance(forward: Forward, layers: Sequence[HookedAttention], ids: Tensor, *,
                    loss: Metric | None = None, valid: Tensor | None = None, normalise: bool = True) -> np.ndarray:
    """Michel et al.'s head importance from one forward and one backward: (n_layers, n_heads), each layer scaled to
    unit L2 norm over its heads unless ``normalise=False``. The loss defaults to the next-token cross-entropy over
    ``valid`` tokens."""
    chosen = loss if loss is not None else next_token_loss(ids, valid)
    with torch.enable_grad():
        logits, z = _record(layers, "hook_z", forward, ids, keep_graph=True)
        if not all(a.requires_grad for a in z):
            raise MultiheadError("head importance needs gradients through the heads' outputs: the model's "
                                 "parameters must require grad (they do unless frozen)")
        grads = torch.autograd.grad(chosen(logits).sum(), z)
    rows = []
    for g, a in zip(grads, z, strict=True):  # each (b, h, s, d)
        gate = (g * a.detach()).flatten(2).sum(-1)  # dL/d xi_h per example: (b, h)
        rows.append(gate.abs().mean(0).double().cpu().numpy())  # E_x |dL/d xi_h|
    importance = np.stack(rows)  # (n_layers, n_heads)
    if normalise:
        norms = np.linalg.norm(importance, axis=1, keepdims=True)
        importance = importance / np.where(norms > 0, norms, 1.0)
    return importance


# ---------------------------------------------------------------------------------------------- prompt pairs
@dataclass(frozen=True)
class PromptPair:
    clean: str
    corrupt: str
    answer: str  # the clean prompt's right next token (text, one token)
    wrong: str  # the corrupted prompt's (the clean prompt's wrong answer)


def shipped_pairs() -> list[PromptPair]:
    """The indirect-object sentences shipped with multihead (written for it; see data/prompt_pairs.json)."""
    import json
    from importlib import resources

    data = json.loads(resources.files("multihead").joinpath("data/prompt_pairs.json").read_text(encoding="utf-8"))
    return [PromptPair(**p) for p in data["pairs"]]


@dataclass
class PairsResult:
    """Per-head effects over several prompt pairs, each pooled as sum(patched - corrupted) / sum(clean - corrupted)."""

    point: str
    pairs: int
    clean: float  # mean logit difference on the clean prompts
    corrupted: float
    patching: np.ndarray | None  # (n_layers, heads) recovered fraction, activation patching
    attribution: np.ndarray | None  # the same by attribution patching
    seconds: dict[str, float]
    # each pair's own figures (TransformerLens's reduce="none"): (n_pairs, n_layers, heads) recovered fractions, and
    # the pairs' clean and corrupted logit differences (n_pairs,)
    per_pair_patching: np.ndarray | None = None
    per_pair_attribution: np.ndarray | None = None
    clean_per_pair: np.ndarray | None = None
    corrupted_per_pair: np.ndarray | None = None

    def top(self, n: int = 10, which: str = "patching") -> list[tuple[int, int, float]]:
        e = self.patching if which == "patching" else self.attribution
        assert e is not None
        return _top(e, n)

    def correlation(self) -> float | None:
        """Pearson correlation of attribution with activation patching over all heads."""
        if self.patching is None or self.attribution is None:
            return None
        return float(np.corrcoef(self.patching.ravel(), self.attribution.ravel())[0, 1])


def patch_pairs(forward: Forward, layers: Sequence[HookedAttention], encode: Callable[[str], list[int]],
                pairs: Sequence[PromptPair], *, point: str = "hook_z", patching: bool = True,
                attribution: bool = True, chunk: int = 16, progress: bool = False,
                prompt: Callable[[str], list[int]] | None = None) -> PairsResult:
    """Activation and/or attribution patching of every head over prompt pairs (each run on its own, pooled);
    ``progress``: a bar on stderr, one step per pair. ``encode`` tokenizes the answers (no special tokens);
    ``prompt`` the prompts as the model reads them (a head model's ``prompt_ids``: its tokenizer's BOS first), by
    default ``encode``."""
    import time

    from multihead.heads.progress import progress_bar

    if not pairs:
        raise MultiheadError("no prompt pairs given")
    if not (patching or attribution):
        raise MultiheadError("patch_pairs with patching=False and attribution=False has nothing to compute")
    sums: dict[str, np.ndarray] = {}
    spans: dict[str, float] = {}  # each analysis's sum of clean - corrupted, over its own forwards
    each: dict[str, list[np.ndarray]] = {}
    cleans: list[float] = []
    corrupts: list[float] = []
    clean_total = corrupt_total = 0.0
    seconds = {"patching": 0.0, "attribution": 0.0}
    what = " and ".join(name for name, on in (("patching", patching), ("attribution", attribution)) if on)
    for i, pair in enumerate(progress_bar(pairs, desc=f"{what} over {len(pairs)} prompt pair(s)", unit="pair",
                                          progress=progress)):
        clean, corrupt = (prompt or encode)(pair.clean), (prompt or encode)(pair.corrupt)
        answer, wrong = encode(pair.answer), encode(pair.wrong)
        if len(clean) != len(corrupt):
            raise MultiheadError(f"pair {i}: the clean prompt has {len(clean)} tokens and the corrupted one "
                                 f"{len(corrupt)}: patching needs equal lengths")
        if len(answer) != 1 or len(wrong) != 1:
            raise MultiheadError(f"pair {i}: the answers {pair.answer!r} and {pair.wrong!r} must be one token each "
                                 f"(they are {len(answer)} and {len(wrong)})")
        metric = logit_difference(answer[0], wrong[0])
        c, k = torch.tensor([clean]), torch.tensor([corrupt])
        seen: list[Any] = []  # the analyses' results of this pair, in order
        for name, enabled in (("patching", patching), ("attribution", attribution)):
            if not enabled:
                continue
            start = time.perf_counter()
            if name == "patching":
                result = activation_patching(forward, layers, c, k, metric, point=point, chunk=chunk)
            else:
                result = attribution_patching(forward, layers, c, k, metric, point=point)
            seconds[name] += time.perf_counter() - start
            span = result.clean - result.corrupted
            effects = result.effects.numpy()
            sums[name] = sums.get(name, 0.0) + effects * span  # patched - corrupted, per head
            spans[name] = spans.get(name, 0.0) + span
            each.setdefault(name, []).append(effects)
            seen.append(result)
        # the pair's logit differences as the first analysis measured them (patching's forward without autograd and
        # attribution's with it may run other product kinds: the same sums to float32's rounding, not the same bits)
        clean_total += seen[0].clean
        corrupt_total += seen[0].corrupted
        cleans.append(seen[0].clean)
        corrupts.append(seen[0].corrupted)
    return PairsResult(point, len(pairs), clean_total / len(pairs), corrupt_total / len(pairs),
                       sums["patching"] / spans["patching"] if patching else None,
                       sums["attribution"] / spans["attribution"] if attribution else None, seconds,
                       np.stack(each["patching"]) if patching else None,
                       np.stack(each["attribution"]) if attribution else None, np.array(cleans), np.array(corrupts))
