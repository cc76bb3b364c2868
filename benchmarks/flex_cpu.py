"""Flex attention against SDPA on the CPU for structured masks (why ``auto`` keeps SDPA on the CPU, and when
``backend="flex"`` pays): b 1, 12 heads, head_dim 64, float32, inference; alternating, median of repeats; the first
flex call's compile time is reported separately.

    .venv/bin/python benchmarks/flex_cpu.py [--tokens 4096] [--repeats 3] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import bench
import torch
from results import publish

from multihead.cache import DenseKV
from multihead.kernels import AttentionCall, attend, flex
from multihead.layers.masks import build_mask


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    b, h, s, d = 1, 12, args.tokens, 64
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    rows = []
    for name, kw in [("causal, window 256", dict(causal=True, window=256)), ("causal", dict(causal=True)),
                     ("key padding, half the keys", dict(key_padding_mask=torch.arange(s)[None] < s // 2))]:
        spec = build_mask(batch=b, n_heads=h, s=s, t=s, **kw)  # type: ignore[arg-type]
        with torch.no_grad():
            start = time.perf_counter()
            flex_call = AttentionCall(q, DenseKV(k, v), spec, scale=d**-0.5, backend="flex")
            sdpa_call = AttentionCall(q, DenseKV(k, v), spec, scale=d**-0.5, backend="sdpa")
            attend(flex_call)
            first = time.perf_counter() - start
            t_flex, t_sdpa = bench.alternate(lambda c=flex_call: attend(c), lambda c=sdpa_call: attend(c),
                                             args.repeats)
        skipped = flex.sparsity(spec, q.device)
        rows.append(f"| {name} | {skipped:.0%} | {t_flex * 1e3:.0f} ms | {t_sdpa * 1e3:.0f} ms | "
                    f"{t_flex / t_sdpa:.2f}x | {first:.1f} s |")
    text = "\n".join([
        f"### Flex attention vs SDPA on the CPU, {s} tokens ({datetime.date.today()})",
        bench.header("float32, inference", args.repeats),
        "",
        "| mask | blocks skipped | flex | SDPA (dense mask or causal flag) | flex / SDPA | first flex call (compile) |",
        "|---|---|---|---|---|---|",
        *rows,
    ]) + "\n"
    publish(text, args.record)


if __name__ == "__main__":
    main()
