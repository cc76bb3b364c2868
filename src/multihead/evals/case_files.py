"""Needle cases as JSON lines, one object per case with exactly the keys :data:`JSONL_KEYS`: what
``multihead tradeoff --long --cases-jsonl`` writes and ``benchmarks/kvpress_longctx.py`` reads, so kvpress and
multihead answer the same cases. A file is written whole or not at all; read back, every field is checked."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from multihead.errors import MultiheadError
from multihead.evals.needles import JSONL_KEYS, Case


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


__all__ = ["read_jsonl", "write_jsonl"]
