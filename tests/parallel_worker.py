"""Run under torchrun by tests/test_parallel.py: sharded layers against the same layers whole, on every rank.

Usage: parallel_worker.py layer | fail
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from multihead import KVCache, MultiHeadAttention
from multihead.layers import parallel


def check_layers() -> None:
    mesh = parallel.init()
    world, rank = dist.get_world_size(), dist.get_rank()
    for n_heads, n_kv_heads in [(6, 6), (6, 3), (12, 6)]:
        if n_kv_heads % world or n_heads % world:
            continue
        torch.manual_seed(0)
        layer = MultiHeadAttention(d_model=48, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=8, rope=10000.0,
                                   bias=False)
        x = torch.randn(2, 9, 48)
        valid = torch.ones(2, 9, dtype=torch.bool)
        valid[1, 6:] = False
        whole = layer(x, causal=True, key_padding_mask=valid)
        whole_prefix = layer(x[:, :4], causal=True)
        whole_bytes = parallel.local_bytes(layer)
        cache_whole = KVCache(batch=2, n_kv_heads=n_kv_heads, head_dim=8, max_len=16)
        parallel.shard_attention(layer, mesh)
        split = layer(x, causal=True, key_padding_mask=valid)
        assert (split - whole).abs().max() <= 1e-5, (n_heads, n_kv_heads, (split - whole).abs().max())
        assert parallel.local_bytes(layer) * world == whole_bytes
        cache = KVCache(batch=2, n_kv_heads=parallel.local_rows(layer.k_proj) // 8, head_dim=8, max_len=16)
        assert cache.bytes * world == cache_whole.bytes
        y = layer(x[:, :4], causal=True, cache=cache.layer(0))
        cache.advance(4)
        torch.testing.assert_close(y, whole_prefix, atol=1e-5, rtol=1e-5)  # the sharded cache decodes the same
        print(f"rank {rank}: heads {n_heads}/{n_kv_heads} ok, local bytes {parallel.local_bytes(layer)} of "
              f"{whole_bytes}, cache {cache.bytes} of {cache_whole.bytes}", flush=True)
    parallel.finish()
    print(f"rank {rank}: left the group", flush=True)


def fail() -> None:
    parallel.init()
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()  # the other ranks wait here for a rank that will never come


if __name__ == "__main__":
    {"layer": check_layers, "fail": fail}[sys.argv[1]]()
    parallel.leave(0)  # as the CLI ends a --tp run
