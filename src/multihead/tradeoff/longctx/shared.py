"""The shared-prefill protocol: one prefill a case, every method's cache compressed from it (kvpress's protocol).

::

    for each case:   full = model.new_cache(1, room); prefill(context, full)          (the context, every key kept)
      for each method:  small = compress(full, method.cache(...))                   (what the method keeps of it)
                        answer_steps(model, small, question, answer)                (question unseen while compressing)

N methods then cost one prefill and N short decodes, where the streaming protocol (:func:`runner.run`: each method
prefills through its own cache, the real peak memory of a method that never holds the full cache) costs N prefills;
at a 4k context on two cores that is the difference between about 400 cases an hour and about 40. Only the keys
differ between the two: here they were computed by a model that saw every context key. Methods that change the
model (pooled or uptrained MQA, pruning) need their own prefill and are not run here.

Each finished case is one line of ``shared-prefill.jsonl`` (every method's answer to it), written whole and
flushed, so a run stopped at any point resumes where it stopped (:func:`finished`); :func:`summary` reads the lines
back: per (length, task) each method's accuracy with its Wilson interval, and each method against the full cache and
each head plan against its uniform control of the same bytes by McNemar's exact test on the same cases.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from multihead.cache import compress
from multihead.errors import MultiheadError
from multihead.evals.answers import answer_steps, prefill, score
from multihead.evals.needles import Case
from multihead.tradeoff.longctx.methods import Method
from multihead.tradeoff.longctx.stats import mcnemar, paired_difference, wilson

PROTOCOLS = ("shared", "streaming")
ALL = "all tasks"  # the cell of every task at one length
FILE = "shared-prefill.jsonl"
PROTOCOL_TEXT = ("shared prefill: each case's context prefilled once with the full cache, then each method's cache "
                 "compressed from it (multihead.cache.compress) and the question and answer decoded through it; the "
                 "question is not seen while compressing (kvpress's protocol)")


def cache_methods(methods: Iterable[Method]) -> list[Method]:
    """The methods the protocol runs: those that keep the original model and change only its cache."""
    return [m for m in methods if m.model == "original"]


def finished(path: Path) -> dict[str, dict[str, Any]]:
    """The cases already answered in ``path`` (one JSON object a line), by id; a last line cut short by a stop is
    ignored (it is answered again)."""
    done: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return done
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # a line cut short by a stop: answered again
            raise MultiheadError(f"{path}: line {number} is not JSON (a file of another run, or edited)") from None
        if not isinstance(record, dict) or "id" not in record or "methods" not in record:
            raise MultiheadError(f"{path}: line {number} is not a case's record (id, methods)")
        done[str(record["id"])] = record
    return done


def _drop_cut_line(path: Path) -> None:
    """Cut a last line that a stop left without its newline, so that the next case's line starts a line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def _inner(cache: Any) -> Any:
    """The multihead cache behind a transformers one (hf.cache.MultiheadCache), or the cache itself."""
    return getattr(cache, "inner", cache)


def prefill_full(model: Any, context_ids: Sequence[int], room: int, chunk: int) -> tuple[Any, float]:
    """The full cache of ``room`` slots with ``context_ids`` prefilled into it, and the prefill's seconds."""
    full = model.new_cache(1, room)
    began = time.perf_counter()
    prefill(model, context_ids, full, chunk)
    return full, time.perf_counter() - began


