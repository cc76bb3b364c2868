"""transformers' attention interface, answered by multihead: the registered function and mask, and the keywords
transformers passes, each honoured or refused by name (the package's docstring lists them). Over a multihead
cache (:mod:`multihead.hf.cache`) the keys handed over carry the cache's view (attribute :data:`VIEW`), and the
call runs over it as multihead's own models do."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from multihead.cache.view import DenseKV
from multihead.errors import MultiheadError, require
from multihead.kernels import AttentionCall, attend
from multihead.layers.hooks import HookPoint, call_hooks
from multihead.layers.masks import MaskSpec

NAME = "multihead"

# keywords transformers may pass that do not change what attention computes
IGNORED = frozenset({
    "position_ids", "cache_position", "use_cache", "output_hidden_states", "return_dict", "num_items_in_batch",
    "output_router_logits", "layer_idx", "token_type_ids", "seq_idx", "past_key_values", "cache", "query_length",
    "encoder_hidden_states",
})  # a head_mask does change the result: it is refused like any other unknown keyword

_registered = False


def register() -> None:
    """Register ``"multihead"`` with transformers' AttentionInterface and AttentionMaskInterface (once)."""
    global _registered
    if _registered:
        return
    require("transformers", "hf")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # boolean, True = may attend
    _registered = True


def _mask(attention_mask: Tensor | None, position_bias: Tensor | None, b: int, h: int, s: int, t: int,
          causal: bool) -> MaskSpec:
    keep = bias = None
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor) or attention_mask.ndim != 4:
            raise MultiheadError(f"transformers passed an attention_mask of {type(attention_mask).__name__} "
                                 f"{tuple(getattr(attention_mask, 'shape', ()))}: expected (b, 1|h, s, t)")
        mask = attention_mask[..., :t]  # a static cache's mask can be longer than the keys it hands over
        if mask.dtype == torch.bool:
            keep = mask
        elif mask.is_floating_point():
            bias = mask
        else:
            raise MultiheadError(f"transformers passed an attention_mask of dtype {mask.dtype}: expected bool or a "
                                 "float mask added to the scores")
    if position_bias is not None:
        pb = position_bias[..., :t]
        bias = pb if bias is None else bias + pb
    return MaskSpec(batch=b, n_heads=h, s=s, t=t, causal=causal, keep=keep, bias=bias)


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      softcap: float | None = None, sliding_window: int | None = None, s_aux: Tensor | None = None,
                      position_bias: Tensor | None = None, output_attentions: bool = False, **kwargs: Any
                      ) -> tuple[Tensor, Tensor | None]:
    """The function transformers calls: query (b, h, s, d), key and value (b, g, t, d) -> ((b, s, h, dv), weights)."""
    unknown = sorted(k for k, v in kwargs.items() if k not in IGNORED and v is not None)
    if unknown:
        raise MultiheadError(f"{type(module).__name__} passed {', '.join(map(repr, unknown))} to the attention "
                             f"function, which multihead does not support: use attn_implementation='sdpa' or 'eager' "
                             "for this call")
    found = getattr(key, VIEW, None)
    if found is not None:  # a multihead cache's view (multihead.hf.cache): its own masks, its own keys
        return _over_cache_view(module, query, found, attention_mask, dropout, scaling, softcap, s_aux,
                                position_bias, output_attentions)
    b, h, s, d = query.shape
    g, t = key.shape[1], key.shape[2]
    if h % g != 0:
        raise MultiheadError(f"{type(module).__name__}: {h} query heads do not divide into {g} KV heads")
    causal = False
    if attention_mask is None:
        wants = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(wants) and s > 1
        if causal and t > s:  # a prefill into an empty static cache: its first s slots, as transformers' SDPA path
            key, value, t = key[:, :, :s], value[:, :, :s], s
            position_bias = None if position_bias is None else position_bias[..., :s]
    spec = _mask(attention_mask, position_bias, b, h, s, t, causal)
    hooked = call_hooks(module) if isinstance(getattr(module, "hook_z", None), HookPoint) else None  # type: ignore[arg-type]
    call = AttentionCall(query, DenseKV(key, value), spec, scale=d**-0.5 if scaling is None else float(scaling),
                         dropout_p=float(dropout), backend=getattr(module, "multihead_backend", "auto"),
                         need_weights=bool(output_attentions), softcap=softcap, sinks=s_aux, hooks=hooked)
    z, weights = attend(call)  # (b, h, s, dv)
    return z.transpose(1, 2).contiguous(), weights


VIEW = "multihead_view"  # the attribute a multihead cache's update sets on the keys it hands over (hf.cache)


def check_no_padding(attention_mask: Tensor | None, positions: Tensor, window: int | None) -> None:
    """transformers' mask for a multihead cache's step, where it made one (a bool (b, 1, s, t) over positions 0 ..
    t - 1), must let every query see every earlier key of its window: a padded batch does not (these caches hold
    one length, and their own masks would attend to the padding)."""
    if not isinstance(attention_mask, Tensor) or attention_mask.dtype != torch.bool or attention_mask.ndim != 4:
        return
    t = attention_mask.shape[-1]
    j = torch.arange(t, device=attention_mask.device)
    q = positions.to(attention_mask.device)[:, None, :, None]  # (b, 1, s, 1)
    want = j <= q if window is None else (j <= q) & (j > q - window)  # (b, 1, s, t)
    if not bool((attention_mask | ~want).all()):
        raise MultiheadError("transformers passed a mask that hides earlier tokens (padding) for a multihead cache: "
                             "its sequences hold one length; decode prompts of other lengths one at a time")


def _over_cache_view(module: nn.Module, query: Tensor, found: Any, attention_mask: Tensor | None, dropout: float,
                     scaling: float | None, softcap: float | None, s_aux: Tensor | None, position_bias: Tensor | None,
                     output_attentions: bool) -> tuple[Tensor, Tensor | None]:
    """attention_forward over a multihead cache's view (:mod:`multihead.hf.cache`): the step's mask (a head-wise
    cache's view carries one per group of KV heads), transformers' mask only checked to have no padding."""
    if position_bias is not None:
        raise MultiheadError(f"{type(module).__name__} passed a position_bias: a multihead cache takes causal decoders")
    if found.positions is not None:  # the step's first layer of its kind: transformers' mask, checked once
        check_no_padding(attention_mask, found.positions, found.window)
    step = found.step
    d = query.shape[-1]
    hooked = call_hooks(module) if isinstance(getattr(module, "hook_z", None), HookPoint) else None  # type: ignore[arg-type]
    call = AttentionCall(query, found.view, step.mask, scale=d**-0.5 if scaling is None else float(scaling),
                         dropout_p=float(dropout), backend=getattr(module, "multihead_backend", "auto"),
                         need_weights=bool(output_attentions), softcap=softcap, sinks=s_aux, hooks=hooked)
    z, weights = attend(call)  # (b, h, s, dv)
    return z.transpose(1, 2).contiguous(), weights
