"""The CPU benchmarks' layer shapes: this checkout against another git revision, in one process, alternating.

    .venv/bin/python benchmarks/ab_layer.py --base REV [--repeats 7] [--record]

The package at ``--base`` is loaded beside the current one (``ab_decode.export``); both layers get the same weights
and inputs, and each case times them alternately (``bench.alternate``), once with each side first: P1 inference
(d768, 12 heads, batch 4, 1024 tokens), P2 a causal training step (512 tokens), P3 a GQA decode step (9/3 heads,
head_dim 64, 4096 cached tokens), P5 the attention core (b4 h12 s1024 d64), and an MLA layer of DeepSeek-V2-Lite's
attention shape (benchmarks/mla_decode.py's) taking a decode step over 4096 cached latents (the absorbed path) and a
512-token prefill (the expanded one). The ratio is new time over base time
(below 1: the checkout is faster).
P4 is a peak-memory measure in a fresh process (benchmarks/cpu.py), not a timing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench
import torch
from ab_decode import ROOT, export
from results import publish


def cases(mh: Any, kernels: Any, masks: Any, new_api: bool) -> dict[str, Callable[[], object]]:
    """The four timed calls for one version of the package (same seeds, so the same weights and inputs)."""
    torch.manual_seed(0)
    p1 = mh.MultiHeadAttention(d_model=768, n_heads=12).eval()
    x1 = torch.randn(4, 1024, 768)
    torch.manual_seed(0)
    p2 = mh.MultiHeadAttention(d_model=768, n_heads=12)
    x2 = torch.randn(4, 512, 768, requires_grad=True)
    torch.manual_seed(0)
    p3 = mh.MultiHeadAttention(d_model=576, n_heads=9, n_kv_heads=3, bias=False).eval()
    cache = mh.KVCache(batch=1, n_kv_heads=3, head_dim=64, max_len=4097)
    cache.k[0, :, :, :4096] = torch.randn(1, 3, 4096, 64)
    cache.v[0, :, :, :4096] = torch.randn(1, 3, 4096, 64)
    cache.advance(4096)
    x3 = torch.randn(1, 1, 576)
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 12, 1024, 64) for _ in range(3))
    spec = masks.build_mask(batch=4, n_heads=12, s=1024, t=1024)
    torch.manual_seed(0)
    latent = _module(mh.__name__, "latent")
    mla = latent.MultiHeadLatentAttention(d_model=2048, n_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
                                          qk_rope_head_dim=64, v_head_dim=128).eval()
    latents = mh.cache.LatentCache(batch=1, kv_lora_rank=512, rope_dim=64, max_len=4097)
    latents.latent[0, :, :4096] = torch.randn(1, 4096, 576)
    latents.advance(4096)
    x_mla, x_mla_prefill = torch.randn(1, 1, 2048), torch.randn(1, 512, 2048)

    def infer() -> object:
        with torch.no_grad():
            return p1(x1)

    def train() -> object:
        p2(x2, causal=True).sum().backward()
        return None

    def decode() -> object:
        with torch.no_grad():
            return p3(x3, causal=True, cache=cache.layer(0))  # writes slot 4096 and attends to 4097 keys; not advanced

    def core() -> object:
        with torch.no_grad():
            if hasattr(kernels, "DenseKV"):  # a call over a view of the keys (the cache protocol of issue 41)
                return kernels.attend(kernels.AttentionCall(q, kernels.DenseKV(k, v), spec, scale=0.125))
            if new_api:
                return kernels.attend(kernels.AttentionCall(q, k, v, spec, scale=0.125))
            return kernels.attend(q, k, v, spec, scale=0.125)

    def mla_decode() -> object:
        with torch.no_grad():
            return mla(x_mla, causal=True, cache=latents.layer(0))  # absorbed, folded; not advanced

    def mla_prefill() -> object:
        with torch.no_grad():
            return mla(x_mla_prefill, causal=True)  # expanded

    return {"P1 inference d768 h12 b4 s1024": infer, "P2 train step d768 h12 b4 s512 causal": train,
            "P3 GQA decode 9/3 heads d64, 4096 cached": decode, "P5 attention core b4 h12 s1024 d64": core,
            "MLA decode h16 r512, 4096 cached (absorbed)": mla_decode,
            "MLA prefill h16 r512 s512 (expanded)": mla_prefill}


def _module(package: str, name: str) -> Any:
    """A module of either tree: ``layers.<name>`` since the layers' room, ``<name>`` before it."""
    try:
        return importlib.import_module(f"{package}.layers.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"{package}.{name}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--record", action="store_true", help="append the results to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    tmp = Path(tempfile.mkdtemp(prefix="multihead-ab-"))
    base_rev = export(args.base, tmp)
    sys.path.insert(0, str(tmp))
    head_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    mods = {name: (importlib.import_module(name), importlib.import_module(f"{name}.kernels"), _module(name, "masks"))
            for name in ("multihead", "multihead_base")}
    new = cases(*mods["multihead"], new_api=True)
    base = cases(*mods["multihead_base"], new_api=hasattr(mods["multihead_base"][1], "AttentionCall"))
    rows = []
    for name in new:
        # the decode steps are short: more repeats
        repeats = args.repeats * (20 if name.startswith("P3") else 5 if name.startswith("MLA decode") else 1)
        # each order once: on this machine the side timed first in a pair measured up to 3-8% slower
        t_new, t_base = bench.alternate(new[name], base[name], repeats)
        t_base2, t_new2 = bench.alternate(base[name], new[name], repeats)
        first, second = t_new / t_base, t_new2 / t_base2
        rows.append(f"| {name} | {bench._ms(t_new)} / {bench._ms(t_new2)} | {bench._ms(t_base)} / "
                    f"{bench._ms(t_base2)} | {first:.3f} / {second:.3f} | {(first * second) ** 0.5:.3f} |")
    text = "\n".join([
        f"### CPU benchmark shapes, {head_rev} against {base_rev} ({datetime.date.today()})",
        f"machine: {bench.machine()}, torch {torch.__version__}, float32; one process, median of {args.repeats} "
        f"alternating repeats (P3: {args.repeats * 20}) (benchmarks/ab_layer.py --base {args.base})",
        "",
        "| case | new (new first / base first) | base | new / base time, each order | geometric mean |",
        "|---|---|---|---|---|",
        *rows,
    ]) + "\n"
    publish(text, args.record)


if __name__ == "__main__":
    main()