def answer_case(model: Any, case: Case, methods: Sequence[Method], chunk: int, *,
                prefilled: tuple[Any, float] | None = None) -> dict[str, Any]:
    """One case under every method, from one prefill: a JSON-ready record (the case, the prefill's seconds, each
    method's score, cache bytes and seconds of its compress + question + answer, and torch's threads).
    ``prefilled``: (a full cache holding this case's context, with room for its question and answer, the seconds its
    prefill took), for the cases of one prompt (multikey's keys: the same context, other questions); the cache is
    used as it is, so give each case its own copy. The record then says ``prefill_shared``."""
    room = len(case.context_ids) + len(case.question_ids) + len(case.answer_ids)
    full, seconds = prefilled if prefilled is not None else prefill_full(model, case.context_ids, room, chunk)
    record: dict[str, Any] = {"id": case.id, "task": case.task, "length": case.length, "depth": case.depth,
                              "haystack": case.haystack, "group": case.group, "prefill_seconds": round(seconds, 4),
                              "prefill_shared": prefilled is not None, "threads": torch.get_num_threads(),
                              "methods": {}}
    order = [m for m in methods if m.series != "full"] + [m for m in methods if m.series == "full"]
    for method in order:
        began = time.perf_counter()
        if method.series == "full":
            cache = full if method is order[-1] else copy.deepcopy(full)
        else:
            cache = method.cache(model, case.length, room)
            compress(_inner(full), _inner(cache))
        result = score(case, answer_steps(model, cache, case.question_ids, case.answer_ids))
        result.update(cache_bytes=int(cache.bytes), seconds=round(time.perf_counter() - began, 4))
        record["methods"][method.name] = result
    return record


def interleaved(cases: Sequence[Case]) -> list[Case]:
    """The cases in turns over their (length, task) cells, each cell's in its own order, the cases of one prompt
    (one context) together: a run stopped early has about as many cases in every cell, and a prompt's cases share
    its prefill."""
    cells: dict[tuple[int, str], dict[tuple[str, tuple[int, ...]], list[Case]]] = {}
    for c in cases:
        cells.setdefault((c.length, c.task), {}).setdefault((c.group, c.context_ids), []).append(c)
    turns = [list(prompts.values()) for prompts in cells.values()]
    out: list[Case] = []
    for i in range(max((len(t) for t in turns), default=0)):
        out += [c for t in turns if i < len(t) for c in t[i]]
    return out


