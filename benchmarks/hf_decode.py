"""The transformers path's speed (issue 50): a model in transformers, its attention on multihead with each cache kind,
against transformers' own sdpa attention and DynamicCache, in one process, the variants alternating.

For each model, dtype and cached length: the same random context (seeded) is prefilled in chunks of
``--prefill-chunk`` tokens, once through transformers' DynamicCache (sdpa) and once through a full multihead cache,
each chunked prefill timed (one run each: seconds); the other kinds are then made from the full prefill
(:func:`multihead.cache.compress`: sinks + window, int8, int4, head-wise plans) and every variant decodes the same
greedy continuation one token a step, the variants taking turns step by step (``--steps`` timed steps after one
untimed step, which also records the kernel :func:`multihead.kernels.explain` names for each variant's first layer).
multihead's variants run with its products (``hf.enable``'s default, ``products=True``); "multihead full, transformers'
products" is the full cache with the model's own ``nn.Linear`` (``products=False``), and every transformers variant runs
with those. The table gives each variant's median ms a step and its speed against transformers' (>1: faster), with the
bytes each cache holds and each multihead kind's step against its bytes bound (:func:`bytes_bound`: the full cache's
step scaled by the weights + cache bytes read).
``--load N`` repeats the decode with N busy processes (pure Python loops,
one core each) started by the benchmark; multihead's kinds follow the load (:func:`multihead.kernels.cpu.follow_load`,
the default; ``--no-follow-load``: the configured threads, as ``MULTIHEAD_FOLLOW_LOAD=0``), transformers' steps never,
and under the load a second full cache runs with the threads as configured, so both are measured against
transformers there. ``--json`` is written after each cell;
``--resume`` keeps the cells a file of an earlier run holds and measures the rest.

transformers' compiled decoding runs beside them as a second anchor (issue 50 item 3): its StaticCache prefilled
eagerly, then ``torch.compile(model.forward)`` one token a step (:class:`CompiledStatic`; compiled afresh for each
cell, ~30 s on 2 cores, in the untimed warm-up; ``--no-compiled`` leaves it out; a model it fails on is said and
left out). "vs compiled" is each variant's speed against it. multihead's caches do not compile: their view reaches
the attention function as an attribute of the keys tensor, which torch.compile does not carry.

Head-wise plans: SmolLM2's shipped ones (docs/experiments/smollm2-duo-50-plan.json, smollm2-duo1024-25-plan.json);
Gemma 3 270M has one KV head a layer and 15 of its 18 layers slide (their heads are rings of the 512-token window
whatever a plan says), so its plans keep every key on 2 of the 3 global layers ("50%") or on 1 ("25%"), the others
streaming with 4 sinks + 256.

    .venv/bin/python benchmarks/hf_decode.py [--models smollm2 gemma3] [--dtypes float32 bfloat16]
        [--lengths 1024 4096 8192] [--steps 12] [--load 0] [--no-follow-load] [--no-compiled]
        [--json out/hf-decode.json] [--resume] [--record]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bench
import torch
from results import publish

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
SINKS, WINDOW = 4, 256


def load(name: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from multihead.models import default_gemma3_path, default_gguf_path

    logging.set_verbosity_error()
    path = {"smollm2": default_gguf_path, "gemma3": default_gemma3_path}[name]()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def plans(name: str, model: Any) -> dict[str, Any]:
    from multihead.cache import HeadPlan
    from multihead.hf.cache import layer_windows

    if name == "smollm2":
        folder = ROOT / "docs" / "experiments"
        return {"head-wise 50%": HeadPlan.load(folder / "smollm2-duo-50-plan.json"),
                "head-wise 25%": HeadPlan.load(folder / "smollm2-duo1024-25-plan.json")}
    text = model.config
    n_layers, h = text.num_hidden_layers, text.num_attention_heads
    g, d = text.num_key_value_heads, text.head_dim
    globals_ = [i for i, w in enumerate(layer_windows(text, n_layers)) if w is None]
    out = {}
    for label, keep in (("head-wise 50%", globals_[:2]), ("head-wise 25%", globals_[:1])):
        full = [[i in keep] * g for i in range(n_layers)]
        out[label] = HeadPlan(full=full, sinks=SINKS, window=WINDOW, model=f"{name} (benchmark)",
                              shape=(n_layers, h, g, d))
    return out


@contextlib.contextmanager
def recording_kernels(found: list[str]) -> Iterator[None]:
    """Record what :func:`multihead.kernels.explain` says of each attention call made inside (the calls still run)."""
    from multihead import kernels
    from multihead.hf import attention as hf  # the module whose attention function calls the dispatcher

    real = hf.attend

    def attend(call: Any) -> Any:
        found.append(str(kernels.explain(call)))
        return real(call)

    hf.attend = attend  # type: ignore[assignment]
    try:
        yield
    finally:
        hf.attend = real  # type: ignore[assignment]


def weights_read(model: Any) -> int:
    """The bytes of weights a decode step reads: every parameter once (a tied LM head is the embedding table), an
    untied input embedding table left out (a step reads one row of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or emb.weight is not head.weight:
        total -= emb.weight.numel() * emb.weight.element_size()
    return int(total)


def bytes_bound(rows: list[dict[str, Any]], weights: int) -> None:
    """Each multihead kind's decode step against its bytes bound (issue 50 item 2): a step reads the weights and the
    cache, so a kind holding fewer bytes than the full cache should take the full cache's step time scaled by the
    bytes read, ``ms_full * (weights + cache) / (weights + cache_full)``; ``of_bound`` is the step's time over that
    (1.0: at the bound; the issue asks 0.85-1.15). Added to the rows of each condition in place, for the kinds (a
    variant named "multihead <kind>, <how it runs>" is another way to run one: none)."""
    for condition in {r["condition"] for r in rows}:
        mine = [r for r in rows if r["condition"] == condition]
        full = next(r for r in mine if r["variant"] == "multihead full")
        for r in mine:
            r["bytes_read"] = weights + r["cache_bytes"]
            if r["variant"].startswith("multihead") and ", " not in r["variant"]:  # a kind, not a way to run one
                bound = full["ms_per_step"] * r["bytes_read"] / (weights + full["cache_bytes"])
                r["ms_bound"] = round(bound, 2)
                r["of_bound"] = round(r["ms_per_step"] / bound, 3)


def prefill(model: Any, ids: torch.Tensor, cache: Any, chunk: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, ids.shape[1], chunk):
            model(ids[:, i:i + chunk], cache=cache, logits_to_keep=1)
    return time.perf_counter() - start


def cell(name: str, model: Any, dtype: torch.dtype, length: int, *, steps: int, chunk: int, load: int,
         plan_of: dict[str, Any], compiled: bool = True, follow: bool = True) -> dict[str, Any]:
    from transformers import DynamicCache

    from multihead import hf
    from multihead.cache import compress
    from multihead.kernels import cpu

    extra = 2 * (steps + 2)  # the decode steps' tokens (idle and loaded, and the warm-up)
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and length + extra > context:  # SmolLM2's 8,192: cache as many as leave room to decode
        print(f"{name}: {length:,} cached tokens and {extra} decode steps exceed the context ({context:,}): "
              f"{context - extra:,} cached instead", flush=True)
        length = context - extra
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(10, model.config.vocab_size, (1, length), generator=gen)
    room = length + extra
    model.set_attn_implementation("sdpa")
    hf.switch_products(model, False)  # an earlier cell's hf.enable switched them
    theirs = DynamicCache(config=model.config)
    prefill_s = {"transformers sdpa + DynamicCache": prefill(model, ids, theirs, chunk)}
    hf.enable(model)  # multihead's attention and products (the default)
    full = hf.new_cache(model, room)
    prefill_s["multihead full"] = prefill(model, ids, full, chunk)
    caches: dict[str, Any] = {"transformers sdpa + DynamicCache": theirs, "multihead full": full}
    made = {"sinks + window": hf.new_cache(model, room, window=WINDOW, sink_tokens=SINKS),
            "int8": hf.new_cache(model, room, bits=8), "int4": hf.new_cache(model, room, bits=4),
            **{label: hf.new_cache(model, room, plan=p) for label, p in plan_of.items()}}
    # the full kind with transformers' own products (hf.enable(model, products=False)): what multihead's add
    made[THEIR_PRODUCTS.removeprefix("multihead ")] = hf.new_cache(model, room)
    if load and follow:  # the full kind with the configured threads (MULTIHEAD_FOLLOW_LOAD=0), under the load
        made[UNFOLLOWED.removeprefix("multihead ")] = hf.new_cache(model, room)
    for label, cache in made.items():
        compress(full.inner, cache.inner)
        caches[f"multihead {label}"] = cache
    compiled_step = _compiled_static(model, ids, room, chunk) if compiled else None
    if isinstance(compiled_step, str):
        print(f"{name} {dtype} {length}: transformers' compiled StaticCache did not run: {compiled_step}", flush=True)
        compiled_step = None
    if compiled_step is not None:
        caches[COMPILED] = compiled_step.cache
    token = {label: ids[:, -1:] for label in caches}
    kernels: dict[str, str] = {}
    conditions = [("idle", 0)] + ([(f"{load} busy", load)] if load else [])

    def step(label: str, record: list[str] | None = None) -> float:
        mine = label.startswith("multihead")
        model.set_attn_implementation("multihead" if mine else "sdpa")
        hf.switch_products(model, mine and label != THEIR_PRODUCTS)  # transformers' steps: its own nn.Linear
        # transformers' own steps never follow it, nor the full kind's second copy (the default's threads)
        cpu.follow_load(follow and label.startswith("multihead") and label != UNFOLLOWED)
        if label == COMPILED:
            assert compiled_step is not None
            took, logits = compiled_step(token[label])
            token[label] = logits[:, -1:].argmax(-1)
            return took
        with torch.no_grad(), (recording_kernels(record) if record is not None else contextlib.nullcontext()):
            start = time.perf_counter()
            logits = model(token[label], cache=caches[label]).logits
            took = time.perf_counter() - start
        token[label] = logits[:, -1:].argmax(-1)
        return took

    for label in list(caches):  # one untimed step each: warm (the compiled one: compiles), and the kernel each runs
        found: list[str] = []
        if label == COMPILED:
            try:
                step(label)
                step(label)
            except Exception as e:
                print(f"{name} {dtype} {length}: transformers' compiled StaticCache did not run: "
                      f"{type(e).__name__}: {str(e)[:300]}", flush=True)
                del caches[label]
                continue
        step(label, None if label.startswith("transformers") else found)
        kernels[label] = found[0] if found else ("torch sdpa (transformers), torch.compile (inductor)"
                                                 if label == COMPILED else "torch sdpa (transformers)")
    times: dict[str, dict[str, list[float]]] = {c: {label: [] for label in caches} for c, _ in conditions}
    for condition, busy in conditions:
        with bench_load(busy):
            for _ in range(steps):
                for label in caches:
                    if busy or label != UNFOLLOWED:  # idle, the two full copies would run the same way
                        times[condition][label].append(step(label))
    rows = []
    for condition, _ in conditions:
        anchor = statistics.median(times[condition]["transformers sdpa + DynamicCache"])
        fastest = statistics.median(times[condition][COMPILED]) if COMPILED in caches else None
        for label in caches:
            if not times[condition][label]:
                continue
            ms = statistics.median(times[condition][label])
            cache = caches[label]
            held = (sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)
                    if label.startswith("transformers") else cache.bytes)
            rows.append({"model": name, "dtype": str(dtype).removeprefix("torch."), "cached": length,
                         "condition": condition, "variant": label, "ms_per_step": round(1000 * ms, 2),
                         "speed_vs_transformers": round(anchor / ms, 3),
                         "speed_vs_compiled": None if fastest is None else round(fastest / ms, 3), "cache_bytes": held,
                         "prefill_s": round(prefill_s[label], 2) if label in prefill_s else None,
                         "kernel": kernels[label]})
    bytes_bound(rows, weights_read(model))
    return {"rows": rows}


