"""DuoAttention-style choice of the head-wise plan: one gate per KV head, optimised on synthetic passkeys.

DuoAttention (Xiao et al. 2024) keeps the weights frozen and gives every KV head a gate ``alpha`` in [0, 1] that mixes
its full attention with its streaming attention (attention sinks + a recent window, the mask of
:func:`multihead.cache.sink_keep`)::

    z_head = alpha * z_full + (1 - alpha) * z_stream          (for each query head of the KV head)

The gates learn, on synthetic retrieval prompts, to keep the model's final hidden states where the answer is asked
and given while an L1 term pushes them to zero::

    loss = mean over the question and answer positions of (h_gated - h_full)^2  +  l1 * mean(alpha)

A KV head whose gate stays high is a retrieval head (it keeps every key); the rest can stream. The gates (n_layers,
n_kv_heads) become a plan through a threshold or a top fraction (``HeadPlan.from_scores(gates, fraction)``).

Here the gated forward is made of hook points (:mod:`multihead.layers.hooks`): each attention layer's ``hook_q``,
``hook_k`` and ``hook_v`` are read, and ``hook_z`` is replaced by the mixture, whose streaming part runs through the
project's attention core (:func:`multihead.kernels.attend`, SDPA's CPU flash kernel with the streaming mask: no
(b, h, s, t) score matrix is kept for the backward, only the (s, s) mask). The layer's own path is unchanged. The
same hooks serve multihead's own models and any transformers decoder whose attention runs on multihead
(:func:`multihead.hf.enable`, :mod:`multihead.heads.engines`): there the streaming part keeps the layer's scale and
softcap and stays inside its own mask (a sliding-window layer streams within its window), and
:func:`plan_from_gates` makes the plan with the shape read from the model's config.
A step is the full model's forward, the gated forward and its backward; its time and memory on SmolLM2-135M are
recorded with their hosts and dates in benchmarks/RESULTS.md ("DuoAttention gate training: a step's time").

Training data: passkey and single-number prompts from the long-context generator
(:func:`multihead.evals.needles.make_prompt_cases`) built on the *training* split of the text, with seeds of their
own (prompt indices from :data:`TRAIN_INDEX` on, where the evaluation uses 0, 1, ...): the evaluation's cases are
never trained on. As in DuoAttention the loss covers the question and the answer (its labels are the question and
answer tokens): the question's last position is the one that predicts the answer's first token. The answer is
teacher-forced (its tokens are part of the input).

One sample per step, fixed by (seed, step), so a run stopped and rerun on its checkpoint folder (``state.json`` and
``duo.safetensors``: gates, AdamW's moments, history) ends with the gates an uninterrupted run gives. The gates are
also written as ``gates.json`` (``{"gates": [[...]], "settings": {...}}``) at every checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.cache.sink import sink_keep
from multihead.cache.view import DenseKV
from multihead.errors import MultiheadError
from multihead.evals.needles import HAYSTACKS, Haystacks, Tokenizer, case_seed, check_length, make_prompt_cases
from multihead.heads.engines import Site, as_engine
from multihead.kernels import AttentionCall, attend
from multihead.layers.hooks import HookFn, HookHandle, HookPoint
from multihead.layers.masks import build_mask
from multihead.models.decoder import as_tokenizer

if TYPE_CHECKING:
    from multihead.cache import HeadPlan

TRAIN_TASKS = ("passkey", "single-number", "single-word")  # the one-needle tasks of the generator
TRAIN_INDEX = 1_000_000  # training prompts are indices TRAIN_INDEX + step: the evaluation uses 0 .. prompts - 1


# ---------------------------------------------------------------------------------------------------------- settings
def _integer(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise MultiheadError(f"gate optimisation {name} ({value!r}) must be an integer of at least {least}")


def _number(name: str, value: object, low: float, high: float, *, open_low: bool = False) -> float:
    x = float(value) if not isinstance(value, bool) and isinstance(value, int | float) else math.nan
    if not (math.isfinite(x) and (x > low if open_low else x >= low) and x <= high):
        side = "(" if open_low else "["
        raise MultiheadError(f"gate optimisation {name} ({value!r}) must be a finite number in {side}{low}, {high}]")
    return x


@dataclass(frozen=True)
class DuoSettings:
    """What one gate optimisation does. ``sinks`` and ``window`` are the streaming heads' mask (a query at p sees
    keys j <= p with j > p - window or j < sinks, :func:`~multihead.cache.sink_keep`): use the cache's own. ``lr``
    is AdamW's (DuoAttention: 0.02 over 2,000 steps; a few dozen steps need more), after ``warmup`` linear steps;
    ``init`` the gates' first value (1: every head full, as DuoAttention starts). A checkpoint every ``every`` steps
    and at the end. Prompts of ``length`` tokens, the ``tasks`` and ``haystacks`` taking turns step by step.

    ``average_from``: from this step on, the gates after every step are also averaged, and the average is what
    :func:`optimise_gates` returns (0: the last step's gates). One sample a step at a constant learning rate leaves
    the gates wandering around where they settle: on SmolLM2 (1,024 tokens, lr 0.05) the 25% plan of each
    checkpoint from step 38 to 398 shared only 15-20 of its 22 full heads with step 400's, while the mean gates of
    steps 202-300 and 302-400 made plans sharing 21 of 22 (``benchmarks/duo_settling.py``). Averaging does not
    change the steps, so a checkpoint resumes under another ``average_from`` as long as no step it needs to
    average has passed."""

    steps: int = 40
    lr: float = 0.05
    l1: float = 0.05
    length: int = 1024
    sinks: int = 4
    window: int = 256
    seed: int = 0
    tasks: tuple[str, ...] = ("passkey", "single-number")
    haystacks: tuple[str, ...] = ("jargon", "filler")
    warmup: int = 2
    init: float = 1.0
    every: int = 5
    average_from: int = 0

    def __post_init__(self) -> None:
        _integer("steps", self.steps, 1)
        _integer("average_from", self.average_from, 0)
        if self.average_from >= self.steps:
            raise MultiheadError(f"average_from ({self.average_from}) must be below the {self.steps} steps: the "
                                 "gates are averaged over the steps after it (0: no average)")
        _integer("every", self.every, 1)
        _integer("warmup", self.warmup, 0)
        _integer("seed", self.seed, 0)
        _integer("length", self.length, 1)
        _integer("sinks", self.sinks, 0)
        _integer("window", self.window, 1)
        _number("lr", self.lr, 0.0, 1.0, open_low=True)
        _number("l1", self.l1, 0.0, 100.0)
        _number("init", self.init, 0.0, 1.0)
        if self.window < self.sinks:
            raise MultiheadError(f"window ({self.window}) must not be shorter than the {self.sinks} sinks: the sinks "
                                 "are a few first tokens kept beside a longer window (use a larger window or fewer "
                                 "sinks)")
        if self.window >= self.length:
            raise MultiheadError(f"window ({self.window}) covers the whole prompt of {self.length} tokens: streaming "
                                 "attention would equal full attention and the gates learn nothing; use a window "
                                 "shorter than the length")
        if not self.tasks or any(t not in TRAIN_TASKS for t in self.tasks):
            raise MultiheadError(f"gate optimisation tasks {self.tasks!r}: choose from {', '.join(TRAIN_TASKS)} "
                                 "(one needle, one answer)")
        if not self.haystacks or any(h not in HAYSTACKS for h in self.haystacks):
            raise MultiheadError(f"gate optimisation haystacks {self.haystacks!r}: choose from "
                                 f"{', '.join(HAYSTACKS)}")

    def stamp(self) -> dict[str, Any]:
        """The settings as JSON reads them back (tuples as lists)."""
        out: dict[str, Any] = json.loads(json.dumps(asdict(self)))
        return out


# ------------------------------------------------------------------------------------------------- the gated forward
def attention_layers(model: Any) -> list[Any]:
    """The model's attention layers in order (the rows of the gates): multihead's own layers, or the attention
    modules of a transformers model switched to multihead's attention (:func:`multihead.hf.enable`)."""
    return [site.module for site in as_engine(model).sites()]


def gate_shape(model: Any) -> tuple[int, int]:
    """(n_layers, n_kv_heads): one gate per KV head of every attention layer."""
    return as_engine(model).gate_shape()


def new_gates(model: Any, init: float = 1.0) -> nn.Parameter:
    """A (n_layers, n_kv_heads) float32 parameter of gates, all ``init``, on the model's device."""
    init = _number("init", init, 0.0, 1.0)
    device = as_engine(model).device
    return nn.Parameter(torch.full(gate_shape(model), init, dtype=torch.float32, device=device))


def _check_gates(model: Any, gates: Tensor) -> None:
    want = gate_shape(model)
    if not isinstance(gates, Tensor) or tuple(gates.shape) != want:
        got = tuple(gates.shape) if isinstance(gates, Tensor) else type(gates).__name__
        raise MultiheadError(f"gates have shape {got} but the model needs (n_layers, n_kv_heads) = {want}")
    with torch.no_grad():
        if not bool(torch.isfinite(gates).all()) or float(gates.min()) < 0 or float(gates.max()) > 1:
            raise MultiheadError(f"gates must lie in [0, 1] (found {float(gates.min()):g} .. {float(gates.max()):g}):"
                                 " clamp them (gates.clamp_(0, 1))")


@contextmanager
def gated(model: Any, gates: Tensor, *, sinks: int, window: int) -> Iterator[None]:
    """Run ``model`` with each KV head's output (the z of its query heads) replaced by
    ``gate * z_full + (1 - gate) * z_stream``, where z_stream is the same head's attention under the streaming mask
    (``sinks`` first tokens and the last ``window``, :func:`~multihead.cache.sink_keep`). ``gates``
    (n_layers, n_kv_heads) in [0, 1]; gradients flow to them. For uncached forwards over positions 0 .. s - 1 (the
    model's own causal mask): a cached call is refused.

    ``model``: multihead's own, or a transformers model with its attention on multihead (:mod:`multihead.heads.
    engines`): the streaming attention is the layer's own (its scale, its softcap) under the streaming mask within
    the layer's own mask (a sliding-window layer: sinks + window inside its window)."""
    engine = as_engine(model)
    _check_gates(engine, gates)
    _integer("sinks", sinks, 0)
    _integer("window", window, 1)
    masks: dict[tuple[int, torch.device], Tensor] = {}
    handles: list[HookHandle] = []

    def stream_mask(s: int, device: torch.device) -> Tensor:
        key = (s, device)
        if key not in masks:
            pos = torch.arange(s, device=device)
            masks[key] = sink_keep(pos, pos, window=window, sink_tokens=sinks)  # (s, s), True = may attend
        return masks[key]

    def attach(index: int, site: Site) -> None:
        layer = site.module
        held: dict[str, Tensor] = {}

        def keep(name: str) -> HookFn:
            def read(x: Tensor, point: HookPoint) -> None:
                held[name] = x
            return read

        def mix(z: Tensor, point: HookPoint) -> Tensor:
            q, k, v = held.pop("q"), held.pop("k"), held.pop("v")
            b, h, s, _ = q.shape  # (b, h, s, d)
            g, t = k.shape[1], k.shape[2]  # (b, g, t, d)
            if s != t:
                raise MultiheadError(f"the gated forward is for uncached calls (queries and keys at the same "
                                     f"positions): this call has {s} queries over {t} keys")
            allowed = site.stream_keep(stream_mask(s, q.device))  # (1 | b, 1 | h, s, s)
            spec = build_mask(batch=b, n_heads=h, s=s, t=t, mask=allowed, device=q.device)
            stream, _ = attend(AttentionCall(q, DenseKV(k, v), spec, scale=site.scale,
                                             softcap=site.softcap))  # (b, h, s, d)
            gate = gates[index].to(z.dtype).repeat_interleave(h // g)[None, :, None, None]  # (1, h, 1, 1)
            return gate * z + (1 - gate) * stream

        handles.extend([layer.hook_q.add(keep("q")), layer.hook_k.add(keep("k")), layer.hook_v.add(keep("v")),
                        layer.hook_z.add(mix)])

    with engine.reading():
        try:
            for i, site in enumerate(engine.sites()):
                attach(i, site)
            yield
        finally:
            for handle in handles:
                handle.remove()


def final_hidden(model: Any, tokens: Tensor) -> Tensor:
    """The final hidden states (b, s, d_model), after the last norm, of an uncached causal forward: a
    LlamaModel-like model's (``embed``, ``step``, ``layers``, ``norm``) forward without the lm_head, whose logits
    over the vocabulary the loss does not need; a transformers model's base model's last hidden state."""
    return as_engine(model).final_hidden(tokens)


# ------------------------------------------------------------------------------------------------------- training data
@dataclass(frozen=True)
class Sample:
    """One training prompt: ``tokens`` (1, n) = context, question and answer; ``scored`` the positions of the
    question and the answer, where the loss is taken."""

    id: str
    tokens: Tensor
    scored: slice


def training_sample(settings: DuoSettings, sources: Haystacks, step: int, *, max_context: int) -> Sample:
    """The prompt of one step, fixed by (settings.seed, step): the tasks and haystacks take turns, the depth is
    drawn in [0.05, 0.95], the seed is the generator's for prompt index TRAIN_INDEX + step (never an evaluation's)."""
    task = settings.tasks[step % len(settings.tasks)]
    haystack = settings.haystacks[step % len(settings.haystacks)]
    seed = case_seed(settings.seed, task, settings.length, TRAIN_INDEX + step)
    depth = round(0.05 + 0.9 * random.Random(f"depth|{seed}").random(), 4)
    case = make_prompt_cases(task, settings.length, [depth], haystack, seed, sources, max_context=max_context,
                             group=f"train{step}")[0]
    ids = case.context_ids + case.question_ids + case.answer_ids
    tokens = torch.tensor(ids, dtype=torch.long)[None]  # (1, n)
    return Sample(case.id, tokens, slice(len(case.context_ids), len(ids)))


def distill_loss(model: Any, gates: Tensor, sample: Sample, settings: DuoSettings,
                 target: Tensor | None = None) -> Tensor:
    """Mean squared error between the gated model's final hidden states and the full model's over the sample's
    question and answer positions (``target``: the full model's, computed here when not given)."""
    engine = as_engine(model)
    tokens = sample.tokens.to(gates.device)
    if target is None:
        with torch.no_grad():
            target = final_hidden(engine, tokens)[0, sample.scored].float()
    with gated(engine, gates, sinks=settings.sinks, window=settings.window):
        mine = final_hidden(engine, tokens)[0, sample.scored].float()
    return F.mse_loss(mine, target)


# ------------------------------------------------------------------------------------------------------ optimisation
def optimise_gates(model: Any, settings: DuoSettings | None = None, *, tokenizer: Tokenizer,
                   text_ids: Sequence[int] | None = None, out: str | Path | None = None, progress: bool = True,
                   **changes: Any) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Optimise one gate per KV head of ``model`` (weights frozen) as DuoAttention does; returns the gates
    (n_layers, n_kv_heads) as a NumPy array (the mean over the steps after ``average_from`` when it is set) and the
    history (per step: loss, distillation, mean gate, seconds).

    ``settings`` (default :class:`DuoSettings`), with any of its fields changed by keyword
    (``optimise_gates(model, tokenizer=tok, steps=40, lr=0.05, l1=0.05, length=1024, sinks=4, window=256,
    seed=0)``). ``tokenizer`` and ``text_ids`` (the *training* split's tokens, for the jargon haystack; without it
    the filler haystack alone) feed the case generator. ``out``: the checkpoint folder; a run with the same settings
    and model shape continues from it, also to more ``steps`` (the schedule and the prompts depend on the step
    alone, so 28 steps then 60 equal 60 at once); another run there is refused; ``gates.json`` is written there.
    """
    from tqdm import tqdm

    settings = settings if settings is not None else DuoSettings()
    if changes:
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(DuoSettings)})
        if unknown:
            raise MultiheadError(f"unknown gate optimisation setting(s) {', '.join(unknown)}: choose from "
                                 f"{', '.join(f.name for f in dataclasses.fields(DuoSettings))}")
        settings = dataclasses.replace(settings, **changes)
    if not isinstance(settings, DuoSettings):
        raise MultiheadError(f"settings must be a DuoSettings, got {type(settings).__name__}")
    engine = as_engine(model)
    check_length(settings.length, engine.max_context)
    if text_ids is None and "jargon" in settings.haystacks:
        settings = dataclasses.replace(settings, haystacks=("filler",))
    sources = Haystacks(as_tokenizer(tokenizer), text_ids)
    shape = engine.gate_shape()
    net = engine.model
    for p in net.parameters():
        p.requires_grad_(False)
    was_training = net.training
    net.eval()
    gates = new_gates(engine, settings.init)
    optimizer = torch.optim.AdamW([gates], lr=settings.lr, weight_decay=0.0)
    folder = Path(out) if out is not None else None
    first = 0
    history: list[dict[str, Any]] = []
    average = Average(settings.average_from, torch.zeros(shape, dtype=torch.float64), 0)
    if folder is not None and (folder / "state.json").exists():
        first, history = _load(folder, gates, optimizer, settings, shape, average)
    bar = tqdm(range(first, settings.steps), desc="duo gates", unit="step", disable=not progress, initial=first,
               total=settings.steps)
    try:
        for step in bar:
            began = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * min(1.0, (step + 1) / max(1, settings.warmup))
            sample = training_sample(settings, sources, step, max_context=engine.max_context)
            distill = distill_loss(engine, gates, sample, settings)
            reg = gates.mean()
            loss = distill + settings.l1 * reg
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                gates.clamp_(0.0, 1.0)
                if settings.average_from and step + 1 > settings.average_from:
                    average.total += gates.detach().to("cpu", torch.float64)
                    average.steps += 1
            entry = {"step": step + 1, "loss": float(loss.detach()), "distill": float(distill.detach()),
                     "mean_gate": float(gates.detach().mean()), "sample": sample.id,
                     "seconds": round(time.perf_counter() - began, 3)}
            history.append(entry)
            bar.set_postfix(distill=f"{entry['distill']:.4f}", gate=f"{entry['mean_gate']:.3f}")
            if folder is not None and ((step + 1) % settings.every == 0 or step + 1 == settings.steps):
                _save(folder, gates, optimizer, settings, shape, step + 1, history, average)
    finally:
        bar.close()
        net.train(was_training)
    if average.steps:
        return (average.total / average.steps).numpy().copy(), history
    return gates.detach().cpu().numpy().copy(), history


@dataclass
class Average:
    """The running sum of the gates over the steps after ``after`` (``steps`` of them so far)."""

    after: int
    total: Tensor
    steps: int


def plan_from_gates(model: Any, gates: np.ndarray | Tensor, fraction: float, *, sinks: int, window: int,
                    name: str = "", settings: DuoSettings | None = None) -> HeadPlan:
    """The :class:`~multihead.cache.HeadPlan` keeping every key for the top ``fraction`` of KV heads by gate
    (``HeadPlan.from_scores``) and ``sinks`` + ``window`` for the rest, with ``model``'s name (or ``name``) and
    shape (n_layers, n_heads, n_kv_heads, head_dim: a transformers model's read from its config). Its method says
    what was optimised, on which model and engine (and the ``settings``' steps, length and window when given)."""
    from multihead.cache import HeadPlan

    engine = as_engine(model, name)
    arr = gates.detach().cpu().numpy() if isinstance(gates, Tensor) else np.asarray(gates, dtype=float)
    if arr.shape != engine.gate_shape():
        raise MultiheadError(f"gates have shape {arr.shape} but the model needs (n_layers, n_kv_heads) = "
                             f"{engine.gate_shape()}")
    how = "" if settings is None else (f", {settings.steps} steps on {settings.length}-token prompts with "
                                       f"{settings.sinks} sinks + {settings.window}")
    if settings is not None and settings.average_from:
        how += f", gates averaged over steps {settings.average_from + 1}-{settings.steps}"
    method = (f"duo: DuoAttention-style gates per KV head (frozen weights, hidden-state distillation + L1 on passkey "
              f"prompts of the training split{how}); {engine.scored}")
    return HeadPlan.from_scores(arr.tolist(), fraction, sinks=sinks, window=window, model=engine.name,
                                shape=engine.shape, method=method)


def top_heads(gates: np.ndarray, k: int | None = None) -> list[tuple[int, int, float]]:
    """(layer, KV head, gate) from the highest gate down (ties by layer, then head); the first ``k`` or all."""
    arr = np.asarray(gates, dtype=float)
    if arr.ndim != 2:
        raise MultiheadError(f"gates must be a (n_layers, n_kv_heads) array, got shape {arr.shape}")
    order = sorted(((int(i), int(j), float(arr[i, j])) for i, j in np.ndindex(arr.shape)),
                   key=lambda x: (-x[2], x[0], x[1]))
    return order if k is None else order[:k]


def read_gates(path: str | Path) -> np.ndarray:
    """The (n_layers, n_kv_heads) gates of a ``gates.json``."""
    from multihead.models.loaders import read_json

    data = read_json(Path(path))
    arr = np.asarray(data.get("gates"), dtype=float)
    if arr.ndim != 2 or not np.isfinite(arr).all():
        raise MultiheadError(f"{path}: 'gates' must be a (n_layers, n_kv_heads) array of numbers")
    return arr


# ------------------------------------------------------------------------------------------------------- checkpoint
def _save(folder: Path, gates: nn.Parameter, optimizer: torch.optim.Optimizer, settings: DuoSettings,
          shape: tuple[int, int], step: int, history: list[dict[str, Any]], average: Average) -> None:
    from safetensors.torch import save_file

    from multihead.files import atomic_path, write_text

    folder.mkdir(parents=True, exist_ok=True)
    state = optimizer.state.get(gates, {})
    tensors = {"gates": gates.detach().cpu().contiguous()}
    for key in ("exp_avg", "exp_avg_sq"):
        if key in state:
            tensors[key] = state[key].detach().cpu().contiguous()
    if average.steps:
        tensors["average_total"] = average.total.contiguous()
    with atomic_path(folder / "duo.safetensors") as partial:
        save_file(tensors, str(partial))
    adam_step = float(state["step"]) if "step" in state else 0.0
    saved: dict[str, Any] = {"gates": gates.detach().cpu().tolist(), "settings": settings.stamp(),
                             "shape": {"n_layers": shape[0], "n_kv_heads": shape[1]}, "step": step}
    if average.steps:  # the steps averaged: after..after + steps
        saved["average"] = {"after": average.after, "steps": average.steps,
                            "gates": (average.total / average.steps).tolist()}
    write_text(folder / "gates.json", json.dumps(saved))
    write_text(folder / "state.json", json.dumps({"step": step, "settings": settings.stamp(),
                                                  "shape": list(shape), "adam_step": adam_step,
                                                  "history": history,
                                                  "average": {"after": average.after, "steps": average.steps}}))


def _load(folder: Path, gates: nn.Parameter, optimizer: torch.optim.Optimizer, settings: DuoSettings,
          shape: tuple[int, int], average: Average) -> tuple[int, list[dict[str, Any]]]:
    from multihead.models.loaders import read_json, read_safetensors

    state = read_json(folder / "state.json")
    saved_settings = state.get("settings")
    free = ("steps", "average_from")  # neither changes a step: a run may go on with others
    mine = {k: v for k, v in settings.stamp().items() if k not in free}
    if not isinstance(saved_settings, dict) or {k: v for k, v in saved_settings.items() if k not in free} != mine:
        raise MultiheadError(f"the checkpoint in {folder} was made with other settings ({saved_settings}); "
                             f"rerun with the same ones ({settings.stamp()}, steps may grow) or use another folder")
    if state.get("shape") != list(shape):
        raise MultiheadError(f"the checkpoint in {folder} holds gates of shape {state.get('shape')} but this model "
                             f"needs {list(shape)}: use another folder")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise MultiheadError(f"{folder / 'state.json'}: step {step!r} is not a positive number of steps")
    if step > settings.steps:
        raise MultiheadError(f"the checkpoint in {folder} holds {step} steps, more than the {settings.steps} asked: "
                             f"ask for at least {step} steps or use another folder")
    tensors = read_safetensors([folder / "duo.safetensors"])
    saved = tensors.get("gates")
    if saved is None or tuple(saved.shape) != shape:
        raise MultiheadError(f"{folder / 'duo.safetensors'}: no tensor 'gates' of shape {shape}")
    with torch.no_grad():
        gates.copy_(saved)
    if "exp_avg" in tensors and "exp_avg_sq" in tensors:
        device = gates.device
        optimizer.state[gates] = {"step": torch.tensor(float(state.get("adam_step", step))),
                                  "exp_avg": tensors["exp_avg"].to(device).clone(),
                                  "exp_avg_sq": tensors["exp_avg_sq"].to(device).clone()}
    if settings.average_from and step > settings.average_from:  # some steps to average have passed: were they?
        kept = state.get("average")
        ok = (isinstance(kept, dict) and kept.get("after") == settings.average_from
              and kept.get("steps") == step - settings.average_from and "average_total" in tensors)
        if not ok:
            raise MultiheadError(f"the checkpoint in {folder} is at step {step}, past average_from "
                                 f"{settings.average_from}, and did not average those steps: use average_from "
                                 f"{step} or more (or the {settings.average_from} it was run with) or another folder")
        average.total = tensors["average_total"].to(torch.float64).clone()
        average.steps = step - settings.average_from
    history = state.get("history")
    return step, history if isinstance(history, list) else []


# ---------------------------------------------------------------------------------------------------- command line
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m multihead.tradeoff.duo``: optimise SmolLM2's gates (or a model's at --model: a GGUF file or a
    Hugging Face folder, run by our port or by transformers with its attention on multihead) on passkeys built from
    the training split of the text; writes OUT/gates.json (and with --budget the plans OUT/plan-duo-<pct>.json) and
    prints the top KV heads."""
    import argparse
    import sys

    from multihead.names import ENGINES, head_name

    defaults = DuoSettings()
    parser = argparse.ArgumentParser(prog="python -m multihead.tradeoff.duo", description=main.__doc__)
    parser.add_argument("--model", default=None, help="GGUF file or model folder (default SmolLM2-135M-Instruct)")
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="auto (default): our port for a Llama GGUF or folder, else transformers with its "
                             "attention on multihead; or force one")
    parser.add_argument("--budget", type=float, action="append", default=None, metavar="FRACTION",
                        help="also write the plan keeping every key for this fraction of KV heads (repeatable)")
    parser.add_argument("--text", default=None, help="text file (default the Jargon File)")
    parser.add_argument("--out", default="out/duo", help="checkpoint folder, resumed when rerun (default out/duo)")
    for f in ("steps", "length", "sinks", "window", "seed", "warmup", "every"):
        parser.add_argument(f"--{f}", type=int, default=getattr(defaults, f))
    parser.add_argument("--average-from", type=int, default=0, metavar="STEP",
                        help="average the gates over the steps after STEP; the plans come from the average "
                             "(default 0: from the last step's gates)")
    for f in ("lr", "l1", "init"):
        parser.add_argument(f"--{f}", type=float, default=getattr(defaults, f))
    parser.add_argument("--tasks", default=",".join(defaults.tasks), help="comma-separated one-needle tasks")
    parser.add_argument("--top", type=int, default=10, help="KV heads to print (default 10)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    args = parser.parse_args(argv)
    try:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        settings = DuoSettings(steps=args.steps, lr=args.lr, l1=args.l1, length=args.length, sinks=args.sinks,
                               window=args.window, seed=args.seed, warmup=args.warmup, every=args.every,
                               average_from=args.average_from,
                               init=args.init, tasks=tuple(t for t in args.tasks.split(",") if t))
        for budget in args.budget or ():
            if not 0.0 <= budget <= 1.0:
                raise MultiheadError(f"--budget {budget!r} must be a fraction of the KV heads in [0, 1]")
        from multihead.evals.text import read_text, token_splits
        from multihead.models.decoder import load_decoder

        loaded = load_decoder(args.model, args.engine)  # a sentence encoder refused: gates go on a decoder's KV heads
        model, tokenizer = loaded, loaded.tokenizer
        train = token_splits(tokenizer.encode(read_text(args.text))).train
        began = time.perf_counter()
        gates, history = optimise_gates(model, settings, tokenizer=tokenizer, text_ids=train, out=args.out)
        plans = [plan_from_gates(model, gates, budget, sinks=settings.sinks, window=settings.window,
                                 name=loaded.name, settings=settings).save(
                                     Path(args.out) / f"plan-duo-{round(budget * 100)}.json")
                 for budget in args.budget or ()]
    except MultiheadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: rerun the same command to continue from {args.out}", file=sys.stderr)
        return 130
    seconds = [h["seconds"] for h in history if "seconds" in h]
    print(f"{len(history)} steps, {time.perf_counter() - began:.0f} s in this run, median step "
          f"{float(np.median(seconds)) if seconds else float('nan'):.1f} s; gates in {Path(args.out) / 'gates.json'}")
    print("top KV heads (gate):")
    for layer, head, gate in top_heads(gates, args.top):
        print(f"  {head_name(layer, head, kv=True):<7} {gate:.3f}")
    for path in plans:
        print(f"plan: {path}")
    return 0


__all__ = [
    "TRAIN_INDEX",
    "TRAIN_TASKS",
    "Average",
    "DuoSettings",
    "Sample",
    "attention_layers",
    "distill_loss",
    "final_hidden",
    "gate_shape",
    "gated",
    "main",
    "new_gates",
    "optimise_gates",
    "plan_from_gates",
    "read_gates",
    "top_heads",
    "training_sample",
]

if __name__ == "__main__":
    raise SystemExit(main())
