"""Does it fit? The whole model's parameters and memory from its config: weights, KV cache, activations.

Parameters are counted per part from a Hugging Face ``config.json`` (or a preset), as the model's own modules hold
them: embeddings (tied or not), each layer's attention (MHA/GQA/MQA from :mod:`multihead.cost`, MLA from its own
count), MLP (gated or not), mixture-of-experts (routed experts, shared experts, router), norms, biases and the LM head.
A mixture-of-experts model has a total and an active count (the parameters one token passes through).

Families: GPT-2, BERT, Llama-style decoders (Llama, Mistral, Qwen2, Gemma, SmolLM, ...), Mixtral, Qwen2-MoE,
DeepSeek-V2/V3 and Falcon; another ``model_type`` raises and names these. The tests hold every count against
``sum(p.numel())`` of transformers' own models built from its config classes, the shipped checkpoints, and
published totals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from multihead import cost
from multihead.errors import MultiheadError
from multihead.hfconfig import HFConfig
from multihead.presets import ModelConfig
from multihead.values import MAX_PARAMETERS

LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2", "granite", "cohere", "phi3",
              "smollm3", "starcoder2", "internlm2"}
FAMILIES = ("gpt2", "bert", *sorted(LLAMA_LIKE), "mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3", "falcon")

# GGML tensor types of a GGUF file (llama.cpp's numbering) and their bits per weight, block scales included
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
              12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}
GGUF_BITS: dict[str, float] = {
    "F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0,
    "Q2_K": 2.625, "Q3_K": 3.4375, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "Q8_K": 9.125,
}
WEIGHT_BITS: dict[str, float] = {"fp32": 32.0, "float32": 32.0, "fp16": 16.0, "float16": 16.0, "bf16": 16.0,
                                 "bfloat16": 16.0, "fp8": 8.0, "int8": 8.0, "int4": 4.0,
                                 **{k.lower(): v for k, v in GGUF_BITS.items()}}


class NotCounted(MultiheadError):
    """A model the whole-model count does not know yet (a family, a layout, a missing field): `count` says so and
    still answers for the attention; a bad value in a config raises a plain MultiheadError instead."""


@dataclass(frozen=True)
class ModelSize:
    """Parameters of a whole model by part; ``total`` and ``active`` (per token, for mixtures of experts)."""

    name: str
    family: str
    parts: dict[str, int]
    active: int
    replicated: int  # not split by tensor parallelism (embeddings, norms, LM head, routers)
    tied: bool
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _config(model: ModelConfig) -> HFConfig:
    """The config the model was read from (every value already typed and ranged by multihead.hfconfig)."""
    if model.hf is None:
        raise NotCounted(f"{model.name}: no config to count the whole model from (give --preset or --config)")
    return model.hf


def _positions(cfg: HFConfig) -> int:
    """The rows of a position-embedding table: max_position_embeddings (n_positions, ...)."""
    if cfg.max_context is None:
        raise NotCounted(f"{cfg.where!r} has no max_position_embeddings (nor n_positions): needed for the "
                             "whole-model count")
    return cfg.max_context


def _width(cfg: HFConfig, key: str) -> int:
    """An MLP width (intermediate_size and kin); a list of per-layer widths (Gemma 3n) is not counted yet."""
    value = cfg.integer(key)
    if isinstance(value, list):
        raise NotCounted(f"{cfg.where!r}: {key} is a list of per-layer widths: not counted yet")
    return int(value)


def model_size(model: ModelConfig) -> ModelSize:
    """The whole model's parameters from the config it was read from (``model.hf``)."""
    cfg = _config(model)
    family = cfg.model_type
    a, n_layers = model.attention, model.n_layers
    D = a.d_model
    V = int(cfg.integer("vocab_size"))
    attn_params = cost.mla_parameters(model.mla).total if model.mla is not None else cost.parameters(a).total
    parts: dict[str, int] = {}
    notes: list[str] = []
    if family == "gpt2":
        positions = _positions(cfg)
        inner = int(cfg.integer("n_inner", default=4 * D))
        parts["embeddings"] = V * D + positions * D
        parts["attention"] = n_layers * attn_params
        parts["mlp"] = n_layers * (2 * D * inner + inner + D)
        parts["norms"] = n_layers * 4 * D + 2 * D
        tied = True
    elif family == "bert":
        positions = _positions(cfg)
        types = int(cfg.integer("type_vocab_size", default=2))
        inner = _width(cfg, "intermediate_size")
        parts["embeddings"] = (V + positions + types) * D
        parts["attention"] = n_layers * attn_params
        parts["mlp"] = n_layers * (2 * D * inner + inner + D)
        parts["norms"] = 2 * D + n_layers * 4 * D
        parts["pooler"] = D * D + D
        tied = True
        notes.append("BERT with its pooler (BertModel); the masked-LM head is not counted")
    elif family == "falcon":
        if cfg.flag("new_decoder_architecture", default=False):
            raise NotCounted("Falcon's new decoder architecture (40B/180B) is not counted yet: only Falcon-7B's")
        bias = bool(cfg.flag("bias", default=False))
        parts["embeddings"] = V * D
        parts["attention"] = n_layers * attn_params
        parts["mlp"] = n_layers * (8 * D * D + (5 * D if bias else 0))
        parts["norms"] = n_layers * 2 * D + 2 * D  # one LayerNorm (weight and bias) per layer: parallel attention
        tied = bool(cfg.flag("tie_word_embeddings", default=True))
    elif family in LLAMA_LIKE or family in ("mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3"):
        tied = bool(cfg.flag("tie_word_embeddings", default=family in ("gemma", "gemma2")))
        inner = _width(cfg, "intermediate_size")
        parts["embeddings"] = V * D
        parts["attention"] = n_layers * attn_params
        norms_per_layer = 4 * D if family == "gemma2" else 2 * D
        if family == "qwen3":
            norms_per_layer += 2 * a.head_dim  # q_norm and k_norm
        parts["norms"] = n_layers * norms_per_layer + D
        dense, moe_layers, expert, routed, shared, router = _mlp(cfg, family, D, inner, n_layers)
        if dense:
            parts["mlp"] = dense
        if moe_layers:
            parts["experts"] = moe_layers * routed * expert
            if shared:
                parts["shared_experts"] = moe_layers * shared
            parts["routers"] = moe_layers * router
        if family == "deepseek_v3" and cfg.integer("num_nextn_predict_layers", default=0):
            notes.append("DeepSeek-V3's multi-token-prediction layer is not counted (transformers does not load it)")
    else:
        raise NotCounted(f"model_type {family!r} is not counted yet: the whole-model count knows "
                             f"{', '.join(FAMILIES)}")
    if not tied:
        parts["lm_head"] = V * D
    total = sum(parts.values())
    if total > MAX_PARAMETERS:
        raise MultiheadError(f"{cfg.where!r} describes {total:,} parameters: past MAX_PARAMETERS (2^61, whose "
                             "float32 bytes pass 2^63, the most an int64 byte count holds): no machine can allocate "
                             "them")
    active = total
    if "experts" in parts:
        moe_layers, routed, per_tok, expert = _moe_shape(cfg, family, n_layers, D)
        active = total - moe_layers * (routed - per_tok) * expert
    replicated = parts.get("embeddings", 0) + parts.get("norms", 0) + parts.get("lm_head", 0) + parts.get(
        "routers", 0) + parts.get("pooler", 0)
    return ModelSize(name=model.name, family=family, parts=parts, active=active, replicated=replicated, tied=tied,
                     notes=notes)


