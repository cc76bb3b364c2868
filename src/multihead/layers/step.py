"""Step: the state every attention layer of a model shares in one forward step, made once and passed down.

::

    step = build_step(x, causal=True, cache=cache, ...)     once per model step (or ``layer.step(...)``)
        mask       MaskSpec over (b, h, s, t)               t counts the cached keys when there is a cache
        positions  (b|1, s)                                 for RoPE (None when nothing reads them)
        rope       cos, signed sin (b|1, 1, s, d)           or None
        slots      the cache's slots for the step             (:meth:`multihead.cache.BaseCache.reserve`) or None
    for each layer:  layer(h, step=step, cache=cache.layer(i))   -> view = cache.layer(i).update(k, v, step.slots)
    cache.advance(s)

A model makes the step from its first layer (``layer.step``); a layer called alone makes its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from multihead.cache import BaseCache, BaseLayerCache, Slots
from multihead.errors import MultiheadError
from multihead.kernels import cpu
from multihead.layers.masks import MaskSpec, build_mask
from multihead.layers.rope import RotaryEmbedding


@dataclass(frozen=True)
class Step:
    """What every attention layer of a model shares in one forward step, made once (``layer.step(...)``).

    ``mask`` covers (b, h, s, t), t counting the cached keys when there is a cache; ``positions`` (b|1, s) are the
    tokens' positions for RoPE (None when nothing reads them); ``rope`` the cos and signed sin tables (b|1, 1, s, d)
    or None; ``slots`` the cache's slots for this step (where the new tokens go, what each layer reads), or None
    without a cache. A cache whose keys differ by KV head (head-wise) makes each kind's mask at reserve and its views
    carry them; ``mask`` is then the one its slots give. A step made by one layer serves every layer with the same
    window, rope and head counts (a model's layers).
    """

    mask: MaskSpec
    positions: Tensor | None = None
    rope: tuple[Tensor, Tensor] | None = None
    slots: Slots | None = None


def build_step(x: Tensor, context: Tensor | None = None, *, n_heads: int, window: int | None,
               rotary: RotaryEmbedding | None, mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
               causal: bool = False, documents: Tensor | None = None, positions: Tensor | None = None,
               cache: BaseCache | BaseLayerCache | None = None, dtype: torch.dtype | None = None,
               validate: bool = True) -> Step:
    """The :class:`Step` of one call on x (b, s, .) for a layer of ``n_heads`` query heads with this window and
    RoPE: the mask, the positions, the RoPE tables, the cache's slots (inputs already checked). ``validate`` checks
    a float mask's values (:func:`multihead.layers.masks.build_mask`) and positions given into a cache."""
    b, s = x.shape[0], x.shape[1]
    t = s if context is None else context.shape[1]
    pos: Tensor | None = None
    slots: Slots | None = None
    if cache is not None:
        check_cache_call(cache, context, mask, key_padding_mask, causal)
        kv = cache.cache if isinstance(cache, BaseLayerCache) else cache
        given = None if positions is None else check_positions(positions, b, s, x.device).expand(b, s)
        slots = kv.reserve(s, given, need_positions=rotary is not None, attention_window=window, validate=validate,
                           shortcuts=cpu.enabled())
        pos, t = slots.positions, slots.t
    elif rotary is not None:
        pos = check_positions(positions, b, s, x.device)  # (b|1, s)
    elif positions is not None:
        raise MultiheadError("positions were given but this layer has no rope or cache: they would be ignored")
    if slots is not None and slots.mask is not None:  # the cache made the step's mask
        spec = slots.mask
    elif slots is not None and not slots.positional:  # a kind that evicts says which of its keys each query sees
        spec = MaskSpec(batch=b, n_heads=n_heads, s=s, t=t, keep=slots.keep)
    else:
        by_position = slots is not None and not slots.aligned
        spec = build_mask(batch=b, n_heads=n_heads, s=s, t=t, mask=mask, key_padding_mask=key_padding_mask,
                          causal=causal, window=window, documents=documents,
                          q_positions=pos if by_position else None, device=x.device, validate=validate)
    rope = None
    if rotary is not None:
        assert pos is not None
        rope = rotary.tables(pos, dtype or x.dtype)
    return Step(mask=spec, positions=pos, rope=rope, slots=slots)


def check_cache_call(cache: object, context: Tensor | None, mask: Tensor | None, key_padding_mask: Tensor | None,
                     causal: bool, *, layer: bool = False) -> None:
    """Refuse a cache the call cannot use: not a cache (or, with ``layer``, not one layer of a cache), with a
    context, without causal=True, or with a mask (the cache's lengths keep padding out)."""
    if not isinstance(cache, BaseLayerCache) and (layer or not isinstance(cache, BaseCache)):
        raise MultiheadError(f"cache must be one layer of a cache (cache.layer(i)), got {type(cache).__name__}")
    if context is not None:
        raise MultiheadError("a KV cache holds this layer's own past keys: it cannot be used with a context")
    if not causal:
        raise MultiheadError("a KV cache is for causal decoding: call with causal=True")
    if mask is not None or key_padding_mask is not None:
        raise MultiheadError(
            "mask and key_padding_mask cannot be combined with a KV cache: the cache's per-sequence lengths "
            "already keep padding out (write a padded prompt, then cache.advance(s, lengths=real_lengths))"
        )


def check_positions(positions: Tensor | None, b: int, s: int, device: torch.device) -> Tensor:
    """Positions (s,) or (b, s) as (b|1, s), checked; default 0 .. s - 1 as (1, s)."""
    if positions is None:
        return torch.arange(s, device=device)[None]  # (1, s)
    if not isinstance(positions, Tensor):
        raise MultiheadError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    batched = positions if positions.ndim != 1 else positions[None]  # (b|1, s)
    if batched.ndim != 2 or batched.shape[-1] != s or batched.shape[0] not in (1, b):
        raise MultiheadError(f"positions of shape {tuple(positions.shape)} must be (s,) or (b, s) = {(b, s)}")
    if positions.device != device:
        raise MultiheadError(f"positions is on {positions.device} but the inputs are on {device}: move it, e.g. "
                             f"positions.to({str(device)!r})")
    if positions.is_complex() or positions.dtype == torch.bool:
        raise MultiheadError(f"positions has dtype {positions.dtype}: give integer (or float) positions")
    return batched
