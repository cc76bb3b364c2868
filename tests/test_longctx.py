"""Long-context retrieval (multihead.tradeoff.longctx): case generator, scoring, caches at length, the run."""

from __future__ import annotations

import itertools
import json
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from multihead import MultiheadError
from multihead.cache import quantized_tokens, sink_keep
from multihead.models.llama import LlamaConfig, LlamaModel
from multihead.tradeoff import longctx as lc
from multihead.tradeoff.longctx import runner
from test_kv_compression import _quantized_reference

CHARS = "\n" + string.printable[:95]  # newline, then the printable ASCII characters


class CharTokenizer:
    """One token per character: every split is a token boundary, so prompts built from ids read back exactly."""

    def encode(self, text: str) -> list[int]:
        return [CHARS.index(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(CHARS[i] for i in ids)


TOK = CharTokenizer()
_WORDS = ("system", "hacker", "kernel", "program", "network", "terminal", "memory", "compiler", "bug", "file",
          "user", "machine", "code", "jargon", "manual", "screen", "loop", "archive", "daemon", "byte")


def _prose(n_sentences: int, seed: int = 0) -> str:
    """Plain text with sentences and paragraphs of varied length (a stand-in for the Jargon File)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_sentences):
        n = int(torch.randint(4, 14, (1,), generator=g))
        words = [_WORDS[int(j)] for j in torch.randint(0, len(_WORDS), (n,), generator=g)]
        out.append(" ".join(words).capitalize() + ".")
        if i % 5 == 4:
            out.append("\n\n")
    return " ".join(out).replace(" \n\n ", "\n\n")


JARGON = TOK.encode(_prose(400))


def _hay_position(case: lc.Case, span: tuple[int, int], intro: int) -> int:
    """Where a needle starts in haystack coordinates: its index minus the intro and the needles before it."""
    before = sum(e - s for s, e in case.needles if e <= span[0])
    return span[0] - intro - before


@pytest.mark.parametrize("haystack", lc.HAYSTACKS)
@pytest.mark.parametrize("task", lc.TASKS)
def test_a_case_has_the_target_length_and_its_needles_sit_at_their_depths(task: str, haystack: str) -> None:
    sources = lc.Haystacks(TOK, JARGON)
    n = {"multikey": 3, "multivalue": 3}.get(task, 1)
    for depths in ([0.0] * n, [1.0] * n, [round((j + 0.5) / n, 3) for j in range(n)], [0.37] * n):
        cases = lc.make_prompt_cases(task, 1500, depths, haystack, 7, sources, max_context=4096, values=3)
        assert len(cases) == (3 if task == "multikey" else 1)
        for case in cases:
            prompt = case.context_ids + case.question_ids
            assert len(prompt) == 1500 and case.length == 1500
            assert case.context_ids == cases[0].context_ids  # a multikey prompt is shared by its questions
            text = TOK.decode(prompt)
            assert TOK.decode(case.answer_ids).strip() == case.answer and case.answer_ids[0] == CHARS.index(" ")
            intro = text.index("\n\n") + 2
            needles = sum(e - s for s, e in case.needles)
            h = len(case.context_ids) - intro - needles  # haystack tokens
            hay = [t for i, t in enumerate(case.context_ids[intro:], intro)
                   if not any(s <= i < e for s, e in case.needles)]
            assert len(hay) == h
            ends = [0] + [i + 1 for i, t in enumerate(hay[:-1]) if CHARS[t] in ".!?\n"] + [h]
            gap = max(b - a for a, b in itertools.pairwise(ends))
            for span, depth in zip(case.needles, _depths_of(case, depths), strict=True):
                needle = TOK.decode(case.context_ids[span[0]:span[1]])
                assert needle.startswith(" ") and needle.endswith(".") and ("pass key" in needle or "magic" in needle)
                pos = _hay_position(case, span, intro)
                assert pos in ends  # a needle never splits a sentence
                assert abs(pos - depth * h) <= gap / 2 + 1
                if depth == 0.0:
                    assert pos == 0
                if depth == 1.0:
                    assert pos == h
            asked = TOK.decode(case.context_ids[case.needles[0][0]:case.needles[0][1]])
            if task == "multivalue":
                assert all(v in text for v in case.answer.replace(" and ", ", ").split(", "))
            else:
                assert case.answer in asked  # the first span is the needle the question asks about
            assert TOK.decode(case.question_ids).rstrip().endswith(" is" if task != "multivalue" else " are")


def _depths_of(case: lc.Case, depths: list[float]) -> list[float]:
    """The depths in the order of case.needles (the asked needle first)."""
    if case.task == "multikey":
        k = int(case.id.rsplit("-k", 1)[1])
        return [depths[k]] + [d for j, d in enumerate(depths) if j != k]
    return depths


def test_cases_are_fixed_by_their_seed_and_cover_the_depths() -> None:
    settings = lc.Settings(lengths=(900, 1200), tasks=lc.TASKS, prompts=3, keys=3, values=2, sinks=2)
    a = lc.make_cases(settings, TOK, JARGON, max_context=2048)
    b = lc.make_cases(settings, TOK, JARGON, max_context=2048)
    assert [c.to_json() for c in a] == [c.to_json() for c in b]
    assert len({c.id for c in a}) == len(a) == 2 * 3 * (4 + 3)
    other = lc.make_cases(lc.Settings(lengths=(900, 1200), tasks=lc.TASKS, prompts=3, keys=3, values=2, sinks=2,
                                      seed=1), TOK, JARGON, max_context=2048)
    assert [c.answer for c in other] != [c.answer for c in a]
    single = [c.depth for c in a if c.task == "passkey" and c.length == 900]
    assert len(set(single)) == len(single) and min(single) < 0.4 and max(single) > 0.6
    assert single == [c.depth for c in a if c.task == "passkey" and c.length == 1200]  # lengths compare alike
    assert {c.haystack for c in a} == set(lc.HAYSTACKS)
    assert all(0 <= c.depth <= 1 for c in a)


def test_each_passkey_wording_asks_the_same_key_in_its_own_words() -> None:
    """--passkey-prompt: every wording of PASSKEY_PROMPTS hides the same key in the same haystack (one seed), with
    its own intro, needle and cue, the answer the key alone; a wording other than the default is named in the id;
    the other tasks are unchanged; an unknown wording is refused naming the choices."""
    from multihead.evals.needles import PASSKEY_PROMPTS

    def cases(wording: str) -> list[lc.Case]:
        return lc.make_cases(lc.Settings(lengths=(700,), tasks=("passkey", "single-number"), prompts=2,
                                         passkey_prompt=wording), TOK, JARGON, max_context=2048)

    default = cases("cue")
    assert [c.id for c in default] == ["passkey-700-jargon-p0", "passkey-700-filler-p1", "single-number-700-filler-p0",
                                       "single-number-700-jargon-p1"]
    assert set(PASSKEY_PROMPTS) == {"cue", "colon", "number", "important"}
    for name, wording in PASSKEY_PROMPTS.items():
        got = cases(name)
        for mine, theirs in zip(got, default, strict=True):
            assert len(mine.context_ids) + len(mine.question_ids) == 700
            assert mine.answer == theirs.answer and mine.depth == theirs.depth
            if mine.task != "passkey":
                assert mine.to_json() == theirs.to_json()
                continue
            assert mine.id == theirs.id.replace("passkey-", "passkey~" + name + "-" if name != "cue" else "passkey-")
            text = TOK.decode(mine.context_ids)
            assert text.startswith(wording.intro) and wording.needle.format(v=mine.answer) in text
            assert TOK.decode(mine.question_ids).endswith(wording.question)
            assert TOK.decode(mine.answer_ids) == " " + mine.answer
            span = mine.needles[0]
            assert TOK.decode(mine.context_ids[span[0]:span[1]]) == wording.needle.format(v=mine.answer)
    with pytest.raises(MultiheadError, match="unknown passkey prompt 'loud': choose from cue, colon, number, "
                                             "important"):
        lc.Settings(lengths=(700,), tasks=("passkey",), passkey_prompt="loud")


def test_cases_round_trip_through_the_jsonl_the_kvpress_side_reads(tmp_path: Path) -> None:
    settings = lc.Settings(lengths=(900,), tasks=lc.TASKS, keys=2, values=2, sinks=2)
    cases = lc.make_cases(settings, TOK, JARGON, max_context=2048)
    path = lc.write_jsonl(cases, tmp_path / "cases.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == len(cases)
    for line in lines:
        rec = json.loads(line)
        assert list(rec) == list(lc.JSONL_KEYS)
        assert isinstance(rec["context_ids"], list) and isinstance(rec["depth"], float)
        assert rec["haystack"] in ("jargon", "filler")
    back = lc.read_jsonl(path)
    assert [c.to_json() for c in back] == [c.to_json() for c in cases]
    multikey = [c for c in back if c.task == "multikey"]
    assert len({c.group for c in multikey}) == 1  # the shared prompt is found again from the ids
    (tmp_path / "bad.jsonl").write_text('{"id": "x"}\n')
    with pytest.raises(MultiheadError, match="exactly the keys"):
        lc.read_jsonl(tmp_path / "bad.jsonl")


def test_real_tokenizer_cases_have_exact_lengths_and_answers(smollm2) -> None:  # type: ignore[no-untyped-def]
    from multihead.evals.text import read_text, token_splits

    model, tokenizer = smollm2
    test = token_splits(tokenizer.encode(read_text())).test
    settings = lc.Settings(lengths=(1024, 8192 - lc.ANSWER_ROOM), tasks=lc.TASKS, prompts=2)
    cases = lc.make_cases(settings, tokenizer, test, max_context=model.config.max_context)
    for case in cases:
        assert len(case.context_ids) + len(case.question_ids) == case.length
        assert tokenizer.decode(case.answer_ids) == " " + case.answer
        start, end = case.needles[0]
        needle = tokenizer.decode(case.context_ids[start:end])
        if case.task != "multivalue":
            assert case.answer in needle
    with pytest.raises(MultiheadError, match=r"length 8,161 exceeds the model's context of 8,192"):
        lc.make_cases(lc.Settings(lengths=(8161,)), tokenizer, test, max_context=model.config.max_context)


# ------------------------------------------------------------------------------------------------------------ scoring
class _Held:
    """A stand-in cache for the copy model: the tokens seen so far."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.pending: list[int] = []

    def advance(self, s: int) -> None:
        assert len(self.pending) == s
        self.tokens += self.pending
        self.pending = []

    @property
    def bytes(self) -> int:
        return 8 * len(self.tokens)


class CopyModel:
    """A hand-made induction model: the next token is the one that followed the most recent earlier occurrence of
    the longest suffix (up to 24 tokens) of the text so far; ``copy=False`` predicts token 0 instead."""

    config = LlamaConfig(vocab_size=len(CHARS), d_model=8, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=8,
                         max_context=4096)

    def __init__(self, copy: bool = True) -> None:
        self.copy = copy

    def new_cache(self, batch: int, max_len: int | None = None, **_: Any) -> _Held:  # any kind, spec= too
        return _Held()

    def __call__(self, tokens: torch.Tensor, *, cache: _Held, logits_to_keep: int = 0) -> torch.Tensor:
        cache.pending = tokens[0].tolist()
        seen = cache.tokens + cache.pending
        logits = torch.zeros(1, tokens.shape[1], len(CHARS))
        logits[0, -1, self._next(seen) if self.copy else 0] = 1.0  # only the last position is read
        return logits[:, -logits_to_keep:] if logits_to_keep else logits

    @staticmethod
    def _next(seen: list[int]) -> int:
        p = len(seen) - 1
        best, at = 0, None
        for j in range(p - 1, -1, -1):
            k = 0
            while k < 24 and j - k >= 0 and seen[j - k] == seen[p - k]:
                k += 1
            if k > best:
                best, at = k, j
        return 0 if at is None else seen[at + 1]


@pytest.mark.parametrize("task", lc.TASKS)
def test_a_copying_model_scores_a_needle_case_right_and_a_non_copying_one_wrong(task: str) -> None:
    sources = lc.Haystacks(TOK, JARGON)
    n = {"multikey": 3, "multivalue": 2}.get(task, 1)
    cases = lc.make_prompt_cases(task, 700, [0.2 + 0.3 * j for j in range(n)], "jargon", 3, sources,
                                 max_context=4096, values=2)
    full = lc.Method("full cache", "full")
    if task != "multivalue":  # copying the needle is the answer; a list of values in order needs more than a copy
        right = lc.run_prompt(CopyModel(), full, cases, chunk=128)
        assert [r["correct"] for r in right] == [True] * len(cases)
        assert [TOK.decode(r["greedy_ids"]) for r in right] == [" " + c.answer for c in cases]
    wrong = lc.run_prompt(CopyModel(copy=False), full, cases, chunk=128)
    assert [r["correct"] for r in wrong] == [False] * len(cases)
    assert all(r["first_wrong"] == 0 and len(r["greedy_ids"]) == 1 for r in wrong)
    if task != "multivalue":
        assert all(a["answer_logprob"] > b["answer_logprob"] for a, b in zip(right, wrong, strict=True))


def test_the_copy_model_fails_once_the_needle_is_dropped_from_what_it_sees() -> None:
    """The scoring reads what the model sees: the same case with the needle's value altered fails."""
    sources = lc.Haystacks(TOK, JARGON)
    case = lc.make_prompt_cases("single-number", 700, [0.3], "filler", 5, sources, max_context=4096)[0]
    _s, e = case.needles[0]
    context = list(case.context_ids)
    context[e - 3] = CHARS.index("9") if CHARS[context[e - 3]] != "9" else CHARS.index("8")
    altered = lc.Case(**{**case.__dict__, "context_ids": tuple(context)})
    (r,) = lc.run_prompt(CopyModel(), lc.Method("full cache", "full"), [altered], chunk=64)
    assert not r["correct"] and r["first_wrong"] == len(case.answer_ids) - 2


def _tiny(seed: int = 0, max_context: int = 640, vocab: int = 50) -> LlamaModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      max_context=max_context)
    model = LlamaModel(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)  # large weights: attention far from uniform, so evictions show
    return model


def test_score_is_exactly_greedy_decoding() -> None:
    """Exact match by teacher forcing equals comparing a real greedy decode; greedy_ids is the decode's prefix."""
    model = _tiny()
    g = torch.Generator().manual_seed(1)
    context = torch.randint(0, 50, (90,), generator=g).tolist()
    question = [3, 4, 5]
    cache = model.new_cache(1, 120)
    logits = lc.prefill(model, context + question, cache, chunk=32)
    greedy = []
    for _ in range(6):
        greedy.append(int(logits.argmax()))
        logits = model(torch.tensor([[greedy[-1]]]), cache=cache)[0, -1]
        cache.advance(1)
    for answer, correct, known in ((greedy, True, 6), ([*greedy[:2], (greedy[2] + 1) % 50, *greedy[3:]], False, 3)):
        case = lc.Case(id="x", task="passkey", length=93, depth=0.5, haystack="filler", seed=0,
                       context_ids=tuple(context), question_ids=tuple(question), answer_ids=tuple(answer),
                       answer="", group="g")
        (r,) = lc.run_prompt(model, lc.Method("full cache", "full"), [case], chunk=32)
        assert r["correct"] is correct and r["greedy_ids"] == greedy[:known]


# ------------------------------------------------------------------------------------------- the caches at length
def _reference(model: LlamaModel, method: lc.Method, tokens: torch.Tensor, starts: list[int],
               length: int) -> torch.Tensor:
    """The uncached model under the same compression, given where each call through the cache began."""
    n = tokens.shape[1]
    window = method.window_at(length)
    if window is not None:
        positions = torch.arange(n)
        return model(tokens, mask=sink_keep(positions, positions, window=window, sink_tokens=method.sinks))
    if method.bits is not None:
        begin = [max(s for s in starts if s <= i) for i in range(n)]
        quantized = [quantized_tokens(b, group=method.group, residual=method.residual) for b in begin]
        return _quantized_reference(model, tokens, quantized, method.bits, method.group)
    return model(tokens)


@pytest.mark.parametrize("method", [
    lc.Method("full cache", "full"),
    lc.Method("window 25%", "window", keep=0.25),
    lc.Method("4 sinks + window 25%", "sinks + window", keep=0.25, sinks=4),
    lc.Method("2 sinks + window 40", "sinks + window (fixed)", window=40, sinks=2),
    lc.Method("int4", "quantized", bits=4, group=8, residual=16),
    lc.Method("int2", "quantized", bits=2, group=8, residual=0),
], ids=lambda m: m.slug)
def test_chunked_prefill_and_answer_steps_equal_the_uncached_model_under_the_same_compression(
        method: lc.Method) -> None:
    model = _tiny()
    g = torch.Generator().manual_seed(2)
    # long enough for several chunks, evictions and quantized groups; the quantized reference runs query by query
    n_context, n_question, n_answer = (190 if method.bits else 430), 7, 5
    ids = torch.randint(0, 50, (1, n_context + n_question + n_answer), generator=g)
    context, question = ids[0, :n_context].tolist(), ids[0, n_context:n_context + n_question].tolist()
    answer = ids[0, n_context + n_question:].tolist()
    case = lc.Case(id="c", task="single-number", length=n_context + n_question, depth=0.5, haystack="filler",
                   seed=0, context_ids=tuple(context), question_ids=tuple(question), answer_ids=tuple(answer),
                   answer="", group="g")
    chunk = 96
    cache = method.cache(model, case.length, ids.shape[1])
    last = lc.prefill(model, context, cache, chunk)
    steps = lc.answer_steps(model, cache, question, answer)
    starts = [*range(0, n_context, chunk), n_context, *range(n_context + n_question, ids.shape[1])]
    with torch.no_grad():
        reference = _reference(model, method, ids, starts, case.length)[0]  # (n, vocab)
    torch.testing.assert_close(last, reference[n_context - 1], atol=1e-4, rtol=1e-4)
    logp = torch.log_softmax(reference[n_context + n_question - 1:-1].double(), -1)
    expected = [float(logp[i, t]) for i, t in enumerate(answer)]
    assert steps["logprobs"] == pytest.approx(expected, abs=1e-4)
    assert steps["argmax"] == logp.argmax(-1).tolist()
    if method.window_at(case.length) is not None:  # the window really evicts: the full model differs
        with torch.no_grad():
            full = model(ids)[0]
        assert (full[n_context - 1] - last).abs().max() > 1e-3
        assert cache.bytes < model.new_cache(1, ids.shape[1]).bytes


def test_questions_of_one_prompt_share_its_prefill_and_score_as_if_alone() -> None:
    model = _tiny()
    g = torch.Generator().manual_seed(3)
    context = torch.randint(0, 50, (120,), generator=g).tolist()
    cases = [lc.Case(id=f"k{i}", task="multikey", length=126, depth=0.5, haystack="filler", seed=0,
                     context_ids=tuple(context), question_ids=tuple(torch.randint(0, 50, (6,), generator=g).tolist()),
                     answer_ids=tuple(torch.randint(0, 50, (4,), generator=g).tolist()), answer="", group="g")
             for i in range(3)]
    for method in (lc.Method("sinks", "sinks + window", keep=0.25, sinks=2), lc.Method("int4", "quantized", bits=4,
                                                                                         group=8, residual=16)):
        together = lc.run_prompt(model, method, cases, chunk=64)
        alone = [lc.run_prompt(model, method, [c], chunk=64)[0] for c in cases]
        for a, b in zip(together, alone, strict=True):
            assert a["answer_logprob"] == pytest.approx(b["answer_logprob"], abs=1e-5)
            assert a["greedy_ids"] == b["greedy_ids"]


def test_bootstrap_resamples_prompts_and_the_wilson_interval_is_not_degenerate() -> None:
    lo, hi = lc.bootstrap_ci([True] * 4, ["a"] * 4, draws=200)
    assert (lo, hi) == (1.0, 1.0)  # one prompt: resampling prompts cannot vary it
    lo, hi = lc.bootstrap_ci([True, False, True, False, True, True], list("abcdef"), draws=2000)
    assert 0.1 < lo < 0.67 < hi <= 1.0
    wlo, whi = lc.wilson(4, 4)
    assert 0.45 < wlo < 0.55 and whi == pytest.approx(1.0)  # 4 of 4 only shows accuracy above ~51%


# ---------------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tasks": ("passkey", "needle")}, r"unknown task 'needle': choose from passkey, single-number"),
    ({"keep": (0.001,), "lengths": (1024,)}, r"keep 0.001 of 1024 tokens holds 1 tokens, fewer than the 4 sinks"),
    ({"windows": (3,)}, r"window 3 keeps fewer tokens than the 4 sinks"),
    ({"keep": (1.5,)}, r"keep share \(1.5\) must lie in \(0, 1\)"),
    ({"haystacks": ("essay",)}, r"unknown haystack 'essay'"),
    ({"lengths": ()}, "lengths is empty"),
    ({"prompts": 0}, r"prompts \(0\) must be an integer of at least 1"),
    ({"bits": (3,)}, r"bits \(3\) is not a supported cache width"),
])
def test_bad_settings_are_refused_with_the_value_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(MultiheadError, match=message):
        lc.Settings(**kwargs)


