"""SmolLM2-135M decode steps at a long context: every cache kind of multihead and transformers (sdpa), interleaved
step by step in one process.

    .venv/bin/python benchmarks/cache_steps.py [--length 8192] [--dtypes float32 bfloat16]
        [--caches full sink int4 int8 headwise] [--decode-tokens 40] [--warm-steps 4] [--plan PLAN] [--no-transformers]
        [--record] [--json PATH | --json -]

``benchmarks/longctx_speed.py`` alternates whole runs (a prefill and its decode steps), so on a host whose speed drifts
(other machines' work on the same hardware) a run that falls in a slow spell moves its runner's median, and with two
or three rounds one such run is a third or half of the figure. Here every runner prefills the same prompt once (the
first ``--length`` tokens of the held-out Jargon File text; the full and quantized caches and transformers in one
call, the sink and head-wise caches in chunks of longctx_speed.WINDOW_CHUNK, as longctx_speed.py does), then each of
``--decode-tokens`` rounds takes one greedy decode step of every runner, the order rotated every round, so a slow
spell falls on every runner alike. The first ``--warm-steps`` rounds are not timed (the first calls at a new length:
allocation; multihead's kernel choices are the host's tuning table's or the default rules, read, never timed). A
figure is a runner's median step; the ratios are ratios of medians; ``spread`` is the middle half of its steps (25th
to 75th percentile).

Each runner continues its own sequence, so the caches grow by one token a round, from ``--length`` on, the same for
all. The models of one dtype are loaded, warmed up (:func:`longctx_speed.warm_up`), measured and freed before the next.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ctxbench
import longctx_speed
import torch

from multihead.cache import HeadPlan
from multihead.models import LlamaModel

WINDOW, SINKS, GROUP, RESIDUAL = 256, 4, 32, 128  # the sink cache's window and sinks, the quantized caches' group
# and residual: longctx_speed.py's defaults


@dataclass(frozen=True)
class Settings:
    length: int
    dtypes: tuple[str, ...]
    caches: tuple[str, ...]
    decode_tokens: int  # timed rounds (longctx_speed.py's --decode-tokens: greedy steps after the prompt)
    warm_steps: int
    plan: str
    transformers: bool
    record: bool = False
    json: str | None = None


@dataclass(frozen=True)
class Row:
    dtype: str
    runner: str  # a cache kind of multihead, or "transformers"
    step_ms: float  # median
    q1_ms: float  # 25th percentile
    q3_ms: float  # 75th percentile
    tok_s: float  # 1000 / step_ms
    vs_full: float | None  # the full cache's median step / this one's (above 1: faster than the full cache)
    vs_transformers: float | None  # transformers' median step / this one's (above 1: faster than transformers)
    cache_bytes: int
    steps_ms: tuple[float, ...] = ()  # every timed step, in order (the JSON keeps them; the table does not)


def parse(argv: Sequence[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(prog="cache_steps.py", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--length", type=int, default=8192, help="prompt tokens before the decode steps (default 8192)")
    p.add_argument("--dtypes", nargs="+", default=list(longctx_speed.DTYPES), help="float32, bfloat16 (default both)")
    p.add_argument("--caches", nargs="+", default=list(ctxbench.CACHE_KINDS), help="multihead's cache kinds")
    p.add_argument("--decode-tokens", type=int, default=40,
                   help="timed rounds, one greedy step of every runner each (default 40)")
    p.add_argument("--warm-steps", type=int, default=4, help="untimed rounds before them (default 4)")
    p.add_argument("--plan", default=str(longctx_speed.PLAN), help="the head-wise cache's plan (a HeadPlan JSON file)")
    p.add_argument("--no-transformers", action="store_true", help="multihead's caches only")
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON here (- for stdout)")
    a = p.parse_args(argv)
    if not 1 <= a.length <= ctxbench.SMOLLM2["max_context"]:
        p.error(f"--length ({a.length}) must lie between 1 and SmolLM2's context ({ctxbench.SMOLLM2['max_context']})")
    if a.decode_tokens < 1 or a.warm_steps < 0:
        p.error(f"--decode-tokens ({a.decode_tokens}) must be at least 1 and --warm-steps ({a.warm_steps}) at least 0")
    unknown = ([d for d in a.dtypes if d not in longctx_speed.DTYPES]
               + [c for c in a.caches if c not in ctxbench.CACHE_KINDS])
    if unknown:
        p.error(f"unknown {unknown}: dtypes {', '.join(longctx_speed.DTYPES)}; "
                f"caches {', '.join(ctxbench.CACHE_KINDS)}")
    if "headwise" in a.caches and not Path(a.plan).is_file():
        p.error(f"--plan {a.plan} is not a file (a HeadPlan JSON)")
    return Settings(a.length, tuple(dict.fromkeys(a.dtypes)), tuple(dict.fromkeys(a.caches)), a.decode_tokens,
                    a.warm_steps, a.plan, not a.no_transformers, a.record, a.json)


Step = Callable[[], torch.Tensor]  # one greedy decode step; returns the token it chose (1, 1)


@torch.no_grad()
def multihead_runner(model: LlamaModel, kind: str, tokens: torch.Tensor, s: Settings, plan: HeadPlan | None
                     ) -> tuple[Step, Callable[[], int]]:
    """Prefill ``tokens`` into a new cache of ``kind``; a function that takes one greedy decode step (and returns the
    token it chose), and one that gives the cache's bytes."""
    cache = ctxbench.make_cache(model, kind, tokens.shape[1] + s.warm_steps + s.decode_tokens, plan=plan,
                                window=WINDOW, sinks=SINKS, group=GROUP, residual=RESIDUAL)
    chunk = longctx_speed.prefill_chunk(kind, 0) or tokens.shape[1]
    for at in range(0, tokens.shape[1], chunk):
        part = tokens[:, at:at + chunk]
        logits = model(part, cache=cache, logits_to_keep=1)
        cache.advance(part.shape[1])
    state = {"next": logits[:, -1:].argmax(-1)}

    @torch.no_grad()
    def step() -> torch.Tensor:
        out = model(state["next"], cache=cache)
        cache.advance(1)
        state["next"] = out[:, -1:].argmax(-1)
        return state["next"]

    return step, lambda: cache.bytes