def run_shared(model: Any, cases: Sequence[Case], methods: Sequence[Method], *, out: str | Path, chunk: int,
               progress: bool = True, say: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every case under every cache method by the shared-prefill protocol, each finished case appended to
    ``out/shared-prefill.jsonl`` as it ends (flushed and synced), in turns over the (length, task) cells
    (:func:`interleaved`); cases already there are skipped. Returns every case's record, in the order of ``cases``."""
    from tqdm import tqdm

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FILE
    done = finished(path)
    _drop_cut_line(path)
    names = [m.name for m in methods]
    for record in done.values():
        if sorted(record["methods"]) != sorted(names):
            raise MultiheadError(f"{path} holds a case answered by other methods ({sorted(record['methods'])}): "
                                 "resume with the same methods or use another folder")
    todo = interleaved([c for c in cases if c.id not in done])
    if say is not None and done:
        say(f"{len(done)} of {len(cases)} cases already answered in {path}: {len(todo)} to go")
    began = time.perf_counter()
    prompt: tuple[tuple[int, ...], Any, float] | None = None  # the last context prefilled, when its prompt has more
    with path.open("a", encoding="utf-8") as f:
        for n, case in enumerate(tqdm(todo, desc="cases", unit="case", disable=not progress), 1):
            same = [c for c in todo[n - 1:] if c.context_ids == case.context_ids and c.group == case.group]
            if prompt is not None and prompt[0] == case.context_ids:
                full = copy.deepcopy(prompt[1]) if len(same) > 1 else prompt[1]
                record = answer_case(model, case, methods, chunk, prefilled=(full, prompt[2]))
            elif len(same) > 1:  # the first case of a prompt with more: its prefill kept for the others
                room = len(case.context_ids) + max(len(c.question_ids) + len(c.answer_ids) for c in same)
                kept, seconds = prefill_full(model, case.context_ids, room, chunk)
                prompt = (case.context_ids, kept, seconds)
                record = answer_case(model, case, methods, chunk, prefilled=(copy.deepcopy(kept), seconds))
                record["prefill_shared"] = False  # this case's own prefill, shared by the next
            else:
                prompt = None
                record = answer_case(model, case, methods, chunk)
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
            done[case.id] = record
            if say is not None and n % 25 == 0:
                rate = n / (time.perf_counter() - began) * 3600
                say(f"{len(done)} of {len(cases)} cases, {rate:.0f} cases an hour")
    return [done[c.id] for c in cases if c.id in done]


def summary(records: Sequence[dict[str, Any]], methods: Sequence[Method], *, controls: dict[str, str] | None = None
            ) -> dict[str, Any]:
    """Per (length, task), and per length every task together (task ``ALL``, where a length has several): each
    method's mean cache bytes (and their share of the full cache's), accuracy with its
    Wilson 95% interval, McNemar's exact test of each method against the full cache, and of each head plan
    (``controls``: method name -> its control's name) against its uniform control of the same bytes, on the same
    cases, each with the accuracy difference and its paired bootstrap interval (:func:`.stats.paired_difference`);
    and the evaluation's throughput (cases an hour, all methods, and each method's seconds a case beside the
    shared prefill's)."""
    names = [m.name for m in methods]
    full = next((m.name for m in methods if m.series == "full"), None)
    cells: dict[str, Any] = {}
    keys: list[tuple[int, str]] = sorted({(r["length"], r["task"]) for r in records})
    for length in sorted({k[0] for k in keys}):
        if sum(1 for k in keys if k[0] == length) > 1:
            keys.append((length, ALL))  # every task of that length together
    for key in keys:
        mine = [r for r in records if r["length"] == key[0] and key[1] in (r["task"], ALL)]
        cell: dict[str, Any] = {"cases": len(mine), "methods": {}}
        for name in names:
            right = [bool(r["methods"][name]["correct"]) for r in mine]
            k = sum(right)
            held = sum(r["methods"][name]["cache_bytes"] for r in mine) / len(mine)
            entry: dict[str, Any] = {"correct": k, "accuracy": k / len(right), "wilson95": wilson(k, len(right)),
                                     "mean_cache_bytes": held}
            if full is not None and name != full:
                truth = [bool(r["methods"][full]["correct"]) for r in mine]
                entry["vs_full"] = {**mcnemar(truth, right), **paired_difference(truth, right)}
            if controls and name in controls:
                theirs = [bool(r["methods"][controls[name]]["correct"]) for r in mine]
                entry["vs_control"] = {"control": controls[name], **mcnemar(theirs, right),
                                       **paired_difference(theirs, right)}
            cell["methods"][name] = entry
        if full is not None:
            for entry in cell["methods"].values():
                entry["bytes_of_full"] = entry["mean_cache_bytes"] / cell["methods"][full]["mean_cache_bytes"]
        cells[f"{key[0]}|{key[1]}"] = cell
    prefill_s = sum(r["prefill_seconds"] for r in records if not r.get("prefill_shared"))  # each prefill once
    method_s = {name: sum(r["methods"][name]["seconds"] for r in records) for name in names}
    total = prefill_s + sum(method_s.values())
    return {"protocol": PROTOCOL_TEXT, "cases": len(records), "cells": cells,
            "throughput": {"cases_per_hour": len(records) / total * 3600 if total else None,
                           "prefill_seconds_per_case": prefill_s / len(records) if records else None,
                           "method_seconds_per_case": {n: s / len(records) for n, s in method_s.items()}
                           if records else {}}}


# ---------------------------------------------------------------------------------------------- a whole run
def controls_of(methods: Sequence[Method]) -> dict[str, str]:
    """Each head-wise method's uniform control of the same bytes (the sinks + window method sized to its plan)."""
    from multihead.tradeoff.longctx.methods import control_key, load_plan

    out: dict[str, str] = {}
    for m in methods:
        if m.plan is None:
            continue
        plan = load_plan(m.plan)
        for c in methods:
            if c.equal_to is not None and control_key(load_plan(c.equal_to)) == control_key(plan):
                out[m.name] = c.name
                break
    return out


def _older(stamp: Any, settings: Any) -> Any:
    """A folder's settings stamp with what a run from before a setting existed took: the test split and each later
    field's default (a run from before --passkey-prompt asked the default wording)."""
    import dataclasses

    if not isinstance(stamp, dict):
        return stamp
    out = {"split": "test", **stamp}
    if isinstance(out.get("settings"), dict):
        defaults = {f.name: f.default for f in dataclasses.fields(type(settings))
                    if f.default is not dataclasses.MISSING}
        out["settings"] = json.loads(json.dumps({**defaults, **out["settings"]}))
    return out


def run(settings: Any, *, out: str | Path, model_path: str | None = None, text_path: str | None = None,
        engine: str = "auto", dtype: str = "float32", split: str = "test", progress: bool = True, model: Any = None,
        tokenizer: Any = None) -> dict[str, Any]:
    """The shared-prefill protocol over a run's cases and cache methods (:class:`~.settings.Settings`; the methods
    that change the model left out): every case one line of ``out/shared-prefill.jsonl`` as it is answered (a
    stopped run resumes; a run of other settings in the folder is refused), then ``out/shared-result.json`` (the
    :func:`summary`, the settings, the machine) and ``out/shared-table.txt``. ``dtype`` the model's (float32 or
    bfloat16); ``split`` the part of the text the jargon haystacks come from: ``test`` (the evaluation's) or
    ``train`` (cases for choosing a plan, disjoint from the evaluation's: give them another ``seed`` too, as the
    filler haystack is the same text in both); ``engine`` as :func:`~.runner.load_decoder` takes it; ``model`` and
    ``tokenizer`` replace the loaded ones (tests)."""
    import dataclasses
    import platform
    from datetime import date

    from tqdm import tqdm

    from multihead.evals.needles import make_cases
    from multihead.evals.text import read_text, token_splits
    from multihead.models.decoder import Decoder, as_decoder
    from multihead.tradeoff.longctx.runner import load_decoder, resolve_engine

    if dtype not in ("float32", "bfloat16"):
        raise MultiheadError(f"dtype {dtype!r}: the shared-prefill run takes float32 or bfloat16")
    if split not in ("test", "train"):
        raise MultiheadError(f"split {split!r}: the cases come from the text's test or train split")
    folder = Path(out)
    stamp = {"protocol": "shared", "settings": dataclasses.asdict(settings), "model": model_path, "text": text_path,
             "engine": "given" if model is not None else resolve_engine(model_path, engine), "dtype": dtype,
             "split": split}
    settings_file = folder / "shared-settings.json"
    if settings_file.exists() and _older(json.loads(settings_file.read_text()), settings) != json.loads(
            json.dumps(stamp)):
        raise MultiheadError(f"{folder} holds a shared-prefill run with other settings ({settings_file}): resume "
                             "with the same settings or use another folder")
    if model is None:
        model = load_decoder(model_path, engine, dtype=getattr(torch, dtype))
    elif tokenizer is None and not isinstance(model, Decoder):
        raise MultiheadError("a model given to the shared-prefill run needs its tokenizer")
    model = as_decoder(model, tokenizer)
    tokenizer = tokenizer or model.tokenizer
    splits = token_splits(tokenizer.encode(read_text(text_path)), least=2)
    cases = make_cases(settings, tokenizer, getattr(splits, split), max_context=model.shape.max_context)
    methods = cache_methods(settings.methods(model.shape.n_kv_heads))
    folder.mkdir(parents=True, exist_ok=True)
    new = not settings_file.exists()
    settings_file.write_text(json.dumps(stamp, indent=1) + "\n")
    try:
        records = run_shared(model, cases, methods, out=folder, chunk=settings.chunk, progress=progress,
                             say=(lambda m: tqdm.write(m)) if progress else None)
    except BaseException:
        lines = folder / FILE
        if new and (not lines.exists() or not lines.read_bytes().strip()):
            lines.unlink(missing_ok=True)  # a run that failed before its first case leaves nothing behind
            settings_file.unlink()
        raise
    result = summary(records, methods, controls=controls_of(methods))
    result.update(settings=stamp, methods=[dataclasses.asdict(m) for m in methods],
                  machine=f"{platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads, "
                          f"torch {torch.__version__}".replace("  ", " "), date=date.today().isoformat())
    from multihead.files import write_text

    write_text(folder / "shared-result.json", json.dumps(result, indent=1) + "\n")
    write_text(folder / "shared-table.txt", table(result) + "\n")
    return result


def table(result: dict[str, Any]) -> str:
    """The summary as text: per cell each method's mean cache bytes as a share of the full cache's, accuracy, Wilson
    interval, and its difference from the full cache and (a head plan) from its control in points with the paired
    bootstrap interval and McNemar's p."""
    def against(x: dict[str, Any] | None) -> str:
        if x is None:
            return ""
        lo, hi = x["difference95"]
        return f"{100 * x['difference']:+5.1f} [{100 * lo:+5.1f}, {100 * hi:+5.1f}] p {x['p_value']:<7.2g}"

    lines = [f"{result['protocol']}", f"{result['cases']:,} cases; "
             f"{(result['throughput']['cases_per_hour'] or 0):,.0f} cases an hour, all methods"]
    for key, cell in result["cells"].items():
        length, task = key.split("|")
        lines.append(f"\n{task} at {length} tokens, {cell['cases']} cases (differences in points)")
        width = max(len(n) for n in cell["methods"])
        lines.append(f"  {'method':<{width}}  bytes  accuracy  Wilson 95%    {'against the full cache':<33}  "
                     "against the plan's uniform control")
        for name, m in cell["methods"].items():
            lo, hi = m["wilson95"]
            share = f"{m['bytes_of_full']:>5.0%}" if "bytes_of_full" in m else " " * 5
            ctl = m.get("vs_control")
            lines.append(f"  {name:<{width}}  {share}  {m['accuracy']:>7.1%}  [{lo:.2f}, {hi:.2f}]  "
                         f"{against(m.get('vs_full')):<33}  "
                         + (f"{against(ctl)} ({ctl['control']})" if ctl else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- several runs
def methods_of(folder: str | Path) -> list[Method]:
    """The cache methods of the shared-prefill run in ``folder`` (from its shared-settings.json; plan paths are
    read relative to the working folder, as the run read them)."""
    from multihead.tradeoff.longctx.settings import Settings

    path = Path(folder) / "shared-settings.json"
    if not path.is_file():
        raise MultiheadError(f"{path} does not exist: give the --out folder of a `tradeoff --long --protocol "
                             "shared` run")
    stamp = json.loads(path.read_text(encoding="utf-8"))
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in stamp["settings"].items()}
    return cache_methods(Settings(**fields).methods(1))


def combine(folders: Sequence[str | Path]) -> tuple[list[dict[str, Any]], list[Method], dict[str, Any]]:
    """The cases every one of several shared-prefill runs answered (by id), each case's methods gathered from all
    of them: (records, methods, agreement). A method that two runs share (the full cache, say) keeps the first run's
    answer; ``agreement`` says, by method, on how many cases the others were right or wrong as the first run was
    (``same``), right where it was wrong (``other_only``) and the reverse (``first_only``)."""
    runs = [(Path(f), finished(Path(f) / FILE), methods_of(f)) for f in folders]
    if not runs:
        raise MultiheadError("no run to combine")
    common = [i for i in runs[0][1] if all(i in done for _, done, _ in runs[1:])]
    methods: list[Method] = []
    for _, _, ms in runs:
        methods += [m for m in ms if m.name not in {x.name for x in methods}]
    agreement: dict[str, dict[str, int]] = {}
    records = []
    for case in common:
        record = copy.deepcopy(runs[0][1][case])
        for _, done, _ in runs[1:]:
            for name, answer in done[case]["methods"].items():
                if name in record["methods"]:
                    first, other = bool(record["methods"][name]["correct"]), bool(answer["correct"])
                    a = agreement.setdefault(name, {"cases": 0, "same": 0, "first_only": 0, "other_only": 0})
                    a["cases"] += 1
                    a["same"] += int(first == other)
                    a["first_only"] += int(first and not other)
                    a["other_only"] += int(other and not first)
                else:
                    record["methods"][name] = answer
        records.append(record)
    return records, methods, agreement


__all__ = ["ALL", "FILE", "PROTOCOLS", "PROTOCOL_TEXT", "answer_case", "cache_methods", "combine", "controls_of",
           "finished", "interleaved", "methods_of", "prefill_full", "run", "run_shared", "summary", "table"]
