"""Which inputs flex attention takes on this machine, through the layer (``backend="flex"``), and how far each is
from SDPA given the same mask as a dense tensor: head width x query length x KV heads, causal and a dense boolean
mask. One line a case (compiled, or the error's first line), then JSON:

    python benchmarks/gpu_flex.py [--device cuda] [--json gpu-flex.json] [--budget 120]

On a GPU each shape compiles a Triton kernel (seconds a case); on the CPU, a C++ one. ``--budget`` stops starting
new cases after that many seconds, and says how many were left.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from multihead import MultiHeadAttention

HEAD_DIMS = (8, 16, 64)
QUERIES = (48, 256)
KV_HEADS = (8, 2)  # of 8 query heads: MHA and GQA (4 query heads a KV head)


def case(head_dim: int, s: int, kv_heads: int, masking: str, device: str) -> dict[str, object]:
    torch.manual_seed(0)
    d_model = 8 * head_dim
    layer = MultiHeadAttention(d_model=d_model, n_heads=8, n_kv_heads=kv_heads, device=device,
                               dtype=torch.bfloat16).eval()
    x = torch.randn(2, s, d_model, device=device, dtype=torch.bfloat16)
    keep = None
    if masking == "bool":
        keep = (torch.rand(s, s, device=device) < 0.8) | torch.eye(s, dtype=torch.bool, device=device)
    row: dict[str, object] = {"head_dim": head_dim, "queries": s, "kv_heads": kv_heads, "mask": masking}
    start = time.perf_counter()
    try:
        with torch.no_grad():
            ours = layer(x, mask=keep, causal=masking == "causal", backend="flex")
            dense = torch.ones(s, s, dtype=torch.bool, device=device)
            dense = dense.tril() if masking == "causal" else dense & keep if keep is not None else dense
            want = layer(x, mask=dense, backend="sdpa")
        row.update(ok=True, max_difference=float((ours.float() - want.float()).abs().max()))
    except Exception as e:  # the point of the probe: which cases fail, and with what
        text = str(e).strip()
        row.update(ok=False, error=f"{type(e).__name__}: {text.splitlines()[0][:240] if text else ''}")
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default="gpu-flex.json")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds after which no new case starts")
    args = parser.parse_args()
    grid = [(d, s, g, "causal") for d, s, g in itertools.product(HEAD_DIMS, QUERIES, KV_HEADS)]
    grid += [(16, 48, 2, "bool"), (64, 256, 2, "bool")]
    start, rows = time.perf_counter(), []
    for d, s, g, masking in grid:
        if time.perf_counter() - start > args.budget:
            print(f"budget of {args.budget:.0f} s spent: {len(grid) - len(rows)} cases not run", flush=True)
            break
        row = case(d, s, g, masking, args.device)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                   "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
