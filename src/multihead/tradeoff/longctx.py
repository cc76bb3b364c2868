"""Long-context retrieval under each KV-saving method: RULER-style needles at 1k-8k tokens, beside perplexity.

Perplexity on short windows hides what a cache that forgets loses (a sliding window of 256 plus sinks costs little
perplexity and cannot recall a number from 3,000 tokens back). This module measures recall directly, with synthetic
tasks in the manner of RULER (Hsieh et al. 2024), written for multihead and for a small model that follows
instructions poorly: every prompt ends in a completion cue ("... The pass key is") whose continuation is the answer.

Tasks (``TASKS``)::

    passkey        one pass key (5 digits) in the haystack; cue "The pass key is"
    single-number  one needle "The special magic number for <key> is <7 digits>."; cue asks that key
    single-word    the same with a word value (adjective-noun)
    multikey       ``keys`` needles with distinct keys; each key is asked in its own case (the cases share a prompt)
    multivalue     ``values`` needles for one key; the cue asks for all of them, in the order they appear

Haystacks: ``jargon`` (a passage of the held-out Jargon File split, :mod:`multihead.tradeoff.text`) or ``filler``
(a short paragraph repeated). A prompt is built in token ids so that its length is exactly the target: intro,
haystack with the needles inserted at sentence boundaries nearest their depths (depth = the share of the haystack
before the needle), then the question. Every case has a stable id and a seed fixed by (settings seed, task, length,
prompt index), so every method, and kvpress (:func:`write_jsonl`), sees the same cases.

Scoring: the prompt is prefilled through the method's real cache in chunks; the answer is teacher-forced one token at
a time. The greedy answer equals the expected one exactly when every teacher-forced step's argmax is the expected
token (greedy decoding follows the same prefix as long as it agrees), so one pass gives the exact match, the answer
tokens' log-likelihood and the decode step time. Cases that share a prompt share its prefill (the cache is copied
after the prompt's context). The full cache is measured first; a (length, task) cell it scores below ``threshold``
is reported and left out of the other methods' runs and of the comparison.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import math
import random
import re
import statistics
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from multihead.errors import MultiheadError

TASKS = ("passkey", "single-number", "single-word", "multikey", "multivalue")
DEFAULT_TASKS = ("passkey", "single-number", "multikey", "multivalue")
HAYSTACKS = ("jargon", "filler")
ANSWER_ROOM = 48  # tokens kept free after the prompt for the answer: a length may be at most max_context - this
JSONL_KEYS = ("id", "task", "length", "depth", "haystack", "seed", "context_ids", "question_ids", "answer_ids",
              "answer")

_FILLER = (" The hills are quiet and the river runs slowly past the mill. A bird crosses the grey sky. The road goes "
           "on between the fields. Here the afternoon is long and nothing happens. Then it all begins once more.")
_ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
               "lucky", "mellow", "noble", "odd", "plain", "quiet", "rapid", "silent", "tidy", "upper", "vivid",
               "wild", "young", "zesty", "bold", "crisp", "damp", "early", "fuzzy")
_NOUNS = ("anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
          "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tiger",
          "umbrella", "violin", "walnut", "yacht", "zebra", "basket", "cactus", "donkey", "feather", "glacier")
_INTRO = {
    "passkey": "A pass key is hidden somewhere in the long text below. Find it and remember it: you will be asked "
               "for it at the end.\n\n",
    "number": "Special magic numbers are hidden in the long text below. Remember them: you will be asked about "
              "them at the end.\n\n",
    "word": "Special magic words are hidden in the long text below. Remember them: you will be asked about them "
            "at the end.\n\n",
}


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Case:
    """One question: the prompt ``context_ids + question_ids`` (``length`` tokens) and the ``answer_ids`` the model
    should continue with. ``needles`` holds the (start, end) token spans of every needle in ``context_ids``, the
    asked one first; ``group`` names the prompt (cases of a multikey prompt share it)."""

    id: str
    task: str
    length: int
    depth: float
    haystack: str
    seed: int
    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    answer: str
    needles: tuple[tuple[int, int], ...] = ()
    group: str = ""

    def to_json(self) -> dict[str, Any]:
        """The JSONL record (exactly :data:`JSONL_KEYS`), read by the kvpress side-by-side."""
        return {"id": self.id, "task": self.task, "length": self.length, "depth": self.depth,
                "haystack": self.haystack, "seed": self.seed, "context_ids": list(self.context_ids),
                "question_ids": list(self.question_ids), "answer_ids": list(self.answer_ids), "answer": self.answer}


def check_task(task: object) -> str:
    if task not in TASKS:
        raise MultiheadError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")
    return str(task)


def check_depth(depth: object) -> float:
    if isinstance(depth, bool) or not isinstance(depth, int | float) or not 0.0 <= float(depth) <= 1.0:
        raise MultiheadError(f"depth ({depth!r}) must lie in [0, 1]: the share of the haystack before the needle")
    return float(depth)


def check_length(length: object, max_context: int) -> int:
    """A prompt length that leaves :data:`ANSWER_ROOM` tokens of the model's context for the answer."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise MultiheadError(f"length ({length!r}) must be a positive number of tokens")
    if length + ANSWER_ROOM > max_context:
        raise MultiheadError(f"length {length:,} exceeds the model's context of {max_context:,} tokens with "
                             f"{ANSWER_ROOM} left for the answer: use at most {max_context - ANSWER_ROOM:,}")
    return length


def case_seed(seed: int, task: str, length: int, index: int) -> int:
    """The seed of one prompt, fixed by (settings seed, task, length, prompt index) whatever else is asked."""
    return (seed * 1_000_003 + zlib.crc32(f"{task}|{length}|{index}".encode())) % 2**31


