"""MultiHeadAttention: one layer for MHA, GQA and MQA.

The forward reads as the formula: project, split into heads, (rotate), attend, merge, project back::

    q = x W_Q   -> (b, h, s, d)        k = c W_K, v = c W_V -> (b, g, t, d)      (c = x, or the context)
    o = attend(q, k, v)  -> (b, h, s, d)   # head i uses KV head i // (h / g)
    y = Concat(o_1 .. o_h) W_O  -> (b, s, d_model)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from multihead.cache import LayerCache
from multihead.config import AttentionConfig, RopeConfig
from multihead.errors import MultiheadError
from multihead.kernels import KernelChoice, attend, attention_weights, check_backend, explain
from multihead.linear import Linear
from multihead.masks import MaskSpec, build_mask
from multihead.rope import RotaryEmbedding

StepHook = Callable[[str, Tensor], None]


class MultiHeadAttention(nn.Module):
    """Multi-head attention with n_heads query heads sharing n_kv_heads key/value heads.

    ::

        MHA  n_kv_heads = n_heads      GQA  1 < n_kv_heads < n_heads      MQA  n_kv_heads = 1

    Call it as ``attn(x)`` (self-attention), ``attn(x, context)`` (cross-attention), with ``causal=True``,
    ``mask=keep`` (bool, True = may attend; or a float mask added to the scores), ``key_padding_mask=valid``
    ((b, t) bool, True = a real token) and ``return_weights=True`` for the per-head weights (b, n_heads, s, t).
    Keyword arguments of the constructor are those of :class:`AttentionConfig`, plus ``device`` and ``dtype``.
    """

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        kv_dim: int | None = None,
        value_dim: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        dropout: float = 0.0,
        scale: float | None = None,
        rope: RopeConfig | float | None = None,
        window: int | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        config = AttentionConfig(
            d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, kv_dim=kv_dim,
            value_dim=value_dim, bias=bias, out_bias=out_bias, dropout=dropout, scale=scale,
            rope=rope,  # type: ignore[arg-type]  # a float base is accepted and becomes a RopeConfig
            window=window,
        )
        self.config = config
        assert config.kv_dim is not None and config.value_dim is not None
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.q_proj = Linear(config.d_model, config.q_dim, bias=bias, **factory)
        self.k_proj = Linear(config.kv_dim, config.k_dim, bias=bias, **factory)
        self.v_proj = Linear(config.value_dim, config.k_dim, bias=bias, **factory)
        self.o_proj = Linear(config.q_dim, config.d_model, bias=bool(config.out_bias), **factory)
        self.rotary = (
            RotaryEmbedding(config.head_dim, config.rope.base)  # type: ignore[arg-type]
            if config.rope is not None
            else None
        )
        self.backend = check_backend(backend)
        self._step_hooks: list[StepHook] = []
        self._weight_observers = 0

    @classmethod
    def from_config(
        cls,
        config: AttentionConfig,
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> MultiHeadAttention:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return cls(**fields, backend=backend, device=device, dtype=dtype)

    # Shorthands for the config's numbers.
    @property
    def n_heads(self) -> int:
        return self.config.n_heads

    @property
    def n_kv_heads(self) -> int:
        assert self.config.n_kv_heads is not None
        return self.config.n_kv_heads

    @property
    def head_dim(self) -> int:
        assert self.config.head_dim is not None
        return self.config.head_dim

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        value: Tensor | None = None,
        mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        documents: Tensor | None = None,
        positions: Tensor | None = None,
        cache: LayerCache | None = None,
        return_weights: bool = False,
        backend: str | None = None,
    ) -> Any:
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
            cache: one layer of a :class:`~multihead.cache.KVCache` (``cache.layer(i)``): the new keys and values
                are written at ``positions`` and the queries attend to everything cached up to their own position
                (needs causal=True). The caller advances the cache after the step (``cache.advance(s)``).
            return_weights: also return the per-head attention weights (never averaged over heads).
            backend: "auto", "sdpa", "math" or "flex" for this call; default the layer's ``backend``.
        """
        q, k, v, spec = self._prepare(x, context, value, mask, key_padding_mask, causal, positions, cache,
                                          documents)
        dropout_p = self.config.dropout if self.training else 0.0
        out, weights = attend(
            q, k, v, spec, scale=self.config.softmax_scale, dropout_p=dropout_p,
            backend=self.backend if backend is None else backend, need_weights=return_weights,
        )  # (b, h, s, d)
        if weights is None and self._weight_observers:
            # observed on a fused path: the same weights, recomputed exactly from this call's q, k and mask
            weights = attention_weights(q, k, spec, scale=self.config.softmax_scale)
            self._emit("weights", weights)
            weights = None
        elif weights is not None:
            self._emit("weights", weights)
        del q, k, v  # free the projections before merging: a long sequence's peak is q, k, v and the output
        self._emit("attention", out)
        b, s = x.shape[0], x.shape[1]
        merged = out.transpose(1, 2).reshape(b, s, out.shape[1] * out.shape[3])  # (b, s, h*d)
        self._emit("merged", merged)
        y = self.o_proj(merged)  # (b, s, d_model)
        self._emit("output", y)
        return (y, weights) if return_weights else y

    def explain(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        value: Tensor | None = None,
        mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        documents: Tensor | None = None,
        positions: Tensor | None = None,
        cache: LayerCache | None = None,
        return_weights: bool = False,
        backend: str | None = None,
    ) -> KernelChoice:
        """Which kernel a call with these arguments runs, and why (the projections run, attention does not).

        With a cache this writes the new keys and values into it, as the call would.
        """
        with torch.no_grad():
            q, k, v, spec = self._prepare(x, context, value, mask, key_padding_mask, causal, positions, cache,
                                          documents)
        dropout_p = self.config.dropout if self.training else 0.0
        return explain(
            q, k, v, spec, scale=self.config.softmax_scale, dropout_p=dropout_p,
            backend=self.backend if backend is None else backend, need_weights=return_weights,
        )

    def _prepare(
        self,
        x: Tensor,
        context: Tensor | None,
        value: Tensor | None,
        mask: Tensor | None,
        key_padding_mask: Tensor | None,
        causal: bool,
        positions: Tensor | None,
        cache: LayerCache | None,
        documents: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, MaskSpec]:
        """Validate the inputs, project and split into heads: q (b, h, s, d), k and v (b, g, t, d), the mask."""
        cfg = self.config
        b, s = self._check_input("x", x, cfg.d_model, "d_model")
        self._check_matches_weights("x", x)
        kv_in = x
        if context is not None:
            bc, t = self._check_input("context", context, cfg.kv_dim, "kv_dim")  # type: ignore[arg-type]
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
            bv, tv = self._check_input("value", value, cfg.value_dim, "value_dim")  # type: ignore[arg-type]
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
            self._check_cache_call(cache, context, mask, key_padding_mask, causal)
            at_cache_end = positions is None  # the new tokens continue each sequence at its cached length
            positions = cache.cache.next_positions(s) if positions is None else positions
        spec = build_mask(
            batch=b, n_heads=cfg.n_heads, s=s, t=t, mask=mask, key_padding_mask=key_padding_mask,
            causal=causal, window=cfg.window, documents=documents,
        )
        self._emit("input", x)
        q = self.q_proj(x)  # (b, s, h*d)
        k = self.k_proj(kv_in)  # (b, t, g*d)
        v = self.v_proj(v_in)  # (b, t, g*d)
        self._emit("q_proj", q)
        self._emit("k_proj", k)
        self._emit("v_proj", v)
        # Head counts come from the projections' widths: all heads here, or this rank's share when the projections
        # are sharded by heads across processes (multihead.parallel).
        d = self.head_dim
        h, g = q.shape[-1] // d, k.shape[-1] // d
        if h != cfg.n_heads and any(m is not None and m.ndim == 4 and m.shape[1] > 1 for m in (spec.keep, spec.bias)):
            raise MultiheadError(f"this layer holds {h} of {cfg.n_heads} heads (sharded): give masks without a "
                                 "per-head dimension (size 1 there)")
        if cache is not None and (cache.cache.n_kv_heads, cache.cache.head_dim) != (g, d):
            raise MultiheadError(
                f"the cache holds n_kv_heads {cache.cache.n_kv_heads} of head_dim {cache.cache.head_dim} but this "
                f"layer has n_kv_heads {g} of head_dim {d}"
            )
        q = q.view(b, s, h, d).transpose(1, 2)  # (b, h, s, d)
        k = k.view(b, t, g, d).transpose(1, 2)  # (b, g, t, d)
        v = v.view(b, t, g, d).transpose(1, 2)  # (b, g, t, d)
        if self.rotary is not None or cache is not None:
            pos = self._positions(positions, b, s, x.device)  # (b|1, s)
            if self.rotary is not None:
                q, k = self.rotary(q, k, pos)
            if cache is not None:
                pos = pos if pos.shape[0] == b else pos.expand(b, s)  # the same tensor: the cache knows it
                k, v = cache.write(k, v, pos)  # (b, g, t, d): everything cached, the new tokens included
                if b == 1 and at_cache_end and not torch.compiler.is_compiling():
                    # one sequence at its cached length: its queries are the last s of t, plain bottom-right causal
                    spec = replace(spec, t=k.shape[2])
                else:
                    spec = replace(spec, t=k.shape[2], q_positions=pos)
        elif positions is not None:
            raise MultiheadError("positions were given but this layer has no rope or cache: they would be ignored")
        self._emit("q_heads", q)
        self._emit("k_heads", k)
        self._emit("v_heads", v)
        return q, k, v, spec

    def _check_cache_call(self, cache: LayerCache, context: Tensor | None, mask: Tensor | None,
                          key_padding_mask: Tensor | None, causal: bool) -> None:
        if not isinstance(cache, LayerCache):
            raise MultiheadError(f"cache must be one layer of a KVCache (cache.layer(i)), got {type(cache).__name__}")
        if context is not None:
            raise MultiheadError("a KV cache holds this layer's own past keys: it cannot be used with a context")
        if not causal:
            raise MultiheadError("a KV cache is for causal decoding: call with causal=True")
        if mask is not None or key_padding_mask is not None:
            raise MultiheadError(
                "mask and key_padding_mask cannot be combined with a KV cache: the cache's per-sequence lengths "
                "already keep padding out (write a padded prompt, then cache.advance(s, lengths=real_lengths))"
            )

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
        return x.shape[0], x.shape[1]

    def _check_matches_weights(self, name: str, x: Tensor) -> None:
        w = self.q_proj.weight
        if x.device != w.device:
            raise MultiheadError(f"{name} is on {x.device} but the layer's weights are on {w.device}: move one, e.g. "
                                 f"layer.to({str(x.device)!r})")
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            raise MultiheadError(f"{name} has dtype {x.dtype} but the layer's weights are {w.dtype}: convert one "
                                 f"(layer.to({x.dtype}) or {name}.to({w.dtype})), or run under torch.autocast")

    @staticmethod
    def _positions(positions: Tensor | None, b: int, s: int, device: torch.device) -> Tensor:
        if positions is None:
            return torch.arange(s, device=device)[None]  # (1, s)
        if not isinstance(positions, Tensor):
            raise MultiheadError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
        batched = positions if positions.ndim != 1 else positions[None]  # (b|1, s)
        if batched.ndim != 2 or batched.shape[-1] != s or batched.shape[0] not in (1, b):
            raise MultiheadError(f"positions of shape {tuple(positions.shape)} must be (s,) or (b, s) = {(b, s)}")
        return batched

    # ------------------------------------------------------------------ observing the steps
    def _emit(self, step: str, tensor: Tensor) -> None:
        for hook in self._step_hooks:
            hook(step, tensor)

    @contextmanager
    def observe(self, hook: StepHook, *, weights: bool = False) -> Iterator[None]:
        """Call ``hook(step, tensor)`` at each step of forward while the block runs.

        Steps, in order: input, q_proj, k_proj, v_proj, q_heads, k_heads, v_heads (after RoPE), weights (with
        return_weights, or always with ``weights=True``), attention, merged, output. With ``weights=True`` the
        per-head weights (b, n_heads, s, t) are recomputed exactly from the call's q, k and mask even when the fused
        kernel computes the output, so observing a model does not change which kernel it runs.
        """
        self._step_hooks.append(hook)
        self._weight_observers += int(weights)
        try:
            yield
        finally:
            self._step_hooks.remove(hook)
            self._weight_observers -= int(weights)

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
        layer = cls(
            d_model=e, n_heads=m.num_heads, kv_dim=m.kdim, value_dim=m.vdim, bias=has_bias, dropout=m.dropout,
            device=ref.device, dtype=ref.dtype,
        )
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
