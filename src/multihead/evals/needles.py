"""Needle cases in the manner of RULER (Hsieh et al. 2024): a haystack of ``length`` tokens with needles at chosen
depths and a question whose answer the model must copy from a needle.

Written for multihead and for a small model that follows instructions poorly: every prompt ends in a completion cue
("... The pass key is") whose continuation is the answer.

Tasks (``TASKS``)::

    passkey        one pass key (5 digits) in the haystack; cue "The pass key is" (or another wording of
                   ``PASSKEY_PROMPTS``: a model may read one wording's cue as the start of a sentence about the key)
    single-number  one needle "The special magic number for <key> is <7 digits>."; cue asks that key
    single-word    the same with a word value (adjective-noun)
    multikey       ``keys`` needles with distinct keys; each key is asked in its own case (the cases share a prompt)
    multivalue     ``values`` needles for one key; the cue asks for all of them, in the order they appear

Haystacks: ``jargon`` (a passage of the held-out Jargon File split, :mod:`multihead.evals.text`) or ``filler``
(a short paragraph repeated). A prompt is built in token ids so that its length is exactly the target: intro,
haystack with the needles inserted at sentence boundaries nearest their depths (depth = the share of the haystack
before the needle), then the question. Every case has a stable id and a seed fixed by (seed, task, length, prompt
index), so every method, and kvpress (:func:`multihead.evals.case_files.write_jsonl`), sees the same cases.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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


@dataclass(frozen=True)
class PasskeyPrompt:
    """One wording of the passkey task: the ``intro`` before the haystack, the ``needle`` (``{v}`` the key) and the
    ``question`` whose continuation is the key."""

    intro: str
    needle: str
    question: str


PASSKEY_PROMPTS = {
    # multihead's first wording, the SmolLM2 runs': Gemma 3 270M continues its cue with "a hidden key ..."
    "cue": PasskeyPrompt(_INTRO["passkey"], " The pass key is {v}. Remember it. {v} is the pass key.",
                         "\n\nWhat is the pass key? The pass key is"),
    # the key after a colon, in the needle and in the cue, so that only the key continues "The pass key is:"
    "colon": PasskeyPrompt(_INTRO["passkey"], " The pass key is: {v}. Remember it. The pass key is: {v}.",
                           "\n\nWhat is the pass key? The pass key is:"),
    # the key named a number, in the needle and in the cue
    "number": PasskeyPrompt(_INTRO["passkey"], " The pass key is number {v}. Remember it. {v} is the pass key.",
                            "\n\nWhat is the pass key? The pass key is number"),
    # the intro of the passkey test of Mohtashami & Jaggi (2023), as RULER and LongLoRA ask it, with our cue
    "important": PasskeyPrompt("There is an important info hidden inside a lot of irrelevant text. Find it and "
                               "memorize it. I will quiz you about the important information there.\n\n",
                               " The pass key is {v}. Remember it. {v} is the pass key.",
                               "\n\nWhat is the pass key? The pass key is"),
}
DEFAULT_PASSKEY_PROMPT = "cue"


def check_passkey_prompt(name: object) -> str:
    """A wording of :data:`PASSKEY_PROMPTS`, or a MultiheadError naming the choices."""
    if not isinstance(name, str) or name not in PASSKEY_PROMPTS:
        raise MultiheadError(f"unknown passkey prompt {name!r}: choose from {', '.join(PASSKEY_PROMPTS)}")
    return name


class Tokenizer(Protocol):
    """A model's tokenizer as the cases call it: ``encode`` gives a whole text's ids as the model reads a prompt (its
    BOS first where ``add_bos`` and ``bos_id`` say the tokenizer adds one, as multihead's
    :class:`~multihead.models.tokenizer.TextTokenizer` and :class:`~multihead.models.decoder.TransformersTokenizer`
    do); ``decode`` the reverse."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def start_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids every prompt starts with: ``[bos_id]`` where the tokenizer adds a BOS (``add_bos``), else none."""
    bos = getattr(tokenizer, "bos_id", None)
    return [int(bos)] if getattr(tokenizer, "add_bos", False) and bos is not None else []


