"""Multi-head latent attention (MLA, DeepSeek-V2): a cache of one compressed latent per token, two equal paths.

::

    expanded (prefill, training):  k_i = [c W_UK^i, k_pe], v_i = c W_UV^i  ->  attention over n_heads KV heads
    absorbed (decode):             q'_i = [q_nope_i W_UK^i^T, q_pe_i]      (b, h, s, kv_lora_rank + rope)
                                   z'_i = softmax(q'_i [c, k_pe]^T * scale) c  over ONE latent KV head (MQA)
                                   z_i  = z'_i W_UV^i^T

q_nope_i . (c W_UK^i) = (q_nope_i W_UK^i^T) . c, so the absorbed path is exactly the expanded one computed in the
latent space: an MQA whose single KV head is the cached latent, run by the same kernels as every other layer. It
reads kv_lora_rank + rope values per cached token instead of up-projecting every cached token for every head; the
expanded path is cheaper when the queries are many (a prefill). ``path="auto"`` takes the one with fewer FLOPs
(:func:`multihead.cost.mla_flops`); ``explain`` says which ran.

Hook points as on every layer, named for what enters the kernel: expanded ``hook_q`` (b, h, s, qk), ``hook_k``
(b, h, t, qk), ``hook_v`` (b, h, t, v); absorbed ``hook_q`` (b, h, s, rank + rope), ``hook_k`` (b, 1, t, rank + rope),
``hook_v`` (b, 1, t, rank). ``hook_pattern`` (b, h, s, t), ``hook_z`` (b, h, s, v_head_dim, each head's output
before W_O) and ``hook_out`` are the same on both paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from multihead import kernels
from multihead.cache import DenseKV, LatentCache, LatentLayer, LayerView
from multihead.config import MLAConfig, config_or_keywords
from multihead.errors import MultiheadError
from multihead.hooks import HookPoint, add_hook_points, call_hooks
from multihead.kernels import AttentionCall, CallHooks, KernelChoice, check_backend
from multihead.linear import Linear
from multihead.masks import MaskSpec
from multihead.norms import RMSNorm
from multihead.rope import RotaryEmbedding
from multihead.step import Step, build_step

PATHS = ("auto", "expanded", "absorbed")


@dataclass(frozen=True)
class _Core:
    """One call's attention core on one path: the kernel call, and what the path does around it. ``w_uv`` (h, dv, r)
    up-projects the absorbed path's output; ``folded``: an absorbed decode step whose h query heads run as the rows
    of the one latent head (q (b, 1, h, r + rope))."""

    path: Literal["expanded", "absorbed"]
    call: AttentionCall
    s: int
    t: int
    w_uv: Tensor | None = None
    folded: bool = False


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
        core = self._core(x, mask, key_padding_mask, causal, positions, cache, step, return_weights, backend, path)
        z, weights = self._attend(core)  # (b, h, s, dv), hook_z applied
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
            core = self._core(x, mask, key_padding_mask, causal, positions, cache, step, return_weights, backend,
                              path, peek=True)
        return self._explained(kernels.explain(core.call), core)

    def step(self, x: Tensor, *, mask: Tensor | None = None, key_padding_mask: Tensor | None = None,
             causal: bool = False, positions: Tensor | None = None, cache: LatentCache | LatentLayer | None = None,
             dtype: torch.dtype | None = None) -> Step:
        """The state every layer of a model shares for one call (mask, positions, RoPE tables, cache slot)."""
        self._check_x(x)
        self._check_cache(cache)
        return build_step(x, None, n_heads=self.n_heads, window=None, rotary=self.rotary, mask=mask,
                          key_padding_mask=key_padding_mask, causal=causal, positions=positions, cache=cache,
                          dtype=dtype)

    def choose_path(self, s: int, t: int) -> Literal["expanded", "absorbed"]:
        """The path with fewer FLOPs for s queries over t keys (multihead.cost.mla_flops)."""
        from multihead.cost import mla_flops

        absorbed = mla_flops(self.config, s=s, t=t, path="absorbed").forward
        expanded = mla_flops(self.config, s=s, t=t, path="expanded").forward
        return "absorbed" if absorbed < expanded else "expanded"

    # ------------------------------------------------------------------ the two paths
    def _core(self, x: Tensor, mask: Tensor | None, key_padding_mask: Tensor | None, causal: bool,
              positions: Tensor | None, cache: LatentLayer | None, step: Step | None, return_weights: bool,
              backend: str | None, path: str, *, peek: bool = False) -> _Core:
        """The path and the kernel call for these inputs; ``peek`` reads the cache from a copy (explain)."""
        step = self._checked_step(x, mask, key_padding_mask, causal, positions, cache, step, path)
        q_nope, q_pe, latent = self._project(x, step)
        latent = self._latents(latent, cache, step, copy=peek)  # (b, t, r + rope): every key this call sees
        s, t = x.shape[1], latent.shape[1]
        chosen = self.choose_path(s, t) if path == "auto" else path
        kind = check_backend(backend) if backend is not None else self.backend
        dropout = self.config.dropout if self.training else 0.0
        if chosen == "expanded":
            return _Core("expanded", self._expanded_call(q_nope, q_pe, latent, step, kind, dropout, return_weights),
                         s, t)
        return self._absorbed_core(q_nope, q_pe, latent, step, kind, dropout, return_weights)

    def _attend(self, core: _Core) -> tuple[Tensor, Tensor | None]:
        """Run the core: z (b, h, s, v_head_dim) through hook_z, and the weights when asked for."""
        z, weights = kernels.attend(core.call)  # expanded: hook_z ran in the core
        if core.w_uv is not None:  # absorbed: W_UV after the weighted sum
            z_lat = z.transpose(1, 2) if core.folded else z  # (b, h, s, r)
            z = torch.einsum("bhsr,hvr->bhsv", z_lat, core.w_uv)  # (b, h, s, dv)
            z = self.hook_z(z) if self.hook_z.active else z
        return z, weights

    def _checked_step(self, x: Tensor, mask: Tensor | None, key_padding_mask: Tensor | None, causal: bool,
                      positions: Tensor | None, cache: LatentLayer | None, step: Step | None, path: str) -> Step:
        """The call's step (made here unless given), after every check of the inputs."""
        self._check_x(x)
        self._check_cache(cache, layer=True)
        if path not in PATHS:
            raise MultiheadError(f"path {path!r} is unknown: choose one of {', '.join(map(repr, PATHS))}")
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

    def _expanded_call(self, q_nope: Tensor, q_pe: Tensor, latent: Tensor, step: Step, backend: str,
                       dropout: float, return_weights: bool) -> AttentionCall:
        """Expanded: the latents up-projected to h keys [c W_UK^i, k_pe] (b, h, t, qk) and values c W_UV^i."""
        c = self.config
        b, t, h = latent.shape[0], latent.shape[1], c.n_heads
        c_t, k_pe = latent.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c_t).view(b, t, h, c.qk_nope_head_dim + c.v_head_dim).transpose(1, 2)  # (b, h, t, .)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(b, h, t, c.qk_rope_head_dim)], dim=-1)  # (b, h, t, qk)
        return AttentionCall(torch.cat([q_nope, q_pe], dim=-1), DenseKV(k, v.contiguous()), step.mask,
                             scale=c.softmax_scale,
                             dropout_p=dropout, backend=backend, need_weights=return_weights,
                             hooks=call_hooks(self))

    def _absorbed_core(self, q_nope: Tensor, q_pe: Tensor, latent: Tensor, step: Step, backend: str,
                       dropout: float, return_weights: bool) -> _Core:
        """Absorbed: W_UK folded into the queries, MQA over the one latent KV head (b, 1, t, r + rope); W_UV comes
        after the weighted sum (:meth:`_attend`), and so does hook_z."""
        c = self.config
        b, s, t, r = q_nope.shape[0], q_nope.shape[2], latent.shape[1], c.kv_lora_rank
        w_b = self.kv_b_proj.weight.view(c.n_heads, c.qk_nope_head_dim + c.v_head_dim, r)  # per head: W_UK, W_UV
        w_uk, w_uv = w_b[:, :c.qk_nope_head_dim], w_b[:, c.qk_nope_head_dim:]  # (h, nope, r), (h, dv, r)
        q_lat = torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk)  # (b, h, s, r)
        q_abs = torch.cat([q_lat, q_pe], dim=-1)  # (b, h, s, r + rope)
        keys, values = latent[:, None], latent[:, None, :, :r]  # (b, 1, t, r + rope), (b, 1, t, r)
        hooked = call_hooks(self, z=False)
        core_hooked = hooked is not None and any(fn is not None for fn in (hooked.q, hooked.k, hooked.v,
                                                                             hooked.pattern))
        if s == 1 and not return_weights and not dropout and not core_hooked:
            # a decode step: the h query heads of the one latent KV head become h query rows of one head, so the
            # kernel reads the latent once (no GQA expansion of t x (r + rope)), as FlashMLA does
            spec = step.mask
            keep, bias, _ = spec.dense(latent.device, latent.dtype) if not spec.is_empty else (None, None, None)
            folded = MaskSpec(batch=b, n_heads=1, s=c.n_heads, t=t, keep=keep, bias=bias)
            call = AttentionCall(q_abs.transpose(1, 2), DenseKV(keys, values), folded, scale=c.softmax_scale,
                                 backend=backend,
                                 hooks=None if hooked is None else CallHooks(names=hooked.names),
                                 rows_are_heads=True)  # (b, 1, h, r + rope) over (b, 1, t, .)
            return _Core("absorbed", call, s, t, w_uv, folded=True)
        call = AttentionCall(q_abs, DenseKV(keys, values), step.mask, scale=c.softmax_scale, dropout_p=dropout,
                             backend=backend, need_weights=return_weights, hooks=hooked)
        return _Core("absorbed", call, s, t, w_uv)

    def _explained(self, choice: KernelChoice, core: _Core) -> KernelChoice:
        c = self.config
        if core.path == "absorbed":
            what = (f"MLA absorbed path: W_UK folded into the queries and W_UV after the weighted sum, so the kernel "
                    f"runs MQA over one latent KV head of width {c.latent_dim} ({c.n_heads} query heads"
                    + (", folded into query rows of one head for this decode step" if core.folded else "") + ")")
        else:
            what = (f"MLA expanded path: the {core.t} cached latents are up-projected to {c.n_heads} keys of width "
                    f"{c.qk_head_dim} and values of width {c.v_head_dim}")
        return KernelChoice(choice.backend, choice.kernel, f"{what}; {choice.reason}", choice.mask)

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
        kv = cache.cache if isinstance(cache, LayerView) else cache
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
