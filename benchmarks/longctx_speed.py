"""SmolLM2-135M at long contexts: prefill time and decode speed of multihead with each cache kind against
transformers (sdpa) on the same GGUF weights, alternating in one process.

    .venv/bin/python benchmarks/longctx_speed.py [--lengths 2048 4096 8192] [--dtypes float32 bfloat16]
        [--caches full sink int4 int8 headwise] [--rounds 3] [--decode-tokens 16] [--chunk 0]
        [--window 256] [--sinks 4] [--plan docs/experiments/smollm2-0-best-plan.json] [--quick] [--random]
        [--no-transformers] [--record] [--json out.json | --json -]

For each dtype and length the prompt is the first ``length`` tokens of the held-out Jargon File text
(:mod:`multihead.evals.text`, Debian's jargon-text). Each round runs every runner once, the order rotated every
round: multihead with each cache of ``--caches`` (by default the full and quantized caches take the whole prompt in
one call with ``logits_to_keep=1``, as transformers is called, and the sink and head-wise caches chunks of
WINDOW_CHUNK tokens: in one call their sinks + window need a dense s x t mask, measured 0.40-0.55 of transformers'
prefill speed at 8k; ``--chunk N``: every cache in chunks of N, as a server's chunked prefill and
:func:`multihead.evals.answers.prefill`; then ``--decode-tokens`` greedy steps, each timed) and transformers (its
model called on the whole prompt at once with ``logits_to_keep=1``, as ``generate`` prefills, then the same number of
steps through its DynamicCache). A figure is the median over rounds (decode: of each run's median step); the ratios
are ratios of those medians. Caches: ``full`` (every token, KVCache), ``sink`` (``--sinks`` + ``--window``,
SinkCache), ``int4`` and ``int8`` (QuantizedKVCache, group 32, residual 128), ``headwise`` (HeadwiseCache with the
shipped plan ``--plan``).

Memory beside each run, two measures: ``cache bytes``, exact (multihead: ``cache.bytes``, the tensors that hold
keys and values; transformers: the nbytes of its DynamicCache's key and value tensors after the run), and ``peak RSS
delta``, the process's resident high-water mark during the run (reset before it, /proc/self/clear_refs) above its
resident size before it (the heap trimmed first, glibc's malloc_trim): the cache, the activations and every
temporary the run touches afresh; memory the allocator still holds and reuses is not counted again.

Before the rounds each model decodes a short prompt (:func:`warm_up`: allocation, the native build, caches warm).
multihead's kernel choices are the host's tuning table's (``multihead tune``) or the default rules, never timed here.

``--quick``: one length of 512 tokens, float32, one round, 4 decode tokens (about a minute: a check that it runs,
its figures are not the benchmark). ``--random``: random weights of SmolLM2's shape, no transformers (no model file
needed). ``--record`` appends the table to benchmarks/RESULTS.md; ``--json PATH`` writes the rows (``-``: stdout).
Timings on a shared machine are noise: the load average before and after is printed beside the table.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench
import ctxbench
import torch
from results import publish

from multihead.cache import HeadPlan
from multihead.models import LlamaModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "docs" / "experiments" / "smollm2-0-best-plan.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TRANSFORMERS = "transformers"


WINDOW_CHUNK = 512  # the windowed caches' prefill chunk by default
WHOLE_PROMPT = ("full", "int4", "int8")  # the caches that prefill the whole prompt in one call by default


def prefill_chunk(kind: str, chunk: int) -> int:
    """The prefill chunk of a cache kind: ``chunk`` if given, else 0 (one call) for WHOLE_PROMPT, WINDOW_CHUNK for the
    sink and head-wise caches."""
    return chunk or (0 if kind in WHOLE_PROMPT else WINDOW_CHUNK)


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...]
    dtypes: tuple[str, ...]
    caches: tuple[str, ...]
    rounds: int
    decode_tokens: int
    chunk: int
    window: int
    sinks: int
    plan: str
    random: bool
    transformers: bool
    record: bool = False
    json: str | None = None
    group: int = 32  # the quantized caches' group and residual (QuantizedKVCache's defaults)
    residual: int = 128


@dataclass(frozen=True)
class Row:
    """One runner at one (dtype, length): medians over the rounds."""

    dtype: str
    length: int
    runner: str  # a cache kind of multihead, or "transformers"
    prefill_s: float
    decode_tok_s: float
    cache_bytes: int
    peak_rss_delta: int
    prefill_vs_transformers: float | None  # transformers' prefill time / this one's (above 1: faster)
    decode_vs_transformers: float | None  # this decode tok/s / transformers' (above 1: faster)
    prefill_vs_full: float | None  # the full cache's prefill time / this one's
    decode_vs_full: float | None  # this decode tok/s / the full cache's
    bytes_vs_full: float | None  # this cache's bytes / the full cache's


def parse(argv: Sequence[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(prog="longctx_speed.py", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt tokens (default 2048 4096 8192)")
    p.add_argument("--dtypes", nargs="+", default=None, help="float32, bfloat16 (default both)")
    p.add_argument("--caches", nargs="+", default=list(ctxbench.CACHE_KINDS), help="multihead's cache kinds")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3)")
    p.add_argument("--decode-tokens", type=int, default=None, help="greedy steps after the prompt (default 16)")
    p.add_argument("--chunk", type=int, default=0,
                   help="multihead's prefill chunk (default 0: the whole prompt in one call for the full and quantized "
                        f"caches, as transformers, chunks of {WINDOW_CHUNK} for the windowed ones)")
    p.add_argument("--window", type=int, default=256, help="the sink cache's window")
    p.add_argument("--sinks", type=int, default=4, help="the sink cache's sink tokens")
    p.add_argument("--plan", default=str(PLAN), help="the head-wise cache's plan (a HeadPlan JSON file)")
    p.add_argument("--quick", action="store_true", help="512 tokens, float32, 1 round, 4 decode tokens")
    p.add_argument("--random", action="store_true", help="random weights of SmolLM2's shape, no transformers")
    p.add_argument("--no-transformers", action="store_true", help="multihead's caches only")
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON here (- for stdout)")
    a = p.parse_args(argv)
    quick = a.quick
    lengths = a.lengths or ([512] if quick else [2048, 4096, 8192])
    dtypes = a.dtypes or (["float32"] if quick else ["float32", "bfloat16"])
    rounds = a.rounds if a.rounds is not None else (1 if quick else 3)
    steps = a.decode_tokens if a.decode_tokens is not None else (4 if quick else 16)
    for name, value in (("--rounds", rounds), ("--decode-tokens", steps), ("--window", a.window)):
        if value < 1:
            p.error(f"{name} ({value}) must be at least 1")
    if a.chunk < 0:
        p.error(f"--chunk ({a.chunk}) must be at least 1, or 0 for the whole prompt in one call")
    if a.sinks < 0 or a.sinks > a.window:
        p.error(f"--sinks ({a.sinks}) must lie between 0 and --window ({a.window})")
    bad = [n for n in lengths if not 1 <= n <= ctxbench.SMOLLM2["max_context"]]
    if bad:
        p.error(f"--lengths {bad} must lie between 1 and SmolLM2's context ({ctxbench.SMOLLM2['max_context']})")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        p.error(f"--dtypes {unknown}: choose from {', '.join(DTYPES)}")
    unknown = [c for c in a.caches if c not in ctxbench.CACHE_KINDS]
    if unknown:
        p.error(f"--caches {unknown}: choose from {', '.join(ctxbench.CACHE_KINDS)}")
    if "headwise" in a.caches and not Path(a.plan).is_file():
        p.error(f"--plan {a.plan} is not a file (a HeadPlan JSON, e.g. {PLAN.relative_to(ROOT)})")
    settings = Settings(tuple(lengths), tuple(dict.fromkeys(dtypes)), tuple(dict.fromkeys(a.caches)), rounds, steps,
                        a.chunk, a.window, a.sinks, a.plan, a.random, not (a.random or a.no_transformers), a.record,
                        a.json)
    return settings


def text_tokens(tokenizer: Any, n: int) -> torch.Tensor:
    """The first n tokens of the held-out Jargon File text, (1, n)."""
    from multihead.evals.text import read_text, token_splits

    held_out = token_splits(tokenizer.encode(read_text())).test
    if len(held_out) < n:
        raise SystemExit(f"the held-out text has {len(held_out):,} tokens, fewer than the {n:,} asked for")
    return torch.tensor(held_out[:n], dtype=torch.long)[None]


def transformers_cache_bytes(past: Any) -> int:
    """Bytes of the key and value tensors a transformers cache holds (DynamicCache, layers of keys and values)."""
    layers = getattr(past, "layers", None)
    if layers is not None:
        return sum(t.nbytes for layer in layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))
    return sum(t.nbytes for t in (*past.key_cache, *past.value_cache))


@torch.no_grad()
def transformers_run(model: Any, tokens: torch.Tensor, steps: int) -> tuple[float, list[float], int]:
    """transformers' prefill of the whole prompt (logits of the last token only, as generate) and ``steps`` greedy
    steps through its cache: (prefill seconds, each step's seconds, cache bytes)."""
    # transformers 5.x renamed past_key_values to cache (argument and output; the old name is deprecated)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    start = time.perf_counter()
    out = model(tokens, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - start
    past, nxt, times = getattr(out, name), out.logits[:, -1:].argmax(-1), []
    for _ in range(steps):
        t = time.perf_counter()
        out = model(nxt, use_cache=True, **{name: past})
        times.append(time.perf_counter() - t)
        past, nxt = getattr(out, name), out.logits[:, -1:].argmax(-1)
    return prefill, times, transformers_cache_bytes(past)


def multihead_run(model: LlamaModel, kind: str, tokens: torch.Tensor, s: Settings, plan: HeadPlan | None
                  ) -> tuple[float, list[float], int]:
    cache = ctxbench.make_cache(model, kind, tokens.shape[1] + s.decode_tokens, plan=plan, window=s.window,
                                sinks=s.sinks, group=s.group, residual=s.residual)
    prefill, times = ctxbench.prefill_decode(model, cache, tokens, prefill_chunk(kind, s.chunk), s.decode_tokens)
    return prefill, times, cache.bytes


def trim_heap() -> None:
    """Hand the memory the allocator keeps after frees back to the system (glibc's malloc_trim; elsewhere nothing),
    so that a run's peak RSS delta counts its own pages, not only those beyond what earlier runs left resident."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def with_peak(run: Callable[[], tuple[float, list[float], int]]) -> tuple[float, float, int, int]:
    """(prefill s, median step s, cache bytes, peak RSS delta) of one run."""
    got: list[tuple[float, list[float], int]] = []
    trim_heap()
    peak = bench.peak_extra_bytes(lambda: got.append(run()), torch.device("cpu"))
    prefill, times, size = got[0]
    return prefill, statistics.median(times), size, peak


def measure(models: dict[str, tuple[LlamaModel, Any]], tokens: torch.Tensor, s: Settings,
            plan: HeadPlan | None) -> list[Row]:
    """Every runner at every (dtype, length), alternating, the order rotated every round."""
    rows = []
    for dtype in s.dtypes:
        ours, hf = models[dtype]
        runners: list[tuple[str, Callable[[torch.Tensor], tuple[float, list[float], int]]]] = [
            (kind, lambda t, m=ours, kind=kind: multihead_run(m, kind, t, s, plan)) for kind in s.caches]
        if hf is not None:
            runners.append((TRANSFORMERS, lambda t, m=hf: transformers_run(m, t, s.decode_tokens)))
        for length in s.lengths:
            prompt = tokens[:, :length]
            seen: dict[str, list[tuple[float, float, int, int]]] = {name: [] for name, _ in runners}
            for r in range(s.rounds):
                turn = r % len(runners)
                for name, run in runners[turn:] + runners[:turn]:
                    seen[name].append(with_peak(lambda run=run, p=prompt: run(p)))
            med = {name: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v), v[-1][2],
                          int(statistics.median(x[3] for x in v))) for name, v in seen.items()}
            hf_m, full_m = med.get(TRANSFORMERS), med.get("full")
            for name, (prefill, step, size, peak) in med.items():
                ours_row = name != TRANSFORMERS
                rows.append(Row(
                    dtype, length, name, prefill, 1 / step, size, peak,
                    hf_m[0] / prefill if hf_m and ours_row else None,
                    hf_m[1] / step if hf_m and ours_row else None,
                    full_m[0] / prefill if full_m and ours_row else None,
                    full_m[1] / step if full_m and ours_row else None,
                    size / full_m[2] if full_m and ours_row else None))
    return rows


def _x(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(rows: Sequence[Row], s: Settings, notes: Sequence[str]) -> str:
    lines = [f"### SmolLM2-135M long context: prefill and decode, multihead's caches against transformers (sdpa) "
             f"({datetime.date.today()})",
             *notes,
             (f"multihead's full and quantized caches and transformers prefill the whole prompt in one call "
              f"(logits_to_keep=1), the sink and head-wise caches in chunks of {WINDOW_CHUNK}; " if not s.chunk
              else f"multihead prefills in chunks of {s.chunk}; transformers the whole prompt (logits_to_keep=1); ")
             +
             f"{s.decode_tokens} greedy decode tokens after it (median step); median of {s.rounds} alternating "
             f"round(s), order rotated; sink = {s.sinks} sinks + window {s.window}; int4/int8 group {s.group} "
             f"residual {s.residual}; "
             f"headwise = {Path(s.plan).name}",
             "vs transformers: its prefill time / this one's, this decode tok/s / its (above 1: multihead faster); "
             "vs full: the same against multihead's full cache; bytes: the cache's exact key/value bytes; peak: the "
             "process's peak RSS above its RSS before the run (cache, activations, temporaries)",
             "",
             "| dtype | tokens | runner | prefill s | vs transformers | vs full | decode tok/s | vs transformers | "
             "vs full | cache MiB | bytes vs full | peak RSS delta MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.dtype} | {r.length} | {r.runner} | {r.prefill_s:.2f} | {_x(r.prefill_vs_transformers)} | "
                     f"{_x(r.prefill_vs_full)} | {r.decode_tok_s:.1f} | {_x(r.decode_vs_transformers)} | "
                     f"{_x(r.decode_vs_full)} | {r.cache_bytes / 2**20:.1f} | {_x(r.bytes_vs_full, 3)} | "
                     f"{r.peak_rss_delta / 2**20:.0f} |")
    return "\n".join(lines) + "\n"


def load_models(s: Settings) -> tuple[dict[str, tuple[LlamaModel, Any]], Any, str]:
    """multihead's model (and transformers' on the same GGUF weights) per dtype, the tokenizer (None with
    random weights) and the model's name."""
    models: dict[str, tuple[LlamaModel, Any]] = {}
    tokenizer = None
    if s.random:
        return {d: (ctxbench.load(True, DTYPES[d]), None) for d in s.dtypes}, None, "random weights of SmolLM2's shape"
    from multihead.models import load_llama

    hf_load: Callable[[torch.dtype], Any] | None = None
    if s.transformers:
        sys.path.insert(0, str(ROOT / "tests"))
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        from tests_support import smollm2_gguf

        logging.set_verbosity_error()
        path = smollm2_gguf()

        def hf_load(dtype: torch.dtype) -> Any:
            return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                        attn_implementation="sdpa").eval()

    for d in s.dtypes:
        ours, tokenizer = load_llama(dtype=DTYPES[d])
        models[d] = (ours, hf_load(DTYPES[d]) if hf_load is not None else None)
    return models, tokenizer, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)"


