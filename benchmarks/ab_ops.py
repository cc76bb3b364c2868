"""Aten ops dispatched by the hot paths: this checkout against another git revision, in one process, no clock.

    .venv/bin/python benchmarks/ab_ops.py --base REV [--repeats 30]

The package at ``--base`` is loaded beside the current one (``ab_decode.export``). Each case is built with the same
seed in both versions and run once under a TorchDispatchMode that records every aten op: a SmolLM2-135M-sized decode
step (random weights; 30 layers, 9/3 heads, after a 6-token prompt; float32 and bfloat16), and single layer calls
(bidirectional, causal, a causal train step with backward, a GQA decode step over 4,096 cached tokens, the same with
a hook reading the pattern, MLA's absorbed decode step and its expanded prefill). It prints, per case, the op count
of each version and whether the ops are the same kinds in the same numbers, and the Python calls (functions and
builtins, counted by cProfile) of one run; then, as a rough check only, the median
time ratio (new / base) of the decode step over ``--repeats`` alternating calls (noise on a shared machine).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib
import importlib.util
import pstats
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench
import torch
from ab_decode import export
from torch.utils._python_dispatch import TorchDispatchMode

SMOLLM2 = {"vocab_size": 49152, "d_model": 576, "n_layers": 30, "n_heads": 9, "n_kv_heads": 3, "ffn_dim": 1536,
           "rope_base": 100000.0, "max_context": 8192}
MLA = {"d_model": 256, "n_heads": 16, "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
       "v_head_dim": 32}


class Ops(TorchDispatchMode):
    """Counts the aten ops a call dispatches, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def cases(pkg: str) -> dict[str, Callable[[], object]]:
    """The calls to count for one version of the package (same seeds, so the same weights and inputs)."""
    mh = importlib.import_module(pkg)
    llama = importlib.import_module(f"{pkg}.models.llama")
    latent = importlib.import_module(
        f"{pkg}.layers.latent" if importlib.util.find_spec(f"{pkg}.layers") else f"{pkg}.latent")
    out: dict[str, Callable[[], object]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = llama.LlamaModel(llama.LlamaConfig(**SMOLLM2), dtype=dtype).eval()
        cache = model.new_cache(1, 64)
        with torch.no_grad():
            model(torch.arange(6)[None], cache=cache)
        cache.advance(6)
        token = torch.tensor([[7]])

        def decode(m: Any = model, c: Any = cache, t: Any = token) -> object:
            with torch.no_grad():
                return m(t, cache=c)  # writes slot 6 and attends to 7 keys; not advanced

        out[f"SmolLM2 decode step {str(dtype).removeprefix('torch.')}"] = decode
    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(d_model=64, n_heads=4).eval()
    x = torch.randn(2, 16, 64)
    torch.manual_seed(0)
    train = mh.MultiHeadAttention(d_model=64, n_heads=4, dropout=0.0)
    xt = torch.randn(2, 16, 64, requires_grad=True)
    torch.manual_seed(0)
    p3 = mh.MultiHeadAttention(d_model=576, n_heads=9, n_kv_heads=3, bias=False).eval()
    kv = mh.KVCache(batch=1, n_kv_heads=3, head_dim=64, max_len=4097)
    kv.k[0, :, :, :4096] = torch.randn(1, 3, 4096, 64)
    kv.v[0, :, :, :4096] = torch.randn(1, 3, 4096, 64)
    kv.advance(4096)
    x3 = torch.randn(1, 1, 576)
    torch.manual_seed(0)
    mla = latent.MultiHeadLatentAttention(**MLA).eval()
    lc = mh.LatentCache(batch=1, kv_lora_rank=128, rope_dim=16, max_len=600)
    with torch.no_grad():
        mla(torch.randn(1, 512, 256), causal=True, cache=lc.layer(0))
    lc.advance(512)
    xm, xp = torch.randn(1, 1, 256), torch.randn(1, 64, 256)

    def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return fn()
        return run

    def read_pattern() -> object:
        with torch.no_grad(), p3.hook_pattern.add(lambda w, point: None):
            return p3(x3, causal=True, cache=kv.layer(0))

    out["layer bidirectional b2 s16"] = no_grad(lambda: layer(x))
    out["layer causal b2 s16"] = no_grad(lambda: layer(x, causal=True))
    out["layer causal train step (backward)"] = lambda: train(xt, causal=True).sum().backward()
    out["GQA decode 9/3 over 4096 cached"] = no_grad(lambda: p3(x3, causal=True, cache=kv.layer(0)))
    out["GQA decode, hook reading the pattern"] = read_pattern
    out["MLA absorbed decode over 512 cached"] = no_grad(lambda: mla(xm, causal=True, cache=lc.layer(0)))
    out["MLA expanded prefill s64"] = no_grad(lambda: mla(xp, causal=True, path="expanded"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="multihead-ab-"))
    base_rev = export(args.base, tmp)
    sys.path.insert(0, str(tmp))
    new, base = cases("multihead"), cases("multihead_base")
    print(f"aten ops, this checkout against {base_rev} (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print("| case | aten ops new | base | same kinds and counts | Python calls new | base |")
    print("|---|---|---|---|---|---|")
    for name in new:
        counts, calls = [], []
        for run in (new[name], base[name]):
            run()  # warm-up: lazily made state (compiled chooser, cached tables) is not counted
            with Ops() as ops:
                run()
            counts.append(ops.count)
            profile = cProfile.Profile()
            profile.runcall(run)
            calls.append(pstats.Stats(profile).total_calls)  # type: ignore[attr-defined]
        same = counts[0] == counts[1]
        print(f"| {name} | {sum(counts[0].values())} | {sum(counts[1].values())} | {'yes' if same else 'no'} | "
              f"{calls[0]} | {calls[1]} |")
        if not same:
            print("   new - base:", dict(counts[0] - counts[1]), " base - new:", dict(counts[1] - counts[0]))
    for name in ("SmolLM2 decode step float32", "GQA decode 9/3 over 4096 cached"):
        t_new, t_base = bench.alternate(new[name], base[name], args.repeats)
        t_base2, t_new2 = bench.alternate(base[name], new[name], args.repeats)
        print(f"{name}: new / base time {t_new / t_base:.3f} (new first), {t_new2 / t_base2:.3f} (base first)")


if __name__ == "__main__":
    main()
