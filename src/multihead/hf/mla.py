"""Our MLA layer in transformers' DeepSeek-V2/V3 models: the weights carried over (their interleaved RoPE rows put
in our half layout), the layer standing in each decoder layer's ``self_attn`` with its own latent cache."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from multihead.errors import MultiheadError


def _rope_rows(n_rows_before: int, rope: int, interleaved: bool) -> Tensor:
    """Row order that turns DeepSeek's interleaved RoPE pairs (x0, x1), (x2, x3) .. into the half layout
    (x0, x2, .., x1, x3, ..) our rotation uses; q and k get the same order, so q . k is unchanged."""
    order = torch.arange(rope)
    if interleaved:
        order = torch.cat([order[0::2], order[1::2]])
    return n_rows_before + order


def mla_from_transformers(module: Any) -> Any:
    """Our :class:`~multihead.layers.latent.MultiHeadLatentAttention` with the weights of a transformers DeepSeek-V2/V3
    attention module (their interleaved RoPE dims reordered to our half layout; same function)."""
    from multihead.config import MLAConfig
    from multihead.layers.latent import MultiHeadLatentAttention

    cfg = module.config
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise MultiheadError(f"rope_type {params.get('rope_type')!r} (YaRN scaling) is not supported by our MLA layer")
    config = MLAConfig(d_model=cfg.hidden_size, n_heads=cfg.num_attention_heads, kv_lora_rank=cfg.kv_lora_rank,
                       qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                       v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank,
                       rope=float(params.get("rope_theta", 10000.0)), norm_eps=float(cfg.rms_norm_eps),
                       bias=bool(getattr(cfg, "attention_bias", False)), scale=float(module.scaling))
    ref = module.o_proj.weight
    layer = MultiHeadLatentAttention(config, device=ref.device, dtype=ref.dtype)
    interleaved = getattr(cfg, "rope_interleave", None) is not False  # V3: True by default; V2: complex pairs
    h, qk, nope, r, rope = config.n_heads, config.qk_head_dim, config.qk_nope_head_dim, config.kv_lora_rank, \
        config.qk_rope_head_dim
    q_rows = torch.cat([torch.cat([torch.arange(i * qk, i * qk + nope), _rope_rows(i * qk + nope, rope, interleaved)])
                        for i in range(h)])
    kv_a_rows = torch.cat([torch.arange(r), _rope_rows(r, rope, interleaved)])
    with torch.no_grad():
        if config.q_lora_rank is None:
            assert layer.q_proj is not None
            layer.q_proj.weight.copy_(module.q_proj.weight[q_rows])
        else:
            assert layer.q_a_proj is not None and layer.q_a_norm is not None and layer.q_b_proj is not None
            layer.q_a_proj.load_state_dict(module.q_a_proj.state_dict())
            layer.q_a_norm.weight.copy_(module.q_a_layernorm.weight)
            layer.q_b_proj.weight.copy_(module.q_b_proj.weight[q_rows])
        layer.kv_a_proj.weight.copy_(module.kv_a_proj_with_mqa.weight[kv_a_rows])
        if module.kv_a_proj_with_mqa.bias is not None:
            layer.kv_a_proj.bias.copy_(module.kv_a_proj_with_mqa.bias[kv_a_rows])
        layer.kv_a_norm.weight.copy_(module.kv_a_layernorm.weight)
        layer.kv_b_proj.weight.copy_(module.kv_b_proj.weight)
        layer.o_proj.load_state_dict(module.o_proj.state_dict())
    eps = float(getattr(module.kv_a_layernorm, "variance_epsilon", cfg.rms_norm_eps))
    layer.kv_a_norm.eps = eps
    if layer.q_a_norm is not None:
        layer.q_a_norm.eps = eps
    return layer.train(module.training)


class MLAInTransformers(nn.Module):
    """Our MLA layer standing in a transformers DeepSeek decoder layer's ``self_attn``: it reads transformers'
    hidden states and position ids and keeps its own :class:`~multihead.cache.LatentCache` (one sequence length
    for the batch, from position 0), so ``generate`` decodes over latents on the absorbed path."""

    def __init__(self, layer: Any, max_len: int, path: str = "auto") -> None:
        super().__init__()
        self.layer = layer
        self.max_len = max_len
        self.path = path
        self.cache: Any = None

    def forward(self, hidden_states: Tensor, position_embeddings: Any = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: Any = None, use_cache: bool | None = None,
                **kwargs: Any) -> tuple[Tensor, None]:
        b, s = hidden_states.shape[:2]
        positions = position_ids if position_ids is not None else torch.arange(s, device=hidden_states.device)[None]
        if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
            raise MultiheadError("our MLA layer in a transformers model takes unpadded sequences of one length")
        if cache is None and not use_cache:
            return self.layer(hidden_states, causal=True, positions=positions.expand(b, s), path=self.path), None
        if int(positions[0, 0]) == 0 or self.cache is None or self.cache.batch != b:
            self.cache = self._latents(b, s, hidden_states)
        elif self.cache.used + s > self.cache.max_len:  # grow by doubling, up to the model's context
            old = self.cache
            self.cache = self._latents(b, old.used + s, hidden_states)
            self.cache.latent[:, :, :old.used].copy_(old.latent[:, :, :old.used])
            self.cache.advance(old.used)
        out = self.layer(hidden_states, causal=True, positions=positions.expand(b, s), cache=self.cache.layer(0),
                         path=self.path)
        self.cache.advance(s)
        return out, None

    def _latents(self, b: int, need: int, like: Tensor) -> Any:
        """A latent cache for ``need`` tokens or more (room doubles as a generation grows)."""
        from multihead.cache import CacheShape, CacheSpec

        c = self.layer.config
        size = min(self.max_len, max(256, 1 << max(0, need - 1).bit_length()))
        if need > size:
            raise MultiheadError(f"{need} tokens exceed the model's context of {self.max_len}")
        shape = CacheShape.mla(n_layers=1, n_heads=c.n_heads, kv_lora_rank=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim,
                               context=self.max_len)
        return CacheSpec(size, latent=True).build(shape, batch=b, dtype=like.dtype, device=like.device)


def use_mla_layers(model: nn.Module, *, path: str = "auto") -> nn.Module:
    """Put our MLA layer in place of every DeepSeek attention module of a transformers model (in place)."""
    replaced = 0
    for module in list(model.modules()):
        attn: Any = getattr(module, "self_attn", None)
        if attn is not None and hasattr(attn, "kv_a_proj_with_mqa"):
            max_len = int(getattr(attn.config, "max_position_embeddings", 4096))
            module.self_attn = MLAInTransformers(mla_from_transformers(attn), max_len, path)
            replaced += 1
    if not replaced:
        raise MultiheadError(f"{type(model).__name__} has no DeepSeek MLA attention modules (kv_a_proj_with_mqa)")
    return model
