"""MultiHeadAttention: one layer for MHA, GQA and MQA.

The forward reads as the formula: project, split into heads, rotate, cache, attend, merge, project back::

    q = x W_Q   -> (b, h, s, d)        k = c W_K, v = c W_V -> (b, g, t, d)      (c = x, or the context)
    z = attend(q, k, v)  -> (b, h, s, d)   # head i uses KV head i // (h / g)
    y = Concat(z_1 .. z_h) W_O  -> (b, s, d_model)

The forward visits each room once, in this order: the checks, the step (:mod:`multihead.layers.step`, made once by
a model and passed down), the projections (:mod:`multihead.layers.linear`), RoPE (:mod:`multihead.layers.rope`), the
cache's one verb (``view = cache.update(k, v, slots)``: the cache stores and returns a view,
:mod:`multihead.cache.view`), the dispatcher (:func:`multihead.kernels.attend`: it alone decides which kernel reads
the view) and W_O. The layer never asks which kind of cache it holds.

What every layer of a model shares in one step (positions, RoPE tables, the mask, the cache's slots) is a
:class:`multihead.layers.step.Step`, made once by the model (``layer.step(...)``) and passed to each layer; a layer
called alone makes its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch import Tensor, nn

from multihead.cache import Cache, DenseKV, KVView, LatentLayer, LayerCache
from multihead.config import AttentionConfig, config_or_keywords, register_layer
from multihead.errors import MultiheadError
from multihead.kernels import AttentionCall, KernelChoice, attend, check_backend
from multihead.kernels import explain as explain_call
from multihead.layers.hooks import HookPoint, add_hook_points, call_hooks
from multihead.layers.linear import Linear
from multihead.layers.rope import RotaryEmbedding
from multihead.layers.step import Step, build_step, check_cache_call


def _zero_padding(k: Tensor, v: Tensor, padding: Tensor | None) -> tuple[Tensor, Tensor]:
    """K and V (b, g, t, d) with the padded keys' rows zeroed (padding: (b, t), True = real): masked scores are -inf
    and their weights 0, but 0 * NaN is NaN, so a NaN in a padded position would otherwise reach every real row."""
    if padding is None:
        return k, v
    dead = ~padding[:, None, :, None]  # (b, 1, t, 1)
    return k.masked_fill(dead, 0.0), v.masked_fill(dead, 0.0)


def _update(cache: LayerCache | None, k: Tensor, v: Tensor, step: Step, *, read_only: bool = False) -> KVView:
    """The keys and values a call attends to: the cache layer's view after placing k and v (b, g, s, d) in the
    step's slots (``read_only``: from a copy), or k and v themselves without a cache."""
    if cache is None:
        return DenseKV(k, v)
    assert step.slots is not None  # checked: a cache call's step carries the cache's slots
    return cache.update(k, v, step.slots, read_only=read_only)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with n_heads query heads sharing n_kv_heads key/value heads.

    ::

        MHA  n_kv_heads = n_heads      GQA  1 < n_kv_heads < n_heads      MQA  n_kv_heads = 1

    Make it from a config, ``MultiHeadAttention(config)``, or from the config's fields as keywords,
    ``MultiHeadAttention(d_model=4096, n_heads=32, n_kv_heads=8)``; ``backend``, ``device`` and ``dtype`` are the
    layer's own; ``validate=False`` skips the check of a float mask's values (NaN, +inf), which costs a pass over the
    mask (it is skipped under torch.compile anyway). Call it as ``attn(x)`` (self-attention), ``attn(x, context)``
    (cross-attention), with ``causal=True``, ``mask=keep`` (bool, True = may attend; or a float mask added to the
    scores), ``key_padding_mask=valid`` ((b, t) bool, True = a real token) and ``return_weights=True`` for the
    per-head weights (b, n_heads, s, t). Its hook points (``hook_q`` .. ``hook_out``, :mod:`multihead.layers.hooks`)
    read or replace what passes through the attention core.
    """

    hook_q: HookPoint
    hook_k: HookPoint
    hook_v: HookPoint
    hook_pattern: HookPoint
    hook_z: HookPoint
    hook_out: HookPoint

    def __init__(
        self,
        config: AttentionConfig | None = None,
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        validate: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        if not isinstance(validate, bool):
            raise MultiheadError(f"validate ({validate!r}) must be True or False")
        self.config = config = config_or_keywords(AttentionConfig, config, options)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.q_proj = Linear(config.d_model, config.q_dim, bias=config.bias, **factory)
        self.k_proj = Linear(config.kv_dim, config.k_dim, bias=config.bias, **factory)
        self.v_proj = Linear(config.value_dim, config.k_dim, bias=config.bias, **factory)
        self.o_proj = Linear(config.q_dim, config.d_model, bias=config.out_bias, **factory)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope.base) if config.rope is not None else None
        self.backend = check_backend(backend)
        self.validate = validate
        add_hook_points(self)

    # Shorthands for the config's numbers.
    @property
    def n_heads(self) -> int:
        return self.config.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.config.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    # ------------------------------------------------------------------ forward
    @overload
    def forward(self, x: Tensor, context: Tensor | None = None, *, value: Tensor | None = None,
                mask: Tensor | None = None, key_padding_mask: Tensor | None = None, causal: bool = False,
                documents: Tensor | None = None, positions: Tensor | None = None, cache: LayerCache | None = None,
                step: Step | None = None, return_weights: Literal[False] = False, backend: str | None = None
                ) -> Tensor: ...

    @overload
    def forward(self, x: Tensor, context: Tensor | None = None, *, value: Tensor | None = None,
                mask: Tensor | None = None, key_padding_mask: Tensor | None = None, causal: bool = False,
                documents: Tensor | None = None, positions: Tensor | None = None, cache: LayerCache | None = None,
                step: Step | None = None, return_weights: Literal[True], backend: str | None = None
                ) -> tuple[Tensor, Tensor]: ...

    def forward(self, x: Tensor, context: Tensor | None = None, *, value: Tensor | None = None,
                mask: Tensor | None = None, key_padding_mask: Tensor | None = None, causal: bool = False,
                documents: Tensor | None = None, positions: Tensor | None = None, cache: LayerCache | None = None,
                step: Step | None = None, return_weights: bool = False, backend: str | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        """x (b, s, d_model) -> (b, s, d_model), or (output, weights (b, n_heads, s, t)) with return_weights.

        Args:
            x: queries' input (b, s, d_model).
            context: keys' and values' input (b, t, kv_dim) for cross-attention; None for self-attention.
            value: a separate input for the values (b, t, value_dim), as torch.nn.MultiheadAttention allows.
            mask: bool (True = may attend) or float (added to the scores), broadcastable to (b, n_heads, s, t).
            key_padding_mask: (b, t) bool, True = a real token.
            causal: query i sees keys up to t - s + i (bottom-right aligned).
            documents: (b, s) integer document ids of sequences packed together (self-attention): a token sees
                only its own document's tokens.
            positions: positions of the tokens, (s,) or (b, s), for RoPE and the cache; default 0 .. s - 1, or the
                next positions of each sequence in the cache.
            cache: one layer of a cache of keys and values (``cache.layer(i)``, any kind of
                :mod:`multihead.cache`): the new keys and values are placed in the step's slots and the queries
                attend to what the cache holds up to their own position (needs causal=True). The caller commits
                them after the step (``cache.advance(s)``).
            step: the model's per-step state from :meth:`step` (instead of mask, key_padding_mask, causal,
                documents and positions).
            return_weights: also return the per-head attention weights (never averaged over heads).
            backend: "auto", "sdpa", "math" or "flex" for this call; default the layer's ``backend``.
        """
        kv_in, v_in = self._check(x, context, value, cache, step, mask, key_padding_mask, causal, documents,
                                  positions)
        if step is None:
            step = self._step(x, context, mask=mask, key_padding_mask=key_padding_mask, causal=causal,
                              documents=documents, positions=positions, cache=cache)
        b, s = x.shape[0], x.shape[1]
        q, k, v = self._project(x, kv_in, v_in)  # (b, h, s, d), (b, g, t, d), (b, g, t, dv)
        q, k = self._rotate(q, k, step)  # RoPE at the step's positions (unchanged without rope)
        k, v = _zero_padding(k, v, step.mask.padding)  # a padded key has no influence, even if it holds NaN
        kv = _update(cache, k, v, step)  # the cache stores k, v and returns its view of every key the call sees
        z, weights = attend(self._call(q, kv, step, return_weights, backend))  # (b, h, s, dv), hooked
        del q, k, v, kv  # free the projections before merging: a long sequence's peak is q, k, v and the output
        y = self.o_proj(z.transpose(1, 2).reshape(b, s, -1))  # (b, s, d_model): Concat(z_1 .. z_h) W_O
        y = self.hook_out(y) if self.hook_out.active else y
        return (y, weights) if return_weights else y  # type: ignore[return-value]

    if TYPE_CHECKING:  # calling the module is calling forward, with its precise return types
        __call__ = forward

    def explain(self, x: Tensor, context: Tensor | None = None, *, value: Tensor | None = None,
                mask: Tensor | None = None, key_padding_mask: Tensor | None = None, causal: bool = False,
                documents: Tensor | None = None, positions: Tensor | None = None, cache: LayerCache | None = None,
                step: Step | None = None, return_weights: bool = False, backend: str | None = None) -> KernelChoice:
        """Which kernel a call with these arguments runs, and why (the projections run, attention does not): the
        dispatcher's own decision (:func:`multihead.kernels.explain`) on the same view of the keys.

        With a cache, the keys the call would attend to are read from a copy: the cache is left unchanged.
        """
        kv_in, v_in = self._check(x, context, value, cache, step, mask, key_padding_mask, causal, documents,
                                  positions)
        with torch.no_grad():
            if step is None:
                step = self._step(x, context, mask=mask, key_padding_mask=key_padding_mask, causal=causal,
                                  documents=documents, positions=positions, cache=cache)
            q, k, v = self._project(x, kv_in, v_in)
            q, k = self._rotate(q, k, step)
            k, v = _zero_padding(k, v, step.mask.padding)
            kv = _update(cache, k, v, step, read_only=True)
        return explain_call(self._call(q, kv, step, return_weights, backend))

    def _project(self, x: Tensor, kv_in: Tensor, v_in: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q = x W_Q split into heads (b, h, s, d); k = c W_K and v = c W_V, (b, g, t, d) and (b, g, t, dv)."""
        b, s, t, d = x.shape[0], x.shape[1], kv_in.shape[1], self.head_dim
        q = self.q_proj(x).view(b, s, -1, d).transpose(1, 2)  # (b, h, s, d)
        k = self.k_proj(kv_in).view(b, t, -1, d).transpose(1, 2)  # (b, g, t, d)
        v = self.v_proj(v_in).view(b, t, -1, d).transpose(1, 2)  # (b, g, t, d)
        return q, k, v

    # ------------------------------------------------------------------ the per-step state
    def step(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
             key_padding_mask: Tensor | None = None, causal: bool = False, documents: Tensor | None = None,
             positions: Tensor | None = None, cache: Cache | LayerCache | None = None,
             dtype: torch.dtype | None = None) -> Step:
        """The state every layer of a model shares for one call on x (b, s, .): the mask, the positions, the RoPE
        tables (in ``dtype``, default x's), the cache's slots for the step (``cache.reserve``). Made once per model step
        and passed as ``step=``."""
        self._check_input("x", x, self.config.d_model, "d_model")
        if context is not None:
            self._check_input("context", context, self.config.kv_dim, "kv_dim")
        return self._step(x, context, mask=mask, key_padding_mask=key_padding_mask, causal=causal,
                          documents=documents, positions=positions, cache=cache, dtype=dtype)

    def _step(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
              key_padding_mask: Tensor | None = None, causal: bool = False, documents: Tensor | None = None,
              positions: Tensor | None = None, cache: Cache | LayerCache | None = None,
              dtype: torch.dtype | None = None) -> Step:
        """:meth:`step` for inputs already checked (forward and explain check them first)."""
        return build_step(x, context, n_heads=self.n_heads, window=self.config.window, rotary=self.rotary, mask=mask,
                          key_padding_mask=key_padding_mask, causal=causal, documents=documents,
                          positions=positions, cache=cache, dtype=dtype, validate=self.validate)

    def _rotate(self, q: Tensor, k: Tensor, step: Step) -> tuple[Tensor, Tensor]:
        if self.rotary is None:
            return q, k
        if step.rope is None:
            raise MultiheadError("this layer has rope but the step carries no RoPE tables: make the step with a "
                                 "layer that has rope (layer.step(...))")
        cos, sin = (table.to(q.dtype) for table in step.rope)
        return RotaryEmbedding.rotate(q, cos, sin), RotaryEmbedding.rotate(k, cos, sin)

    def _call(self, q: Tensor, kv: KVView, step: Step, return_weights: bool, backend: str | None) -> AttentionCall:
        spec = step.mask
        if q.shape[1] != spec.n_heads and any(m is not None and m.ndim == 4 and m.shape[1] > 1
                                              for m in (spec.keep, spec.bias)):
            raise MultiheadError(f"this layer holds {q.shape[1]} of {spec.n_heads} heads (sharded): give masks "
                                 "without a per-head dimension (size 1 there)")
        return AttentionCall(q, kv, spec, scale=self.config.softmax_scale,
                             dropout_p=self.config.dropout if self.training else 0.0,
                             backend=self.backend if backend is None else check_backend(backend),
                             need_weights=return_weights, hooks=call_hooks(self))

    # ------------------------------------------------------------------ input checks
    def _check(self, x: Tensor, context: Tensor | None, value: Tensor | None, cache: LayerCache | None,
               step: Step | None, mask: Tensor | None, key_padding_mask: Tensor | None, causal: bool,
               documents: Tensor | None, positions: Tensor | None) -> tuple[Tensor, Tensor]:
        """Every check of one call's inputs; returns the inputs of the keys and of the values."""
        cfg = self.config
        b, s = self._check_input("x", x, cfg.d_model, "d_model")
        self._check_matches_weights("x", x)
        kv_in = x
        if context is not None:
            bc, t = self._check_input("context", context, cfg.kv_dim, "kv_dim")
            self._check_matches_weights("context", context)
            if bc != b:
                raise MultiheadError(f"context has batch {bc} but x has batch {b}")
            kv_in = context
        else:
            t = s
        v_in = kv_in
        if value is not None:
            if context is None:
                raise MultiheadError("value was given without context: pass context (keys' input) with it")
            bv, tv = self._check_input("value", value, cfg.value_dim, "value_dim")
            self._check_matches_weights("value", value)
            if (bv, tv) != (b, t):
                raise MultiheadError(f"value has (batch, length) {(bv, tv)} but context has {(b, t)}")
            v_in = value
        elif cfg.value_dim != cfg.kv_dim:
            raise MultiheadError(
                f"this layer projects values from a separate input of width value_dim ({cfg.value_dim}) != "
                f"kv_dim ({cfg.kv_dim}): pass value=..."
            )
        if documents is not None and context is not None:
            raise MultiheadError("documents are for self-attention over packed sequences: they cannot take a context")
        if documents is not None and cache is not None:
            raise MultiheadError("documents cannot be combined with a KV cache (decode one document per sequence)")
        if self.rotary is not None and context is not None:
            raise MultiheadError("rope is for self-attention: a layer with rope cannot take a context")
        if cache is not None:
            if isinstance(cache, LatentLayer):
                raise MultiheadError("a LatentCache holds the latents of multi-head latent attention: use it with "
                                     "MultiHeadLatentAttention, and a KVCache (model.new_cache) with "
                                     "MultiHeadAttention")
            causal_step = step is not None and (step.mask.causal or not cache.cache.positional)  # evicting: by keep
            check_cache_call(cache, context, mask, key_padding_mask, causal if step is None else causal_step,
                             layer=True)
            if (cache.n_kv_heads, cache.head_dim) != (self.local_kv_heads, cfg.head_dim):
                raise MultiheadError(
                    f"the cache holds n_kv_heads {cache.n_kv_heads} of head_dim {cache.head_dim} but "
                    f"this layer has n_kv_heads {self.local_kv_heads} of head_dim {cfg.head_dim}"
                )
        if step is not None:
            if not isinstance(step, Step):
                raise MultiheadError(f"step must be a Step (from layer.step(...)), got {type(step).__name__}")
            given = [name for name, v in (("mask", mask), ("key_padding_mask", key_padding_mask),
                                          ("documents", documents), ("positions", positions)) if v is not None]
            if given or causal:
                raise MultiheadError(f"{', '.join(given + (['causal'] if causal else []))} go to layer.step(...) "
                                     "when a step is passed: the step already holds the mask and positions")
            if (step.mask.batch, step.mask.s) != (b, s):
                raise MultiheadError(f"the step was made for (b, s) = {(step.mask.batch, step.mask.s)} but x has "
                                     f"{(b, s)}")
            if cache is not None and step.slots is None:
                raise MultiheadError("a cache was passed but the step was made without one: make it with "
                                     "layer.step(x, causal=True, cache=cache)")
        return kv_in, v_in

    @property
    def local_kv_heads(self) -> int:
        """KV heads held here: all of them, or this rank's share when the projections are sharded by heads."""
        w: Any = self.k_proj.weight
        rows = w.shape[0] if type(w) in (Tensor, nn.Parameter) else w.to_local().shape[0]  # a DTensor shard: local
        return int(rows) // self.config.head_dim

    @staticmethod
    def _check_input(name: str, x: Tensor, width: int, width_name: str) -> tuple[int, int]:
        if not isinstance(x, Tensor):
            raise MultiheadError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 3:
            raise MultiheadError(
                f"{name} must have 3 dimensions (b, length, {width_name}), got shape {tuple(x.shape)}"
            )
        if x.shape[-1] != width:
            raise MultiheadError(
                f"{name} has width {x.shape[-1]} (shape {tuple(x.shape)}) but the layer's {width_name} is {width}"
            )
        if not x.is_floating_point():
            raise MultiheadError(f"{name} has dtype {x.dtype}: it must be a floating-point tensor")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise MultiheadError(f"{name} of shape {tuple(x.shape)} is empty: attention needs at least one sequence "
                                 "of at least one token")
        return x.shape[0], x.shape[1]

    def _check_matches_weights(self, name: str, x: Tensor) -> None:
        w = self.q_proj.weight
        if x.device != w.device:
            raise MultiheadError(f"{name} is on {x.device} but the layer's weights are on {w.device}: move one, e.g. "
                                 f"layer.to({str(x.device)!r})")
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            raise MultiheadError(f"{name} has dtype {x.dtype} but the layer's weights are {w.dtype}: convert one "
                                 f"(layer.to({x.dtype}) or {name}.to({w.dtype})), or run under torch.autocast")

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """A layer computing exactly the function of a ``torch.nn.MultiheadAttention``.

        The result is always batch-first: for a module with ``batch_first=False`` transpose inputs (s, b, e) to
        (b, s, e). Masks map as ``mask = ~attn_mask`` for torch's bool masks (True = masked there, True = may attend
        here), float masks are the same, and ``key_padding_mask = ~torch_key_padding_mask``. Keys and values of
        torch's ``forward(query, key, value)`` are ``attn(query, key, value=value)`` here (or ``attn(query, key)``
        when key is value). ``add_bias_kv`` and ``add_zero_attn`` have no equivalent and raise.
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise MultiheadError(f"from_torch takes a torch.nn.MultiheadAttention, got {type(m).__name__}")
        if m.bias_k is not None or m.bias_v is not None:
            raise MultiheadError("nn.MultiheadAttention with add_bias_kv=True has no equivalent here "
                                 "(it appends a learned key and value to every sequence)")
        if m.add_zero_attn:
            raise MultiheadError("nn.MultiheadAttention with add_zero_attn=True has no equivalent here "
                                 "(it appends a zero key and value to every sequence)")
        e = m.embed_dim
        has_bias = m.in_proj_bias is not None
        ref = m.out_proj.weight
        config = AttentionConfig(d_model=e, n_heads=m.num_heads, kv_dim=m.kdim, value_dim=m.vdim, bias=has_bias,
                                 dropout=m.dropout)
        layer = cls(config, device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            if m._qkv_same_embed_dim:
                assert m.in_proj_weight is not None
                wq, wk, wv = m.in_proj_weight.chunk(3)
            else:
                wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
            layer.q_proj.weight.copy_(wq)
            layer.k_proj.weight.copy_(wk)
            layer.v_proj.weight.copy_(wv)
            layer.o_proj.weight.copy_(m.out_proj.weight)
            if has_bias:
                assert m.in_proj_bias is not None
                bq, bk, bv = m.in_proj_bias.chunk(3)
                layer.q_proj.bias.copy_(bq)
                layer.k_proj.bias.copy_(bk)
                layer.v_proj.bias.copy_(bv)
                layer.o_proj.bias.copy_(m.out_proj.bias)
        layer.train(m.training)
        return layer

    def extra_repr(self) -> str:
        c = self.config
        parts = [f"d_model={c.d_model}", f"n_heads={c.n_heads}", f"n_kv_heads={c.n_kv_heads}",
                 f"head_dim={c.head_dim}", c.variant]
        if c.window is not None:
            parts.append(f"window={c.window}")
        return ", ".join(parts)


register_layer(AttentionConfig, MultiHeadAttention)  # AttentionConfig.build makes this layer