COMPILED = "transformers sdpa + StaticCache, compiled"
UNFOLLOWED = "multihead full, threads as configured"  # with --load N: MULTIHEAD_FOLLOW_LOAD=0, under the load
THEIR_PRODUCTS = "multihead full, transformers' products"  # hf.enable(model, products=False)


class CompiledStatic:
    """transformers' own compiled decoding: a StaticCache prefilled eagerly, then ``torch.compile(model.forward)``
    (inductor; sizes that change between steps made dynamic after the first recompile, torch.compile's default) one
    token a step at explicit cache positions. Built after :func:`multihead.hf.enable`, so the model's inactive hook
    points are traced in with it (they add no work when inactive). ``cache`` the StaticCache; calling it with a
    token returns (seconds, logits)."""

    def __init__(self, model: Any, cache: Any, position: int) -> None:
        self.model, self.cache, self.position = model, cache, position
        self.forward = torch.compile(model.forward)

    def __call__(self, token: torch.Tensor) -> tuple[float, torch.Tensor]:
        at = torch.tensor([self.position])
        with torch.no_grad():
            start = time.perf_counter()
            logits = self.forward(token, cache=self.cache, cache_position=at, position_ids=at[None]).logits
            took = time.perf_counter() - start
        self.position += 1
        return took, logits


