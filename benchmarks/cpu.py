"""CPU benchmarks of issue 6 (P1, P2, P3, P5): multihead against its anchors, side by side in one process.

Each comparison alternates the two implementations, takes the median of the repeats and prints the ratio
(multihead time / anchor time: below 1 is faster). ``--record`` appends the table to benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/cpu.py [--repeats 5] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from decode import machine  # noqa: E402

from multihead import KVCache, MultiHeadAttention, cost  # noqa: E402
from multihead.check import plain_layer  # noqa: E402


def alternate(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of a and of b, run alternately after one warm-up each."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        a()
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        b()
        tb.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


def p1(repeats: int) -> str:
    torch.manual_seed(0)
    anchor = nn.MultiheadAttention(768, 12, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(anchor).eval()
    x = torch.randn(4, 1024, 768)
    with torch.no_grad():
        t_ours, t_anchor = alternate(lambda: ours(x), lambda: anchor(x, x, x, need_weights=False), repeats)
    return f"| P1 inference d768 h12 b4 s1024 | nn.MultiheadAttention (fast path) | {t_ours * 1e3:.1f} ms | " \
           f"{t_anchor * 1e3:.1f} ms | {t_ours / t_anchor:.2f}x | <= 0.70x |"


def p2(repeats: int) -> list[str]:
    torch.manual_seed(0)
    anchor = nn.MultiheadAttention(768, 12, batch_first=True)
    ours = MultiHeadAttention.from_torch(anchor)
    x = torch.randn(4, 512, 768, requires_grad=True)
    mask = nn.Transformer.generate_square_subsequent_mask(512)

    def step_ours() -> None:
        ours(x, causal=True).sum().backward()

    def step_anchor() -> None:
        anchor(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0].sum().backward()

    def step_eager() -> None:
        plain_layer(ours, x, None, True).sum().backward()

    t_ours, t_anchor = alternate(step_ours, step_anchor, repeats)
    t_ours2, t_eager = alternate(step_ours, step_eager, repeats)
    return [f"| P2 train step s512 causal | nn.MultiheadAttention | {t_ours * 1e3:.1f} ms | {t_anchor * 1e3:.1f} ms | "
            f"{t_ours / t_anchor:.2f}x | <= 1.0x |",
            f"| P2 train step s512 causal | eager, K/V repeated | {t_ours2 * 1e3:.1f} ms | {t_eager * 1e3:.1f} ms | "
            f"{t_ours2 / t_eager:.2f}x | <= 0.5x |"]


def p3(repeats: int) -> str:
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_model=576, n_heads=9, n_kv_heads=3, bias=False).eval()
    cached = 4096
    cache = KVCache(batch=1, n_kv_heads=3, head_dim=64, max_len=cached + 1)
    x = torch.randn(1, 1, 576)
    k_all = torch.randn(1, 3, cached + 1, 64)
    v_all = torch.randn(1, 3, cached + 1, 64)
    cache.k[0].copy_(k_all)
    cache.v[0].copy_(v_all)
    cache.advance(cached)

    def ours() -> None:
        layer(x, causal=True, cache=cache.layer(0))  # writes slot 4096, attends to 4097 keys; not advanced

    def repeated() -> None:
        q = layer.q_proj(x).view(1, 1, 9, 64).transpose(1, 2)
        k = torch.cat([k_all[:, :, :cached], layer.k_proj(x).view(1, 1, 3, 64).transpose(1, 2)], 2)
        v = torch.cat([v_all[:, :, :cached], layer.v_proj(x).view(1, 1, 3, 64).transpose(1, 2)], 2)
        k, v = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
        out = F.scaled_dot_product_attention(q, k, v)
        layer.o_proj(out.transpose(1, 2).reshape(1, 1, 576))

    with torch.no_grad():
        t_ours, t_rep = alternate(ours, repeated, repeats * 20)
    return f"| P3 GQA decode 9/3 heads, 4096 cached | K/V repeated per step | {t_ours * 1e6:.0f} us | " \
           f"{t_rep * 1e6:.0f} us | {t_rep / t_ours:.2f}x faster | >= 3x faster |"


def p5(repeats: int) -> str:
    torch.manual_seed(0)
    b, h, s, d = 4, 12, 1024, 64
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    a, m = torch.randn(2048, 2048), torch.randn(2048, 2048)
    with torch.no_grad():
        t_attn, t_mm = alternate(lambda: F.scaled_dot_product_attention(q, k, v),
                                 lambda: a @ m, repeats)
    attn_rate = 4 * b * h * s * s * d / t_attn  # QK^T and PV, 2 FLOPs per multiply-add
    mm_rate = 2 * 2048**3 / t_mm
    return f"| P5 attention core b4 h12 s1024 d64 | fp32 matmul 2048^3 | {attn_rate / 1e9:.1f} GFLOP/s | " \
           f"{mm_rate / 1e9:.1f} GFLOP/s | {attn_rate / mm_rate:.0%} of matmul | >= 60% |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    _ = cost  # the FLOP formula above is cost.flops' attention core for s = t, no mask
    rows = [p1(args.repeats), *p2(args.repeats), p3(args.repeats), p5(args.repeats)]
    text = "\n".join([
        f"### CPU benchmarks P1, P2, P3, P5 ({datetime.date.today()})",
        f"machine: {machine()}, {os.cpu_count()} cores, torch {torch.__version__}; float32; median of "
        f"{args.repeats} alternating repeats (P3: {args.repeats * 20})",
        "",
        "| benchmark | anchor | multihead | anchor time | ratio | target |",
        "|---|---|---|---|---|---|",
        *rows,
    ]) + "\n"
    print(text)
    if args.record:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
