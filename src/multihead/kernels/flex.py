"""The block-sparse backend: PyTorch's flex attention, driven by the structure of a :class:`MaskSpec`.

A structured mask (causal aligned bottom-right, a sliding window, key padding, packed documents, a KV cache's
positions) is turned into a ``mask_mod`` and a ``BlockMask``: blocks of 128 x 128 (query, key) pairs that are fully
masked are skipped, never computed, and no (s, t) mask is made. A float mask becomes a ``score_mod`` that adds it.

- A block mask is made once per mask spec and kept on it; a model makes one spec per step, so its layers share
  one block mask per step (a standalone layer called repeatedly can do the same: ``layer.step(...)`` once, then
  ``layer(x, step=step)``).
- The kernel is ``torch.compile(flex_attention)``, made once per process; torch caches the compiled kernels per
  shape and mask function. Without compiling, flex attention runs a dense reference (O(s * t) memory), so this
  backend always compiles; inside a region that is already being compiled it calls flex attention directly.
- Rows with no allowed key give zeros, as everywhere in multihead (flex attention's own convention too).
- Dropout is not supported by flex attention: dispatch never picks it with dropout, and asking for it explicitly
  raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from multihead.errors import MultiheadError
from multihead.layers.masks import MaskSpec

BLOCK = 128  # flex attention's default block size (queries x keys)

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def available() -> bool:
    """True when this torch has flex attention (torch >= 2.5)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


GPU_MIN_HEAD_DIM = 16  # flex attention's GPU kernel: "embedding dimension ... must be at least 16" (torch 2.11, H200)


def unsupported(head_dim: int, queries: int, group: int, device: torch.device) -> str | None:
    """Why flex attention's kernel cannot take ``queries`` queries of heads ``head_dim`` wide, ``group`` query heads a
    KV head, on ``device``; None when it can. Both refusals were seen on an H200 (torch 2.11, benchmarks/gpu_flex.py):

    - heads under 16 wide: the GPU kernel's lowering says "must be at least 16";
    - grouped heads with fewer queries than a block (128) but more than a block's rows over the group: inductor's
      decoding kernel then asks for a block of next_power_of_2(queries x group) rows, which the 128-row mask block
      does not divide, and is left with no kernel ("NoValidChoicesError"; torch/_inductor/kernel/flex/
      flex_decoding.py). 48 queries, 4 a KV head failed; 1-4 queries and 256 ran.
    """
    if device.type != "cuda":
        return None
    if head_dim < GPU_MIN_HEAD_DIM:
        return f"flex attention's GPU kernel needs head_dim >= {GPU_MIN_HEAD_DIM} (this is {head_dim})"
    if group > 1 and queries < BLOCK and queries * group > BLOCK:
        return (f"flex attention's GPU decoding kernel has no block for {queries} queries x {group} query heads a KV "
                f"head ({queries * group} rows over one {BLOCK}-row block)")
    return None


def _full(x: Tensor, b: int, h: int, s: int, t: int) -> Tensor:
    """A mask tensor broadcast to (b, h, s, t) as a view (no copy), for indexing by (b, h, q, kv)."""
    while x.ndim < 4:
        x = x.unsqueeze(0)
    return x.expand(b, h, s, t)


