"""multihead as a transformers attention implementation: any model transformers can load runs its attention core here.

::

    from multihead import hf
    model = hf.load("path/to/model")          # a local folder (config.json + safetensors) or a .gguf file
    model = hf.enable(any_hf_model)           # or switch a model you already have
    cache = hf.new_cache(model, 8192, ...)    # a multihead cache of any kind, for generate

The package, one module a concern (each imported when first used: reading a config.json needs neither torch's
kernels nor transformers):

    attention.py   the registered attention function and mask, over transformers' tensors or a cache's view
    switch.py      enable: the implementation switched, hook points, residual points, the products, each forward
                   one CPU step
    cache.py       multihead's caches as a transformers Cache (new_cache), each kind storing what a layer sees
    loader.py      load: a folder or .gguf through transformers, switched
    mla.py         our MLA layer standing in DeepSeek-V2/V3's attention
    config.py      the one reader of a config.json (HFConfig): typed, ranged values for sizing and loading

transformers (5.x) calls the registered function with (module, query (b, h, s, d), key and value (b, g, t, d) after
its own RoPE and cache, attention_mask, dropout, scaling, **kwargs). Hugging Face's modules and weights run
unchanged but for two things: the attention core is multihead's (keys and values stay g = n_kv_heads wide into the
kernel, also with a padding mask, where transformers' own SDPA path repeats them; the same hook points as our layer,
``model.layers.3.self_attn.hook_z``; exact per-head patterns on the fused path), and each ``nn.Linear`` computes as
our models' :class:`multihead.layers.linear.Linear` (the decode step's few-row products on the CPU as the fastest
kind for the shape: same weights and state_dict; ``enable(model, products=False)`` keeps transformers' own).

The mask is registered too (``AttentionMaskInterface``): without it transformers passes no mask. It is transformers'
boolean mask (True = may attend, multihead's convention), or None where transformers proves none is needed.

Keywords transformers passes, each honoured or refused by name:

- ``scaling``, ``dropout``: the factor on q·k and the dropout on the weights;
- ``is_causal``: with no mask, causal when the module says so and more than one query comes (a prefill into an
  empty static cache attends to its first s slots, as transformers' SDPA path does);
- ``sliding_window``: already in transformers' mask (or provably without effect when it passes none);
- ``softcap`` (Gemma 2): ``tanh(scores / softcap) * softcap`` before the mask;
- ``s_aux`` (gpt-oss): one learned sink logit per head, in the softmax's denominator only;
- ``position_bias`` (T5): added to the scores, with the mask;
- ``output_attentions``: the per-head weights (the math path);
- ``position_ids``, ``cache_position``, ``use_cache``, ``output_hidden_states`` and the like: not attention's concern.

Anything else (flash-attention's packed ``cu_seq_lens_*``, say) raises a MultiheadError naming it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multihead.hf.attention import IGNORED, NAME, VIEW, attention_forward, check_no_padding, register
    from multihead.hf.cache import MultiheadCache, cache_shape, layer_windows, new_cache
    from multihead.hf.loader import load
    from multihead.hf.mla import MLAInTransformers, mla_from_transformers, use_mla_layers
    from multihead.hf.switch import (
        LAYOUTS,
        RESID_FAMILIES,
        BlockLayout,
        attention_modules,
        block_layout,
        block_parts,
        decoder_layers,
        enable,
        model_type,
        switch_products,
    )

# the package's names, each from the module that defines it (imported on first use)
_HOMES = {
    "attention": ("IGNORED", "NAME", "VIEW", "attention_forward", "check_no_padding", "register"),
    "cache": ("MultiheadCache", "cache_shape", "layer_windows", "new_cache"),
    "switch": ("LAYOUTS", "RESID_FAMILIES", "BlockLayout", "attention_modules", "block_layout", "block_parts",
               "decoder_layers", "enable", "model_type", "switch_products"),
    "loader": ("load",),
    "mla": ("MLAInTransformers", "mla_from_transformers", "use_mla_layers"),
}
_WHERE = {name: module for module, names in _HOMES.items() for name in names}

__all__ = ["IGNORED", "LAYOUTS", "NAME", "RESID_FAMILIES", "VIEW", "BlockLayout", "MLAInTransformers", "MultiheadCache",
           "attention_forward", "attention_modules", "block_layout", "block_parts", "cache_shape", "check_no_padding",
           "decoder_layers", "enable", "layer_windows", "load", "mla_from_transformers", "model_type", "new_cache",
           "register", "switch_products", "use_mla_layers"]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'multihead.hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"multihead.hf.{module}"), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
