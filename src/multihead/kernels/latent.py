"""MLA's latent view: which of its two equal paths runs (:func:`mla_path`) and the dense call each makes
(:func:`latent_call`); :func:`multihead.kernels.attend` runs it and applies W_UV after an absorbed call."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.cache.view import DenseKV, LatentKV
from multihead.errors import MultiheadError
from multihead.kernels.call import AttentionCall, CallHooks
from multihead.layers import (
    linear as products,  # its products read the CPU decisions in this room: imported as a module
)
from multihead.layers.masks import MaskSpec

LATENT_PATHS = ("auto", "expanded", "absorbed")


def mla_path(*, s: int, t: int, n_heads: int, rank: int, rope: int, nope: int, dv: int) -> str:
    """The MLA path with fewer FLOPs for s queries over t keys: "absorbed" (W_UK folded into the queries, MQA over
    the one latent head, W_UV after) or "expanded" (the latents up-projected to every head's keys and values). The
    terms of :func:`multihead.sizing.cost.mla_flops` that differ between the two: the up-projection (t or s rows) and
    the width each pair of query and key reads (qk + dv, or 2 rank + rope)."""
    expanded = t * rank * n_heads * (nope + dv) + n_heads * s * t * (nope + rope + dv)
    absorbed = s * n_heads * rank * (nope + dv) + n_heads * s * t * (2 * rank + rope)
    return "absorbed" if absorbed < expanded else "expanded"


@dataclass(frozen=True)
class LatentCore:
    """How a call over a :class:`~multihead.cache.LatentKV` runs: ``path`` ("expanded" or "absorbed"), ``call`` the
    dense call the kernels run, ``w_uv`` (h, dv, rank) the absorbed path's up-projection after the weighted sum
    (None on the expanded path), ``folded`` an absorbed decode step whose h query heads run as the rows of the one
    latent head, and the widths :meth:`describe` names."""

    path: str
    call: AttentionCall
    w_uv: Tensor | None
    folded: bool
    n_heads: int
    latent: int
    qk: int
    dv: int
    t: int

    def describe(self) -> str:
        if self.path == "absorbed":
            return (f"MLA absorbed path: W_UK folded into the queries and W_UV after the weighted sum, so the kernel "
                    f"runs MQA over one latent KV head of width {self.latent} ({self.n_heads} query heads"
                    + (", folded into query rows of one head for this decode step" if self.folded else "") + ")")
        return (f"MLA expanded path: the {self.t} cached latents are up-projected to {self.n_heads} keys of width "
                f"{self.qk} and values of width {self.dv}")


def latent_call(call: AttentionCall) -> LatentCore:
    """The path and the dense call of a call over a latent view: q (b, h, s, nope + rope) as the layer projected and
    rotated it, the view's latents (b, t, rank + rope) and up-projection (h, nope + dv, rank). Expanded: keys
    [c W_UK^i, k_pe] (b, h, t, nope + rope) and values c W_UV^i; absorbed: queries [q_nope W_UK^i^T, q_pe] over the
    latents as one KV head (b, 1, t, rank + rope), values their first rank channels, W_UV applied after
    (:func:`attend`). Hook points are named for what enters the kernel on either path; hook_z is each head's output
    after W_UV on both. A decode step with nothing hooked at the core folds the h query heads into the rows of the
    one latent head, so the latents are read once (as FlashMLA does)."""
    kv = call.kv
    assert isinstance(kv, LatentKV)
    if kv.up is None:
        raise MultiheadError("a latent view needs its layer's up-projection (LatentKV(latents, up=..., nope=...)): "
                             "the cache gives the latents, the MLA layer adds the rest")
    if kv.path not in LATENT_PATHS:
        raise MultiheadError(f"path {kv.path!r} is unknown: choose one of {', '.join(map(repr, LATENT_PATHS))}")
    q, latents, up = call.q, kv.latents, kv.up
    b, h, s, qk = q.shape
    t, rank, nope = latents.shape[1], up.shape[-1], kv.nope
    rope, dv = latents.shape[-1] - rank, up.shape[1] - nope
    if up.shape[0] != h or qk != nope + rope or not 0 < nope < up.shape[1]:
        raise MultiheadError(f"a latent view of up-projection {tuple(up.shape)} (nope {nope}) and latents "
                             f"{tuple(latents.shape)} cannot serve queries {tuple(q.shape)}: the queries need "
                             "n_heads = up's first size and width nope + rope")
    path = (mla_path(s=s, t=t, n_heads=h, rank=rank, rope=rope, nope=nope, dv=dv) if kv.path == "auto"
            else kv.path)
    sizes = {"n_heads": h, "latent": rank + rope, "qk": qk, "dv": dv, "t": t}
    if path == "expanded":
        c_t, k_pe = latents.split([rank, rope], dim=-1)
        kv_up = products.linear(c_t, up.reshape(h * (nope + dv), rank)).view(b, t, h, nope + dv).transpose(1, 2)
        k_nope, v = kv_up.split([nope, dv], dim=-1)  # (b, h, t, nope), (b, h, t, dv)
        k = torch.cat([k_nope, k_pe[:, None].expand(b, h, t, rope)], dim=-1)  # (b, h, t, nope + rope)
        return LatentCore("expanded", dataclasses.replace(call, kv=DenseKV(k, v.contiguous())), None, False, **sizes)
    w_uk, w_uv = up[:, :nope], up[:, nope:]  # (h, nope, rank), (h, dv, rank)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    q_abs = torch.cat([torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk), q_pe], dim=-1)  # (b, h, s, rank + rope)
    keys, values = latents[:, None], latents[:, None, :, :rank]  # (b, 1, t, rank + rope), (b, 1, t, rank)
    hooks = call.hooks
    if s == 1 and not call.need_weights and not call.dropout_p and (hooks is None or not hooks.at_core):
        spec = call.mask
        keep, bias, _ = spec.dense(latents.device, latents.dtype) if not spec.is_empty else (None, None, None)
        folded = MaskSpec(batch=b, n_heads=1, s=h, t=t, keep=keep, bias=bias)
        inner = AttentionCall(q_abs.transpose(1, 2), DenseKV(keys, values), folded, scale=call.scale,
                              backend=call.backend, hooks=None if hooks is None else CallHooks(names=hooks.names),
                              rows_are_heads=True)  # (b, 1, h, rank + rope) over (b, 1, t, .)
        return LatentCore("absorbed", inner, w_uv, True, **sizes)
    inner_hooks = None if hooks is None else dataclasses.replace(hooks, z=None)  # hook_z after W_UV
    return LatentCore("absorbed", dataclasses.replace(call, q=q_abs, kv=DenseKV(keys, values), hooks=inner_hooks),
                      w_uv, False, **sizes)
