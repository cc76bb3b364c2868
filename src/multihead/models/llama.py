"""A Llama-style decoder on MultiHeadAttention: RMSNorm, RoPE, SwiGLU, grouped-query attention, a KV cache.

::

    h = embed(tokens)
    for each layer:   h = h + attn(rms_norm(h), causal, rope, cache)      (n_heads query heads, n_kv_heads KV heads)
                      h = h + W_down(silu(W_gate rms_norm(h)) * W_up rms_norm(h))
    logits = lm_head(rms_norm(h))                                         (lm_head tied to embed, or its own)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.cache import (
    Cache,
    HeadPlan,
    HeadwiseCache,
    LayerCache,
)
from multihead.cache.spec import CacheShape, CacheSpec, spec_of
from multihead.config import AttentionConfig, RopeConfig
from multihead.errors import MultiheadError
from multihead.kernels import cpu
from multihead.layers.attention import MultiHeadAttention
from multihead.layers.hooks import HookPoint, add_resid_points, resid_block
from multihead.layers.linear import Linear, linear
from multihead.layers.norms import RMSNorm
from multihead.layers.step import Step


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int | None = None
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    max_context: int = 2048
    tie_embeddings: bool = True
    bos_id: int | None = None
    eos_id: int | None = None
    # (n_heads, n_kv_heads) of each layer when they differ (a pruned model); None: every layer has the above
    layer_heads: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.layer_heads is None:
            return
        heads = tuple(tuple(pair) for pair in self.layer_heads)
        object.__setattr__(self, "layer_heads", heads)
        if len(heads) != self.n_layers:
            raise MultiheadError(f"layer_heads has {len(heads)} entries but the model has {self.n_layers} layers")
        for i, pair in enumerate(heads):
            ok = len(pair) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair)
            if not ok or pair[0] % pair[1]:
                raise MultiheadError(f"layer {i}: (n_heads, n_kv_heads) = {pair} must be positive ints with "
                                     "n_kv_heads dividing n_heads")

    def heads(self, layer: int) -> tuple[int, int]:
        """(n_heads, n_kv_heads) of one layer."""
        if self.layer_heads is None:
            return self.n_heads, self.n_kv_heads
        return self.layer_heads[layer]

    def attention(self, layer: int = 0) -> AttentionConfig:
        """The attention config of one layer (all the same unless the model was pruned)."""
        n_heads, n_kv_heads = self.heads(layer)
        head_dim = self.head_dim if self.head_dim is not None else self.d_model // self.n_heads
        return AttentionConfig(d_model=self.d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                               bias=False, rope=RopeConfig(self.rope_base))


class LlamaBlock(nn.Module):
    _resid_points: tuple[HookPoint, ...]

    def __init__(self, config: LlamaConfig, layer: int = 0, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        f: dict[str, Any] = {"device": device, "dtype": dtype}
        self.attn_norm = RMSNorm(config.d_model, config.rms_eps, **f)
        self.attn = MultiHeadAttention(config.attention(layer), **f)
        self.ffn_norm = RMSNorm(config.d_model, config.rms_eps, **f)
        self.gate_proj = Linear(config.d_model, config.ffn_dim, bias=False, **f)
        self.up_proj = Linear(config.d_model, config.ffn_dim, bias=False, **f)
        self.down_proj = Linear(config.ffn_dim, config.d_model, bias=False, **f)

        add_resid_points(self)  # hook_resid_pre .. hook_resid_post (multihead.layers.hooks), no parameters

    def forward(self, h: Tensor, *, step: Step, cache: LayerCache | None = None) -> Tensor:
        return resid_block(self._resid_points, h, self.attn, self._mlp, attn_norm=self.attn_norm, step=step,
                           cache=cache)

    def _mlp(self, h: Tensor) -> Tensor:
        x = self.ffn_norm(h)
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class LlamaModel(nn.Module):
    """Tokens (b, s) -> logits (b, s, vocab)."""

    def __init__(self, config: LlamaConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        f: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed = nn.Embedding(config.vocab_size, config.d_model, **f)
        self.layers = nn.ModuleList(LlamaBlock(config, i, **f) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.rms_eps, **f)
        self.lm_head = None if config.tie_embeddings else Linear(config.d_model, config.vocab_size, bias=False, **f)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @overload
    def new_cache(self, batch: int, max_len: int | None = None, *, window: int | None = None, sink_tokens: int = 0,
                  bits: int | None = None, group: int = 32, residual: int = 128) -> Cache: ...

    @overload
    def new_cache(self, batch: int, max_len: int | None = None, *, plan: HeadPlan) -> HeadwiseCache: ...

    @overload
    def new_cache(self, batch: int, max_len: int | None = None, *, spec: CacheSpec) -> Cache: ...

    def new_cache(self, batch: int, max_len: int | None = None, *, window: int | None = None, sink_tokens: int = 0,
                  bits: int | None = None, group: int = 32, residual: int = 128, plan: HeadPlan | None = None,
                  spec: CacheSpec | None = None) -> Cache:
        """A cache for this model, n_layers layers of (batch, n_kv_heads, *, head_dim) in the model's dtype (this
        rank's KV heads only, when the model is split over processes):

        - ``new_cache(b, max_len)``: every token in full (:class:`KVCache`);
        - ``new_cache(b, window=w, sink_tokens=n)``: n attention sinks and a window of w (:class:`SinkCache`),
          constant memory for any length (``new_cache(b, max_len, window=w)``: for at most max_len tokens, no more
          slots than they fill);
        - ``new_cache(b, max_len, bits=4, group=32, residual=128)``: quantized keys and values
          (:class:`QuantizedKVCache`);
        - ``new_cache(b, max_len, plan=plan)``: each KV head in full or as the plan's sinks + window
          (:class:`HeadwiseCache`, :class:`HeadPlan`), the plan checked against this model's shape;
        - ``new_cache(b, spec=spec)``: the kind a :class:`~multihead.cache.CacheSpec` says (the options above are
          its fields).
        """
        chosen = spec_of(spec, max_len, {"window": window, "sink_tokens": sink_tokens, "bits": bits, "group": group,
                                         "residual": residual, "plan": plan})
        built = chosen.build(self.cache_shape(), batch=batch, dtype=self.dtype, device=self.device)
        assert isinstance(built, Cache)  # the port's shape has no latent widths: a key and value cache
        return built

    def cache_shape(self) -> CacheShape:
        """What a :class:`~multihead.cache.CacheSpec` builds for: each layer's KV heads in this process, every layer
        global, the model's context."""
        a = self.config.attention()
        assert a.head_dim is not None
        kv_heads = tuple(cast(LlamaBlock, block).attn.local_kv_heads for block in self.layers)
        split = any(local != self.config.attention(i).n_kv_heads for i, local in enumerate(kv_heads))
        return CacheShape(kv_heads=kv_heads, windows=(None,) * len(kv_heads), n_heads=a.n_heads,
                          head_dim=a.head_dim, context=self.config.max_context, split=split)

    def forward(self, tokens: Tensor, *, positions: Tensor | None = None, cache: Cache | None = None,
                key_padding_mask: Tensor | None = None, mask: Tensor | None = None,
                logits_to_keep: int = 0) -> Tensor:
        """Logits (b, s, vocab). With a cache, the tokens continue each cached sequence at ``positions``
        (default: the cache's next positions); the caller then calls ``cache.advance``. ``mask`` (bool (s, s) or
        broadcastable to (b, h, s, s), True = may attend) replaces the causal mask: e.g.
        :func:`multihead.cache.sink_keep`'s, the uncached equal of a :class:`SinkCache`. ``logits_to_keep`` n > 0
        (transformers' name) returns the last n positions' logits only, (b, n, vocab): a prefill that needs the next
        token skips the vocabulary product of every other position (about a fifth of SmolLM2's work a token)."""
        self._check_tokens(tokens)
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise MultiheadError(f"logits_to_keep must be an int >= 0 (0 = every position), not {logits_to_keep!r}")
        with cpu.step_threads():  # a loaded machine: as many intra-op threads as cores are free
            h = self.embed(tokens)  # (b, s, d_model)
            step = self.step(h, positions=positions, cache=cache, key_padding_mask=key_padding_mask, mask=mask)
            for i, layer in enumerate(self.layers):
                h = layer(h, step=step, cache=None if cache is None else cache.layer(i))
            if logits_to_keep:
                h = h[:, -logits_to_keep:]
            h = self.norm(h)
            weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
            return linear(h, weight)  # (b, s, vocab)

    def step(self, h: Tensor, *, positions: Tensor | None = None, cache: Cache | None = None,
             key_padding_mask: Tensor | None = None, mask: Tensor | None = None) -> Step:
        """The state all layers share in one step (causal mask, positions, RoPE tables, cache slot), made once;
        raises before any layer writes if the tokens would not fit the cache."""
        first = cast(LlamaBlock, self.layers[0]).attn
        if mask is not None and cache is not None:
            raise MultiheadError("mask replaces the causal mask of an uncached forward: a cache brings its own")
        return first.step(h, causal=mask is None, positions=positions, cache=cache,
                          key_padding_mask=key_padding_mask, mask=mask)

    def _check_tokens(self, tokens: Tensor) -> None:
        if not isinstance(tokens, Tensor) or tokens.ndim != 2 or tokens.dtype not in (torch.long, torch.int32):
            shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise MultiheadError(f"tokens must be an integer tensor (b, s), got {shape}")
        if tokens.shape[1] > self.config.max_context:
            raise MultiheadError(
                f"{tokens.shape[1]} tokens exceed the model's context of {self.config.max_context}"
            )