WARM_UP_TOKENS = 48


def warm_up(models: dict[str, tuple[LlamaModel, Any]], tokens: torch.Tensor) -> None:
    """A short prompt and WARM_UP_TOKENS greedy steps per dtype for each model before anything is timed, as a
    server warms up (allocation, the native kernels' build, transformers' first calls); multihead's choices of
    kernel are read from the host's tuning table or the default rules, not measured here."""
    prompt = tokens[:, :16]
    for ours, theirs in models.values():
        cache = ours.new_cache(1, prompt.shape[1] + WARM_UP_TOKENS)
        ctxbench.prefill_decode(ours, cache, prompt, 0, WARM_UP_TOKENS)
        if theirs is not None:
            transformers_run(theirs, prompt, 8)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    s = parse(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    load_before = os.getloadavg()
    models, tokenizer, name = load_models(s)
    n = max(s.lengths)
    if tokenizer is None:
        tokens = torch.randint(0, ctxbench.SMOLLM2["vocab_size"], (1, n), generator=torch.Generator().manual_seed(1))
    else:
        tokens = text_tokens(tokenizer, n)
    plan = HeadPlan.load(s.plan) if "headwise" in s.caches else None
    if plan is not None:
        c = next(iter(models.values()))[0].config
        a = c.attention()
        assert a.n_kv_heads is not None and a.head_dim is not None
        plan.check(n_layers=c.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim)
    warm_up(models, tokens)
    started = time.perf_counter()
    rows = measure(models, tokens, s, plan)
    notes = run_notes(name, started, load_before)
    write_out(table(rows, s, notes), s, notes, rows)
    return rows


def run_notes(model: str, started: float, load_before: tuple[float, float, float]) -> list[str]:
    """The lines under a table's title: the machine, the threads, the model, the seconds since ``started`` and the
    load average before (``load_before``) and now."""
    after = os.getloadavg()
    return [f"machine: {bench.machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads; {model}; "
            f"measured in {time.perf_counter() - started:.0f} s",
            f"load average (1, 5, 15 min) before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
            f"after {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}"]


def write_out(text: str, s: Any, notes: Sequence[str], rows: Sequence[Any]) -> None:
    """Print the table (appended to RESULTS.md with ``s.record``) and write the settings, notes and rows (dataclasses)
    as JSON to ``s.json`` (``-``: stdout; None: nowhere)."""
    publish(text, s.record)
    if s.json is not None:
        data = json.dumps({"settings": asdict(s), "notes": list(notes), "rows": [asdict(r) for r in rows]}, indent=1)
        if s.json == "-":
            print(data)
        else:
            Path(s.json).write_text(data + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