def _compiled_static(model: Any, ids: torch.Tensor, room: int, chunk: int) -> CompiledStatic | str:
    """transformers' StaticCache compiled, for this model, dtype and length, or why it does not run here."""
    from transformers import StaticCache

    from multihead import hf

    torch._dynamo.reset()  # a fresh compile for this cell's shapes (each cell would otherwise count as a recompile)
    try:
        model.set_attn_implementation("sdpa")
        hf.switch_products(model, False)  # transformers as it is: its own nn.Linear, traced once
        cache = StaticCache(config=model.config, max_cache_len=room)
        prefill(model, ids, cache, chunk)
        return CompiledStatic(model, cache, ids.shape[1])
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:300]


def _busy() -> None:
    while True:
        pass


@contextlib.contextmanager
def bench_load(n: int) -> Iterator[None]:
    """n processes spinning on one core each while the block runs (n = 0: nothing)."""
    procs = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        if procs:
            time.sleep(0.5)
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join()


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | dtype | cached | condition | variant | ms a step | vs transformers | vs compiled | "
            "cache bytes | of bytes bound | prefill s |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        pre = "" if r["prefill_s"] is None else f"{r['prefill_s']:.1f}"
        bound = "" if r.get("of_bound") is None else f"{r['of_bound']:.2f}"
        fast = "" if r.get("speed_vs_compiled") is None else f"{r['speed_vs_compiled']:.2f}x"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['cached']:,} | {r['condition']} | {r['variant']} | "
                     f"{r['ms_per_step']:.1f} | {r['speed_vs_transformers']:.2f}x | {fast} | {r['cache_bytes']:,} | "
                     f"{bound} | {pre} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=("smollm2", "gemma3"), default=["smollm2", "gemma3"])
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 8192])
    p.add_argument("--steps", type=int, default=12, help="timed decode steps of each variant (default 12)")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--load", type=int, default=0, help="also decode with N busy processes (default 0: idle only)")
    p.add_argument("--no-follow-load", action="store_true",
                   help="multihead's steps keep the configured threads (MULTIHEAD_FOLLOW_LOAD=0; by default they "
                        "follow the machine's load, multihead.kernels.cpu.follow_load: as many "
                        "threads as cores are free); transformers' steps never do")
    p.add_argument("--no-compiled", action="store_true",
                   help="leave out transformers' compiled StaticCache (each cell compiles it: ~30 s on 2 cores)")
    p.add_argument("--json", type=Path, default=None, help="write the rows and the machine to this JSON file")
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    p.add_argument("--resume", action="store_true",
                   help="keep the cells the --json file already holds (model, dtype, length asked) and run the rest")
    args = p.parse_args(argv)
    for name, value in (("--steps", args.steps), ("--prefill-chunk", args.prefill_chunk)):
        if value < 1:
            p.error(f"{name} must be at least 1, got {value}")
    if args.load < 0 or any(n < 1 for n in args.lengths):
        p.error(f"--load ({args.load}) must be >= 0 and every --lengths >= 1 ({args.lengths})")
    from multihead.kernels import native

    native.build_now()
    if args.resume and args.json is None:
        p.error("--resume needs --json (the file of the run it resumes)")
    rows: list[dict[str, Any]] = []
    if args.resume and args.json.exists():
        rows = json.loads(args.json.read_text())["rows"]
    done = {(r["model"], r["dtype"], r.get("asked", r["cached"])) for r in rows}
    for name in args.models:
        if all((name, d, n) in done for d in args.dtypes for n in args.lengths):
            continue
        model = load(name)
        plan_of = plans(name, model)
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            model.to(dtype)
            for length in args.lengths:
                if (name, dtype_name, length) in done:
                    print(f"{name} {dtype_name} {length}: kept from {args.json}", flush=True)
                    continue
                found = cell(name, model, dtype, length, steps=args.steps, chunk=args.prefill_chunk,
                             load=args.load, plan_of=plan_of, compiled=not args.no_compiled,
                             follow=not args.no_follow_load)
                rows.extend(dict(r, asked=length) for r in found["rows"])
                print(table(found["rows"]), flush=True)
                if args.json is not None:  # after each cell: a long run that stops keeps what it measured
                    write_json(args.json, rows, not args.no_follow_load)
        del model
    stamp = datetime.date.today().isoformat()
    kernels = sorted({f"{r['variant']}: {r['kernel']}" for r in rows if r["cached"] == args.lengths[0]})
    text = (f"### The transformers path's decode against transformers' sdpa + DynamicCache ({stamp})\n"
            f"machine: {bench.machine()}; {args.steps} steps a variant, alternating step by step, median; "
            + ("multihead's steps following the load (transformers' not); " if not args.no_follow_load else
               "every step with the configured threads; ")
            + f"prefill in chunks of {args.prefill_chunk}; `benchmarks/hf_decode.py`\n\n{table(rows)}\n\n"
            "kernels (first layer of the first step, at the shortest length):\n"
            + "\n".join(f"- {k}" for k in kernels) + "\n")
    publish(text, args.record)
    if args.json is not None:
        write_json(args.json, rows, not args.no_follow_load)
    return 0


def write_json(path: Path, rows: list[dict[str, Any]], follow: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": bench.machine(), "date": datetime.date.today().isoformat(),
                                "follow_load": follow, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