def piece_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text``'s ids as a piece of a longer prompt: without the BOS its tokenizer puts first (a prompt has one BOS,
    at its start: :func:`start_ids`)."""
    ids = list(tokenizer.encode(text))
    start = start_ids(tokenizer)
    return ids[len(start):] if start and ids[:len(start)] == start else ids


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
        self.filler = piece_ids(tokenizer, _FILLER)
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
                      sources: Haystacks, *, max_context: int, group: str = "", values: int = 3,
                      passkey_prompt: str = DEFAULT_PASSKEY_PROMPT) -> list[Case]:
    """The cases of one prompt. ``depths``: one per needle (``keys`` of them for multikey, ``values`` for
    multivalue, else one). Each case asks one question; multikey gives one case per key, asked in turn.
    ``passkey_prompt``: the passkey task's wording (:data:`PASSKEY_PROMPTS`); the key and haystack are the same in
    every wording, and a case of a wording other than the default has the wording in its id."""
    check_task(task)
    wording = PASSKEY_PROMPTS[check_passkey_prompt(passkey_prompt)]
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
        needles.append(wording.needle.format(v=v))
        questions.append((wording.question, f" {v}"))
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
    intro_text = wording.intro if kind == "passkey" else _INTRO[kind]
    intro = start_ids(tok) + piece_ids(tok, intro_text)  # the model's BOS (if any) once, at the very start
    needle_ids = [piece_ids(tok, n) for n in needles]
    asked = []
    for q, a in questions:
        q_ids, full = piece_ids(tok, q), piece_ids(tok, q + a)
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
        worded = f"~{passkey_prompt}" if task == "passkey" and passkey_prompt != DEFAULT_PASSKEY_PROMPT else ""
        cases.append(Case(id=f"{task}{worded}-{length}-{haystack}-{name}{suffix}", task=task, length=length,
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




def _positive(name: str, value: object, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise MultiheadError(f"{name} ({value!r}) must be an integer of at least {least}")


class CaseSpec(Protocol):
    """What :func:`make_cases` reads of a run's settings."""

    @property
    def lengths(self) -> tuple[int, ...]: ...

    @property
    def tasks(self) -> tuple[str, ...]: ...

    @property
    def haystacks(self) -> tuple[str, ...]: ...

    @property
    def prompts(self) -> int: ...

    @property
    def keys(self) -> int: ...

    @property
    def values(self) -> int: ...

    @property
    def seed(self) -> int: ...

    @property
    def passkey_prompt(self) -> str: ...


@dataclass(frozen=True)
class CaseSettings:
    """Which cases: ``prompts`` prompts per (length, task), ``keys`` needles of a multikey prompt, ``values`` of a
    multivalue one, the haystacks taking turns, every prompt's seed drawn from ``seed``. Checked when made."""

    lengths: tuple[int, ...] = (2048, 4096)
    tasks: tuple[str, ...] = DEFAULT_TASKS
    haystacks: tuple[str, ...] = HAYSTACKS
    prompts: int = 1  # prompts per (length, task); a multikey prompt gives `keys` cases
    keys: int = 4
    values: int = 3
    seed: int = 0
    passkey_prompt: str = DEFAULT_PASSKEY_PROMPT  # the passkey task's wording (PASSKEY_PROMPTS)

    def __post_init__(self) -> None:
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
        _positive("prompts", self.prompts)
        _positive("keys", self.keys, 2)
        _positive("values", self.values, 2)
        _positive("seed", self.seed, 0)
        check_passkey_prompt(self.passkey_prompt)


def make_cases(settings: CaseSpec, tokenizer: Tokenizer, jargon_ids: Sequence[int] | None, *,
               max_context: int) -> list[Case]:
    """Every case of a run: ``settings.prompts`` prompts per (length, task), haystacks taking turns (``settings``: a
    :class:`CaseSettings`, or anything with its fields, such as the long-context trade-off's Settings)."""
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
                                           group=f"p{index}", values=settings.values,
                                           passkey_prompt=settings.passkey_prompt)
    return cases


__all__ = [
    "ANSWER_ROOM",
    "DEFAULT_PASSKEY_PROMPT",
    "DEFAULT_TASKS",
    "HAYSTACKS",
    "JSONL_KEYS",
    "PASSKEY_PROMPTS",
    "TASKS",
    "Case",
    "CaseSettings",
    "CaseSpec",
    "Haystacks",
    "PasskeyPrompt",
    "Tokenizer",
    "case_seed",
    "check_depth",
    "check_length",
    "check_passkey_prompt",
    "check_task",
    "make_cases",
    "make_prompt_cases",
    "piece_ids",
    "prompt_depths",
    "start_ids",
]
