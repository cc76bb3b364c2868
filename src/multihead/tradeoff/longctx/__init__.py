"""Long-context retrieval under each KV-saving method: RULER-style needles at 1k-8k tokens, beside perplexity.

Perplexity on short windows hides what a cache that forgets loses (a sliding window of 256 plus sinks costs little
perplexity and cannot recall a number from 3,000 tokens back). This package measures recall directly, on the needle
cases of :mod:`multihead.evals.needles`, each answered through the method's real cache
(:mod:`multihead.evals.answers`). One concept a module:

    methods.py     Method (one cache kind on one model), head plans and the control of equal bytes
    settings.py    Settings: what a run measures, one field per flag of `multihead tradeoff --long`, and its methods
    perplexity.py  perplexity on long held-out windows through each method's cache
    stats.py       bootstrap and Wilson intervals of an accuracy, a cell's summary
    runner.py      run(): every method on every case, saved piece by piece and resumed; build_cases()
    report.py      table() and plot() of a result

The names below are this package's public ones, with the case and answer names it stands on, so that
``from multihead.tradeoff import longctx`` reaches everything a run uses.
"""

from __future__ import annotations

from multihead.evals.answers import answer_steps, prefill, run_prompt, score
from multihead.evals.case_files import read_jsonl, write_jsonl
from multihead.evals.needles import (
    ANSWER_ROOM,
    DEFAULT_TASKS,
    HAYSTACKS,
    JSONL_KEYS,
    TASKS,
    Case,
    Haystacks,
    Tokenizer,
    case_seed,
    check_depth,
    check_length,
    check_task,
    make_cases,
    make_prompt_cases,
    prompt_depths,
)
from multihead.tradeoff.longctx.methods import Method, equal_bytes_slots, load_plan, plan_label
from multihead.tradeoff.longctx.perplexity import long_perplexity
from multihead.tradeoff.longctx.report import plot, table
from multihead.tradeoff.longctx.runner import build_cases, run
from multihead.tradeoff.longctx.settings import Settings
from multihead.tradeoff.longctx.stats import bootstrap_ci, summarise, wilson

__all__ = [
    "ANSWER_ROOM",
    "DEFAULT_TASKS",
    "HAYSTACKS",
    "JSONL_KEYS",
    "TASKS",
    "Case",
    "Haystacks",
    "Method",
    "Settings",
    "Tokenizer",
    "answer_steps",
    "bootstrap_ci",
    "build_cases",
    "case_seed",
    "check_depth",
    "check_length",
    "check_task",
    "equal_bytes_slots",
    "load_plan",
    "long_perplexity",
    "make_cases",
    "make_prompt_cases",
    "plan_label",
    "plot",
    "prefill",
    "prompt_depths",
    "read_jsonl",
    "run",
    "run_prompt",
    "score",
    "summarise",
    "table",
    "wilson",
    "write_jsonl",
]
