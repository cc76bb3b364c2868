"""How the long-context head scores run a model: one interface over multihead's own models and any transformers model
whose attention runs on multihead (:func:`multihead.hf.enable`), so the retrieval scores, the dropped-mass scores and
the DuoAttention-style gates are one code path for both engines.

An :class:`Engine` gives the scores what they need and nothing else:

- :meth:`Engine.sites`: the attention layers in order, each a :class:`Site`: its hook points (``hook_q`` .. ``hook_z``)
  and what a score computed from q and k needs to attend as the layer does: the scale on q.k, the softcap (Gemma 2)
  and, during a call, the layer's own mask (a transformers sliding-window layer's, as transformers hands it to the
  attention function; None where the layer attends to every earlier key);
- ``engine(ids, cache=, logits_to_keep=)``, :meth:`Engine.new_cache` and ``cache.advance(n)``: what
  :mod:`multihead.evals.answers` runs (a chunked prefill, the answer teacher-forced one token a step);
- :meth:`Engine.forward` (uncached logits), :meth:`Engine.final_hidden` (the hidden states after the final norm);
- ``name``, ``shape`` (n_layers, n_heads, n_kv_heads, head_dim: a :class:`~multihead.cache.HeadPlan`'s), the context,
  the vocabulary and ``scored``: what the scores were taken on, for a plan's ``method``.

:func:`as_engine` picks the engine of a model: :class:`TransformersEngine` for a transformers model (switched to
multihead's attention in place when it is not yet), :class:`MultiheadEngine` for ours (any module whose attention
layers are multihead's, e.g. :class:`~multihead.models.LlamaModel`).

A transformers model is run with a :class:`TransformersCache`: transformers' ``DynamicCache`` made without the model's
config, so every layer, a sliding-window one too, keeps every key at its position (the scores read keys by position);
what a sliding layer may see is in the mask transformers builds for it, which the sites read.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from multihead.errors import MultiheadError
from multihead.layers.hooks import HookPoint


# ---------------------------------------------------------------------------------------------------------- a site
@dataclass(eq=False)
class Site:
    """One attention layer as the scores see it: ``module`` holds the hook points, ``scale`` multiplies q.k,
    ``softcap`` (or None) caps the scores as ``tanh(x / softcap) * softcap``; ``mask`` is the layer's own boolean mask
    of the call under way ((b, 1 | h, s, t), True = may attend), set by :meth:`Engine.reading` while a forward runs,
    None where the layer attends causally to every earlier key."""

    module: Any
    index: int
    scale: float
    n_heads: int
    n_kv_heads: int
    softcap: float | None = None
    mask: Tensor | None = None

    def keep(self, rows: Tensor, positions: Tensor, t: int) -> Tensor:
        """(1 | b, 1 | h, r, t) bool, True = may attend: what the call's query rows ``rows`` (r,) at ``positions``
        (r,) may see among its ``t`` keys at positions 0 .. t - 1: causally every key up to its own position, and
        within the layer's own mask where the call has one."""
        j = torch.arange(t, device=positions.device)
        causal = (j[None, :] <= positions[:, None])[None, None]  # (1, 1, r, t)
        if self.mask is None:
            return causal
        own = self.mask[..., :t]
        if own.shape[-1] != t:
            raise MultiheadError(f"layer {self.index}: its mask covers {own.shape[-1]} keys but the call has {t}")
        return causal & own.index_select(-2, rows.to(own.device))  # (b, 1 | h, r, t)

    def stream_keep(self, keep: Tensor) -> Tensor:
        """An uncached call's streaming mask ``keep`` (s, s) within the layer's own mask: (1 | b, 1 | h, s, s)."""
        out = keep[None, None]
        return out if self.mask is None else out & self.mask[..., :keep.shape[-1]]