def test_bad_case_inputs_are_refused_with_the_value_named() -> None:
    sources = lc.Haystacks(TOK, JARGON)
    with pytest.raises(MultiheadError, match=r"depth \(1.5\) must lie in \[0, 1\]"):
        lc.make_prompt_cases("passkey", 700, [1.5], "filler", 0, sources, max_context=4096)
    with pytest.raises(MultiheadError, match=r"depth \(-0.1\) must lie in \[0, 1\]"):
        lc.make_prompt_cases("multikey", 700, [0.5, -0.1], "filler", 0, sources, max_context=4096)
    with pytest.raises(MultiheadError, match="unknown task 'niah'"):
        lc.make_prompt_cases("niah", 700, [0.5], "filler", 0, sources, max_context=4096)
    with pytest.raises(MultiheadError, match=r"length 5,000 exceeds the model's context of 4,096 tokens with 48 "
                                             r"left for the answer: use at most 4,048"):
        lc.make_prompt_cases("passkey", 5000, [0.5], "filler", 0, sources, max_context=4096)
    with pytest.raises(MultiheadError, match="length 100 is too short for passkey"):
        lc.make_prompt_cases("passkey", 100, [0.5], "filler", 0, sources, max_context=4096)
    with pytest.raises(MultiheadError, match="unknown haystack 'essay'"):
        lc.make_prompt_cases("passkey", 700, [0.5], "essay", 0, sources, max_context=4096)


