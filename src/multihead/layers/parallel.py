"""Heads across processes: Megatron-style tensor parallelism on PyTorch's own engine (DTensor).

Heads are independent until W_O, so each rank keeps a contiguous block of them::

    W_Q, W_K, W_V   split by columns (output rows): rank r holds query heads r*h/w .. (r+1)*h/w - 1 and KV heads
                    r*g/w .. (r+1)*g/w - 1, so every query head finds its KV head on its own rank
    W_O             split by rows (input columns): each rank multiplies its heads' share, one all-reduce sums them
    KV cache        each rank caches only its own KV heads: 1/w of the memory

The MLP of a block is split the same way (up/gate by columns, down by rows): one all-reduce per sub-layer. Both the
KV heads and the query heads must divide by the world size; a world size that does not raises an error naming the
valid ones (replicating KV heads instead would cost w/g times their memory and is not done).

Run under ``torchrun`` (or any launcher that sets the usual environment): gloo on CPUs, NCCL on GPUs, one or many
nodes through torchrun's rendezvous.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from multihead.divisors import divisors
from multihead.errors import MultiheadError
from multihead.layers.attention import MultiHeadAttention

joined = False  # set by init(): this process joined a process group, and should end through leave()


def valid_world_sizes(*counts: int) -> list[int]:
    """World sizes that divide every count (head counts, KV head counts, MLP widths)."""
    return divisors(math.gcd(*counts))


def check_world_size(world: int, *, n_heads: int, n_kv_heads: int, extra: dict[str, int] | None = None) -> None:
    counts = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, **(extra or {})}
    bad = {k: v for k, v in counts.items() if v % world}
    if bad:
        listed = ", ".join(f"{k} ({v})" for k, v in counts.items())
        raise MultiheadError(
            f"cannot split {listed} over {world} processes: valid world sizes are "
            f"{', '.join(map(str, valid_world_sizes(*counts.values())))}"
        )


def init(world: int | None = None, *, timeout_s: float = 120.0) -> DeviceMesh:
    """Join the process group that the launcher describes (torchrun's environment) and return a 1-D mesh.

    ``world``, when given, must equal the launcher's WORLD_SIZE.
    """
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise MultiheadError(
            f"tensor parallelism needs a launcher: run under torchrun --nproc-per-node {world or 'N'} "
            "(WORLD_SIZE and RANK are not set)"
        )
    launched = int(os.environ["WORLD_SIZE"])
    if world is not None and world != launched:
        raise MultiheadError(f"--tp {world} does not match the {launched} processes torchrun started")
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    global joined
    joined = True
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return init_device_mesh("cuda" if cuda else "cpu", (launched,))


def finish() -> None:
    """Leave the process group together: a barrier, then ``destroy_process_group``; nothing when none was joined.

    PyTorch asks every process to destroy its groups before it exits: one left to interpreter shutdown, or torn
    down while a peer still runs its last all-reduce, can abort in gloo's threads (a rank of our torchrun test died
    once in CI with "terminate called without an active exception"). The CLI calls this after every run.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def leave(status: int) -> NoReturn:
    """End a process that joined a group: flush stdout and stderr, then ``os._exit(status)``, skipping the
    interpreter's finalization.

    ``destroy_process_group`` drops PyTorch's own references to a group, not the device mesh's or the sharded
    parameters' (PyTorch says as much in its ``_shutdown`` PR), so gloo's process group outlives it and is
    destroyed during finalization, when its C++ worker threads can no longer take the GIL: Python ends such a
    thread with a forced unwind, which ends in ``std::terminate`` ("terminate called without an active
    exception", SIGABRT). CI lost a torchrun rank with that message twice, the second time after :func:`finish`
    (never reproduced here); finalization is the teardown left, and this skips it. Everything a run writes is
    flushed or closed before this (multihead.files writes whole files), so nothing is lost by not finalizing.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or vanished pipe: nothing more can reach it
            stream.flush()
    os._exit(status)


def shard_attention(layer: MultiHeadAttention, mesh: DeviceMesh) -> MultiHeadAttention:
    """Split one layer's heads over the mesh (in place): q/k/v by columns, W_O by rows."""
    check_world_size(mesh.size(), n_heads=layer.n_heads, n_kv_heads=layer.n_kv_heads)
    parallelize_module(layer, mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                     "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
    return layer


def _shard_mlp(block: nn.Module, mesh: DeviceMesh, columns: list[str], rows: str) -> None:
    plan: dict[str, Any] = {name: ColwiseParallel() for name in columns}
    plan[rows] = RowwiseParallel()
    parallelize_module(block, mesh, plan)


def shard_llama(model: Any, mesh: DeviceMesh) -> Any:
    """Split every block of a LlamaModel over the mesh; embeddings and norms stay whole on every rank."""
    c = model.config
    check_world_size(mesh.size(), n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, extra={"ffn_dim": c.ffn_dim})
    for block in model.layers:
        shard_attention(block.attn, mesh)
        _shard_mlp(block, mesh, ["gate_proj", "up_proj"], "down_proj")
    return model


def shard_bert(encoder: Any, mesh: DeviceMesh) -> Any:
    """Split every layer of a BertEncoder over the mesh."""
    c = encoder.config
    check_world_size(mesh.size(), n_heads=c.n_heads, n_kv_heads=c.n_heads, extra={"ffn_dim": c.ffn_dim})
    for layer in encoder.layers:
        shard_attention(layer.attn, mesh)
        _shard_mlp(layer, mesh, ["ffn_in"], "ffn_out")
    return encoder


def local_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shard of each split weight, all of each whole one)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def local_rows(linear: nn.Linear) -> int:
    """Output rows of a Linear held by this rank."""
    w = linear.weight
    return int((w.to_local() if hasattr(w, "to_local") else w).shape[0])