# ---------------------------------------------------------------------------------------------------------- engines
class Engine:
    """What the head scores need of a model (the module docstring lists it)."""

    kind = ""
    name: str
    model: nn.Module

    def sites(self) -> list[Site]:
        raise NotImplementedError

    @contextmanager
    def reading(self) -> Iterator[None]:
        """While the block runs, each site's ``mask`` is the layer's own mask of its current call."""
        yield

    def new_cache(self, batch: int, max_len: int) -> Any:
        raise NotImplementedError

    def __call__(self, ids: Tensor, *, cache: Any = None, logits_to_keep: int = 0) -> Tensor:
        """Logits (b, s, vocab) of ``ids`` (b, s) after what ``cache`` holds (the last ``logits_to_keep`` rows only
        when it is positive); the caller advances the cache."""
        raise NotImplementedError

    def forward(self, ids: Tensor) -> Tensor:
        """Uncached logits (b, s, vocab)."""
        return self(ids)

    def final_hidden(self, ids: Tensor) -> Tensor:
        """The hidden states (b, s, d_model) after the final norm, of an uncached causal forward."""
        raise NotImplementedError

    @property
    def max_context(self) -> int:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def scored(self) -> str:
        """What the scores are taken on, in words (for a plan's method)."""
        return self.name

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(n_layers, n_heads, n_kv_heads, head_dim), as a :class:`~multihead.cache.HeadPlan` takes it."""
        raise NotImplementedError

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: global), as a :class:`~multihead.cache.HeadPlan` records it; every
        layer global unless the engine says otherwise."""
        return (None,) * self.shape[0]

    def gate_shape(self) -> tuple[int, int]:
        """(n_layers, n_kv_heads): one value per KV head of every layer (a plan's, a gate's)."""
        sites = self.sites()
        widths = sorted({s.n_kv_heads for s in sites})
        if len(widths) != 1:
            raise MultiheadError(f"the attention layers have different numbers of KV heads ({widths}): per-KV-head "
                                 "scores and gates take one (n_layers, n_kv_heads) array, so every layer needs the "
                                 "same count")
        return len(sites), widths[0]


class MultiheadEngine(Engine):
    """multihead's own models: a module whose attention layers have hook points q and k and a config with a
    ``softmax_scale`` (:class:`~multihead.MultiHeadAttention`), called as ``model(ids, cache=, logits_to_keep=)``
    with caches from ``model.new_cache(batch, max_len)`` (:class:`~multihead.models.LlamaModel` and its likes)."""

    kind = "multihead"

    def __init__(self, model: nn.Module, name: str = "") -> None:
        self.model = model
        self.name = name or type(model).__name__
        found: list[Any] = [m for m in model.modules() if isinstance(getattr(m, "hook_q", None), HookPoint)
                            and isinstance(getattr(m, "hook_k", None), HookPoint)]
        if not found:
            raise MultiheadError(f"{type(model).__name__} has no attention layer with hook points q and k: the head "
                                 "scores and gates read them")
        for m in found:
            if not isinstance(getattr(getattr(m, "config", None), "softmax_scale", None), float):
                raise MultiheadError(f"{type(m).__name__} has no config.softmax_scale: the scores need the layer's "
                                     "scale")
        self._sites = [Site(m, i, float(m.config.softmax_scale), int(getattr(m, "n_heads", 0)),
                            int(getattr(m, "n_kv_heads", 0) or getattr(m, "n_heads", 0)))
                       for i, m in enumerate(found)]

    def sites(self) -> list[Site]:
        return self._sites

    def new_cache(self, batch: int, max_len: int) -> Any:
        model: Any = self.model
        return model.new_cache(batch, max_len)

    def __call__(self, ids: Tensor, *, cache: Any = None, logits_to_keep: int = 0) -> Tensor:
        if cache is None and not logits_to_keep:
            out: Tensor = self.model(ids)
            return out
        out = self.model(ids, cache=cache, logits_to_keep=logits_to_keep)
        return out

    def final_hidden(self, ids: Tensor) -> Tensor:
        """A LlamaModel-like model's forward (``embed``, ``step``, ``layers``, ``norm``) without the lm_head."""
        model: Any = self.model
        for part in ("embed", "step", "layers", "norm"):
            if not hasattr(model, part):
                raise MultiheadError(f"{type(model).__name__} has no {part!r}: the final hidden states are read from "
                                     "a LlamaModel-like model (embed, step, layers, norm)")
        h = model.embed(ids)  # (b, s, d_model)
        step = model.step(h)
        for layer in model.layers:
            h = layer(h, step=step)
        out: Tensor = model.norm(h)
        return out

    @property
    def max_context(self) -> int:
        return int(getattr(getattr(self.model, "config", None), "max_context", 0) or 2**31 - 1)

    @property
    def vocab_size(self) -> int:
        model: Any = self.model
        return int(model.config.vocab_size)

    @property
    def scored(self) -> str:
        return f"{self.name} (multihead's own model)"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        _, g = self.gate_shape()
        first = self._sites[0].module
        return len(self._sites), int(first.n_heads), g, int(first.head_dim)


