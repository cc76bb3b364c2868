"""Per-rank memory of attention weights and KV cache under tensor parallelism, against one process.

    torchrun --standalone --nproc-per-node 3 benchmarks/parallel_memory.py [--record]

Loads SmolLM2 (9 query heads, 3 KV heads) on every rank, measures the bytes of the attention projections and of a
KV cache for 4096 tokens before and after splitting the heads, and prints (rank 0) the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from multihead.layers import parallel
from multihead.models import load_llama


def attention_bytes(model: torch.nn.Module) -> int:
    return sum(parallel.local_bytes(block.attn) for block in model.layers)  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    model, _ = load_llama()
    whole_attn = attention_bytes(model)
    whole_cache = model.new_cache(1, 4096).bytes
    mesh = parallel.init()
    world = dist.get_world_size()
    parallel.shard_llama(model, mesh)
    split_attn = attention_bytes(model)
    split_cache = model.new_cache(1, 4096).bytes
    if dist.get_rank() == 0:
        text = (
            f"### Tensor-parallel memory per rank, SmolLM2-135M, world {world} ({datetime.date.today()})\n"
            f"machine: {os.cpu_count()} CPU cores, gloo, torch {torch.__version__}\n\n"
            "| what | one process | per rank | ratio |\n|---|---|---|---|\n"
            f"| attention weights (30 layers) | {whole_attn:,} B | {split_attn:,} B | {split_attn / whole_attn:.4f} |\n"
            f"| KV cache, 4096 tokens, float32 | {whole_cache:,} B | {split_cache:,} B | "
            f"{split_cache / whole_cache:.4f} |\n"
        )
        print(text)
        if args.record:
            with open(Path(__file__).parent / "RESULTS.md", "a", encoding="utf-8") as f:
                f.write("\n" + text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