@torch.no_grad()
def transformers_runner(model: Any, tokens: torch.Tensor) -> tuple[Step, Callable[[], int]]:
    """transformers' prefill of the whole prompt (its DynamicCache) and a one-step greedy decode function."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(tokens, use_cache=True, logits_to_keep=1)
    state = {"past": getattr(out, name), "next": out.logits[:, -1:].argmax(-1)}

    @torch.no_grad()
    def step() -> torch.Tensor:
        o = model(state["next"], use_cache=True, **{name: state["past"]})
        state["past"], state["next"] = getattr(o, name), o.logits[:, -1:].argmax(-1)
        return state["next"]

    return step, lambda: longctx_speed.transformers_cache_bytes(state["past"])


def interleave(runners: dict[str, Step], steps: int, warm: int) -> dict[str, list[float]]:
    """``warm`` untimed then ``steps`` timed rounds of one step of every runner, the order rotated every round."""
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warm + steps):
        turn = r % len(names)
        for name in names[turn:] + names[:turn]:
            began = time.perf_counter()
            runners[name]()
            if r >= warm:
                times[name].append(time.perf_counter() - began)
    return times


def quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


def load(dtype: str, s: Settings) -> tuple[dict[str, tuple[LlamaModel, Any]], Any]:
    """multihead's SmolLM2 (and transformers' on the same weights) in one dtype, and the tokenizer."""
    models, tokenizer, _ = longctx_speed.load_models(longctx_speed.Settings(
        lengths=(s.length,), dtypes=(dtype,), caches=s.caches, rounds=1, decode_tokens=1, chunk=0, window=WINDOW,
        sinks=SINKS, plan=s.plan, random=False, transformers=s.transformers))
    return models, tokenizer


def measure_dtype(dtype: str, models: dict[str, tuple[LlamaModel, Any]], tokens: torch.Tensor, s: Settings,
                  plan: HeadPlan | None) -> list[Row]:
    ours, hf = models[dtype]
    longctx_speed.warm_up(models, tokens)
    runners: dict[str, Step] = {}
    sizes: dict[str, Callable[[], int]] = {}
    prompt = tokens[:, :s.length]
    for kind in s.caches:
        runners[kind], sizes[kind] = multihead_runner(ours, kind, prompt, s, plan)
    if hf is not None:
        runners[longctx_speed.TRANSFORMERS], sizes[longctx_speed.TRANSFORMERS] = transformers_runner(hf, prompt)
    times = interleave(runners, s.decode_tokens, s.warm_steps)
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = []
    for name, t in times.items():
        q1, q3 = quartiles(t)
        full, hf_m = med.get("full"), med.get(longctx_speed.TRANSFORMERS)
        ours_row = name != longctx_speed.TRANSFORMERS
        rows.append(Row(dtype, name, med[name] * 1e3, q1 * 1e3, q3 * 1e3, 1 / med[name],
                        full / med[name] if full and ours_row else None,
                        hf_m / med[name] if hf_m and ours_row else None, sizes[name](),
                        tuple(round(x * 1e3, 2) for x in t)))
    return rows


def table(rows: Sequence[Row], s: Settings, notes: Sequence[str]) -> str:
    lines = [f"### SmolLM2-135M decode steps after {s.length} tokens, every cache and transformers interleaved step "
             f"by step ({datetime.date.today()})",
             *notes,
             f"each runner prefilled the prompt once, then {s.warm_steps} untimed and {s.decode_tokens} timed rounds "
             "of one greedy step of every runner, the order rotated every round; median step, the spread its 25th-75th "
             f"percentile; vs full / vs transformers: their median step over this one's (above 1: faster); sink = "
             f"{SINKS} sinks + window {WINDOW}; int4/int8 group {GROUP} residual {RESIDUAL}; "
             f"headwise = {Path(s.plan).name}",
             "",
             "| dtype | runner | step ms | spread ms | tok/s | vs full | vs transformers | cache MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.dtype} | {r.runner} | {r.step_ms:.1f} | {r.q1_ms:.1f}-{r.q3_ms:.1f} | {r.tok_s:.1f} | "
                     f"{longctx_speed._x(r.vs_full)} | {longctx_speed._x(r.vs_transformers)} | "
                     f"{r.cache_bytes / 2**20:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[Row]:
    s = parse(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    load_before = os.getloadavg()
    plan = HeadPlan.load(s.plan) if "headwise" in s.caches else None
    started = time.perf_counter()
    rows: list[Row] = []
    for dtype in s.dtypes:  # one dtype's models at a time
        models, tokenizer = load(dtype, s)
        tokens = longctx_speed.text_tokens(tokenizer, s.length)
        rows += measure_dtype(dtype, models, tokens, s, plan)
        del models
        gc.collect()
    notes = longctx_speed.run_notes("SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)", started, load_before)
    longctx_speed.write_out(table(rows, s, notes), s, notes, rows)
    return rows


if __name__ == "__main__":
    main()