class TransformersCache:
    """transformers' ``DynamicCache`` made without the model's config, so every layer (a sliding-window one too)
    keeps every key at its position, in the protocol :mod:`multihead.evals.answers` runs: transformers writes the
    keys during the forward, ``advance(n)`` checks that it holds what the caller counted. ``bytes``: its tensors'."""

    def __init__(self, batch: int, max_len: int) -> None:
        from transformers import DynamicCache

        self.inner = DynamicCache()
        self.batch, self.max_len, self.used = batch, max_len, 0

    def advance(self, n: int) -> None:
        self.used += n
        held = int(self.inner.get_seq_length())
        if held != self.used:
            raise MultiheadError(f"the transformers cache holds {held} tokens but {self.used} were fed through it")

    @property
    def bytes(self) -> int:
        total = 0
        for layer in getattr(self.inner, "layers", []):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, Tensor):
                    total += t.numel() * t.element_size()
        return total


class TransformersEngine(Engine):
    """A transformers causal language model with its attention on multihead (:func:`multihead.hf.enable`, applied
    in place when the model is not switched yet), as its :class:`~multihead.models.decoder.TransformersDecoder`
    (``decoder``) checks and runs it. Its shape is read from its config (:class:`multihead.hf.config.
    HFConfig`); each attention module's ``scaling`` and ``attn_logit_softcapping`` are what it hands the attention
    function; its layers' masks (sliding windows) are read from the module's ``attention_mask`` argument."""

    kind = "transformers"

    def __init__(self, model: nn.Module, name: str = "") -> None:
        from multihead import hf
        from multihead.hf.config import HFConfig
        from multihead.models.decoder import TransformersDecoder

        self.decoder = TransformersDecoder(model, name=name)  # checks it is a causal LM, switches it when it is not
        if not _all_hooked(model):
            hf.enable(model)  # switched by hand (set_attn_implementation): its hook points not attached yet
        config: Any = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.config = HFConfig(json.loads(text.to_json_string(use_diff=False)),
                               where=str(getattr(text, "_name_or_path", "") or type(model).__name__))
        self.model = model
        self.name = self.decoder.name
        modules: list[Any] = list(self.decoder.attention_layers())
        c = self.config
        if len(modules) != c.n_layers:
            raise MultiheadError(f"{type(model).__name__} has {len(modules)} modules that call the attention "
                                 f"interface but its config says {c.n_layers} layers: the scores take one attention "
                                 "module per decoder layer")
        sites = []
        for i, m in enumerate(modules):
            scale = getattr(m, "scaling", None)
            if isinstance(scale, bool) or not isinstance(scale, int | float):
                raise MultiheadError(f"{type(m).__name__} (layer {i}) has no scaling: the scores need the factor it "
                                     "hands the attention function")
            cap = getattr(m, "attn_logit_softcapping", None)
            sites.append(Site(m, i, float(scale), c.n_heads, c.n_kv_heads, None if cap is None else float(cap)))
        self._sites = sites
        self._mask_arg = {type(m): _argument_index(m, "attention_mask") for m in modules}
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def sites(self) -> list[Site]:
        return self._sites

    @contextmanager
    def reading(self) -> Iterator[None]:
        with ExitStack() as stack:
            for site in self._sites:
                handle = site.module.register_forward_pre_hook(self._reader(site), with_kwargs=True)
                stack.callback(handle.remove)
                stack.callback(setattr, site, "mask", None)
            yield

    def _reader(self, site: Site) -> Callable[..., None]:
        where = self._mask_arg[type(site.module)]

        def read(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if "attention_mask" in kwargs:
                mask = kwargs["attention_mask"]
            else:
                mask = args[where] if where is not None and where < len(args) else None
            if mask is not None and (not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.ndim != 4):
                raise MultiheadError(f"layer {site.index} got an attention_mask of {type(mask).__name__} "
                                     f"{getattr(mask, 'dtype', '')} {tuple(getattr(mask, 'shape', ()))}: the scores "
                                     "read multihead's boolean (b, 1 | h, s, t) mask (hf.enable registers it)")
            site.mask = mask
        return read

    def new_cache(self, batch: int, max_len: int) -> TransformersCache:
        if max_len > self.max_context:
            raise MultiheadError(f"max_len ({max_len}) exceeds the model's context ({self.max_context})")
        return TransformersCache(batch, max_len)

    def __call__(self, ids: Tensor, *, cache: Any = None, logits_to_keep: int = 0) -> Tensor:
        kwargs: dict[str, Any] = {"use_cache": cache is not None, "logits_to_keep": logits_to_keep}
        if cache is not None:
            if not isinstance(cache, TransformersCache):
                raise MultiheadError(f"a transformers model takes its TransformersCache (engine.new_cache), not a "
                                     f"{type(cache).__name__}")
            if cache.used + ids.shape[1] > cache.max_len:
                raise MultiheadError(f"{ids.shape[1]} more tokens do not fit the cache: it holds {cache.used} of "
                                     f"{cache.max_len}")
            kwargs[self._cache_arg] = cache.inner
        out: Tensor = self.model(input_ids=ids, **kwargs).logits
        return out

    def forward(self, ids: Tensor) -> Tensor:
        out: Tensor = self.model(input_ids=ids, use_cache=False).logits
        return out

    def final_hidden(self, ids: Tensor) -> Tensor:
        return self.decoder.final_hidden(ids)

    @property
    def max_context(self) -> int:
        return int(self.config.max_context or 2048)

    @property
    def vocab_size(self) -> int:
        if self.config.vocab_size is None:
            raise MultiheadError(f"{self.name}'s config has no vocab_size")
        return int(self.config.vocab_size)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        c = self.config
        return c.n_layers, c.n_heads, c.n_kv_heads, int(c.head_dim or c.d_model // c.n_heads)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(int(k.window) if k.kind == "sliding" and k.window else None for k in self.config.layer_kinds())

    @property
    def scored(self) -> str:
        kinds = self.config.layer_kinds()
        sliding = [i for i, k in enumerate(kinds) if k.kind == "sliding"]
        out = f"{self.name} ({type(self.model).__name__} in transformers, attention on multihead)"
        if sliding:
            windows = sorted({int(kinds[i].window or 0) for i in sliding})
            out += (f"; sliding-window layers {_ranges(sliding)} (window {', '.join(map(str, windows))}) scored "
                    "under their own mask")
        caps = sorted({s.softcap for s in self._sites if s.softcap is not None})
        if caps:
            out += f"; scores softcapped at {', '.join(f'{c:g}' for c in caps)}"
        return out


def _all_hooked(model: nn.Module) -> bool:
    from multihead import hf

    return all(isinstance(getattr(m, "hook_z", None), HookPoint) for m in hf.attention_modules(model).values())


def _argument_index(module: nn.Module, name: str) -> int | None:
    """The position of ``name`` among the module's forward arguments (after self), None when it has none."""
    try:
        names = [p.name for p in inspect.signature(module.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return None
    return names.index(name) if name in names else None


def _ranges(items: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out: list[str] = []
    for i in items:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def as_engine(model: Any, name: str = "") -> Engine:
    """The engine of ``model``: itself when it is one; the engine of a :class:`~multihead.models.decoder.Decoder`'s
    model; :class:`TransformersEngine` for a transformers model; :class:`MultiheadEngine` for one of ours."""
    from multihead.models.decoder import Decoder

    if isinstance(model, Engine):
        return model
    if isinstance(model, Decoder):
        model, name = model.model, name or model.name
    if hasattr(model, "set_attn_implementation") and hasattr(model, "config"):
        return TransformersEngine(model, name)
    if isinstance(model, nn.Module):
        return MultiheadEngine(model, name)
    raise MultiheadError(f"{type(model).__name__} is not a model: give multihead's own model or a transformers one")


__all__ = [
    "Engine",
    "MultiheadEngine",
    "Site",
    "TransformersCache",
    "TransformersEngine",
    "as_engine",
]