def _moe_shape(cfg: HFConfig, family: str, n_layers: int, D: int) -> tuple[int, int, int, int]:
    """(MoE layers, routed experts, experts per token, parameters of one routed expert)."""
    if family == "mixtral":
        shape = (n_layers, int(cfg.integer("num_local_experts")), int(cfg.integer("num_experts_per_tok")),
                 3 * D * _width(cfg, "intermediate_size"))
    elif family == "qwen2_moe":
        dense = set(cfg.integers("mlp_only_layers", default=[]))
        every = int(cfg.integer("decoder_sparse_step", default=1))
        sparse = [i for i in range(n_layers) if i not in dense and (i + 1) % every == 0]
        shape = (len(sparse), int(cfg.integer("num_experts")), int(cfg.integer("num_experts_per_tok")),
                 3 * D * _width(cfg, "moe_intermediate_size"))
    else:
        first = int(cfg.integer("first_k_dense_replace", default=0))
        every = int(cfg.integer("moe_layer_freq", default=1))
        routed = int(cfg.integer("n_routed_experts", default=0))
        moe = [i for i in range(n_layers) if i >= first and i % every == 0] if routed else []
        shape = (len(moe), routed, int(cfg.integer("num_experts_per_tok", default=0)),
                 3 * D * int(cfg.integer("moe_intermediate_size", default=0)))
    if shape[0] and shape[2] > shape[1]:
        raise MultiheadError(f"{cfg.where!r}: num_experts_per_tok = {shape[2]:,}: expected at most the "
                             f"{shape[1]:,} experts a layer has")
    return shape


