"""Running the long-context trade-off: every method on every case, perplexity beside it, each finished piece saved
and skipped when the run is repeated (:func:`run`); the cases alone for another implementation (:func:`build_cases`).

The full cache is measured first; a (length, task) cell it scores below ``threshold`` is reported and left out of
the other methods' runs and of the comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from multihead.errors import MultiheadError
from multihead.evals.answers import run_prompt
from multihead.evals.case_files import write_jsonl
from multihead.evals.needles import Case, Tokenizer, check_length, make_cases
from multihead.models.decoder import ENGINE_LABELS, Decoder, as_decoder
from multihead.models.llama import LlamaModel
from multihead.tradeoff.longctx.methods import Method, load_plan
from multihead.tradeoff.longctx.perplexity import long_perplexity
from multihead.tradeoff.longctx.report import table
from multihead.tradeoff.longctx.settings import Settings
from multihead.tradeoff.longctx.stats import summarise


def build_cases(settings: Settings, *, model_path: str | None = None,
                text_path: str | None = None) -> list[Case]:
    """The cases of a run with the real model's tokenizer and the held-out text (what :func:`run` measures), e.g.
    to write them with :func:`write_jsonl` for another implementation."""
    from multihead.evals.text import read_text, token_splits

    decoder = load_decoder(model_path)  # the engine the run would take: its tokenizer, its context
    test = token_splits(decoder.tokenizer.encode(read_text(text_path))).test
    return make_cases(settings, decoder.tokenizer, test, max_context=decoder.shape.max_context)


def _atomic_json(path: Path, data: Any) -> None:
    from multihead.files import write_text

    write_text(path, json.dumps(data, indent=1))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None  # absent or unreadable: measured again


def saved_answers(folder: str | Path) -> list[dict[str, Any]]:
    """Every answer a streaming-protocol run saved under ``folder`` (``results/<method>/<prompt id>.json``, one
    record a case with its ``id``, ``method`` and ``correct``), for reports beside other runs; a folder with none, or
    a file that is not such a list, is refused naming it."""
    files = sorted((Path(folder) / "results").glob("*/*.json"))
    if not files:
        raise MultiheadError(f"{folder} holds no streaming-protocol answer (results/<method>/<case>.json)")
    out: list[dict[str, Any]] = []
    for path in files:
        got = _read_json(path)
        if not (isinstance(got, list) and all(isinstance(r, dict) and {"id", "method", "correct"} <= r.keys()
                                              for r in got)):
            raise MultiheadError(f"{path} is not a streaming run's answer list (records with id, method, correct)")
        out += got
    return out


def _prompts(cases: Sequence[Case]) -> Iterator[list[Case]]:
    by: dict[tuple[int, str, str], list[Case]] = {}
    for c in cases:
        by.setdefault((c.length, c.task, c.group), []).append(c)
    yield from by.values()


def resolve_engine(model_path: str | None, engine: str = "auto") -> str:
    """Which engine decodes ``model_path`` (None: SmolLM2), as every command decides
    (:func:`multihead.models.route.route`): multihead's own port ("ours": Llama-architecture GGUF files and
    folders) or transformers on multihead's attention and caches ("transformers": any causal LM, a Gemma 3 GGUF
    among them); "auto" takes our port where one applies. Read from the file's metadata, nothing loaded."""
    from multihead.models.route import route

    found = route(model_path, engine)
    if found.engine == "ours" and found.port != "llama":
        raise MultiheadError(f"{found.label} is a {found.arch} sentence encoder: the long-context evaluation decodes "
                             "with a causal language model")
    return found.engine


def load_decoder(model_path: str | None, engine: str = "auto", *, dtype: torch.dtype = torch.float32) -> Decoder:
    """The model a run decodes, in ``dtype``, with its tokenizer, on the engine :func:`resolve_engine` decides
    (:func:`multihead.models.decoder.load_decoder`)."""
    from multihead.models.decoder import load_decoder as load

    resolve_engine(model_path, engine)  # a sentence encoder refused in this evaluation's words
    return load(model_path, engine, dtype=dtype)


