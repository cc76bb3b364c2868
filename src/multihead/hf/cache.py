"""multihead's caches in transformers models: a transformers ``Cache`` whose layers are one multihead cache's layers.

::

    from multihead import hf
    model = hf.enable(AutoModelForCausalLM.from_pretrained(folder))      # multihead's attention core
    cache = hf.new_cache(model, 8192, plan=HeadPlan.load("plan.json"))   # or window=, bits=, nothing (full)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)
    cache.bytes                                                           # the real tensors' bytes

transformers' attention modules call ``cache.update(k, v, layer_idx)`` and hand what it returns to the registered
attention function. Here ``update`` is the multihead cache's one verb: the keys and values are placed as the kind
stores them (every key, sinks + a window, low-bit codes, each KV head full or streaming as a head plan says: the
streaming heads' other keys never stored) and the view it returns (:mod:`multihead.cache.view`) travels to
:func:`multihead.hf.attention_forward` on the tensor handed over, with the step's masks; the dispatcher
(:func:`multihead.kernels.attend`) computes over it as it does in multihead's own models. A step reserves its slots
when the first layer updates and commits (``advance``) after the last, so a forward pass is one cache step, a prefill
or a decode step alike.

Sliding-window layers (Gemma 2 and 3, Mistral, gpt-oss) keep their window: every kind attends within the layer's
own window (sinks included: a key past it is not seen) and stores only what the layer can see. The full kind keeps
a sliding layer's last ``window - 1`` keys in a ring (a :class:`~multihead.cache.HybridCache` of one part per
window), the quantized kind a ring of code groups, the sinks + window kind no more than the layer's window, and a
head-wise cache a sliding layer's full heads as a ring of that window and its streaming heads as sinks + the smaller
of the two windows: ``bytes`` equals transformers' DynamicCache after the same tokens.

The sequences of a batch hold one length (the kinds that evict and quantize hold one; a padded batch is refused, not
silently mis-masked). Beam search, assisted decoding (``crop``) and ``num_return_sequences > 1`` change a cache in
ways these kinds do not support: refused by name. The compiled (static-cache) path of transformers cannot take
these caches: a view travels as an attribute of the tensor handed over, which a traced graph does not keep, a step's
slots are Python numbers of the positions filled (a graph would be traced again each step), and the head-wise and
sink kinds' key counts change with every step. They say so (``is_compileable`` is False), and transformers'
``generate`` with a ``compile_config`` then skips compilation with its own warning and decodes eagerly. What does
compile is transformers' own StaticCache with multihead's attention and products (one graph, a test checks it);
eager decoding over these caches against both is measured in benchmarks/RESULTS.md (``benchmarks/hf_decode.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from multihead.cache import Cache, HeadPlan
from multihead.cache.spec import CacheShape, CacheSpec, spec_of
from multihead.cache.view import DenseKV, KVView
from multihead.errors import MultiheadError, require
from multihead.hf.attention import VIEW  # the attribute of the keys update hands over: the view and its step
from multihead.layers.step import Step, build_step

require("transformers", "hf")
from transformers.cache_utils import Cache as TransformersCache  # noqa: E402
from transformers.cache_utils import CacheLayerMixin  # noqa: E402


@dataclass(slots=True)
class Carried:
    """What one layer's update hands the attention function beside the tensors: the view of its keys and values,
    the step (its masks) of the layer's kind of attention, and, for the step's first layer of that kind, the new
    tokens' positions (b, s) and the layer's window, against which transformers' own mask is checked once a step."""

    view: KVView
    step: Step
    positions: Tensor | None = None
    window: int | None = None


def carried(key: Tensor) -> Carried | None:
    """The view a :class:`MultiheadCache` handed over with ``key``, or None for a plain key tensor."""
    found = getattr(key, VIEW, None)
    return found if isinstance(found, Carried) else None


