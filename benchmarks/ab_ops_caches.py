"""Aten ops per decode step through each cache kind, this checkout against another revision (no clock).

ab_ops.py counts the layer calls and the Python calls; this one the cache kinds.

    .venv/bin/python benchmarks/ab_ops_caches.py --base REV [--record]

A count of dispatched aten ops (a TorchDispatchMode below autograd) does not depend on the machine's load, so it
shows where a change adds work to the hot path when timings on a shared machine cannot. The package at ``--base`` is
loaded beside the current one (``ab_decode.export``); each case runs one step after the same prompt in both, eager,
under no_grad: SmolLM2-135M (batch 1: slice write and plain mask; float32 and bfloat16), a tiny Llama at batch 2 of
two lengths (indexed write, mask by positions), with a sink + window cache and a quantized cache, the CPU
benchmark's P3 layer call (9/3 heads over 4,096 cached tokens) and an MLA absorbed decode step over a latent cache.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib
import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ab_decode import ROOT, export
from ab_ops import Ops
from results import publish


def count(step: Callable[[], object]) -> collections.Counter[str]:
    with torch.no_grad(), Ops() as ops:
        step()
    return ops.count


def cases(mh: Any, smol: dict[torch.dtype, Any]) -> dict[str, Callable[[], Callable[[], object]]]:
    """Each case prepares its model and cache (not counted) and returns the one step that is counted."""
    llama = importlib.import_module(f"{mh.__name__}.models.llama")
    pkg = mh.__name__
    room = f"{pkg}.layers" if importlib.util.find_spec(f"{pkg}.layers") else pkg  # the layers' room, or before it
    latent = importlib.import_module(f"{room}.latent")

    def smollm(dtype: torch.dtype) -> Callable[[], object]:
        model = smol[dtype]
        cache = model.new_cache(1, 64)
        prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])
        with torch.no_grad():
            model(prompt, cache=cache)
        cache.advance(6)
        return lambda: model(torch.tensor([[7]]), cache=cache)

    def tiny(kind: str) -> Callable[[], object]:
        torch.manual_seed(0)
        cfg = llama.LlamaConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                max_context=128)
        model = llama.LlamaModel(cfg).eval()
        options = {"lengths": {}, "sink": {"window": 8, "sink_tokens": 2}, "quantized": {"bits": 4, "group": 4,
                                                                                         "residual": 4}}[kind]
        cache = model.new_cache(2, **options) if kind == "sink" else model.new_cache(2, 32, **options)
        with torch.no_grad():
            model(torch.randint(0, 50, (2, 9)), cache=cache)
        cache.advance(9, lengths=[5, 9]) if kind == "lengths" else cache.advance(9)
        return lambda: model(torch.randint(0, 50, (2, 1)), cache=cache)

    def p3() -> Callable[[], object]:
        torch.manual_seed(0)
        layer = mh.MultiHeadAttention(d_model=576, n_heads=9, n_kv_heads=3, bias=False).eval()
        cache = mh.KVCache(batch=1, n_kv_heads=3, head_dim=64, max_len=4097)
        cache.advance(4096)
        x = torch.randn(1, 1, 576)
        return lambda: layer(x, causal=True, cache=cache.layer(0))

    def mla() -> Callable[[], object]:
        torch.manual_seed(0)
        layer = latent.MultiHeadLatentAttention(d_model=256, n_heads=8, kv_lora_rank=128, qk_nope_head_dim=32,
                                                qk_rope_head_dim=16, v_head_dim=32).eval()
        cache = mh.LatentCache(batch=1, kv_lora_rank=128, rope_dim=16, max_len=64)
        with torch.no_grad():
            layer(torch.randn(1, 8, 256), causal=True, cache=cache.layer(0))
        cache.advance(8)
        x = torch.randn(1, 1, 256)
        return lambda: layer(x, causal=True, cache=cache.layer(0))

    return {
        "SmolLM2-135M decode step, batch 1, float32": lambda: smollm(torch.float32),
        "SmolLM2-135M decode step, batch 1, bfloat16": lambda: smollm(torch.bfloat16),
        "tiny Llama decode step, batch 2 of lengths 5 and 9": lambda: tiny("lengths"),
        "tiny Llama decode step, batch 2, sink + window cache": lambda: tiny("sink"),
        "tiny Llama decode step, batch 2, 4-bit cache": lambda: tiny("quantized"),
        "P3 layer decode call, 9/3 heads, 4,096 cached": p3,
        "MLA absorbed decode step, latent cache": mla,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--record", action="store_true", help="append the results to benchmarks/RESULTS.md")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="multihead-ab-"))
    base_rev = export(args.base, tmp)
    sys.path.insert(0, str(tmp))
    head_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src"], capture_output=True,
                                text=True).stdout.strip())
    rows = []
    sides = {}
    for name in ("multihead", "multihead_base"):
        mh = importlib.import_module(name)
        loaders = importlib.import_module(f"{name}.models.loaders")
        smol = {dtype: loaders.load_llama(dtype=dtype)[0] for dtype in (torch.float32, torch.bfloat16)}
        sides[name] = cases(mh, smol)
    for case in sides["multihead"]:
        new, base = count(sides["multihead"][case]()), count(sides["multihead_base"][case]())
        diff = sorted((op, new[op] - base[op]) for op in set(new) | set(base) if new[op] != base[op])
        rows.append(f"| {case} | {sum(new.values()):,} | {sum(base.values()):,} | "
                    f"{', '.join(f'{op} {d:+d}' for op, d in diff) or 'none'} |")
    text = "\n".join([
        f"### Aten ops per decode step, {head_rev}{' + uncommitted' if dirty else ''} against {base_rev} "
        f"({datetime.date.today()})",
        f"torch {torch.__version__}, eager, no_grad; one process (ab_ops_caches.py --base {args.base}); a count, "
        "not a timing: the same on any machine and load",
        "",
        "| case | new ops | base ops | ops that differ (new - base) |",
        "|---|---|---|---|",
        *rows,
    ]) + "\n"
    publish(text, args.record)


if __name__ == "__main__":
    main()
