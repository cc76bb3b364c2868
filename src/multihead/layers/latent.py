"""Multi-head latent attention (MLA, DeepSeek-V2): a cache of one compressed latent per token, two equal paths.

::

    expanded (prefill, training):  k_i = [c W_UK^i, k_pe], v_i = c W_UV^i  ->  attention over n_heads KV heads
    absorbed (decode):             q'_i = [q_nope_i W_UK^i^T, q_pe_i]      (b, h, s, kv_lora_rank + rope)
                                   z'_i = softmax(q'_i [c, k_pe]^T * scale) c  over ONE latent KV head (MQA)
                                   z_i  = z'_i W_UV^i^T

q_nope_i . (c W_UK^i) = (q_nope_i W_UK^i^T) . c, so the absorbed path is exactly the expanded one computed in the
latent space: an MQA whose single KV head is the cached latent, run by the same kernels as every other layer. It
reads kv_lora_rank + rope values per cached token instead of up-projecting every cached token for every head; the
expanded path is cheaper when the queries are many (a prefill). The layer projects and rotates, and hands the kernels
one call over a :class:`~multihead.cache.LatentKV` (the latents and its up-projection); the kernels take the path
(:func:`multihead.kernels.latent_call`; ``path="auto"``: the one with fewer FLOPs, :func:`multihead.kernels.mla_path`)
and ``explain`` says which ran.

Hook points as on every layer, named for what enters the kernel: expanded ``hook_q`` (b, h, s, qk), ``hook_k``
(b, h, t, qk), ``hook_v`` (b, h, t, v); absorbed ``hook_q`` (b, h, s, rank + rope), ``hook_k`` (b, 1, t, rank + rope),
``hook_v`` (b, 1, t, rank). ``hook_pattern`` (b, h, s, t), ``hook_z`` (b, h, s, v_head_dim, each head's output
before W_O) and ``hook_out`` are the same on both paths.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from multihead import kernels
from multihead.cache import BaseLayerCache, LatentCache, LatentKV, LatentLayer
from multihead.config import MLAConfig, config_or_keywords
from multihead.errors import MultiheadError
from multihead.kernels import LATENT_PATHS, AttentionCall, KernelChoice, check_backend
from multihead.layers.hooks import HookPoint, add_hook_points, call_hooks
from multihead.layers.linear import Linear
from multihead.layers.norms import RMSNorm
from multihead.layers.rope import RotaryEmbedding
from multihead.layers.step import Step, build_step


class MultiHeadLatentAttention(nn.Module):
    """MLA with ``n_heads`` heads over a ``kv_lora_rank`` latent: ``MultiHeadLatentAttention(MLAConfig(...))`` or
    its fields as keywords. Call it as ``attn(x, causal=True)``, with ``cache=latent_cache.layer(i)`` to decode,
    and ``path=`` "auto" (default), "expanded" or "absorbed"."""

    hook_q: HookPoint
    hook_k: HookPoint
    hook_v: HookPoint
    hook_pattern: HookPoint
    hook_z: HookPoint
    hook_out: HookPoint

    def __init__(self, config: MLAConfig | None = None, *, backend: str = "auto",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 **options: Any) -> None:
        super().__init__()
        self.config = c = config_or_keywords(MLAConfig, config, options)
        f: dict[str, Any] = {"device": device, "dtype": dtype}
        h, qk = c.n_heads, c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj: Linear | None = Linear(c.d_model, h * qk, bias=False, **f)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(c.d_model, c.q_lora_rank, bias=c.bias, **f)
            self.q_a_norm = RMSNorm(c.q_lora_rank, c.norm_eps, **f)
            self.q_b_proj = Linear(c.q_lora_rank, h * qk, bias=False, **f)
        self.kv_a_proj = Linear(c.d_model, c.latent_dim, bias=c.bias, **f)  # [W_DKV; W_KR]
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, c.norm_eps, **f)
        self.kv_b_proj = Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), bias=False, **f)  # W_UK, W_UV
        self.o_proj = Linear(h * c.v_head_dim, c.d_model, bias=c.bias, **f)
        self.rotary = RotaryEmbedding(c.qk_rope_head_dim, c.rope.base)
        self.backend = check_backend(backend)
        add_hook_points(self)

    @property
    def n_heads(self) -> int:
        return self.config.n_heads

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor, *, mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
                causal: bool = False, positions: Tensor | None = None, cache: LatentLayer | None = None,
                step: Step | None = None, return_weights: bool = False, backend: str | None = None,
                path: str = "auto") -> Any:
        """x (b, s, d_model) -> (b, s, d_model), or (output, weights (b, n_heads, s, t)) with return_weights."""
        call = self._call(x, mask, key_padding_mask, causal, positions, cache, step, return_weights, backend, path)
        z, weights = kernels.attend(call)  # (b, h, s, dv), hook_z applied
        b, s = x.shape[:2]
        y = self.o_proj(z.transpose(1, 2).reshape(b, s, -1))  # (b, s, d_model): Concat(z_1 .. z_h) W_O
        y = self.hook_out(y) if self.hook_out.active else y
        return (y, weights) if return_weights else y

    def explain(self, x: Tensor, *, mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
                causal: bool = False, positions: Tensor | None = None, cache: LatentLayer | None = None,
                step: Step | None = None, return_weights: bool = False, backend: str | None = None,
                path: str = "auto") -> KernelChoice:
        """Which path and kernel a call runs, and why; the cache is read from a copy (left unchanged)."""
        with torch.no_grad():
            call = self._call(x, mask, key_padding_mask, causal, positions, cache, step, return_weights, backend,
                              path, peek=True)
        return kernels.explain(call)

    def step(self, x: Tensor, *, mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
             causal: bool = False, positions: Tensor | None = None, cache: LatentCache | LatentLayer | None = None,
             dtype: torch.dtype | None = None) -> Step:
        """The state every layer of a model shares for one call (mask, positions, RoPE tables, cache slot)."""
        self._check_x(x)
        self._check_cache(cache)
        return build_step(x, None, n_heads=self.n_heads, window=None, rotary=self.rotary, mask=mask,
                          key_padding_mask=key_padding_mask, causal=causal, positions=positions, cache=cache,
                          dtype=dtype)

    def choose_path(self, s: int, t: int) -> str:
        """The path ``path="auto"`` takes for s queries over t keys: the one with fewer FLOPs
        (:func:`multihead.kernels.mla_path`, which decides it in the kernels)."""
        c = self.config
        return kernels.mla_path(s=s, t=t, n_heads=c.n_heads, rank=c.kv_lora_rank, rope=c.qk_rope_head_dim,
                                nope=c.qk_nope_head_dim, dv=c.v_head_dim)

    # ------------------------------------------------------------------ the call
    def _call(self, x: Tensor, mask: Tensor | None, key_padding_mask: Tensor | None, causal: bool,
              positions: Tensor | None, cache: LatentLayer | None, step: Step | None, return_weights: bool,
              backend: str | None, path: str, *, peek: bool = False) -> AttentionCall:
        """The kernel call for these inputs: the rotated queries over a :class:`~multihead.cache.LatentKV` of every
        latent the call sees and this layer's up-projection; the kernels take the path (``peek`` reads the cache
        from a copy: explain)."""
        c = self.config
        step = self._checked_step(x, mask, key_padding_mask, causal, positions, cache, step, path)
        q_nope, q_pe, latent = self._project(x, step)
        latent = self._latents(latent, cache, step, copy=peek)  # (b, t, r + rope): every key this call sees
        up = self.kv_b_proj.weight.view(c.n_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return AttentionCall(torch.cat([q_nope, q_pe], dim=-1), LatentKV(latent, up, c.qk_nope_head_dim, path),
                             step.mask, scale=c.softmax_scale, dropout_p=c.dropout if self.training else 0.0,
                             backend=check_backend(backend) if backend is not None else self.backend,
                             need_weights=return_weights, hooks=call_hooks(self))

    def _checked_step(self, x: Tensor, mask: Tensor | None, key_padding_mask: Tensor | None, causal: bool,
                      positions: Tensor | None, cache: LatentLayer | None, step: Step | None, path: str) -> Step:
        """The call's step (made here unless given), after every check of the inputs."""
        self._check_x(x)
        self._check_cache(cache, layer=True)
        if path not in LATENT_PATHS:
            raise MultiheadError(f"path {path!r} is unknown: choose one of {', '.join(map(repr, LATENT_PATHS))}")
        if step is None:
            step = build_step(x, None, n_heads=self.n_heads, window=None, rotary=self.rotary, mask=mask,
                              key_padding_mask=key_padding_mask, causal=causal, positions=positions, cache=cache)
        elif mask is not None or key_padding_mask is not None or causal or positions is not None:
            raise MultiheadError("mask, key_padding_mask, causal and positions go to layer.step(...) when a step is "
                                 "passed")
        b, s = x.shape[:2]
        if (step.mask.batch, step.mask.s) != (b, s):
            raise MultiheadError(f"the step was made for (b, s) = {(step.mask.batch, step.mask.s)} but x has "
                                 f"{(b, s)}")
        return step

    def _project(self, x: Tensor, step: Step) -> tuple[Tensor, Tensor, Tensor]:
        """(q_nope (b, h, s, nope), q_pe (b, h, s, rope) rotated, the new latents (b, s, r + rope) as cached)."""
        c = self.config
        b, s = x.shape[:2]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_norm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.view(b, s, c.n_heads, c.qk_head_dim).transpose(1, 2)  # (b, h, s, qk)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)  # before norm and RoPE
        assert step.rope is not None
        cos, sin = (table.to(q.dtype) for table in step.rope)
        q_pe = RotaryEmbedding.rotate(q_pe, cos, sin)
        k_pe = RotaryEmbedding.rotate(k_pe[:, None], cos, sin)[:, 0]  # (b, s, rope): one key for all heads
        return q_nope, q_pe, torch.cat([self.kv_a_norm(c_kv), k_pe], dim=-1)  # (b, s, r + rope): what is cached

    def _latents(self, latent: Tensor, cache: LatentLayer | None, step: Step, *, copy: bool) -> Tensor:
        """The latents the call attends to (b, t, r + rope): the new ones, or the cache's with them placed."""
        if cache is not None:
            assert step.slots is not None, "a cache call's step carries the cache's slots"
            latent = cache.update(latent, step.slots, read_only=copy).latents  # (b, t, r + rope), the new included
        if step.mask.t != latent.shape[1]:
            raise MultiheadError(f"the step's mask covers {step.mask.t} keys but this call has {latent.shape[1]}: "
                                 "make the step for the same inputs and cache")
        return latent

    # ------------------------------------------------------------------ checks
    def _check_x(self, x: Tensor) -> None:
        if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[-1] != self.config.d_model:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise MultiheadError(f"x must be (b, s, d_model = {self.config.d_model}), got {shape}")
        w = self.kv_a_proj.weight
        if x.device != w.device or (x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type)):
            raise MultiheadError(f"x is {x.dtype} on {x.device} but the layer's weights are {w.dtype} on {w.device}")

    def _check_cache(self, cache: object, *, layer: bool = False) -> None:
        """A LatentCache of this layer's widths: one of its layers (``layer``, a call), or the whole (a step)."""
        if cache is None:
            return
        kv = cache.cache if isinstance(cache, BaseLayerCache) else cache
        if not isinstance(kv, LatentCache):
            raise MultiheadError(f"multi-head latent attention caches latents: give it a LatentCache layer "
                                 f"(cache.layer(i)), not a {type(kv).__name__}")
        if layer and not isinstance(cache, LatentLayer):
            raise MultiheadError("give the layer one layer of the LatentCache (cache.layer(i)), not the whole cache")
        if (kv.kv_lora_rank, kv.rope_dim) != (self.config.kv_lora_rank, self.config.qk_rope_head_dim):
            raise MultiheadError(f"the cache holds latents of kv_lora_rank {kv.kv_lora_rank} + rope {kv.rope_dim} but "
                                 f"this layer has {self.config.kv_lora_rank} + {self.config.qk_rope_head_dim}")

    def extra_repr(self) -> str:
        c = self.config
        return (f"d_model={c.d_model}, n_heads={c.n_heads}, kv_lora_rank={c.kv_lora_rank}, "
                f"q_lora_rank={c.q_lora_rank}, qk={c.qk_nope_head_dim}+{c.qk_rope_head_dim}, v={c.v_head_dim}")