def run(settings: Settings, *, out: str | Path, progress: bool = True, model_path: str | None = None,
        text_path: str | None = None, model: Any = None, tokenizer: Tokenizer | None = None,
        engine: str = "ours") -> dict[str, Any]:
    """The long-context trade-off: every method's accuracy per (length, task), perplexity on long windows, KV
    bytes at each length, prefill and decode time. Each finished (method, prompt) result is saved under ``out``
    and skipped when the run is repeated with the same settings (a run with other settings is refused there).
    ``model`` and ``tokenizer`` replace the default SmolLM2 (tests); ``engine`` runs ``model_path`` on multihead's
    own port ("ours"), on transformers ("transformers", every cache kind and head plan; the methods that change the
    model, MQA and pruning, are left out and the result says so) or as "auto" picks (:func:`load_decoder`).
    Returns a JSON-ready dict, also written to
    ``out/result.json``, with the table in ``out/table.txt``.

    Everything that can be refused (a length past the model's context, a text too short, a case that cannot be
    built) is refused before anything is written; a run that fails before it has measured anything removes the
    files and the folder it made, and one that fails later keeps them, so that it resumes."""
    from tqdm import tqdm

    from multihead.evals.text import read_text, token_splits

    began = time.perf_counter()
    say: Callable[[str], None] = (lambda m: tqdm.write(m)) if progress else (lambda _m: None)
    folder = Path(out)
    stamp: dict[str, Any] = {"settings": dataclasses.asdict(settings), "model": model_path, "text": text_path,
                             "own_model": model is not None}
    ran = "ours" if model is not None else resolve_engine(model_path, engine)
    if ran != "ours":  # (a run on our port keeps the settings file it always had, so it resumes)
        stamp["engine"] = ran
    if settings.plans:  # a plan's file may change under the same name: its contents are part of the run
        stamp["plans"] = {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in settings.plans}
    else:
        del stamp["settings"]["plans"]  # so a run recorded before plans existed resumes
    saved = _read_json(folder / "settings.json")
    if saved is not None and saved != json.loads(json.dumps(stamp)):
        raise MultiheadError(f"{folder} holds a run with other settings ({folder / 'settings.json'}): resume with "
                             "the same settings or use another folder")
    own = model is not None
    if model is None:
        decoder = load_decoder(model_path, engine)
    else:
        if tokenizer is None and not isinstance(model, Decoder):
            raise MultiheadError("a model passed to run() needs its tokenizer")
        decoder = as_decoder(model, tokenizer)
    tokenizer = tokenizer or decoder.tokenizer
    changes_weights = isinstance(decoder.model, LlamaModel)  # pooling, uptraining, pruning: our port's weights
    if not changes_weights:
        settings = dataclasses.replace(settings, mqa=False, prune=(), uptrain_steps=0)
    max_context = decoder.shape.max_context
    for length in settings.lengths:
        check_length(length, max_context)
    splits = token_splits(tokenizer.encode(read_text(text_path)), least=settings.ppl_context + 1)
    cases = make_cases(settings, tokenizer, splits.test, max_context=max_context)
    made = [f for f in (folder, *folder.parents) if not f.exists()]  # the folders this run makes, deepest first
    fresh = [folder / name for name in ("settings.json", "cases.jsonl") if not (folder / name).exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        _atomic_json(folder / "settings.json", stamp)
        write_jsonl(cases, folder / "cases.jsonl")
        result = _measure(settings, folder, decoder, splits, cases, progress, say)
    except BaseException:
        if not any((folder / name).exists() for name in ("results", "perplexity", "uptrain")):  # nothing measured
            for path in fresh:
                path.unlink(missing_ok=True)
            for f in made:
                with contextlib.suppress(OSError):
                    f.rmdir()  # only if empty
        raise
    if not changes_weights:
        result["not_run"] = ("pooled and uptrained MQA and pruning change the model: they exist for multihead's own "
                             "port (engine ours)")
    result.update(model=model_path or ("a model given to run()" if own else
                                       "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)"),
                  engine=ENGINE_LABELS.get(decoder.engine, decoder.engine),
                  text=text_path or "Jargon File 4.4.7 (Debian jargon-text), held-out split",
                  seconds=round(time.perf_counter() - began, 1))
    _atomic_json(folder / "result.json", result)
    from multihead.files import write_text

    write_text(folder / "table.txt", table(result) + "\n")
    return result


def _measure(settings: Settings, folder: Path, model: Decoder, splits: Any, cases: Sequence[Case], progress: bool,
             say: Callable[[str], None]) -> dict[str, Any]:
    """Every method on every prompt (each result saved under ``folder`` as it is made, or read back), then the
    perplexity of each: the result without its model, text and seconds."""
    import platform
    from datetime import date

    from tqdm import tqdm

    models = _models(model, splits.train, settings, folder, progress, say)
    methods = settings.methods(model.shape.n_kv_heads)
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
    return {
        "model": None, "text": None,
        "settings": dataclasses.asdict(settings),
        "cases": len(cases), "prompts": len(prompts),
        "excluded": excluded,
        "rows": rows,
        "dtype": str(model.dtype).replace("torch.", ""),
        "machine": f"{platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}".replace("  ", " "),
        "date": date.today().isoformat(),
        "seconds": None,
    }


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


def _models(decoder: Decoder, train: Sequence[int], settings: Settings, folder: Path, progress: bool,
            say: Callable[[str], None]) -> dict[str, Decoder]:
    """The original decoder and the changed ones the methods need (each a decoder of the original's tokenizer):
    pooled MQA, uptrained MQA (its checkpoint under ``folder/uptrain``, resumed), pruned by one-backward
    importance. Only a decoder whose weights are our port's is changed (:func:`run` asks no other for these)."""
    from multihead.tradeoff.lm import IMPORTANCE_BATCH, pooled_model

    models: dict[str, Decoder] = {"original": decoder}
    if not (settings.mqa or settings.prune):
        return models
    model = decoder.model
    assert isinstance(model, LlamaModel)

    def wrap(changed: LlamaModel) -> Decoder:
        return as_decoder(changed, decoder.tokenizer, decoder.name)

    g = model.config.n_kv_heads
    if settings.mqa and g > 1:
        models["mqa"] = wrap(pooled_model(model, 1))
        if settings.uptrain_steps:
            from multihead.tradeoff.uptrain import uptrain

            student = pooled_model(model, 1)
            checkpoint = Path(settings.uptrain_from) if settings.uptrain_from else folder / "uptrain"
            uptrain(student, model, train, settings.uptrain(), checkpoint=checkpoint, resume=True, progress=progress)
            models["uptrained"] = wrap(student)
    if settings.prune:
        from multihead.tradeoff.prune import group_importance, groups_to_keep, prune

        b, s = IMPORTANCE_BATCH
        s = min(s, len(train) // b - 1)
        step = (len(train) - s) // b
        ids = torch.tensor([train[i * step:i * step + s] for i in range(b)], dtype=torch.long)  # (b, s)
        importance = group_importance(model, ids)
        for fraction in settings.prune:
            keep = groups_to_keep(importance, fraction)
            models[f"pruned-{round(fraction * 100)}"] = wrap(prune(model, keep))
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


__all__ = ["build_cases", "run", "saved_answers"]