class Haystacks:
    """Token sources for the haystacks and the sentence ends where a needle may go."""

    def __init__(self, tokenizer: Tokenizer, jargon_ids: Sequence[int] | None) -> None:
        self.tokenizer = tokenizer
        self.jargon = list(jargon_ids) if jargon_ids is not None else None
        self.filler = tokenizer.encode(_FILLER)
        self._ends: dict[int, bool] = {}
        self._breaks: dict[int, bool] = {}

    def ends_sentence(self, token: int) -> bool:
        if token not in self._ends:
            text = self.tokenizer.decode([token]).rstrip(" ")
            self._ends[token] = text.endswith((".", "!", "?", "\n"))
        return self._ends[token]

    def breaks_line(self, token: int) -> bool:
        if token not in self._breaks:
            self._breaks[token] = "\n" in self.tokenizer.decode([token])
        return self._breaks[token]

    def take(self, kind: str, n: int, rng: random.Random) -> list[int]:
        """``n`` haystack tokens: a passage of the Jargon File starting at a paragraph, or the filler repeated."""
        if kind == "filler":
            reps = -(-n // len(self.filler))
            return (self.filler * reps)[:n]
        if kind != "jargon":
            raise MultiheadError(f"unknown haystack {kind!r}: choose from {', '.join(HAYSTACKS)}")
        if self.jargon is None:
            raise MultiheadError("the jargon haystack needs the held-out text's tokens (jargon_ids)")
        if len(self.jargon) < 2 * n:
            raise MultiheadError(f"the held-out text has {len(self.jargon):,} tokens, too few for a haystack of "
                                 f"{n:,} (twice that is needed to vary the passage): use a shorter length")
        start = rng.randrange(1, len(self.jargon) - 2 * n + 1)
        while start < len(self.jargon) - n and not self.breaks_line(self.jargon[start - 1]):
            start += 1  # begin at a paragraph
        return self.jargon[start:start + n]

    def boundaries(self, hay: Sequence[int]) -> list[int]:
        """Positions 0..len(hay) where a needle can be inserted: the start, the end and after every sentence."""
        return [0] + [i + 1 for i, t in enumerate(hay[:-1]) if self.ends_sentence(t)] + [len(hay)]


def _word(rng: random.Random, taken: set[str]) -> str:
    while True:
        w = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if w not in taken:
            taken.add(w)
            return w


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def make_prompt_cases(task: str, length: int, depths: Sequence[float], haystack: str, seed: int,
                      sources: Haystacks, *, max_context: int, group: str = "", values: int = 3) -> list[Case]:
    """The cases of one prompt. ``depths``: one per needle (``keys`` of them for multikey, ``values`` for
    multivalue, else one). Each case asks one question; multikey gives one case per key, asked in turn."""
    check_task(task)
    check_length(length, max_context)
    depths = [check_depth(d) for d in depths]
    rng = random.Random(seed)
    taken: set[str] = set()
    tok = sources.tokenizer
    kind = "word" if task == "single-word" else ("passkey" if task == "passkey" else "number")
    needles: list[str] = []
    questions: list[tuple[str, str]] = []  # (question, answer) per case
    if task == "passkey":
        if len(depths) != 1:
            raise MultiheadError(f"passkey takes one depth, got {len(depths)}")
        v = _number(rng, 5)
        needles.append(f" The pass key is {v}. Remember it. {v} is the pass key.")
        questions.append(("\n\nWhat is the pass key? The pass key is", f" {v}"))
    elif task in ("single-number", "single-word", "multikey"):
        if task != "multikey" and len(depths) != 1:
            raise MultiheadError(f"{task} takes one depth, got {len(depths)}")
        noun = "word" if task == "single-word" else "number"
        for _ in depths:
            key = _word(rng, taken)
            value = _word(rng, taken) if task == "single-word" else _number(rng, 7)
            needles.append(f" The special magic {noun} for {key} is {value}.")
            questions.append((f"\n\nWhat is the special magic {noun} for {key}? The special magic {noun} for {key} is",
                              f" {value}"))
    else:  # multivalue
        if len(depths) != values:
            raise MultiheadError(f"multivalue with {values} values takes {values} depths, got {len(depths)}")
        key = _word(rng, taken)
        vs = [_number(rng, 7) for _ in depths]
        needles += [f" One of the special magic numbers for {key} is {v}." for v in vs]
        order = sorted(range(len(vs)), key=lambda j: depths[j])
        listed = [vs[j] for j in order]
        questions.append((f"\n\nWhat are all the special magic numbers for {key}, in the order they appear? The "
                          f"special magic numbers for {key} are",
                          " " + ", ".join(listed[:-1]) + " and " + listed[-1]))
    intro = tok.encode(_INTRO[kind])
    needle_ids = [tok.encode(n) for n in needles]
    asked = []
    for q, a in questions:
        q_ids, full = tok.encode(q), tok.encode(q + a)
        if full[:len(q_ids)] != q_ids or len(full) == len(q_ids):
            raise MultiheadError(f"the tokenizer does not split {q + a!r} after the question: the answer's tokens "
                                 "cannot be told apart")
        asked.append((q_ids, full[len(q_ids):], a.strip()))
    longest_q = max(len(q) for q, _, _ in asked)
    if max(len(a) for _, a, _ in asked) > ANSWER_ROOM:
        raise MultiheadError(f"the answer of {task} takes more than {ANSWER_ROOM} tokens: use fewer values")
    h = length - len(intro) - sum(len(n) for n in needle_ids) - longest_q
    least = 16
    if h < least:
        raise MultiheadError(f"length {length} is too short for {task}: its intro, needles and question take "
                             f"{length - h} tokens; use at least {length - h + least}")
    hay = sources.take(haystack, h, rng)
    bounds = sources.boundaries(hay)
    spots = [min(bounds, key=lambda b, t=d * h: (abs(b - t), b)) for d in depths]  # type: ignore[misc]
    context = list(intro)
    spans: dict[int, tuple[int, int]] = {}
    last = 0
    for j in sorted(range(len(needles)), key=lambda j: (spots[j], j)):
        context += hay[last:spots[j]]
        spans[j] = (len(context), len(context) + len(needle_ids[j]))
        context += needle_ids[j]
        last = spots[j]
    context += hay[last:]
    cases = []
    for i, (q_ids, a_ids, answer) in enumerate(asked):
        # one context for every question of the prompt: a shorter question is led by more blank lines
        question = [q_ids[0]] * (longest_q - len(q_ids)) + q_ids
        assert len(context) + len(question) == length
        first = i if task == "multikey" else 0
        ordered = (spans[first], *(spans[j] for j in range(len(needles)) if j != first))
        suffix = f"-k{i}" if task == "multikey" else ""
        name = group or str(seed)
        cases.append(Case(id=f"{task}-{length}-{haystack}-{name}{suffix}", task=task, length=length,
                          depth=round(depths[first], 4), haystack=haystack, seed=seed, context_ids=tuple(context),
                          question_ids=tuple(question), answer_ids=tuple(a_ids), answer=answer, needles=ordered,
                          group=name))
    return cases


_GOLDEN = (math.sqrt(5) - 1) / 2


def prompt_depths(task: str, index: int, *, keys: int, values: int) -> list[float]:
    """Depths of one prompt's needles: one needle at a depth from a golden-ratio sequence over the prompts (so a few
    prompts already cover the context), or several spread evenly with an offset that moves with the prompt."""
    offset = (0.5 + index * _GOLDEN + TASKS.index(task) * 0.3) % 1.0
    n = keys if task == "multikey" else values if task == "multivalue" else 1
    if n == 1:
        return [round(0.05 + 0.9 * offset, 4)]
    return [round(0.05 + 0.9 * ((j + offset) / n), 4) for j in range(n)]


def make_cases(settings: Settings, tokenizer: Tokenizer, jargon_ids: Sequence[int] | None, *,
               max_context: int) -> list[Case]:
    """Every case of a run: ``settings.prompts`` prompts per (length, task), haystacks taking turns."""
    sources = Haystacks(tokenizer, jargon_ids)
    cases: list[Case] = []
    for length in settings.lengths:
        check_length(length, max_context)
        for t, task in enumerate(settings.tasks):
            for index in range(settings.prompts):
                haystack = settings.haystacks[(index + t) % len(settings.haystacks)]
                seed = case_seed(settings.seed, task, length, index)
                depths = prompt_depths(task, index, keys=settings.keys, values=settings.values)
                cases += make_prompt_cases(task, length, depths, haystack, seed, sources, max_context=max_context,
                                           group=f"p{index}", values=settings.values)
    return cases


def build_cases(settings: Settings, *, model_path: str | None = None,
                text_path: str | None = None) -> list[Case]:
    """The cases of a run with the real model's tokenizer and the held-out text (what :func:`run` measures), e.g.
    to write them with :func:`write_jsonl` for another implementation."""
    from multihead.models.loaders import load_llama
    from multihead.tradeoff.text import read_text, token_splits

    model, tokenizer = load_llama(model_path)
    test = token_splits(tokenizer.encode(read_text(text_path))).test
    return make_cases(settings, tokenizer, test, max_context=model.config.max_context)


def write_jsonl(cases: Sequence[Case], path: str | Path) -> Path:
    """The cases as JSON lines (:meth:`Case.to_json`), written whole or not at all."""
    from multihead.files import write_text

    return write_text(path, "".join(json.dumps(c.to_json()) + "\n" for c in cases))


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _token_ids(where: str, name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise MultiheadError(f"{where}: {name!r} must be a non-empty list of token ids, got {_short(value)}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise MultiheadError(f"{where}: {name}[{i}] = {_short(t)} is not a token id (an integer >= 0)")
    return tuple(value)


def _case_from_json(rec: Any, where: str) -> Case:
    """One case from its decoded JSONL record (exactly :data:`JSONL_KEYS`, each of its type); ``where`` (file:line)
    starts every error message, which names the field and what it must be."""
    if not isinstance(rec, dict):
        raise MultiheadError(f"{where}: a case must be a JSON object, got {type(rec).__name__}")
    missing = [k for k in JSONL_KEYS if k not in rec]
    unknown = sorted(k for k in rec if k not in JSONL_KEYS)
    if missing or unknown:
        wrong = f"lacks the field(s) {', '.join(missing)}" if missing else f"has unknown field(s) {', '.join(unknown)}"
        raise MultiheadError(f"{where}: case {rec.get('id', '?')!r} {wrong}: a case needs exactly the keys "
                             f"{', '.join(JSONL_KEYS)}")
    for name in ("id", "task", "haystack", "answer"):
        if not isinstance(rec[name], str) or not rec[name]:
            raise MultiheadError(f"{where}: {name!r} must be a non-empty string, got {_short(rec[name])}")
    for name in ("length", "seed"):
        if isinstance(rec[name], bool) or not isinstance(rec[name], int) or rec[name] < 0:
            raise MultiheadError(f"{where}: {name!r} must be an integer >= 0, got {_short(rec[name])}")
    depth = rec["depth"]
    if isinstance(depth, bool) or not isinstance(depth, int | float) or not 0.0 <= depth <= 1.0:
        raise MultiheadError(f"{where}: 'depth' must be a number in [0, 1], got {_short(depth)}")
    return Case(id=rec["id"], task=rec["task"], length=rec["length"], depth=float(depth), haystack=rec["haystack"],
                seed=rec["seed"], context_ids=_token_ids(where, "context_ids", rec["context_ids"]),
                question_ids=_token_ids(where, "question_ids", rec["question_ids"]),
                answer_ids=_token_ids(where, "answer_ids", rec["answer_ids"]), answer=rec["answer"])


def read_jsonl(path: str | Path) -> list[Case]:
    """Cases back from :func:`write_jsonl` (their needle spans are not stored; the group is the shared prompt:
    cases with the same ``context_ids`` share one). Blank lines are skipped; every field is checked (an error names
    the file, the line and the field) and ids must be unique, since results are kept by id."""
    p = Path(path)
    if not p.is_file():
        raise MultiheadError(f"case file {str(p)!r} does not exist: give the cases.jsonl of a run (or the file "
                             "`multihead tradeoff --long --cases-jsonl` wrote)")
    cases: list[Case] = []
    seen: dict[str, int] = {}
    groups: dict[tuple[int, ...], str] = {}
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise MultiheadError(f"{where}: not a JSON object ({err.msg} at column {err.colno})") from None
        case = _case_from_json(rec, where)
        if case.id in seen:
            raise MultiheadError(f"{where}: case id {case.id!r} is already used on line {seen[case.id]}: ids must be "
                                 "unique (results are kept by id)")
        seen[case.id] = n
        cases.append(dataclasses.replace(case, group=groups.setdefault(case.context_ids, f"g{len(groups)}")))
    if not cases:
        raise MultiheadError(f"case file {str(p)!r} holds no case")
    return cases


# ----------------------------------------------------------------------------------------------------------- methods
@dataclass(frozen=True)
class Method:
    """One cache kind on one model. ``keep``: the share of the prompt length a sinks + window cache holds
    (``sinks + window - 1 = round(keep * length)`` slots, so 0.5 holds the bytes kvpress keeps at 50% compression);
    ``window``: an absolute window instead; ``bits``: a quantized cache; ``plan``: a head-wise cache made by the
    :class:`~multihead.cache.HeadPlan` saved in that file (each KV head full or its sinks + window);
    ``equal_to``: a sinks + window cache holding as many slots per KV head as that plan's cache holds on average
    at each length (the uniform control at equal bytes); none of them: the full cache."""

    name: str
    series: str
    model: str = "original"
    keep: float | None = None
    window: int | None = None
    sinks: int = 0
    bits: int | None = None
    group: int = 32
    residual: int = 128
    plan: str | None = None
    equal_to: str | None = None

    def window_at(self, length: int) -> int | None:
        if self.keep is not None:
            return max(1, round(self.keep * length) - self.sinks + 1)
        if self.equal_to is not None:
            return max(1, equal_bytes_slots(load_plan(self.equal_to), length) - self.sinks + 1)
        return self.window

    def cache(self, model: Any, length: int, max_len: int) -> Any:
        """This method's real cache for a prompt of ``length`` tokens (room for ``max_len`` in a full one)."""
        if self.plan is not None:
            return model.new_cache(1, max_len, plan=load_plan(self.plan))
        window = self.window_at(length)
        if window is not None:
            return model.new_cache(1, window=window, sink_tokens=self.sinks)
        if self.bits is not None:
            return model.new_cache(1, max_len, bits=self.bits, group=self.group, residual=self.residual)
        return model.new_cache(1, max_len)

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")


def load_plan(path: str) -> Any:
    """The :class:`~multihead.cache.HeadPlan` saved at ``path`` (read again only when the file changes)."""
    try:
        stamp = Path(path).stat().st_mtime_ns
    except OSError:
        stamp = -1  # HeadPlan.load says what is wrong with the path
    return _load_plan(path, stamp)


@functools.lru_cache(maxsize=32)
def _load_plan(path: str, stamp: int) -> Any:
    from multihead.cache import HeadPlan

    return HeadPlan.load(path)


def equal_bytes_slots(plan: Any, length: int) -> int:
    """Slots per KV head of a sinks + window cache holding the bytes of ``plan``'s head-wise cache at ``length``
    tokens: a full KV head holds ``length``, a streaming one ``min(length, sinks + window - 1)``."""
    stream: int = min(length, plan.sinks + plan.window - 1)
    share: float = plan.full_fraction
    slots: int = round(share * length + (1 - share) * stream)
    return max(1, slots)


def plan_label(path: str) -> str:
    """A plan's name in tables: its file name without ``-plan.json`` / ``.json``."""
    name = Path(path).name
    for end in ("-plan.json", ".json"):
        if name.endswith(end):
            return name[:-len(end)]
    return name


# ---------------------------------------------------------------------------------------------------------- settings
def _positive(name: str, value: object, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise MultiheadError(f"{name} ({value!r}) must be an integer of at least {least}")


@dataclass(frozen=True)
class Settings:
    """What a run measures; each field is one flag of ``multihead tradeoff --long``."""

    lengths: tuple[int, ...] = (2048, 4096)
    tasks: tuple[str, ...] = DEFAULT_TASKS
    haystacks: tuple[str, ...] = HAYSTACKS
    prompts: int = 1  # prompts per (length, task); a multikey prompt gives `keys` cases
    keys: int = 4
    values: int = 3
    seed: int = 0
    chunk: int = 512
    sinks: int = 4
    keep: tuple[float, ...] = (0.5, 0.25)  # sinks + window holding these shares of the prompt
    window_keep: tuple[float, ...] = (0.25,)  # a plain window (no sinks) holding these shares
    windows: tuple[int, ...] = ()  # absolute sinks + window windows (e.g. 256, as `multihead tradeoff` uses)
    bits: tuple[int, ...] = (8, 4, 2)
    group: int = 32
    residual: int = 128
    mqa: bool = True
    uptrain_steps: int = 40  # 0: no uptrained MQA; the steps, lr and train are `multihead tradeoff`'s defaults
    uptrain_lr: float = 3e-3
    uptrain_train: str = "kv"
    uptrain_from: str | None = None  # an uptraining checkpoint folder to reuse (e.g. a `multihead tradeoff` run's)
    prune: tuple[float, ...] = (0.25,)
    plans: tuple[str, ...] = ()  # HeadPlan JSON files: a head-wise cache each, and a sinks + window one of its bytes
    ppl_context: int = 4096
    ppl_scored: int = 1024
    ppl_windows: int = 1
    threshold: float = 0.8
    bootstrap: int = 2000

    def __post_init__(self) -> None:
        from multihead.cache import check_bits
        from multihead.tradeoff.prune import check_fraction

        if not self.lengths:
            raise MultiheadError("lengths is empty: give at least one prompt length")
        for n in self.lengths:
            _positive("length", n)
        if not self.tasks:
            raise MultiheadError(f"tasks is empty: choose from {', '.join(TASKS)}")
        for t in self.tasks:
            check_task(t)
        for h in self.haystacks or ("(none)",):
            if h not in HAYSTACKS:
                raise MultiheadError(f"unknown haystack {h!r}: choose from {', '.join(HAYSTACKS)}")
        for name in ("prompts", "chunk", "group", "ppl_context", "ppl_scored", "ppl_windows", "bootstrap"):
            _positive(name, getattr(self, name))
        _positive("keys", self.keys, 2)
        _positive("values", self.values, 2)
        for name in ("seed", "sinks", "residual", "uptrain_steps"):
            _positive(name, getattr(self, name), 0)
        if self.ppl_scored > self.ppl_context:
            raise MultiheadError(f"ppl_scored ({self.ppl_scored}) must not exceed ppl_context ({self.ppl_context})")
        shortest = min(self.lengths)
        for share in self.keep + self.window_keep:
            if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share < 1:
                raise MultiheadError(f"keep share ({share!r}) must lie in (0, 1): the share of the prompt a "
                                     "windowed cache holds")
        for share in self.keep:
            held = round(share * shortest)
            if held < self.sinks + 1:
                raise MultiheadError(f"keep {share} of {shortest} tokens holds {held} tokens, fewer than the "
                                     f"{self.sinks} sinks and one window token: use a larger share or fewer sinks")
        for share in self.window_keep:
            if round(share * shortest) < 1:
                raise MultiheadError(f"window keep {share} of {shortest} tokens holds no token")
        for w in self.windows:
            _positive("window", w)
            if w < self.sinks:
                raise MultiheadError(f"window {w} keeps fewer tokens than the {self.sinks} sinks: use a window of "
                                     f"at least {self.sinks} or fewer sinks")
        for b in self.bits:
            check_bits(b)
        for f in self.prune:
            check_fraction(f)
        if self.uptrain_steps:
            self.uptrain()  # its own checks
        labels = [plan_label(p) for p in self.plans]
        for path, label in zip(self.plans, labels, strict=True):
            if labels.count(label) > 1:
                raise MultiheadError(f"two plans are named {label!r} ({', '.join(self.plans)}): give the files "
                                     "distinct names")
            load_plan(path)  # a missing or bad file is refused now, not after the full cache has run
        if not 0 <= self.threshold <= 1:
            raise MultiheadError(f"threshold ({self.threshold!r}) must lie in [0, 1]")

    def uptrain(self) -> Any:
        """The uptraining settings of the uptrained MQA model (:class:`multihead.tradeoff.uptrain.UptrainSettings`)."""
        from multihead.tradeoff.uptrain import UptrainSettings

        return UptrainSettings(steps=self.uptrain_steps, lr=self.uptrain_lr, train=self.uptrain_train,
                               every=max(1, min(10, self.uptrain_steps)))

    def methods(self, n_kv_heads: int) -> list[Method]:
        s = self.sinks
        out = [Method("full cache", "full")]
        out += [Method(f"window {share:.0%}", "window", keep=share) for share in self.window_keep]
        out += [Method(f"{s} sinks + window {share:.0%}", "sinks + window", keep=share, sinks=s) for share in self.keep]
        out += [Method(f"{s} sinks + window {w}", "sinks + window (fixed)", window=w, sinks=s) for w in self.windows]
        out += [Method(f"int{b} (g{self.group}, r{self.residual})", "quantized", bits=b, group=self.group,
                       residual=self.residual) for b in self.bits]
        if self.mqa and n_kv_heads > 1:
            out.append(Method(f"MQA, pooled {n_kv_heads} -> 1", "fewer KV heads", model="mqa"))
            if self.uptrain_steps:
                out.append(Method(f"MQA, uptrained {self.uptrain_steps} steps", "fewer KV heads, uptrained",
                                  model="uptrained"))
        out += [Method(f"pruned {f:.0%} of KV groups", "pruned", model=f"pruned-{round(f * 100)}")
                for f in self.prune]
        controls: dict[tuple[float, int, int], Method] = {}  # plans of one share, sinks and window: one control
        for path in self.plans:
            plan, label = load_plan(path), plan_label(path)
            out.append(Method(f"head-wise {label}", f"head-wise ({plan.method or 'plan'})", plan=path))
            key = (plan.full_fraction, plan.sinks, plan.window)
            controls.setdefault(key, Method(
                f"{s} sinks + window = bytes of {plan.full_fraction:.0%} full, {plan.sinks} + {plan.window}",
                "sinks + window (bytes of a plan)", sinks=s, equal_to=path))
        return out + list(controls.values())


# ------------------------------------------------------------------------------------------------------------ scoring
@torch.no_grad()
def prefill(model: Any, ids: Sequence[int], cache: Any, chunk: int) -> Tensor:
    """Feed ``ids`` through ``cache`` in chunks (a server's chunked prefill); the last position's logits (vocab,)."""
    tokens = torch.tensor(list(ids), dtype=torch.long, device=getattr(model, "device", None))[None]  # (1, n)
    out = None
    for start in range(0, tokens.shape[1], chunk):
        part = tokens[:, start:start + chunk]
        out = model(part, cache=cache, logits_to_keep=1)  # the next token's logits only
        cache.advance(part.shape[1])
    if out is None:
        raise MultiheadError("nothing to prefill: the context is empty")
    last: Tensor = out[0, -1]
    return last


@torch.no_grad()
def answer_steps(model: Any, cache: Any, question: Sequence[int], answer: Sequence[int]) -> dict[str, Any]:
    """After the context is in ``cache``: the question as one chunk, then the answer teacher-forced one token a
    step. Returns per answer token its log-probability and argmax, and the seconds of each single-token step."""
    device = getattr(model, "device", None)
    q = torch.tensor(list(question), dtype=torch.long, device=device)[None]  # (1, s)
    logits = model(q, cache=cache)[0, -1]
    cache.advance(q.shape[1])
    logps, picks, steps = [], [], []
    for i, token in enumerate(answer):
        logp = torch.log_softmax(logits.float(), dim=-1)
        logps.append(float(logp[token]))
        picks.append(int(logits.argmax()))
        if i + 1 == len(answer):
            break
        began = time.perf_counter()
        logits = model(torch.tensor([[token]], dtype=torch.long, device=device), cache=cache)[0, -1]
        cache.advance(1)
        steps.append(time.perf_counter() - began)
    return {"logprobs": logps, "argmax": picks, "step_seconds": steps}


def score(case: Case, steps: dict[str, Any]) -> dict[str, Any]:
    """Exact match and log-likelihood of one case from :func:`answer_steps`. ``greedy_ids``: the greedy answer as
    far as it is known (up to and including its first wrong token)."""
    expected = list(case.answer_ids)
    picks = steps["argmax"]
    wrong = next((i for i, (a, b) in enumerate(zip(picks, expected, strict=True)) if a != b), None)
    greedy = picks if wrong is None else picks[:wrong + 1]
    return {"correct": wrong is None, "first_wrong": wrong, "greedy_ids": greedy,
            "answer_logprob": float(sum(steps["logprobs"])), "answer_tokens": len(expected),
            "decode_step_seconds": statistics.median(steps["step_seconds"]) if steps["step_seconds"] else None}


def run_prompt(model: Any, method: Method, cases: Sequence[Case], chunk: int) -> list[dict[str, Any]]:
    """Every case of one prompt (they share ``context_ids``) under one method: one prefill, the cache copied for
    each question but the last."""
    context = cases[0].context_ids
    if any(c.context_ids != context for c in cases):
        raise MultiheadError("run_prompt takes the cases of one prompt: their context_ids differ")
    room = max(len(context) + len(c.question_ids) + len(c.answer_ids) for c in cases)
    cache = method.cache(model, cases[0].length, room)
    began = time.perf_counter()
    prefill(model, context, cache, chunk)
    seconds = time.perf_counter() - began
    out = []
    for i, case in enumerate(cases):
        mine = cache if i + 1 == len(cases) else copy.deepcopy(cache)
        result = score(case, answer_steps(model, mine, case.question_ids, case.answer_ids))
        result.update(id=case.id, method=method.name, task=case.task, length=case.length, depth=case.depth,
                      haystack=case.haystack, group=case.group, prefill_seconds=round(seconds, 4),
                      prefill_tokens=len(context), cache_bytes=int(mine.bytes))
        out.append(result)
    return out


@torch.no_grad()
def long_perplexity(model: Any, method: Method, tokens: Sequence[int], *, context: int, scored: int,
                    windows: int, chunk: int) -> dict[str, Any]:
    """Perplexity of the last ``scored`` tokens of ``windows`` windows of ``context`` held-out tokens, each fed
    through the method's real cache in chunks (windowed caches hold their share of ``context``)."""
    if len(tokens) < context + 1:
        raise MultiheadError(f"the held-out text has {len(tokens):,} tokens, fewer than one perplexity window of "
                             f"{context:,}: use a shorter ppl_context")
    stride = max(1, (len(tokens) - context) // windows)
    total, count = 0.0, 0
    for w in range(windows):
        ids = torch.tensor(list(tokens[w * stride:w * stride + context]), dtype=torch.long)[None]  # (1, context)
        cache = method.cache(model, context, context)
        parts = []
        for start in range(0, context, chunk):
            parts.append(model(ids[:, start:start + chunk], cache=cache)[0, :, :])
            cache.advance(parts[-1].shape[0])
        logits = torch.cat(parts)[-scored - 1:-1]  # (scored, vocab): predictions of the last `scored` tokens
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = -logp.gather(-1, ids[0, -scored:, None]).squeeze(-1)
        total += float(nll.double().sum())
        count += scored
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count, "context": context,
            "windows": windows}


# ------------------------------------------------------------------------------------------------------- statistics
def bootstrap_ci(correct: Sequence[bool], groups: Sequence[str], *, draws: int, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the accuracy, resampling prompts (cases of one prompt move together)."""
    if not correct:
        return (math.nan, math.nan)
    by: dict[str, list[bool]] = {}
    for c, g in zip(correct, groups, strict=True):
        by.setdefault(g, []).append(bool(c))
    hits = np.array([sum(v) for v in by.values()], dtype=float)
    sizes = np.array([len(v) for v in by.values()], dtype=float)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(hits), size=(draws, len(hits)))
    acc = hits[pick].sum(1) / sizes[pick].sum(1)
    lo, hi = np.quantile(acc, [(1 - level) / 2, (1 + level) / 2])
    return (float(lo), float(hi))


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of k successes in n (not degenerate at 0 or n, unlike the bootstrap)."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def summarise(results: Sequence[dict[str, Any]], *, draws: int, seed: int = 0) -> dict[str, Any]:
    correct = [bool(r["correct"]) for r in results]
    k, n = sum(correct), len(correct)
    return {"accuracy": k / n if n else math.nan, "correct": k, "cases": n,
            "prompts": len({r["group"] + str(r["length"]) + r["task"] for r in results}),
            "ci95": bootstrap_ci(correct, [f"{r['length']}|{r['task']}|{r['group']}" for r in results],
                                 draws=draws, seed=seed),
            "wilson95": wilson(k, n),
            "answer_logprob": statistics.fmean(r["answer_logprob"] for r in results) if n else math.nan}


# -------------------------------------------------------------------------------------------------------------- run
def _atomic_json(path: Path, data: Any) -> None:
    from multihead.files import write_text

    write_text(path, json.dumps(data, indent=1))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None  # absent or unreadable: measured again


def _prompts(cases: Sequence[Case]) -> Iterator[list[Case]]:
    by: dict[tuple[int, str, str], list[Case]] = {}
    for c in cases:
        by.setdefault((c.length, c.task, c.group), []).append(c)
    yield from by.values()


def run(settings: Settings, *, out: str | Path, progress: bool = True, model_path: str | None = None,
        text_path: str | None = None, model: Any = None, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """The long-context trade-off: every method's accuracy per (length, task), perplexity on long windows, KV
    bytes at each length, prefill and decode time. Each finished (method, prompt) result is saved under ``out``
    and skipped when the run is repeated with the same settings (a run with other settings is refused there).
    ``model`` and ``tokenizer`` replace the default SmolLM2 (tests). Returns a JSON-ready dict, also written to
    ``out/result.json``, with the table in ``out/table.txt``."""
    import platform
    from datetime import date

    from tqdm import tqdm

    from multihead.tradeoff.text import read_text, token_splits

    began = time.perf_counter()
    say: Callable[[str], None] = (lambda m: tqdm.write(m)) if progress else (lambda _m: None)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    stamp: dict[str, Any] = {"settings": dataclasses.asdict(settings), "model": model_path, "text": text_path,
                             "own_model": model is not None}
    if settings.plans:  # a plan's file may change under the same name: its contents are part of the run
        stamp["plans"] = {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in settings.plans}
    else:
        del stamp["settings"]["plans"]  # so a run recorded before plans existed resumes
    saved = _read_json(folder / "settings.json")
    if saved is not None and saved != json.loads(json.dumps(stamp)):
        raise MultiheadError(f"{folder} holds a run with other settings ({folder / 'settings.json'}): resume with "
                             "the same settings or use another folder")
    _atomic_json(folder / "settings.json", stamp)
    own = model is not None
    if model is None:
        from multihead.models.loaders import load_llama

        model, loaded = load_llama(model_path)
        tokenizer = tokenizer or loaded
    if tokenizer is None:
        raise MultiheadError("a model passed to run() needs its tokenizer")
    max_context = model.config.max_context
    for length in settings.lengths:
        check_length(length, max_context)
    splits = token_splits(tokenizer.encode(read_text(text_path)), least=settings.ppl_context + 1)
    cases = make_cases(settings, tokenizer, splits.test, max_context=max_context)
    write_jsonl(cases, folder / "cases.jsonl")
    models = _models(model, splits.train, settings, folder, progress, say)
    methods = settings.methods(model.config.n_kv_heads)
    results: dict[str, list[dict[str, Any]]] = {}
    excluded: list[dict[str, Any]] = []
    prompts = list(_prompts(cases))
    for method in methods:
        net = models[method.model]
        todo = prompts
        if method.series != "full":
            left_out = {(e["length"], e["task"]) for e in excluded}
            todo = [p for p in prompts if (p[0].length, p[0].task) not in left_out]
        mine: list[dict[str, Any]] = []
        bar = tqdm(todo, desc=method.name[:28], unit="prompt", disable=not progress, leave=False)
        for prompt in bar:
            path = folder / "results" / method.slug / f"{prompt[0].id}.json"
            got = _read_json(path)
            if not (isinstance(got, list) and [r.get("id") for r in got] == [c.id for c in prompt]):
                got = run_prompt(net, method, prompt, settings.chunk)
                _atomic_json(path, got)
            mine += got
        results[method.name] = mine
        if method.series == "full":
            excluded = _excluded(mine, settings)
            for e in excluded:
                say(f"full cache scores {e['accuracy']:.0%} on {e['task']} at {e['length']} tokens, below "
                    f"{settings.threshold:.0%}: that cell is left out of the comparison")
    ppl = {}
    for method in tqdm(methods, desc="perplexity", unit="method", disable=not progress, leave=False):
        path = folder / "perplexity" / f"{method.slug}.json"
        got = _read_json(path)
        if not isinstance(got, dict) or "perplexity" not in got:
            got = long_perplexity(models[method.model], method, splits.test, context=settings.ppl_context,
                                  scored=settings.ppl_scored, windows=settings.ppl_windows, chunk=settings.chunk)
            _atomic_json(path, got)
        ppl[method.name] = got
    rows = [_row(m, models[m.model], results[m.name], ppl[m.name], settings, excluded) for m in methods]
    result = {
        "model": model_path or ("a model given to run()" if own else
                                "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)"),
        "text": text_path or "Jargon File 4.4.7 (Debian jargon-text), held-out split",
        "settings": dataclasses.asdict(settings),
        "cases": len(cases), "prompts": len(prompts),
        "excluded": excluded,
        "rows": rows,
        "dtype": str(model.dtype).replace("torch.", ""),
        "machine": f"{platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}".replace("  ", " "),
        "date": date.today().isoformat(),
        "seconds": round(time.perf_counter() - began, 1),
    }
    _atomic_json(folder / "result.json", result)
    from multihead.files import write_text

    write_text(folder / "table.txt", table(result) + "\n")
    return result


def _excluded(full: Sequence[dict[str, Any]], settings: Settings) -> list[dict[str, Any]]:
    out = []
    for length in settings.lengths:
        for task in settings.tasks:
            cell = [r for r in full if r["length"] == length and r["task"] == task]
            if cell:
                acc = sum(r["correct"] for r in cell) / len(cell)
                if acc < settings.threshold:
                    out.append({"length": length, "task": task, "accuracy": acc, "cases": len(cell)})
    return out


def _models(model: Any, train: Sequence[int], settings: Settings, folder: Path, progress: bool,
            say: Callable[[str], None]) -> dict[str, Any]:
    """The original model and the changed ones the methods need: pooled MQA, uptrained MQA (its checkpoint under
    ``folder/uptrain``, resumed), pruned by one-backward importance."""
    from multihead.tradeoff.lm import IMPORTANCE_BATCH, pooled_model

    models: dict[str, Any] = {"original": model}
    g = model.config.n_kv_heads
    if settings.mqa and g > 1:
        models["mqa"] = pooled_model(model, 1)
        if settings.uptrain_steps:
            from multihead.tradeoff.uptrain import uptrain

            student = pooled_model(model, 1)
            checkpoint = Path(settings.uptrain_from) if settings.uptrain_from else folder / "uptrain"
            uptrain(student, model, train, settings.uptrain(), checkpoint=checkpoint, resume=True, progress=progress)
            models["uptrained"] = student
    if settings.prune:
        from multihead.tradeoff.prune import group_importance, groups_to_keep, prune

        b, s = IMPORTANCE_BATCH
        s = min(s, len(train) // b - 1)
        step = (len(train) - s) // b
        ids = torch.tensor([train[i * step:i * step + s] for i in range(b)], dtype=torch.long)  # (b, s)
        importance = group_importance(model, ids)
        for fraction in settings.prune:
            keep = groups_to_keep(importance, fraction)
            models[f"pruned-{round(fraction * 100)}"] = prune(model, keep)
            say(f"pruned {fraction:.0%} of KV groups: {sum(len(k) for k in keep)} of "
                f"{model.config.n_layers * g} kept")
    return models


def _row(method: Method, model: Any, results: Sequence[dict[str, Any]], ppl: dict[str, Any], settings: Settings,
         excluded: Sequence[dict[str, Any]]) -> dict[str, Any]:
    left_out = {(e["length"], e["task"]) for e in excluded}
    per_length = {}
    for length in settings.lengths:
        mine = [r for r in results if r["length"] == length]
        kept = [r for r in mine if (length, r["task"]) not in left_out]
        cells = {task: summarise([r for r in mine if r["task"] == task], draws=settings.bootstrap)
                 for task in settings.tasks if any(r["task"] == task for r in mine)}
        prefills = {r["group"] + r["task"]: r["prefill_seconds"] for r in mine}
        steps = [r["decode_step_seconds"] for r in mine if r["decode_step_seconds"] is not None]
        per_length[str(length)] = {
            "kv_bytes": int(method.cache(model, length, length).bytes),
            "compared": summarise(kept, draws=settings.bootstrap) if kept else None,
            "tasks": cells,
            "prefill_seconds": statistics.median(prefills.values()) if prefills else None,
            "decode_step_seconds": statistics.median(steps) if steps else None,
        }
    ppl_bytes = int(method.cache(model, settings.ppl_context, settings.ppl_context).bytes)
    row = {"method": method.name, "series": method.series, "model": method.model,
           "window": {str(n): method.window_at(n) for n in settings.lengths}, "sinks": method.sinks,
           "lengths": per_length, "perplexity": {**ppl, "kv_bytes": ppl_bytes}}
    if method.plan is not None:
        plan = load_plan(method.plan)
        row["plan"] = {"file": method.plan, "method": plan.method, "budget": plan.budget,
                       "full_fraction": plan.full_fraction, "sinks": plan.sinks, "window": plan.window,
                       "full": [list(r) for r in plan.full]}
    return row


# ------------------------------------------------------------------------------------------------------------ report
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


__all__ = [
    "ANSWER_ROOM",
    "HAYSTACKS",
    "JSONL_KEYS",
    "TASKS",
    "Case",
    "Haystacks",
    "Method",
    "Settings",
    "answer_steps",
    "bootstrap_ci",
    "equal_bytes_slots",
    "load_plan",
    "make_cases",
    "make_prompt_cases",
    "plan_label",
    "plot",
    "prefill",
    "read_jsonl",
    "run",
    "run_prompt",
    "score",
    "table",
    "wilson",
    "write_jsonl",
]

