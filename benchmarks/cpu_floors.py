"""Where the time of P2 and P3 goes on this CPU, and the best ratio each could reach (``benchmarks/bench.py``).

P2 (training step, <= 0.5x the eager anchor): the four projections' forward and backward are the same work for
multihead and for the anchor, so ``projections / eager`` is a floor on the ratio that no attention kernel can beat,
and ``(projections + attention at the matmul rate) / eager`` is what a perfect kernel would give.

P3 (GQA decode step, >= 3x faster than repeating K/V): each part of multihead's step is timed right after the anchor's
step (``bench.decode_case``), as in the benchmark: the anchor's 25 MB of concatenated and repeated K/V push
multihead's cache and weights out of the CPU's caches. Beside them, a plain read of the same K/V bytes.

    .venv/bin/python benchmarks/cpu_floors.py [--repeats 5] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable

import bench
import torch
import torch.nn.functional as F
from results import publish
from torch import nn

from multihead import MultiHeadAttention
from multihead.verify.check import plain_layer


def p2_floor(repeats: int) -> list[str]:
    torch.manual_seed(0)
    layer = MultiHeadAttention.from_torch(nn.MultiheadAttention(768, 12, batch_first=True))
    x = torch.randn(4, 512, 768, requires_grad=True)

    def projections() -> None:  # what every attention layer spends outside its core, forward and backward
        merged = layer.q_proj(x) + layer.k_proj(x) + layer.v_proj(x)
        layer.o_proj(merged).sum().backward()

    def ours() -> None:
        layer(x, causal=True).sum().backward()

    def eager() -> None:
        plain_layer(layer, x, None, True).sum().backward()

    qc, kc, vc = (torch.randn(4, 12, 512, 64, requires_grad=True) for _ in range(3))

    def core() -> None:  # multihead's attention core in this step: SDPA's CPU flash kernel, forward and backward
        F.scaled_dot_product_attention(qc, kc, vc, is_causal=True).sum().backward()

    t_proj, t_eager = bench.alternate(projections, eager, repeats)
    t_core_sdpa = bench.alternate(core, lambda: None, repeats)[0]
    t_ours, t_eager2 = bench.alternate(ours, eager, repeats)
    a, mm = torch.randn(2048, 2048), torch.randn(2048, 2048)
    t_mm = bench.alternate(lambda: a @ mm, lambda: None, repeats)[0]
    rate = 2 * 2048**3 / t_mm
    b, h, s, d = 4, 12, 512, 64
    core_flops = 3.5 * (4 * b * h * s * s * d) / 2  # causal half; backward ~2.5x forward
    t_core = core_flops / rate
    return [
        "| P2 part | time | of the eager step |",
        "|---|---|---|",
        f"| eager step (anchor) | {t_eager * 1e3:.0f} ms | 1.00 |",
        f"| multihead step | {t_ours * 1e3:.0f} ms | {t_ours / t_eager2:.2f} |",
        f"| the four projections alone, forward + backward | {t_proj * 1e3:.0f} ms | {t_proj / t_eager:.2f} |",
        f"| the attention core alone (SDPA flash, causal), forward + backward | {t_core_sdpa * 1e3:.0f} ms "
        f"({core_flops / t_core_sdpa / 1e9:.0f} GFLOP/s) | {t_core_sdpa / t_eager:.2f} |",
        f"| + causal attention at the float32 matmul rate ({rate / 1e9:.0f} GFLOP/s) | "
        f"{(t_proj + t_core) * 1e3:.0f} ms | {(t_proj + t_core) / t_eager:.2f} |",
    ]


def p3_parts(repeats: int) -> list[str]:
    case = bench.decode_case()
    k, v = case.cache.k[0], case.cache.v[0]
    q = torch.randn(1, 9, 1, 64)
    parts: dict[str, Callable[[], object]] = {
        "multihead's whole step": case.ours,
        "attention core (SDPA, native GQA)": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "attention core, query heads folded": lambda: F.scaled_dot_product_attention(q.view(1, 3, 3, 64), k, v),
        "read the K/V bytes once (sum)": lambda: (k.sum(), v.sum()),
        "q_proj (576 x 576)": lambda: case.layer.q_proj(case.x),
        "k_proj (192 x 576)": lambda: case.layer.k_proj(case.x),
        "the anchor's whole step": case.anchor,
    }
    rows = ["| P3 part, timed right after the anchor's step | median |", "|---|---|"]
    with torch.no_grad():
        for _ in range(20):
            case.anchor()
        for name, fn in parts.items():
            times = []
            for _ in range(repeats * 20):
                case.anchor()
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            rows.append(f"| {name} | {statistics.median(times) * 1e6:.0f} us |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    text = "\n".join([
        f"### Where P2's and P3's time goes ({datetime.date.today()})",
        bench.header("float32", args.repeats) + "; benchmarks/cpu_floors.py",
        "",
        *p2_floor(args.repeats),
        "",
        *p3_parts(args.repeats),
    ]) + "\n"
    publish(text, args.record)


if __name__ == "__main__":
    main()
