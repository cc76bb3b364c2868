"""The views the kernels take apart: a quantized view read back into keys and values (where no native kernel takes
its codes), and a head-wise view's groups, one call each with their query heads and their own mask."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from multihead.cache.view import DenseKV, GroupedKV, KVView, LatentKV, QuantizedKV
from multihead.errors import MultiheadError
from multihead.kernels.call import AttentionCall
from multihead.kernels.codec import read


def dense_view(kv: KVView) -> DenseKV:
    """The keys and values of a view as tensors (b, g, t, d): a dense view as it is, a quantized one read back (the
    codes dequantised into one new tensor each for keys and values, the tail copied after them; under autograd
    concatenated instead, so the gradient reaches the tail). A head-wise view has no single (b, g, t, d) form."""
    if isinstance(kv, DenseKV):
        return kv
    if isinstance(kv, GroupedKV):
        raise MultiheadError("a head-wise layer's KV heads hold different numbers of keys: there is no one (b, g, t, "
                             "d) tensor of them")
    if isinstance(kv, LatentKV):
        raise MultiheadError("a latent view's keys are made by its path (multihead.kernels.latent_call): there is no "
                             "one (b, g, t, d) tensor of them")
    n, dtype = kv.n, kv.dtype
    b, g, m, d = kv.tail_k.shape
    if torch.is_grad_enabled() and (kv.tail_k.requires_grad or kv.tail_v.requires_grad):
        old_k = torch.empty(b, g, n, d, dtype=dtype, device=kv.tail_k.device)
        old_v = torch.empty_like(old_k)
        _dequantize(kv, old_k, old_v)
        return DenseKV(torch.cat([old_k, kv.tail_k.to(dtype)], dim=2),
                       torch.cat([old_v, kv.tail_v.to(dtype)], dim=2))  # (b, g, t, d)
    keys = torch.empty(b, g, n + m, d, dtype=dtype, device=kv.tail_k.device)  # (b, g, t, d): no concatenation
    values = torch.empty_like(keys)
    _dequantize(kv, keys[:, :, :n], values[:, :, :n])
    keys[:, :, n:] = kv.tail_k
    values[:, :, n:] = kv.tail_v
    return DenseKV(keys, values)


def _dequantize(kv: QuantizedKV, keys: Tensor, values: Tensor) -> None:
    if kv.n:
        read(keys, kv.codes_k, kv.scale_k, kv.min_k, bits=kv.bits, group=kv.group, axis=0)
        read(values, kv.codes_v, kv.scale_v, kv.min_v, bits=kv.bits, group=kv.group, axis=1)


def group_calls(call: AttentionCall) -> tuple[list[AttentionCall], Tensor | None]:
    """One call per group of a head-wise view's KV heads, with the query heads of those KV heads (query head i reads
    KV head i // (h / g)) and the group's own mask, and the order that puts their z back in head order (None: one
    group). hook_q applies before (the caller's), hook_z after; hook_k, hook_v, hook_pattern and weights are
    refused: the groups' keys are not one (b, g, t, d) tensor."""
    kv = call.kv
    assert isinstance(kv, GroupedKV)
    if call.need_weights:
        raise MultiheadError("return_weights cannot be used with a HeadwiseCache: its KV heads attend to different "
                             "keys, so there is no (b, h, s, t) matrix; run uncached with the plan's mask "
                             "(HeadPlan.mask) to read the weights")
    hooks = call.hooks
    hooked = [] if hooks is None else [name for name, fn in (("hook_k", hooks.k), ("hook_v", hooks.v),
                                                             ("hook_pattern", hooks.pattern)) if fn is not None]
    if hooked:
        raise MultiheadError(f"{', '.join(hooked)} cannot be hooked with a HeadwiseCache: its KV heads hold "
                             "different numbers of keys, so a layer's keys are not one (b, g, t, d) tensor "
                             "(hook_q, hook_z and hook_out work; run uncached with the plan's mask, "
                             "HeadPlan.mask, to hook the others)")
    q = call.q
    b, h, s, d = q.shape
    g = kv.n_kv_heads
    calls = []
    for group in kv.groups:
        if group.heads is None:
            qg, sinks = q, call.sinks
        elif group.first is not None:  # consecutive KV heads: their query heads are a view
            n = group.heads.shape[0]
            qg = q.view(b, g, h // g, s, d).narrow(1, group.first, n).reshape(b, -1, s, d)  # (b, |group| r, s, d)
            sinks = None if call.sinks is None else call.sinks.view(g, h // g).narrow(0, group.first, n).reshape(-1)
        else:
            qg = q.view(b, g, h // g, s, d).index_select(1, group.heads).reshape(b, -1, s, d)  # (b, |group| r, s, d)
            sinks = None if call.sinks is None else call.sinks.view(g, h // g).index_select(0, group.heads).reshape(-1)
        assert group.mask.t == group.kv.t
        calls.append(dataclasses.replace(call, q=qg, kv=group.kv, mask=group.mask, hooks=None, sinks=sinks))
    return calls, kv.order