def mask_mod(spec: MaskSpec) -> MaskMod | None:
    """The mask of ``spec`` as a flex-attention mask_mod(b, h, q_idx, kv_idx) -> bool, or None for "all keys".

    A float mask is not part of it (see :func:`score_mod`), except that its -inf entries forbid those keys.
    """
    parts: list[MaskMod] = []
    b, h, s, t = spec.batch, spec.n_heads, spec.s, spec.t
    window = spec.window
    if spec.causal and not spec.is_empty:
        if spec.q_positions is not None:
            qp = spec.q_positions.expand(b, s)

            def causal(bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
                p = qp[bi, qi]
                ok = ki <= p
                return ok & (ki > p - window) if window is not None else ok
        else:
            offset = t - s

            def causal(bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
                p = qi + offset
                ok = ki <= p
                return ok & (ki > p - window) if window is not None else ok
        parts.append(causal)
    if spec.documents is not None:
        doc = spec.documents

        def same_document(bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            return doc[bi, qi] == doc[bi, ki]
        parts.append(same_document)
    if spec.keep is not None:
        keep = _full(spec.keep, b, h, s, t)

        def kept(bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            return keep[bi, hi, qi, ki]
        parts.append(kept)
    if spec.bias is not None:
        bias = _full(spec.bias, b, h, s, t)

        def finite(bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            return bias[bi, hi, qi, ki] != float("-inf")
        parts.append(finite)
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]

    def combined(bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        ok = parts[0](bi, hi, qi, ki)
        for part in parts[1:]:
            ok = ok & part(bi, hi, qi, ki)
        return ok
    return combined


def score_mod(spec: MaskSpec, softcap: float | None = None) -> ScoreMod | None:
    """The score changes as a flex-attention score_mod: the cap softcap * tanh(score / softcap), then the float mask
    added (masked keys stay masked by the mask_mod, so -inf never reaches the kernel's arithmetic)."""
    if spec.bias is None and softcap is None:
        return None
    bias = None if spec.bias is None else _full(spec.bias, spec.batch, spec.n_heads, spec.s, spec.t)

    def modify(score: Tensor, bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        if softcap is not None:
            score = torch.tanh(score / softcap) * softcap
        if bias is None:
            return score
        value = bias[bi, hi, qi, ki]
        return score + torch.where(value == float("-inf"), torch.zeros_like(value), value).to(score.dtype)
    return modify


def _depends_on_heads(spec: MaskSpec) -> bool:
    return any(m is not None and m.ndim == 4 and m.shape[1] > 1 for m in (spec.keep, spec.bias))


def _depends_on_batch(spec: MaskSpec) -> bool:
    per_batch = [spec.q_positions, spec.documents]
    per_batch += [m for m in (spec.keep, spec.bias) if m is not None and m.ndim == 4 and m.shape[0] > 1]
    return any(m is not None and m.shape[0] > 1 for m in per_batch)


def block_mask(spec: MaskSpec, device: torch.device) -> Any:
    """The BlockMask of ``spec``, or None when every query may see every key.

    Made once per spec and kept on it (:attr:`MaskSpec.memo`): a model makes one spec per step for all its layers.
    """
    key = ("block_mask", device)
    if key in spec.memo:
        return spec.memo[key]
    made = _make_block_mask(spec, device)
    if not torch.compiler.is_compiling():
        spec.memo[key] = made
    return made


def _make_block_mask(spec: MaskSpec, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    mod = mask_mod(spec)
    if mod is None:
        return None
    compiling = torch.compiler.is_compiling()
    b = spec.batch if _depends_on_batch(spec) else None
    h = spec.n_heads if _depends_on_heads(spec) else None
    # evaluated eagerly the mask function runs over the whole (s, t) grid at once; past 4096 x 4096 the compiled
    # version works block by block
    make = create_block_mask if compiling or spec.s * spec.t < 4096 * 4096 else _compiled_create_block_mask()
    return make(mod, b, h, spec.s, spec.t, device=device, BLOCK_SIZE=BLOCK)


_compiled: Callable[..., Any] | None = None
_compiled_masks: Callable[..., Any] | None = None


def _compiled_create_block_mask() -> Callable[..., Any]:
    global _compiled_masks
    from torch.nn.attention.flex_attention import create_block_mask

    if _compiled_masks is None:
        _compiled_masks = torch.compile(create_block_mask)
    return _compiled_masks


def _kernel() -> Callable[..., Any]:
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


RECOMPILE_LIMIT = 256  # kernels kept per process (each shape and mask kind is one); past it, an error, not a fallback


def flex_attention(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, *, scale: float,
                   softcap: float | None = None) -> Tensor:
    """softmax(cap(q k^T * scale) + mask) v by flex attention: q (b, h, s, d), k and v (b, g, t, d) -> (b, h, s, d);
    ``softcap`` caps the scaled scores as softcap * tanh(scores / softcap) before the float mask is added."""
    mask = block_mask(spec, q.device)
    kernel = _kernel()
    args = dict(score_mod=score_mod(spec, softcap), block_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    if torch.compiler.is_compiling():
        # inductor's CPU flex template fails to lower inputs that are views of a projection's 2-D output
        out: Tensor = kernel(q.contiguous(), k.contiguous(), v.contiguous(), **args)
        return out
    # torch.compile's default of 8 kernels per function would silently fall back to flex attention's eager path,
    # which materialises the (s, t) scores: allow many more, and fail loudly past them
    try:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
            out = kernel(q, k, v, **args)
    except Exception as e:  # a compiler's failure, said with the inputs that caused it
        if not type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MultiheadError(
            f"flex attention did not compile for q {tuple(q.shape)}, k/v {tuple(k.shape)} {q.dtype} on {q.device} "
            f"({type(e).__name__}: {first[:300]}); backend 'sdpa' takes these inputs") from e
    return out


def sparsity(spec: MaskSpec, device: torch.device) -> float:
    """The share of (query block, key block) pairs that flex attention skips for this mask (0 for no mask).

    Counted in blocks: BlockMask.sparsity() counts elements, 128 x 128 per computed block, which overstates the work
    of partial blocks at the ends and goes negative when s or t is not a multiple of 128.
    """
    mask = block_mask(spec, device)
    if mask is None:
        return 0.0
    computed = int(mask.kv_num_blocks.sum())
    if mask.full_kv_num_blocks is not None:
        computed += int(mask.full_kv_num_blocks.sum())
    pairs = int(mask.kv_num_blocks.numel()) * int(mask.kv_indices.shape[-1])  # (b, h, query blocks) x key blocks
    return 1.0 - computed / pairs