def _mlp(cfg: HFConfig, family: str, D: int, inner: int, n_layers: int
         ) -> tuple[int, int, int, int, int, int]:
    """(dense MLP parameters of all dense layers, MoE layers, one routed expert, routed experts per layer, shared
    expert parameters per layer, router parameters per layer)."""
    gated = 3 * D * inner
    if family not in ("mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3"):
        return n_layers * gated, 0, 0, 0, 0, 0
    moe_layers, routed, _, expert = _moe_shape(cfg, family, n_layers, D)
    dense_layers = n_layers - moe_layers
    if family == "mixtral":
        return 0, moe_layers, expert, routed, 0, D * routed
    if family == "qwen2_moe":
        shared_inner = int(cfg.integer("shared_expert_intermediate_size", default=0))
        shared = 3 * D * shared_inner + D if shared_inner else 0  # the shared expert and its sigmoid gate
        return dense_layers * gated, moe_layers, expert, routed, shared, D * routed
    shared = int(cfg.integer("n_shared_experts", default=0)) * expert
    router = D * routed  # (V3's router also keeps a score-correction bias per expert: a buffer, not a parameter)
    return dense_layers * gated, moe_layers, expert, routed, shared, router


# ---------------------------------------------------------------------------------------------- memory
def weight_bytes(params: int, dtype: str) -> int:
    """Bytes of ``params`` weights stored as ``dtype`` (fp32, bf16, int8, int4, or a GGUF type such as q4_1, q8_0:
    llama.cpp's bits per weight, scales included)."""
    key = str(dtype).lower().removeprefix("torch.")
    if key not in WEIGHT_BITS:
        raise MultiheadError(f"weight dtype {dtype!r} is unknown: choose one of {', '.join(sorted(WEIGHT_BITS))}")
    return math.ceil(params * WEIGHT_BITS[key] / 8)


def prefill_activation_bytes(model: ModelConfig, size: ModelSize, *, seq: int, batch: int, dtype: str) -> int:
    """The peak of a prefill's activations with a fused attention kernel (no (s, t) matrix), inference only:
    the residual stream plus the largest transient of one layer (q, k, v and the attention output, or the MLP's
    gate, up and their product), and the last position's logits in float32::

        b s bytes (D + max(2 D + 2 g d, 3 I)) + b V 4
    """
    cfg = _config(model)
    a = model.attention
    D, g, d = a.d_model, a.n_kv_heads, a.head_dim
    inner = _width(cfg, "intermediate_size") if cfg.has("intermediate_size") else int(
        cfg.integer("n_inner", default=4 * D))
    if "experts" in size.parts:
        moe_inner = int(cfg.integer("moe_intermediate_size", default=inner))
        per_tok = int(cfg.integer("num_experts_per_tok", default=1))
        inner = max(inner if "mlp" in size.parts else 0, moe_inner * per_tok)
    attention = 2 * D + 2 * g * d
    if model.mla is not None:
        m = model.mla
        attention = m.n_heads * (2 * m.qk_head_dim + m.v_head_dim) + m.latent_dim
    per_token = D + max(attention, 3 * inner)
    V = int(cfg.integer("vocab_size", default=0))
    return batch * seq * per_token * cost.dtype_bytes(dtype) + batch * V * 4


def kv_bytes(model: ModelConfig, *, context: int, batch: int, dtype: str, cache: str = "full") -> int:
    """The KV cache of the whole model by cache kind: "full", "window:N" (sinks 4), "int8"/"int4"/"int2"
    (group 32, residual 128), or "latent" (an MLA model's; also what "full" means for one)."""
    a, n = model.attention, model.n_layers
    if model.mla is not None and cache in ("full", "latent"):
        return cost.mla_cache_bytes(model.mla, context=context, batch=batch, n_layers=n, dtype=dtype)
    if cache == "latent":
        raise MultiheadError(f"{model.name} has no latent attention: --cache latent is for MLA models")
    if cache == "full":
        return cost.kv_cache_bytes(a, context=context, batch=batch, n_layers=n, dtype=dtype)
    if cache.startswith("window:"):
        try:
            window = int(cache.split(":", 1)[1])
        except ValueError:
            raise MultiheadError(f"cache {cache!r}: give window:N with N a number of tokens") from None
        return min(cost.sink_cache_bytes(a, window=window, sink_tokens=4, batch=batch, n_layers=n, dtype=dtype),
                   cost.kv_cache_bytes(a, context=context, batch=batch, n_layers=n, dtype=dtype))
    if cache in ("int8", "int4", "int2"):
        return cost.quantized_cache_bytes(a, context=context, bits=int(cache[3:]), group=min(32, a.head_dim),
                                          batch=batch, n_layers=n, dtype=dtype)
    raise MultiheadError(f"cache {cache!r} is unknown: choose full, window:N, int8, int4, int2 or latent")


