"""The SDPA backend: PyTorch's fused scaled_dot_product_attention with GQA passed natively, a GQA decode step
folded (each KV head's query heads as its rows), or a prefill's queries in blocks that each read only the keys their
rows can see (:func:`key_blocks`), or a chunk after cached keys as the prefix and the chunk's own keys, merged
(:func:`splits`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.layers.masks import MaskSpec

QUERY_BLOCK = 128
"""Rows of a query block (:func:`key_blocks`). SDPA's CPU kernel computes every score of the (s, t) mask it is given,
masked or not; a chunk of a sliding layer (512 queries over the 511 keys before them and their own) sees half of
them, and blocks of 128 rows computed it in 0.73x the time of one call in bfloat16 (0.71x float32; Gemma 3's shape on
the 2-core AMD host, 2026-12-07; blocks of 64: 0.70x / 0.65x, 256: 0.75x / 0.79x)."""

CAUSAL_BLOCKS = (256, 512)
"""A float32 or bfloat16 causal square of more than 256 and at most 512 rows (a chunk of up to 512 tokens with
nothing cached before it, or a split's own keys) runs in query blocks (:func:`causal_blocks`). PyTorch's CPU flash
kernel reads the keys in splits of up to 512 and computed such a square in about the time of the unmasked one;
blocks of 128 rows, each over the keys up to its last row, took 0.80-0.90x the time of one causal call at 384 and 512
rows in bfloat16 and 0.80-0.94x in float32, 0.98-1.10x at 256 and from 768 up (SmolLM2's and Gemma 3's heads, the
2-core AMD host, 2026-12-07; benchmarks/prefill_attention.py measures it). float32 kept one call for a while, since
at the model level no gain stood out of this host's spread (whole 1k prefills in chunks of 512,
benchmarks/prefill_blocks.py: 0.95-1.00x in one run, 1.01-1.06x in the next; single rounds 0.77-1.46x); but the
float32 MLA layer's 512-token prefill ran 1.06x and 1.09x the time it took with blocks (benchmarks/ab_layer.py against
the tree before that choice), and 0.99x once they were back."""

SPLIT_BLOCKED_FROM = 0.5
"""A chunk whose own keys run in blocks (:func:`causal_blocks`) splits after at least this many times its length of
cached keys: 512 queries after 256 to 768 keys ran split in 0.89-0.94x one masked call in bfloat16 and 0.81-1.00x in
float32 (512 after 512 of SmolLM2's: 0.88x; both models' heads, the same host and day;
benchmarks/prefill_attention.py)."""

AT_MOST = 0.8
"""Blocks run only where they compute at most this share of the scores one call would (a 512-token chunk after
3,584 keys: 0.94, one call; after 512 keys: 0.81; a sliding layer's: 0.62)."""


SPLIT_FROM = 2
"""A chunk after cached keys splits (:func:`splits`) where the cached keys are at least this many times the chunk:
at 512 queries after 2,048 to 7,680 keys the split ran 0.69-0.94x one masked call (SmolLM2's and Gemma 3's shapes,
both dtypes; two cases 1.05x and 1.12x), after 256 to 1,024 keys 0.71-1.37x (the 2-core AMD host, 2026-12-07)."""

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def causal_blocks(s: int, dtype: torch.dtype) -> bool:
    """Whether a causal square of ``s`` rows in ``dtype`` runs in query blocks (:data:`CAUSAL_BLOCKS`)."""
    return dtype in (torch.float32, torch.bfloat16) and CAUSAL_BLOCKS[0] < s <= CAUSAL_BLOCKS[1]


def splits(spec: MaskSpec, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a chunk of queries after cached keys (causal, aligned bottom-right, nothing else in the mask) runs
    as two calls of PyTorch's CPU flash kernel merged by their log-sum-exp (:func:`_split_prefix`): the cached keys,
    which every query sees, with each KV head's query heads as its rows and no mask, and the chunk's own keys with
    the kernel's causal flag (in query blocks where :func:`causal_blocks` says). Not for one query row, a short
    prefix (:data:`SPLIT_FROM`; :data:`SPLIT_BLOCKED_FROM` for a chunk whose own keys run in blocks), float64, values
    of another width than the keys, or a PyTorch without that kernel."""
    s, t = spec.s, spec.t
    return (_FLASH_CPU is not None and spec.causal and spec.window is None and spec.keep is None
            and spec.bias is None and spec.documents is None and spec.padding is None and spec.q_positions is None
            and s > 1 and t - s >= (SPLIT_BLOCKED_FROM if causal_blocks(s, q.dtype) else SPLIT_FROM) * s
            and q.dtype in (torch.float32, torch.bfloat16)
            and k.shape[-1] == v.shape[-1] == q.shape[-1] and q.shape[0] == k.shape[0]
            and not torch.compiler.is_compiling())


def _split_prefix(q: Tensor, k: Tensor, v: Tensor, *, scale: float, memo: dict[object, object]) -> Tensor:
    """Attention of the last s of t keys' queries (b, h, s, d) as :func:`splits` says: (b, h, s, d). Each part's
    output is rounded to q's dtype by the kernel before the merge (in float32). The chunk's own keys run in query
    blocks where :data:`CAUSAL_BLOCKS` says (their masks kept in ``memo``, the step's)."""
    assert _FLASH_CPU is not None
    b, h, s, d = q.shape
    g, t = k.shape[1], k.shape[2]
    r, p = h // g, t - s
    rows = q.reshape(b, g, r * s, d)  # each KV head's query heads as its rows: every one sees the whole prefix
    before, lse_before = _FLASH_CPU(rows, k[:, :, :p], v[:, :, :p], scale=scale)[:2]
    before, lse_before = before.reshape(b, h, s, d), lse_before.reshape(b, h, s)
    kc, vc = k[:, :, p:], v[:, :, p:]
    if r > 1:
        kc, vc = kc.repeat_interleave(r, 1), vc.repeat_interleave(r, 1)
    own, lse_own = _causal_with_lse(q, kc, vc, scale=scale, memo=memo)  # the chunk's own keys, causal
    top = torch.maximum(lse_before, lse_own)
    w_before = (lse_before - top).exp_().unsqueeze(-1)  # (b, h, s, 1)
    w_own = (lse_own - top).exp_().unsqueeze(-1)
    out: Tensor = before.float().mul_(w_before).add_(own.float().mul_(w_own)).div_(w_before + w_own)
    return out.to(q.dtype)


def _causal_with_lse(q: Tensor, k: Tensor, v: Tensor, *, scale: float, memo: dict[object, object]
                     ) -> tuple[Tensor, Tensor]:
    """Causal attention of q (b, h, s, d) over its own s keys k, v (b, h, s, d), and each row's log-sum-exp (b, h, s):
    one call of PyTorch's CPU flash kernel with its causal flag, or, for a square :data:`CAUSAL_BLOCKS` takes, one
    call a block of :data:`QUERY_BLOCK` rows over the keys up to its last row, with a float mask hiding the later
    ones (made once, kept in ``memo``)."""
    assert _FLASH_CPU is not None
    s = q.shape[2]
    if not causal_blocks(s, q.dtype):
        out, lse = _FLASH_CPU(q, k, v, is_causal=True, scale=scale)[:2]
        return out, lse
    out = q.new_empty(q.shape)
    parts = []
    for a in range(0, s, QUERY_BLOCK):
        e = min(a + QUERY_BLOCK, s)
        key = ("causal block", a, e, q.dtype, q.device)
        if key not in memo:
            hidden = ~_causal_keep(a, e, q.device)
            memo[key] = torch.zeros(e - a, e, dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))
        mask = memo[key]
        assert isinstance(mask, Tensor)
        out[:, :, a:e], lse = _FLASH_CPU(q[:, :, a:e], k[:, :, :e], v[:, :, :e], attn_mask=mask, scale=scale)[:2]
        parts.append(lse)
    return out, torch.cat(parts, dim=2)


def _causal_keep(a: int, e: int, device: torch.device) -> Tensor:
    """The causal mask of query rows a .. e - 1 over keys 0 .. e - 1 (a block of a causal square): (e - a, e) bool, row
    i seeing the keys up to a + i."""
    return torch.ones(e - a, e, dtype=torch.bool, device=device).tril(a)


@dataclass(frozen=True)
class KeyBlock:
    """One block of queries and the keys its rows can see: ``rows`` of the queries; ``keys`` a slice of the keys
    (the seen ones are consecutive) or their indices; ``keep`` the block's mask over those keys, None when it sees
    every one."""

    rows: slice
    keys: slice | Tensor
    keep: Tensor | None


def key_blocks(spec: MaskSpec, device: torch.device, dtype: torch.dtype) -> list[KeyBlock] | None:
    """The query blocks of ``QUERY_BLOCK`` rows for a call over ``spec`` and the keys each can see, where that skips
    enough of the scores (:data:`AT_MOST`); None otherwise: one query row, a float bias, a mask that differs by
    sequence or head, or under torch.compile. Made once a step and kept on the spec."""
    if spec.s <= QUERY_BLOCK or spec.bias is not None or torch.compiler.is_compiling():
        return None
    if spec.is_plain_causal and not causal_blocks(spec.s, dtype):
        return None  # the kernel's own causal path
    key = ("key blocks", device)  # the blocks read the boolean mask alone: one plan for every dtype
    if key in spec.memo:
        found: list[KeyBlock] | None = spec.memo[key]
        return found
    spec.memo[key] = found = _key_blocks(spec, device, dtype)
    return found


def _key_blocks(spec: MaskSpec, device: torch.device, dtype: torch.dtype) -> list[KeyBlock] | None:
    if spec.is_plain_causal:  # (causal_blocks)
        spans = [(a, min(a + QUERY_BLOCK, spec.s)) for a in range(0, spec.s, QUERY_BLOCK)]
        return [KeyBlock(slice(a, e), slice(0, e), _causal_keep(a, e, device)) for a, e in spans]
    if spec.is_empty:
        return None
    keep, bias, _ = spec.dense(device, dtype)
    if keep is None or bias is not None or any(n != 1 for n in keep.shape[:-2]):
        return None
    keep = keep.reshape(keep.shape[-2:])  # (s, t): the same for every sequence and head
    s, t = keep.shape
    blocks: list[KeyBlock] = []
    work = 0
    for a in range(0, s, QUERY_BLOCK):
        rows = slice(a, min(a + QUERY_BLOCK, s))
        part = keep[rows]  # (B, t)
        seen = part.any(dim=0)  # (t,)
        at = seen.nonzero().squeeze(1)  # (n,)
        n = int(at.numel())
        if n == 0:  # no row sees a key (opened up by dense(): never here, but nothing to read)
            return None
        lo, hi = int(at[0]), int(at[-1]) + 1
        keys: slice | Tensor = slice(lo, hi) if hi - lo == n else at
        mine = part[:, keys]  # (B, n)
        blocks.append(KeyBlock(rows, keys, None if bool(mine.all()) else mine.contiguous()))
        work += (rows.stop - a) * n
    return blocks if work <= AT_MOST * s * t else None


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, *, scale: float, dropout_p: float = 0.0, fold: bool = False,
    blocks: list[KeyBlock] | None = None, split: bool = False
) -> Tensor:
    """PyTorch's fused kernel with native GQA: out (b, h, s, d).

    ``fold`` runs a GQA decode step (one query per head) with the query heads of each group folded into the query
    dimension, (b, h, 1, d) -> (b, g, h/g, d): the kernel then reads each KV head once instead of once per query
    head (FlashAttention does the same swap on the GPU), but has b * g work items to share among the threads instead
    of b * h. :func:`resolve_backend` decides when, from :func:`multihead.kernels.cpu.fold_gqa_decode`. Same result.

    ``blocks`` (:func:`key_blocks`, no dropout) runs each block of query rows over only the keys they can see: the
    keys no row of the block sees weigh nothing in its softmax, so leaving them out changes nothing but the work.
    ``split`` (:func:`splits`, no dropout) runs a chunk after cached keys as two calls merged by their log-sum-exp.
    """
    b, h, s, d = q.shape
    g = k.shape[1]
    run_q = q.reshape(b, g, h // g, d) if fold else q
    gqa = g != h and not fold
    if spec.is_plain_causal and blocks is not None:
        return _over_blocks(q, k, v, blocks, scale=scale, gqa=gqa)
    if spec.is_empty or spec.is_plain_causal:
        out = F.scaled_dot_product_attention(
            run_q, k, v, dropout_p=dropout_p, is_causal=spec.is_plain_causal, scale=scale, enable_gqa=gqa
        )
        return out.view(b, h, s, v.shape[-1]) if fold else out
    if split:
        return _split_prefix(q, k, v, scale=scale, memo=spec.memo)
    keep, bias, has_key = spec.dense(q.device, q.dtype)
    if blocks is not None:
        out = _over_blocks(q, k, v, blocks, scale=scale, gqa=gqa)
        return out if has_key is None else out * has_key
    attn_mask: Tensor | None
    if bias is None:
        attn_mask = keep
    elif keep is None:
        attn_mask = bias
    else:
        attn_mask = bias.masked_fill(~keep, float("-inf"))
    if fold and attn_mask is not None:
        attn_mask = _fold_mask(attn_mask, h, g)
    out = F.scaled_dot_product_attention(
        run_q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )  # (b, h, s, dv), or (b, g, h/g, dv) folded
    if fold:
        out = out.view(b, h, s, v.shape[-1])
    if has_key is not None:
        out = out * has_key
    return out


def _over_blocks(q: Tensor, k: Tensor, v: Tensor, blocks: list[KeyBlock], *, scale: float, gqa: bool) -> Tensor:
    """SDPA block by block of query rows, each over the keys it sees: (b, h, s, dv)."""
    b, h, s, _ = q.shape
    out = q.new_empty(b, h, s, v.shape[-1])
    for block in blocks:
        if isinstance(block.keys, slice):
            kb, vb = k[:, :, block.keys], v[:, :, block.keys]
        else:
            kb, vb = k.index_select(2, block.keys), v.index_select(2, block.keys)
        out[:, :, block.rows] = F.scaled_dot_product_attention(
            q[:, :, block.rows], kb, vb, attn_mask=block.keep, scale=scale, enable_gqa=gqa)
    return out


def _fold_mask(mask: Tensor, h: int, g: int) -> Tensor:
    """A mask broadcastable to (b, h, 1, t), made to broadcast to the folded (b, g, h/g, t)."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    if mask.shape[1] == 1:
        return mask  # the same for every head: its single query row broadcasts over the folded rows
    return mask.reshape(mask.shape[0], g, h // g, mask.shape[3])  # head i = group i // (h/g), member i % (h/g)