class _Layer(CacheLayerMixin):
    """One model layer of a :class:`MultiheadCache` (transformers' per-layer object): everything goes to the owner."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: MultiheadCache, index: int, window: int | None) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.is_sliding = window is not None
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        return None

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return self.owner.layer_update(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.inner.used + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.inner.used

    def get_max_length(self) -> int:
        return self.owner.inner.max_len if self.owner.inner.max_len is not None else -1

    def reset(self) -> None:
        self.owner.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise MultiheadError("a multihead cache holds one sequence order: beam search is not supported (decode "
                             "greedily or by sampling)")

    def crop(self, tokens_to_remove: int) -> None:
        raise MultiheadError("a multihead cache cannot be cropped (assisted decoding): decode without an assistant")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise MultiheadError("a multihead cache holds the batch it was made for: num_return_sequences > 1 and beam "
                             "search are not supported (make a cache of that batch)")

    def batch_select_indices(self, indices: Tensor) -> None:
        raise MultiheadError("a multihead cache holds the batch it was made for: it cannot select sequences")


class MultiheadCache(TransformersCache):
    """A transformers ``Cache`` over one multihead cache (``inner``, of the model's layers), for ``n_heads`` query
    heads, each layer's attention ``windows`` (None: global, else its sliding window). Made by
    :func:`multihead.hf.new_cache`."""

    def __init__(self, inner: Cache, *, n_heads: int, windows: list[int | None]) -> None:
        if len(windows) != inner.n_layers:
            raise MultiheadError(f"{len(windows)} layer windows for a cache of {inner.n_layers} layers")
        super().__init__(layers=[_Layer(self, i, w) for i, w in enumerate(windows)])
        self.inner = inner
        self.n_heads = n_heads
        self.windows = windows
        self._steps: dict[int | None, Step] = {}
        self._updated = 0
        self._s = 0
        self._positions: Tensor | None = None

    @property
    def bytes(self) -> int:
        """The bytes of the tensors that hold keys and values (:attr:`multihead.cache.BaseCache.bytes`)."""
        return int(self.inner.bytes)

    @property
    def is_compileable(self) -> bool:
        return False

    def reset(self) -> None:
        self.inner.reset()
        self._steps.clear()
        self._updated = 0

    @property
    def used(self) -> int:
        """Tokens the cache holds (a forward pass commits its own: after it, ``used`` counts them)."""
        return self.inner.used

    def advance(self, s: int) -> None:
        """What multihead's own models call after a forward pass: here the forward committed its tokens already
        (after its last layer), so this only checks that the last forward placed ``s``."""
        if self._updated not in (0, self.inner.n_layers) or (s and s != self._s):
            raise MultiheadError(f"advance({s}) after a forward pass that placed {self._s} tokens in "
                                 f"{self._updated} of {self.inner.n_layers} layers: a transformers model's forward "
                                 "commits its own step")

    def layer_update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Place one layer's keys and values (b, g, s, d) as the kind stores them; hand back tensors that carry the
        view (and the step's masks) to the attention function. The first layer reserves the step's slots, the last
        commits them."""
        if layer == 0:
            self._begin(k)
        elif layer != self._updated:
            raise MultiheadError(f"layer {layer} updated the cache after {self._updated} of its "
                                 f"{self.inner.n_layers} layers: a multihead cache takes every layer in order, once "
                                 "a forward pass")
        elif k.shape[2] != self._s:
            raise MultiheadError(f"layer {layer} gave {k.shape[2]} new tokens where layer 0 gave {self._s}")
        window = self.windows[layer]
        step = self._steps.get(window)
        first = step is None
        if step is None:
            step = self._steps[window] = self._step(k, window)
        assert step.slots is not None
        view = self.inner.update(layer, k, v, step.slots)
        self._updated = layer + 1
        if self._updated == self.inner.n_layers:  # the step's views are made: commit (nothing they read changes)
            self.inner.advance(self._s)
        keys = view.keys if isinstance(view, DenseKV) else k.new_empty(k.shape[0], k.shape[1], 0, k.shape[3])
        values = view.values if isinstance(view, DenseKV) else keys
        positions = self._positions if first else None
        setattr(keys, VIEW, Carried(view, step, positions, window))  # (keys is a fresh object each call)
        return keys, values

    def _begin(self, k: Tensor) -> None:
        if k.shape[0] != self.inner.batch:
            raise MultiheadError(f"the model passed {k.shape[0]} sequences to a multihead cache made for batch "
                                 f"{self.inner.batch}: beam search and num_return_sequences > 1 expand the batch, "
                                 "which these caches do not follow (decode greedily or by sampling one sequence, or "
                                 "make new_cache(model, ..., batch=n) for n prompts of one length)")
        if 0 < self._updated < self.inner.n_layers:
            raise MultiheadError(f"the last forward pass updated {self._updated} of the cache's "
                                 f"{self.inner.n_layers} layers: every layer must run (a model sharing keys between "
                                 "layers is not supported)")
        self._steps.clear()
        self._updated = 0
        self._s = k.shape[2]
        self._positions = self.inner.lengths[:, None] + torch.arange(self._s, device=self.inner.lengths.device)

    def _step(self, k: Tensor, window: int | None) -> Step:
        """The step of layers with this attention window: the slots reserved in the cache and the masks of its
        kind (one per group of KV heads for a head-wise cache)."""
        b, _, s, _ = k.shape
        anchor = k.new_empty(b, s, 0)
        return build_step(anchor, None, n_heads=self.n_heads, window=window, rotary=None, causal=True,
                          cache=self.inner)


def new_cache(model: Any, max_len: int | None = None, *, batch: int = 1, window: int | None = None,
              sink_tokens: int = 0, bits: int | None = None, group: int = 32, residual: int = 128,
              plan: HeadPlan | None = None, layers: str = "all", spec: CacheSpec | None = None) -> MultiheadCache:
    """A multihead cache for a transformers model switched to multihead's attention (:func:`multihead.hf.enable`),
    as :meth:`multihead.models.LlamaModel.new_cache` makes one for our port: every key (``max_len``), ``window=``
    with ``sink_tokens=`` (sinks + a window; ``max_len`` optional, the tokens it is for), ``bits=`` (4- or 8-bit
    codes, KIVI), or ``plan=`` (each KV head full or sinks + window, a :class:`~multihead.cache.HeadPlan` of the
    model's shape). The model's dtype and device; ``batch`` sequences of one length.

    Every kind stores what each layer can see: in a model with sliding-window layers (Gemma 2 and 3, Mistral,
    gpt-oss) the layers of each window get a part of their own (:class:`~multihead.cache.HybridCache`): a full
    cache keeps a sliding layer's last ``window - 1`` keys in a ring, a quantized one its codes in a ring of whole
    groups (or the window in full precision where that is smaller: a window within the residual), a sinks + window
    cache no more than the layer's own window; a head plan's cache does the same per KV head. ``bytes`` is then
    transformers' own cache's after the same tokens (:func:`multihead.sizing.cost.layers_kv_bytes` predicts it).

    ``layers="global"``: the kind on the global layers only, every sliding layer keeping its whole window (a ring of
    ``window - 1`` keys in full precision), as a method that saves bytes only where the context grows (a hybrid
    model's sinks + window or int8 on its global layers); ``"all"`` (default) applies it to every layer.
    ``spec=``: a :class:`~multihead.cache.CacheSpec` instead of the options (they are its fields)."""
    chosen = spec_of(spec, max_len, {"window": window, "sink_tokens": sink_tokens, "bits": bits, "group": group,
                                     "residual": residual, "plan": plan, "layers": layers})
    shape = cache_shape(model)
    param = next(model.parameters())
    inner = chosen.build(shape, batch=batch, dtype=param.dtype, device=param.device)
    assert isinstance(inner, Cache)  # a transformers model's shape has no latent widths (MLA: hf.use_mla_layers)
    return MultiheadCache(inner, n_heads=shape.n_heads, windows=list(shape.windows))


def cache_shape(model: Any) -> CacheShape:
    """What a :class:`~multihead.cache.CacheSpec` builds for in a transformers model switched to multihead's
    attention: its text config's layers, KV heads, head_dim, context and each layer's attention window."""
    config: Any = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "multihead":
        raise MultiheadError("the model does not run multihead's attention: call multihead.hf.enable(model) first "
                             "(a multihead cache's views are read by multihead's attention function only)")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers, h = int(text.num_hidden_layers), int(text.num_attention_heads)
    g = int(getattr(text, "num_key_value_heads", None) or h)
    d = int(getattr(text, "head_dim", None) or text.hidden_size // h)
    context = int(getattr(text, "max_position_embeddings", 0) or 0) or None
    return CacheShape.uniform(n_layers=n_layers, n_kv_heads=g, n_heads=h, head_dim=d, context=context,
                              windows=layer_windows(text, n_layers))


def layer_windows(text_config: Any, n_layers: int) -> list[int | None]:
    """Each layer's sliding attention window from a transformers config (``layer_types`` and ``sliding_window``), or
    None for a global layer."""
    window = getattr(text_config, "sliding_window", None)
    types = getattr(text_config, "layer_types", None)
    if not window:
        return [None] * n_layers
    if types is None:  # a model that slides every layer (Mistral's config: sliding_window alone)
        return [int(window)] * n_layers
    return [int(window) if str(t).startswith("sliding") else None for t in types]