@dataclass(frozen=True)
class Fit:
    weights: int
    kv: int
    activations: int
    per_device: int
    memory: int
    tp: int

    @property
    def fits(self) -> bool:
        return self.per_device <= self.memory


def fit(model: ModelConfig, size: ModelSize, *, seq: int, batch: int, dtype: str, weights_dtype: str, memory: int,
        tp: int = 1, cache: str = "full") -> Fit:
    """Memory per device for weights, KV cache and prefill activations, split over ``tp`` devices as
    multihead.parallel splits them (attention and MLP by heads and columns; embeddings, norms and the LM head on
    every device; each device caches its own KV heads)."""
    check_tp(model, tp)
    weights = weight_bytes(size.total, weights_dtype)
    replicated = weight_bytes(size.replicated, weights_dtype)
    kv = kv_bytes(model, context=seq, batch=batch, dtype=dtype, cache=cache)
    act = prefill_activation_bytes(model, size, seq=seq, batch=batch, dtype=dtype)
    per_device = replicated + (weights - replicated) // tp + kv // tp + act
    return Fit(weights=weights, kv=kv, activations=act, per_device=per_device, memory=memory, tp=tp)


def valid_tp(model: ModelConfig) -> list[int]:
    from multihead.divisors import divisors

    a = model.attention
    heads = model.mla.n_heads if model.mla is not None else a.n_heads
    kv = heads if model.mla is not None else a.n_kv_heads
    return divisors(math.gcd(heads, kv))


def check_tp(model: ModelConfig, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or tp not in valid_tp(model):
        raise MultiheadError(f"--tp {tp!r} must divide the query and KV head counts: choose one of "
                             f"{', '.join(map(str, valid_tp(model)))}")


def devices_needed(model: ModelConfig, size: ModelSize, *, seq: int, batch: int, dtype: str, weights_dtype: str,
                   memory: int, cache: str = "full") -> int | None:
    """The fewest devices (a valid tensor-parallel size) on which the model fits; None if none does."""
    for tp in valid_tp(model):
        if fit(model, size, seq=seq, batch=batch, dtype=dtype, weights_dtype=weights_dtype, memory=memory, tp=tp,
               cache=cache).fits:
            return tp
    return None


def largest(model: ModelConfig, size: ModelSize, *, seq: int, batch: int, dtype: str, weights_dtype: str,
            memory: int, tp: int = 1, cache: str = "full", what: str = "context") -> int:
    """The largest context (at ``batch``) or batch (at ``seq``) that fits; 0 if not even one."""
    def ok(n: int) -> bool:
        s, b = (n, batch) if what == "context" else (seq, n)
        return fit(model, size, seq=s, batch=b, dtype=dtype, weights_dtype=weights_dtype, memory=memory, tp=tp,
                   cache=cache).fits

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo



# ---------------------------------------------------------------------------------------------- the whole model
def whole_model(model: ModelConfig, *, seq: int, batch: int, dtype: str, weights_dtype: str, tp: int = 1,
                cache: str = "full", memory: int | None = None) -> dict[str, Any] | None:
    """The whole model's parameters, memory and fit (what `multihead count` reports as ``whole_model``), or None for
    a model described by its attention sizes alone (no vocabulary). A model whose parts cannot be sized gives
    ``{"unavailable": why}``. With ``memory`` (bytes per device): whether it fits, on how few devices, and the
    largest context and batch that do."""
    if model.hf is None or "vocab_size" not in model.hf:
        return None
    try:
        size = model_size(model)
    except NotCounted as err:  # a family or layout the count does not know: said, not refused (bad values raise)
        return {"unavailable": str(err)}
    check_tp(model, tp)
    out: dict[str, Any] = {
        "total_parameters": size.total, "active_parameters": size.active, "parameters_by_part": size.parts,
        "tied_embeddings": size.tied, "notes": size.notes, "weights_dtype": weights_dtype, "tp": tp, "cache": cache,
    }
    f = fit(model, size, seq=seq, batch=batch, dtype=dtype, weights_dtype=weights_dtype, memory=memory or 0, tp=tp,
            cache=cache)
    out.update({"weight_bytes": f.weights, "kv_bytes": f.kv, "activation_bytes": f.activations,
                "bytes_per_device": f.per_device})
    if memory is not None:
        common: dict[str, Any] = {"dtype": dtype, "weights_dtype": weights_dtype, "memory": memory, "cache": cache}
        out["fits"] = f.fits
        out["devices_needed"] = devices_needed(model, size, seq=seq, batch=batch, **common)
        if f.fits:
            out["largest_context"] = largest(model, size, seq=seq, batch=batch, tp=tp, what="context", **common)
            out["largest_batch"] = largest(model, size, seq=seq, batch=batch, tp=tp, what="batch", **common)
    return out