# ------------------------------------------------------------------------------------------------------- the run
def _run_inputs(tmp_path: Path) -> tuple[LlamaModel, Path]:
    text = tmp_path / "text.txt"
    text.write_text(_prose(1400, seed=4))
    return _tiny(max_context=1024, vocab=len(CHARS)), text


def _settings(**kw: Any) -> lc.Settings:
    base: dict[str, Any] = {"lengths": (400, 500), "tasks": ("passkey", "multikey"), "keys": 2, "values": 2,
                            "chunk": 128, "sinks": 2, "keep": (0.5,), "window_keep": (0.25,), "windows": (32,),
                            "bits": (4,), "group": 8, "residual": 16, "uptrain_steps": 1, "prune": (0.5,),
                            "ppl_context": 256, "ppl_scored": 64, "threshold": 0.0, "bootstrap": 100}
    return lc.Settings(**{**base, **kw})


def test_a_tiny_run_writes_table_json_and_png_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, text = _run_inputs(tmp_path)
    out = tmp_path / "run"
    result = lc.run(_settings(), out=out, progress=False, text_path=str(text), model=model, tokenizer=TOK)
    names = [r["method"] for r in result["rows"]]
    assert names == ["full cache", "window 25%", "2 sinks + window 50%", "2 sinks + window 32", "int4 (g8, r16)",
                     "MQA, pooled 2 -> 1", "MQA, uptrained 1 steps", "pruned 50% of KV groups"]
    assert result["cases"] == 2 * (1 + 2) and result["excluded"] == []
    full, window, half, fixed = result["rows"][:4]
    for n in ("400", "500"):
        assert half["lengths"][n]["kv_bytes"] * 2 == full["lengths"][n]["kv_bytes"]  # sinks + window - 1 = n / 2
        assert window["lengths"][n]["kv_bytes"] * 4 == full["lengths"][n]["kv_bytes"]
        assert fixed["lengths"][n]["kv_bytes"] * int(n) == full["lengths"][n]["kv_bytes"] * 33
        assert full["lengths"][n]["compared"]["cases"] == 3 and full["lengths"][n]["prefill_seconds"] > 0
    assert result["rows"][-1]["lengths"]["500"]["kv_bytes"] * 2 == full["lengths"]["500"]["kv_bytes"]  # pruned
    assert result["rows"][5]["lengths"]["500"]["kv_bytes"] * 2 == full["lengths"]["500"]["kv_bytes"]  # 2 KV heads -> 1
    assert all(r["perplexity"]["perplexity"] > 1 for r in result["rows"])
    on_disk = json.loads((out / "result.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(result["rows"]))
    assert "left out" not in (out / "table.txt").read_text() and "full cache" in (out / "table.txt").read_text()
    assert len((out / "cases.jsonl").read_text().splitlines()) == result["cases"]
    png = lc.plot(result, tmp_path / "longctx.png")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    calls: list[str] = []
    real = lc.run_prompt

    def counted(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        calls.append(args[1].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_prompt", counted)  # the name run() calls
    again = lc.run(_settings(), out=out, progress=False, text_path=str(text), model=model, tokenizer=TOK)
    assert calls == [] and again["rows"] == result["rows"]  # every (method, prompt) was read back, none re-run
    (out / "results" / "int4-g8-r16" / f"{result_case(out, 'passkey', 500)}.json").unlink()
    third = lc.run(_settings(), out=out, progress=False, text_path=str(text), model=model, tokenizer=TOK)
    assert calls == ["int4 (g8, r16)"]  # only the missing (method, prompt) ran again, with the same outcome
    assert [r["lengths"][n]["tasks"] for r in third["rows"] for n in ("400", "500")] == [
        r["lengths"][n]["tasks"] for r in result["rows"] for n in ("400", "500")]
    with pytest.raises(MultiheadError, match="holds a run with other settings"):
        lc.run(_settings(seed=5), out=out, progress=False, text_path=str(text), model=model, tokenizer=TOK)


def result_case(out: Path, task: str, length: int) -> str:
    return next(json.loads(line)["id"] for line in (out / "cases.jsonl").read_text().splitlines()
                if json.loads(line)["task"] == task and json.loads(line)["length"] == length)


def test_cells_the_full_cache_fails_are_reported_and_not_run_for_other_methods(tmp_path: Path) -> None:
    model, text = _run_inputs(tmp_path)
    result = lc.run(_settings(lengths=(400,), threshold=1.0, uptrain_steps=0, prune=(), windows=(), mqa=False),
                    out=tmp_path / "r", progress=False, text_path=str(text), model=model, tokenizer=TOK)
    assert {(e["length"], e["task"]) for e in result["excluded"]} == {(400, "passkey"), (400, "multikey")}
    assert all(r["lengths"]["400"]["compared"] is None for r in result["rows"])
    assert result["rows"][0]["lengths"]["400"]["tasks"]["multikey"]["cases"] == 2  # the full cache was measured
    assert all(r["lengths"]["400"]["tasks"] == {} for r in result["rows"][1:])  # the others were not run
    assert "left out: passkey at 400 tokens" in (tmp_path / "r" / "table.txt").read_text()


def test_a_run_refuses_a_length_beyond_the_models_context(tmp_path: Path) -> None:
    model, text = _run_inputs(tmp_path)
    with pytest.raises(MultiheadError, match=r"length 1,000 exceeds the model's context of 1,024"):
        lc.run(_settings(lengths=(1000,)), out=tmp_path / "r", progress=False, text_path=str(text), model=model,
               tokenizer=TOK)


def test_a_failed_run_leaves_what_it_made_only_once_it_has_measured(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before anything is written (a length past the context); stopped before the first result (Ctrl-C):
    the files and folders it made are gone; stopped after one: they stay, and the run resumes from them."""
    model, text = _run_inputs(tmp_path)
    out = tmp_path / "new" / "run"
    quick = {"lengths": (400,), "tasks": ("passkey",), "uptrain_steps": 0, "prune": (), "windows": (),
             "mqa": False, "window_keep": (), "bits": ()}
    with pytest.raises(MultiheadError, match="exceeds the model's context"):
        lc.run(_settings(**{**quick, "lengths": (1000,)}), out=out, progress=False, text_path=str(text),
               model=model, tokenizer=TOK)
    assert not (tmp_path / "new").exists()
    real = lc.run_prompt
    calls: list[str] = []

    def stop_at(n: int) -> Any:
        def counted(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
            calls.append(args[1].name)
            if len(calls) > n:
                raise KeyboardInterrupt
            return real(*args, **kwargs)
        return counted

    monkeypatch.setattr(runner, "run_prompt", stop_at(0))
    with pytest.raises(KeyboardInterrupt):
        lc.run(_settings(**quick), out=out, progress=False, text_path=str(text), model=model, tokenizer=TOK)
    assert not (tmp_path / "new").exists()
    monkeypatch.setattr(runner, "run_prompt", stop_at(1))
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        lc.run(_settings(**quick), out=out, progress=False, text_path=str(text), model=model, tokenizer=TOK)
    assert (out / "settings.json").is_file() and len(list((out / "results").rglob("*.json"))) == 1
    monkeypatch.setattr(runner, "run_prompt", real)
    done = lc.run(_settings(**quick), out=out, progress=False, text_path=str(text), model=model, tokenizer=TOK)
    assert [r["method"] for r in done["rows"]] == ["full cache", "2 sinks + window 50%"]


# ------------------------------------------------------------------------------------------------- head-wise plans
def _tiny_plan(tmp_path: Path, model: LlamaModel, name: str = "mixed-plan.json", *, window: int = 24) -> str:
    from multihead.cache import HeadPlan

    c = model.config
    plan = HeadPlan(full=((True, False), (False, True)), sinks=2, window=window, model="tiny",
                    shape=(c.n_layers, c.n_heads, c.n_kv_heads, c.d_model // c.n_heads), method="test", budget=0.5)
    return str(plan.save(tmp_path / name))


def test_a_plan_method_decodes_as_the_uncached_model_under_the_plans_per_head_mask(tmp_path: Path) -> None:
    from multihead.layers.linear import linear

    model = _tiny()
    path = _tiny_plan(tmp_path, model)
    method = lc.Method("head-wise mixed", "head-wise (test)", plan=path)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (1, 230), generator=g)
    context, question, answer = ids[0, :200].tolist(), ids[0, 200:225].tolist(), ids[0, 225:].tolist()
    cache = method.cache(model, 225, ids.shape[1])
    last = lc.prefill(model, context, cache, chunk=64)  # chunks longer than the window: eviction inside a chunk
    steps = lc.answer_steps(model, cache, question, answer)
    masks = lc.load_plan(path).mask(ids.shape[1])  # (L, h, n, n): each layer under its own per-head mask
    with torch.no_grad():
        h = model.embed(ids)
        for i, block in enumerate(model.layers):
            h = block(h, step=block.attn.step(h, mask=masks[i][None]))
        reference = linear(model.norm(h), model.embed.weight)[0]  # (n, vocab)
        full = model(ids)[0]
    torch.testing.assert_close(last, reference[199], atol=1e-4, rtol=1e-4)
    assert (full[199] - last).abs().max() > 1e-3  # the streaming heads really forget
    logp = torch.log_softmax(reference[224:-1].double(), -1)
    assert steps["logprobs"] == pytest.approx([float(logp[i, t]) for i, t in enumerate(answer)], abs=1e-4)
    # the uniform control holds the plan's bytes: half the KV heads full (225 slots), half 2 + 24 - 1 slots
    control = lc.Method("control", "sinks + window (bytes of a plan)", sinks=2, equal_to=path)
    slots = lc.equal_bytes_slots(lc.load_plan(path), 225)
    assert slots == round(0.5 * 225 + 0.5 * 25) and control.window_at(225) == slots - 2 + 1
    assert control.cache(model, 225, 225).bytes == pytest.approx(method.cache(model, 225, 225).bytes, rel=0.01)


def _drawn_texts(fig: Any) -> list[tuple[str, Any]]:
    """Every text the figure really draws (tick labels outside the view are never drawn), with its box in pixels."""
    import matplotlib.text

    drawn: list[tuple[str, Any]] = []
    real = matplotlib.text.Text.draw

    def draw(self: Any, renderer: Any) -> None:
        real(self, renderer)
        if self.get_visible() and self.get_text().strip():
            drawn.append((self.get_text(), self.get_window_extent(renderer)))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matplotlib.text.Text, "draw", draw)
        fig.canvas.draw()
    return drawn


def _layout_faults(fig: Any) -> list[str]:
    """Texts cut by the figure's edge and pairs of texts that overlap, by their drawn boxes."""
    texts = _drawn_texts(fig)
    edge = fig.bbox
    faults = [f"cut: {t!r}" for t, b in texts
              if b.x0 < edge.x0 - 1 or b.y0 < edge.y0 - 1 or b.x1 > edge.x1 + 1 or b.y1 > edge.y1 + 1]
    for (t, a), (u, b) in itertools.combinations(texts, 2):
        if min(a.x1, b.x1) - max(a.x0, b.x0) > 0.5 and min(a.y1, b.y1) - max(a.y0, b.y0) > 0.5:
            faults.append(f"overlap: {t!r} and {u!r}")
    return faults


def _ink_at_the_edges(png: Path, frame: int = 2) -> list[str]:
    """The edges of a saved picture where something is drawn (not the white background) within ``frame`` pixels: a
    title or a label cut by the canvas leaves its ink there."""
    import matplotlib.image

    ink = (matplotlib.image.imread(str(png))[..., :3] < 0.95).any(-1)  # (rows, columns)
    edges = {"top": ink[:frame], "bottom": ink[-frame:], "left": ink[:, :frame], "right": ink[:, -frame:]}
    return [f"{name}: {int(e.sum())} pixels" for name, e in edges.items() if e.any()]


def test_the_picture_keeps_every_text_inside_and_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 42: the long-context PNG's title was clipped with one length and its labels overlapped. A run with a
    method of every kind, drawn for two lengths and for one: every text the figure draws lies inside it and no two
    overlap (their drawn boxes); the PNG is the figure that was checked."""
    import matplotlib.pyplot as plt

    import multihead.files

    model, text = _run_inputs(tmp_path)
    plan = _tiny_plan(tmp_path, model, "smollm2-retrieval-best-plan.json")
    result = lc.run(_settings(keep=(0.5, 0.25), bits=(8, 4, 2), plans=(plan,)), out=tmp_path / "run",
                    progress=False, text_path=str(text), model=model, tokenizer=TOK)
    one = {**result, "settings": {**result["settings"], "lengths": [400]},
           "rows": [{**r, "lengths": {"400": r["lengths"]["400"]}} for r in result["rows"]]}
    saved: list[Any] = []
    real = multihead.files.save_figure

    def keep(fig: Any, path: Any) -> Any:
        saved.append(fig)
        return real(fig, path)

    monkeypatch.setattr(multihead.files, "save_figure", keep)
    monkeypatch.setattr(plt, "close", lambda *_: None)  # the figures stay open to be measured
    for case, res in (("two lengths", result), ("one length", one)):
        png = Path(lc.plot(res, tmp_path / f"{case}.png"))
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        fig = saved[-1]
        texts = [t for t, _ in _drawn_texts(fig)]
        assert len(result["rows"]) == 13 and all(any(r["method"] in t for t in texts) for r in res["rows"])
        assert _layout_faults(fig) == [], case
        assert _ink_at_the_edges(png) == [], case  # the PNG itself, read back as pixels: nothing cut at its edges
    plt.close("all")


def test_the_table_shows_whole_names_in_columns_that_say_what_they_hold(tmp_path: Path) -> None:
    """issue 42: names were cut at 30 characters and two columns were both "MiB". Every method's name starts its row
    whole; every row's separators stand under the header's; each block is headed by its length or by perplexity and
    its window, and every MiB column is a "KV MiB"."""
    model, text = _run_inputs(tmp_path)
    plan = _tiny_plan(tmp_path, model, "smollm2-retrieval-best-plan.json")
    result = lc.run(_settings(lengths=(400,), tasks=("passkey",), plans=(plan,), uptrain_steps=0, prune=(),
                              windows=(), bits=(4,), mqa=False), out=tmp_path / "run", progress=False,
                    text_path=str(text), model=model, tokenizer=TOK)
    lines = lc.table(result).splitlines()
    names = [r["method"] for r in result["rows"]]
    assert max(len(n) for n in names) > 30  # the control's name: "2 sinks + window = bytes of 50% full, 2 + 24"
    head, sub, rule = lines[1:4]
    body = lines[4:4 + len(names)]
    assert [line[:len(n) + 1] for line, n in zip(body, names, strict=True)] == [n + " " for n in names]
    bars = [i for i, ch in enumerate(sub) if ch == "|"]
    assert len(bars) == 2 and all([i for i, ch in enumerate(line) if ch == "|"] == bars for line in [head, *body])
    assert set(rule) == {"-"}
    assert "| 400 tokens" in head and "| perplexity, 256 tokens" in head
    assert re.findall(r"\S+ MiB", sub) == ["KV MiB", "KV MiB"] and sub.split("|")[2].split() == ["ppl", "KV", "MiB"]


def test_the_layout_check_sees_a_cut_title_and_overlapping_labels() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    fig.suptitle("a title far too long for a figure three inches wide, cut at both ends")
    ax.annotate("one label", (0.5, 0.5))
    ax.annotate("another label", (0.52, 0.5))
    faults = _layout_faults(fig)
    plt.close(fig)
    assert any(f.startswith("cut: 'a title") for f in faults)
    assert "overlap: 'one label' and 'another label'" in faults


def test_a_run_with_plans_measures_each_plan_and_its_equal_bytes_control(tmp_path: Path) -> None:
    model, text = _run_inputs(tmp_path)
    path = _tiny_plan(tmp_path, model)
    (tmp_path / "b").mkdir()
    other = _tiny_plan(tmp_path / "b", model, "other-plan.json")  # the same share, sinks and window: one control
    settings = _settings(lengths=(400,), tasks=("passkey",), plans=(path, other), uptrain_steps=0, prune=(),
                         windows=(), bits=(), mqa=False, keep=(), window_keep=())
    result = lc.run(settings, out=tmp_path / "r", progress=False, text_path=str(text), model=model, tokenizer=TOK)
    rows = {r["method"]: r for r in result["rows"]}
    control_name = "2 sinks + window = bytes of 50% full, 2 + 24"
    assert list(rows) == ["full cache", "head-wise mixed", "head-wise other", control_name]
    plan_row, control = rows["head-wise mixed"], rows[control_name]
    assert plan_row["plan"]["full"] == [[True, False], [False, True]] and plan_row["series"] == "head-wise (test)"
    full_bytes = rows["full cache"]["lengths"]["400"]["kv_bytes"]
    assert plan_row["lengths"]["400"]["kv_bytes"] == full_bytes // 2 + full_bytes // 2 * 25 // 400
    assert control["lengths"]["400"]["kv_bytes"] == pytest.approx(plan_row["lengths"]["400"]["kv_bytes"], rel=0.01)
    assert "head-wise mixed" in (tmp_path / "r" / "table.txt").read_text()
    Path(path).write_text(Path(path).read_text().replace('"window": 24', '"window": 30'))
    with pytest.raises(MultiheadError, match="holds a run with other settings"):  # a changed plan is another run
        lc.run(settings, out=tmp_path / "r", progress=False, text_path=str(text), model=model, tokenizer=TOK)


def test_plans_are_checked_when_the_settings_are_made(tmp_path: Path) -> None:
    with pytest.raises(MultiheadError, match=r"nowhere-plan\.json"):
        _settings(plans=(str(tmp_path / "nowhere-plan.json"),))
    model = _tiny()
    (tmp_path / "a").mkdir()
    a, b = _tiny_plan(tmp_path / "a", model), _tiny_plan(tmp_path, model)
    with pytest.raises(MultiheadError, match="two plans are named 'mixed'"):
        _settings(plans=(a, b))
