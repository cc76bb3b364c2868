"""One MLA layer's decode step: the absorbed path against the expanded path, alternating in one process.

DeepSeek-V2-Lite's attention shape (16 heads, kv_lora_rank 512, q/k heads 128 + 64, v heads 128, d_model 2048),
batch 1, ``--cached`` tokens in a LatentCache, one new token per step. Reports the median time of each path, their
ratio, and the bytes each path moves per step (weights it reads, the cache it reads, the expanded keys and values it
writes and reads), counted from the shapes:

    python benchmarks/mla_decode.py [--cached 4096] [--rounds 15] [--device cpu|cuda] [--dtype float32|bfloat16]
                                    [--record] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import torch
from results import publish

from multihead.cache import LatentCache
from multihead.config import MLAConfig
from multihead.layers.latent import MultiHeadLatentAttention

CONFIG = {"d_model": 2048, "n_heads": 16, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
          "v_head_dim": 128}


def bytes_moved(c: MLAConfig, t: int, elem: int, path: str) -> dict[str, int]:
    """Bytes read or written by one decode step of one sequence over t cached tokens, by kind."""
    h, r, rope, nope, v, d = c.n_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim, \
        c.d_model
    weights = (d * h * c.qk_head_dim + d * (r + rope) + r * h * (nope + v) + h * v * d) * elem
    cache = t * (r + rope) * elem
    if path == "absorbed":
        return {"weights": weights, "latent cache": cache, "expanded k/v": 0}
    expanded = t * h * (nope + v) * elem * 2 + t * h * c.qk_head_dim * elem * 2  # kv_b out written+read, k built
    return {"weights": weights, "latent cache": cache, "expanded k/v": expanded}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cached", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    config = MLAConfig(**CONFIG)  # type: ignore[arg-type]
    layer = MultiHeadLatentAttention(config, device=device, dtype=dtype).eval()
    cache = LatentCache(batch=1, kv_lora_rank=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim,
                        max_len=args.cached + 1, dtype=dtype, device=device)
    with torch.no_grad():
        layer(torch.randn(1, args.cached, config.d_model, device=device, dtype=dtype), causal=True,
              cache=cache.layer(0), path="expanded")
    cache.advance(args.cached)
    x = torch.randn(1, 1, config.d_model, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    runs = {"absorbed": ("absorbed", None), "absorbed, sdpa backend": ("absorbed", "sdpa"),
            "expanded": ("expanded", None)}

    def step(name: str) -> float:
        path, backend = runs[name]
        sync()
        began = time.perf_counter()
        with torch.no_grad():  # writes the same slot each time: no advance
            layer(x, causal=True, cache=cache.layer(0), path=path, backend=backend)
        sync()
        return time.perf_counter() - began

    with torch.no_grad():
        same = (layer(x, causal=True, cache=cache.layer(0), path="absorbed").float()
                - layer(x, causal=True, cache=cache.layer(0), path="expanded").float()).abs().max().item()
        kernels = {name: layer.explain(x, causal=True, cache=cache.layer(0), path=path, backend=backend).kernel
                   for name, (path, backend) in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(3):
        for name in runs:
            step(name)
    for i in range(args.rounds):
        for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            times[name].append(step(name))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    elem = torch.tensor([], dtype=dtype).element_size()
    moved = {name: bytes_moved(config, args.cached + 1, elem, runs[name][0]) for name in runs}
    machine = (torch.cuda.get_device_name() if device.type == "cuda" else
               f"{cpu_name()}, {torch.get_num_threads()} threads")
    lines = [
        f"### MLA decode step, absorbed vs expanded ({datetime.date.today().isoformat()})",
        f"machine: {machine}, torch {torch.__version__}, {args.dtype}; DeepSeek-V2-Lite attention (16 heads, latent "
        f"512 + rope 64), batch 1, {args.cached} cached tokens; median of {args.rounds} alternating rounds "
        f"(benchmarks/mla_decode.py); the two paths' outputs differ by at most {same:.2e}",
        "",
        "| path | kernel | time per step | bytes moved per step (weights + latent cache + expanded k/v) |",
        "|---|---|---|---|",
    ]
    for path in runs:
        b = moved[path]
        lines.append(f"| {path} | {kernels[path]} | {med[path] * 1e3:.3f} ms | {sum(b.values()) / 2**20:.1f} MiB ("
                     f"{b['weights'] / 2**20:.1f} + {b['latent cache'] / 2**20:.1f} + {b['expanded k/v'] / 2**20:.1f})"
                     " |")
    lines.append(f"\nexpanded / absorbed time: {med['expanded'] / med['absorbed']:.2f}x (absorbed on SDPA: "
                 f"{med['expanded'] / med['absorbed, sdpa backend']:.2f}x)")
    publish("\n".join(lines), args.record)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"median_s": med, "kernels": kernels, "bytes": moved, "max_difference": same, "machine": machine,
                       "dtype": args.dtype, "cached": args.cached, "rounds": args.rounds}, f, indent=1)


if __name__ == "__main__":
    main()
