"""Does it fit? The whole model's parameters and memory from its config: weights, KV cache, activations.

Parameters are counted per part from a Hugging Face ``config.json`` (or a preset), as the model's own modules hold
them: embeddings (tied or not), each layer's attention (MHA/GQA/MQA from :mod:`multihead.sizing.cost`, MLA from its own
count), MLP (gated or not), mixture-of-experts (routed experts, shared experts, router), norms, biases and the LM head.
A mixture-of-experts model has a total and an active count (the parameters one token passes through).

Families: GPT-2, BERT, Llama-style decoders (Llama, Mistral, Ministral, Qwen2, Qwen3, Gemma 1-3, Phi-3 and Phi-4,
SmolLM, ...), the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, Llama 4 and DeepSeek-V2/V3, and Falcon;
a multimodal config (Gemma 3, Mistral 3, Llama 4) by its text model, said in the notes; another ``model_type``
raises and names these (Phi-4-multimodal saying what it is). The tests hold every count against
``sum(p.numel())`` of transformers' own models built from its config classes, the shipped checkpoints, and
published totals.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from multihead.errors import MultiheadError
from multihead.hf.config import HFConfig
from multihead.sizing import cost
from multihead.sizing.presets import ModelConfig
from multihead.values import MAX_PARAMETERS

LLAMA_LIKE = {"llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
              "gemma3_text", "olmo2", "granite", "cohere", "phi3", "smollm3", "starcoder2", "internlm2"}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "llama4", "llama4_text", "deepseek_v2",
                "deepseek_v3")
FAMILIES = ("gpt2", "bert", *sorted(LLAMA_LIKE), *MOE_FAMILIES, "falcon")
TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text")  # tie_word_embeddings when the config does not say
# Families refused by name, saying what they are (the count knows their language model's layout, not the rest).
NOT_COUNTED = {
    "phi4mm": "Phi-4-multimodal in its own code (auto_map): a Phi-4-mini language model with LoRA adapters for "
              "vision and speech, an image encoder and an audio encoder; the whole-model count knows the language "
              "model's layout (model_type phi3, as Phi-4 and Phi-4-mini give it) but not the adapters and encoders, "
              "so it gives no total",
    "phi4_multimodal": "Phi-4-multimodal as transformers ports it: a Phi-4-mini language model with an image "
                       "encoder (vision_config) and an audio encoder (audio_config); the whole-model count knows the "
                       "language model's layout (model_type phi3) but not the encoders, so it gives no total",
}
REPLICATED_PARTS = ("embeddings", "norms", "lm_head", "routers", "pooler")  # on every device under tensor parallelism

# GGML tensor types of a GGUF file (llama.cpp's numbering) and their bits per weight, block scales included
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
              12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}
GGUF_BITS: dict[str, float] = {
    "F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0,
    "Q2_K": 2.625, "Q3_K": 3.4375, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "Q8_K": 9.125,
}
# llama.cpp's K-quant mixes (the file types quantize writes): most tensors in the base type, a few (attn_v, part of
# ffn_down) in a wider one. Counted at their base type's bits (Q4_K_M as Q4_K's 4.5), so a real file is somewhat larger.
GGUF_MIXES = {"q2_k_s": "q2_k", "q3_k_s": "q3_k", "q3_k_m": "q3_k", "q3_k_l": "q3_k", "q4_k_s": "q4_k",
              "q4_k_m": "q4_k", "q5_k_s": "q5_k", "q5_k_m": "q5_k"}
WEIGHT_BITS: dict[str, float] = {"fp32": 32.0, "float32": 32.0, "fp16": 16.0, "float16": 16.0, "bf16": 16.0,
                                 "bfloat16": 16.0, "fp8": 8.0, "int8": 8.0, "int4": 4.0,
                                 # OCP MX FP4: 4-bit elements, one shared 8-bit (E8M0) scale per 32: 4 + 8/32
                                 "mxfp4": 4.25,
                                 # NVIDIA's NVFP4: 4-bit elements, an FP8 (E4M3) scale per 16 (+ one fp32 per tensor)
                                 "nvfp4": 4.5,
                                 **{k.lower(): v for k, v in GGUF_BITS.items()}}
WEIGHT_BITS.update({mix: WEIGHT_BITS[base] for mix, base in GGUF_MIXES.items()})
# The parts a whole-model count names (ModelSize.parts), which --weights-dtype may store in their own type
WEIGHT_PARTS = ("embeddings", "attention", "mlp", "norms", "experts", "shared_experts", "routers", "lm_head",
                "pooler")


class NotCounted(MultiheadError):
    """A model the whole-model count does not know yet (a family, a layout, a missing field): `count` says so and
    still answers for the attention, but gives no fit answer (:func:`cannot_fit`); a bad value in a config raises a
    plain MultiheadError instead."""


def cannot_fit(model: ModelConfig, memory: int, why: str) -> MultiheadError:
    """The refusal of a fit answer for a model whose weights are not counted: "does it fit in ``memory``?" counts
    the weights (the KV cache alone would answer for a model without weights, past its own context too)."""
    from multihead.sizing.units import format_bytes

    where = model.hf.where if model.hf is not None else model.name
    return MultiheadError(f"{where}: cannot say what fits in {format_bytes(memory)}: the whole model's weights are "
                          f"not counted ({why}); a fit answer counts them. Without --device-memory and --hardware "
                          "the attention's own figures are given")


@dataclass(frozen=True)
class ModelSize:
    """Parameters of a whole model by part; ``total`` and ``active`` (per token, for mixtures of experts)."""

    name: str
    family: str
    parts: dict[str, int]
    active: int
    replicated: int  # not split by tensor parallelism (REPLICATED_PARTS: embeddings, norms, LM head, routers, pooler)
    tied: bool
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _config(model: ModelConfig) -> HFConfig:
    """The config the model was read from (every value already typed and ranged by multihead.hf.config)."""
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
    """The whole model's parameters from the config it was read from (``model.hf``). For a multimodal config (a
    ``text_config`` beside a vision_config, ...: Gemma 3, Mistral 3, Llama 4) the text model, said in the notes."""
    cfg = _config(model)
    family = cfg.model_type
    a, n_layers = model.attention, model.n_layers
    D = a.d_model
    if family in NOT_COUNTED:
        raise NotCounted(f"model_type {family!r} is {NOT_COUNTED[family]}")
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
    elif family in LLAMA_LIKE or family in MOE_FAMILIES:
        tied = bool(cfg.flag("tie_word_embeddings", default=family in TIED_BY_DEFAULT))
        parts["embeddings"] = V * D
        if family == "gpt_oss":  # each head's learned sink logit (s_aux), beside its projections
            attn_params += a.n_heads
        parts["attention"] = n_layers * attn_params
        parts["norms"] = n_layers * _norms_per_layer(family, D, a.head_dim) + D
        ffn = _ffn(cfg, family, D, n_layers)
        if ffn.dense:
            parts["mlp"] = ffn.dense
        if ffn.moe_layers:
            parts["experts"] = ffn.moe_layers * ffn.routed * ffn.expert
            if ffn.shared:
                parts["shared_experts"] = ffn.moe_layers * ffn.shared
            parts["routers"] = ffn.moe_layers * ffn.router
        if family == "deepseek_v3" and cfg.integer("num_nextn_predict_layers", default=0):
            notes.append("DeepSeek-V3's multi-token-prediction layer is not counted (transformers does not load it)")
        if family == "gpt_oss":
            notes.append("active counts the whole embedding table, as for every mixture of experts here; gpt-oss's "
                         "model card counts the unembedding toward active but not the embedding: its figure is this "
                         "one less the embeddings")
    else:
        raise NotCounted(f"model_type {family!r} is not counted yet: the whole-model count knows "
                             f"{', '.join(FAMILIES)}")
    if cfg.container:
        towers = ", ".join(cfg.towers) or "no other part"
        notes.append(f"the text model of this {cfg.container} config alone (its text_config): its {towers} and the "
                     "projector into the text model are not counted")
    if cfg.defaulted:
        given = ", ".join(f"{k} {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k} {v}"
                          for k, v in cfg.defaulted.items())
        notes.append(f"keys the file leaves to transformers' defaults for {family}: {given}")
    if not tied:
        parts["lm_head"] = V * D
    total = sum(parts.values())
    if total > MAX_PARAMETERS:
        raise MultiheadError(f"{cfg.where!r} describes {total:,} parameters: past MAX_PARAMETERS (2^61, whose "
                             "float32 bytes pass 2^63, the most an int64 byte count holds): no machine can allocate "
                             "them")
    active = total
    if "experts" in parts:
        ffn = _ffn(cfg, family, D, n_layers)
        active = total - ffn.moe_layers * (ffn.routed - ffn.per_token) * ffn.expert
    replicated = sum(parts.get(k, 0) for k in REPLICATED_PARTS)
    return ModelSize(name=model.name, family=family, parts=parts, active=active, replicated=replicated, tied=tied,
                     notes=notes)


def _norms_per_layer(family: str, D: int, head_dim: int) -> int:
    """The RMSNorm weights of one decoder layer: two of d_model (before attention and MLP); four in Gemma 2 and 3
    (also after each); Qwen3's and Gemma 3's q_norm and k_norm of head_dim beside them. (Llama 4's qk norm is an L2
    norm without weights.)"""
    per_layer = 4 * D if family in ("gemma2", "gemma3", "gemma3_text") else 2 * D
    if family in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"):
        per_layer += 2 * head_dim
    return per_layer


@dataclass(frozen=True)
class _Ffn:
    """The feed-forward part of a decoder: ``dense`` (the parameters of all its dense MLP layers) and, for a
    mixture of experts, ``moe_layers`` layers each of ``routed`` experts of ``expert`` parameters, ``per_token`` of
    them a token's, ``shared`` expert parameters (a token's too) and a ``router``."""

    dense: int = 0
    moe_layers: int = 0
    routed: int = 0
    per_token: int = 0
    expert: int = 0
    shared: int = 0
    router: int = 0


def _ffn(cfg: HFConfig, family: str, D: int, n_layers: int) -> _Ffn:
    """The feed-forward parameters of each family, as its transformers modules hold them (gated MLPs: gate, up and
    down, 3 D I; gpt-oss's experts with their biases)."""
    if family not in MOE_FAMILIES:
        return _Ffn(dense=n_layers * 3 * D * _width(cfg, "intermediate_size"))
    moe = _moe_layers(cfg, family, n_layers)
    if not family.startswith("deepseek"):
        routed = _experts(cfg, family)
        per_token = int(cfg.integer("num_experts_per_tok"))
    else:  # DeepSeek
        routed = int(cfg.integer("n_routed_experts", default=0))
        per_token = int(cfg.integer("num_experts_per_tok", default=0))
    if moe and per_token > routed:
        raise MultiheadError(f"{cfg.where!r}: num_experts_per_tok = {per_token:,}: expected at most the "
                             f"{routed:,} experts a layer has")
    dense_layers = n_layers - len(moe)
    if family == "mixtral":
        return _Ffn(moe_layers=len(moe), routed=routed, per_token=per_token,
                    expert=3 * D * _width(cfg, "intermediate_size"), router=D * routed)
    if family == "gpt_oss":  # gate_up (D x 2I) and down (I x D) with their biases; a router with a bias
        inner = _width(cfg, "intermediate_size")
        return _Ffn(moe_layers=len(moe), routed=routed, per_token=per_token, expert=3 * D * inner + 2 * inner + D,
                    router=D * routed + routed)
    if family in ("llama4", "llama4_text"):  # routed experts and one shared expert of intermediate_size each
        inner = _width(cfg, "intermediate_size")
        dense = dense_layers * 3 * D * _llama4_dense_width(cfg) if dense_layers else 0
        return _Ffn(dense=dense, moe_layers=len(moe), routed=routed, per_token=per_token, expert=3 * D * inner,
                    shared=3 * D * inner, router=D * routed)
    if family in ("qwen2_moe", "qwen3_moe"):
        dense = dense_layers * 3 * D * _width(cfg, "intermediate_size") if dense_layers else 0
        shared = 0
        if family == "qwen2_moe":
            shared_inner = int(cfg.integer("shared_expert_intermediate_size", default=0))
            shared = 3 * D * shared_inner + D if shared_inner else 0  # the shared expert and its sigmoid gate
        return _Ffn(dense=dense, moe_layers=len(moe), routed=routed, per_token=per_token,
                    expert=3 * D * _width(cfg, "moe_intermediate_size"), shared=shared, router=D * routed)
    expert = 3 * D * int(cfg.integer("moe_intermediate_size", default=0))
    dense = dense_layers * 3 * D * _width(cfg, "intermediate_size") if dense_layers else 0
    shared = int(cfg.integer("n_shared_experts", default=0)) * expert
    # (V3's router also keeps a score-correction bias per expert: a buffer, not a parameter)
    return _Ffn(dense=dense, moe_layers=len(moe), routed=routed, per_token=per_token, expert=expert, shared=shared,
                router=D * routed)


def _experts(cfg: HFConfig, family: str) -> int:
    """The routed experts of a MoE layer: num_experts in Qwen's configs, num_local_experts in the others' (and in
    the files transformers 5 writes for Qwen3-MoE: its config names the field so), whichever the file holds."""
    keys = ("num_experts", "num_local_experts") if family in ("qwen2_moe", "qwen3_moe") else (
        "num_local_experts", "num_experts")
    given = next((k for k in keys if cfg.has(k)), keys[0])
    return int(cfg.integer(given))


def _llama4_dense_width(cfg: HFConfig) -> int:
    """The MLP width of Llama 4's dense layers: intermediate_size_mlp (16,384 when absent, transformers'
    Llama4TextConfig default)."""
    return int(cfg.integer("intermediate_size_mlp", default=16384))


def _mlp_width(cfg: HFConfig, family: str, size: ModelSize, D: int) -> int:
    """The widest MLP hidden activation one token makes in a layer: intermediate_size (n_inner) for a dense
    model; for a mixture of experts the larger of a dense layer's (Llama 4: intermediate_size_mlp) and its routed
    experts' per token (moe_intermediate_size, or intermediate_size where that is the experts' width: Mixtral,
    gpt-oss, Llama 4)."""
    dense_inner = (_width(cfg, "intermediate_size") if cfg.has("intermediate_size") else
                   int(cfg.integer("n_inner", default=4 * D)))
    if family not in MOE_FAMILIES or "experts" not in size.parts:
        return dense_inner
    per_token = int(cfg.integer("num_experts_per_tok", default=1))
    if family in ("mixtral", "gpt_oss", "llama4", "llama4_text"):
        expert_inner = dense_inner
        dense_inner = _llama4_dense_width(cfg) if family.startswith("llama4") else dense_inner
    else:
        expert_inner = int(cfg.integer("moe_intermediate_size", default=dense_inner))
    return max(dense_inner if "mlp" in size.parts else 0, per_token * expert_inner)


def _moe_layers(cfg: HFConfig, family: str, n_layers: int) -> list[int]:
    """The layers that hold experts: every layer in Mixtral and gpt-oss; Qwen2/Qwen3-MoE's every
    decoder_sparse_step-th but those in mlp_only_layers; Llama 4's moe_layers, by default every
    interleave_moe_layer_step-th (from layer step - 1); DeepSeek's from first_k_dense_replace on, every
    moe_layer_freq-th."""
    if family in ("mixtral", "gpt_oss"):
        return list(range(n_layers))
    if family in ("qwen2_moe", "qwen3_moe"):
        dense = set(cfg.integers("mlp_only_layers", default=[]))
        every = int(cfg.integer("decoder_sparse_step", default=1))
        experts = _experts(cfg, family)
        return [i for i in range(n_layers) if i not in dense and experts > 0 and (i + 1) % every == 0]
    if family in ("llama4", "llama4_text"):
        given = cfg.integers("moe_layers", default=None)
        if given is not None:
            return sorted({i for i in given if i < n_layers})
        step = int(cfg.integer("interleave_moe_layer_step", default=1))
        return list(range(step - 1, n_layers, step))
    first = int(cfg.integer("first_k_dense_replace", default=0))
    every = int(cfg.integer("moe_layer_freq", default=1))
    routed = int(cfg.integer("n_routed_experts", default=0))
    return [i for i in range(n_layers) if i >= first and i % every == 0] if routed else []


# ---------------------------------------------------------------------------------------------- memory
def weight_spec(spec: str) -> tuple[str, dict[str, str]]:
    """(the default type, {part: its type}) of a weight dtype spec: one type (``bf16``), or per part after the
    default, ``bf16,experts=mxfp4`` (gpt-oss: experts in MXFP4, the rest bf16); parts are :data:`WEIGHT_PARTS`."""
    default, parts = None, {}
    for item in str(spec).split(","):
        part, _, dtype = item.strip().rpartition("=")
        key = dtype.strip().lower().removeprefix("torch.")
        if key not in WEIGHT_BITS:
            raise MultiheadError(f"weight dtype {dtype.strip()!r} is unknown: choose one of "
                                 f"{', '.join(sorted(WEIGHT_BITS))}")
        if not part:
            if default is not None:
                raise MultiheadError(f"weight dtype {spec!r} gives two default types ({default}, {key}): give one, "
                                     "then part=type for the parts stored otherwise, e.g. bf16,experts=mxfp4")
            default = key
        elif part.strip() not in WEIGHT_PARTS:
            raise MultiheadError(f"weight dtype {spec!r}: part {part.strip()!r} is unknown: the parts are "
                                 f"{', '.join(WEIGHT_PARTS)}")
        else:
            parts[part.strip()] = key
    if default is None:
        raise MultiheadError(f"weight dtype {spec!r} gives no default type: start with it, e.g. bf16,experts=mxfp4")
    return default, parts


def weight_bytes(params: int, dtype: str, *, part: str | None = None) -> int:
    """Bytes of ``params`` weights stored as ``dtype`` (fp32, bf16, int8, int4, mxfp4 (4.25 bits), nvfp4 (4.5 bits),
    or a GGUF type such as q4_1, q8_0, q4_k_m: llama.cpp's bits per weight, scales included; a K-quant mix such as
    q4_k_m at its base type's, :data:`GGUF_MIXES`). A per-part spec (:func:`weight_spec`) needs ``part``: the
    type it gives that part, else its default."""
    default, parts = weight_spec(dtype)
    if parts and part is None:
        raise MultiheadError(f"weight dtype {dtype!r} stores parts differently: count the bytes part by part "
                             "(multihead.sizing.parts_weight_bytes)")
    return math.ceil(params * WEIGHT_BITS[parts.get(part or "", default)] / 8)


def parts_weight_bytes(parts: Mapping[str, int], dtype: str, *, name: str = "the model") -> int:
    """Bytes of a model's weights by part ({part: parameters}, :attr:`ModelSize.parts`), each in the type ``dtype``
    gives it (:func:`weight_spec`); a part named in ``dtype`` that the model lacks is refused."""
    missing = [p for p in weight_spec(dtype)[1] if p not in parts]
    if missing:
        raise MultiheadError(f"weight dtype {dtype!r} names {', '.join(missing)}, which {name} does not have: its "
                             f"parts are {', '.join(parts)}")
    return sum(weight_bytes(n, dtype, part=k) for k, n in parts.items())


def size_parts(size: ModelSize, params: int) -> dict[str, int]:
    """The parts of ``params`` of the model's weights: ``size.total`` (every part) or ``size.active`` (what one
    token reads: the routed experts it uses)."""
    if params == size.total:
        return dict(size.parts)
    if params == size.active:
        return {**size.parts, **({"experts": size.parts["experts"] - (size.total - size.active)}
                                 if "experts" in size.parts else {})}
    raise MultiheadError(f"{params:,} parameters are neither {size.name}'s total ({size.total:,}) nor its active "
                         f"({size.active:,})")


FLOAT_DTYPES = ("fp32", "float32", "fp16", "float16", "bf16", "bfloat16")


def activation_dtype(dtype: str) -> str:
    """The element type of the activations when the KV cache is ``dtype``: the same for a float type; bf16 for an
    int8 or fp8 cache (the layers compute in bf16 and store K and V narrower)."""
    key = str(dtype).removeprefix("torch.")
    return key if key in FLOAT_DTYPES else "bf16"


def prefill_activation_bytes(model: ModelConfig, size: ModelSize, *, seq: int, batch: int, dtype: str, tp: int = 1,
                             shard_embeddings: bool = False) -> int:
    """The peak of a prefill's activations of ``seq`` tokens on one device, with a fused attention kernel (no (s, t)
    matrix), inference only: the residual stream (on every device) plus the largest transient of one layer (q, k, v
    and the attention output, or the MLP's gate, up and their product; split over ``tp`` devices by heads and
    columns), and the last position's logits in float32 (split by vocabulary with ``shard_embeddings``), in the
    activation dtype (:func:`activation_dtype`)::

        b s bytes (D + max(2 D / tp + 2 g' d, 3 I / tp)) + b V 4 / (tp if shard_embeddings else 1)

    with g' the KV heads on one device (g / tp, or 1 where they are replicated: :func:`kv_share`).
    """
    cfg = _config(model)
    a = model.attention
    D, d = a.d_model, a.head_dim
    inner = _mlp_width(cfg, cfg.model_type, size, D)
    attention = -(-2 * D // tp) + 2 * kv_share(model, tp)[0] * d  # q and the output split; k, v of this device's heads
    if model.mla is not None:
        m = model.mla
        attention = -(-(m.n_heads * (2 * m.qk_head_dim + m.v_head_dim) + m.latent_dim) // tp)
    per_token = D + max(attention, -(-3 * inner // tp))
    V = int(cfg.integer("vocab_size", default=0))
    logits = batch * 4 * (-(-V // tp) if shard_embeddings else V)
    return batch * seq * per_token * cost.dtype_bytes(activation_dtype(dtype)) + logits


def kv_bytes(model: ModelConfig, *, context: int, batch: int, dtype: str, cache: str = "full") -> int:
    """The KV cache of the whole model by cache kind, summed layer by layer (``model.layers()``: a sliding layer
    holds min(context, window - 1) tokens, a full one the context, an MLA one its latents): "full", "window:N"
    (sinks 4 on every layer, or less where the layer holds less), "int8"/"int4"/"int2" (group 32, residual 128; a
    sliding layer's codes a ring of its window, :func:`multihead.sizing.cost.quantized_cache_bytes`), or "latent" (an
    MLA model's; also what "full" means for one). Each is what :func:`multihead.hf.cache.new_cache` allocates."""
    a, layers = model.attention, model.layers()
    if model.mla is not None:
        if cache in ("full", "latent"):
            return cost.layers_kv_bytes(a, layers, context=context, batch=batch, dtype=dtype, mla=model.mla)
        raise MultiheadError(f"{model.name} caches MLA latents ({model.mla.latent_dim} values a token and layer), "
                             f"not keys and values per head: --cache {cache} sizes a cache of keys and values, which "
                             "multihead does not build for an MLA model (no quantized or windowed latent cache); give "
                             "--cache full (its latent cache)")
    if cache == "latent":
        raise MultiheadError(f"{model.name} has no latent attention: --cache latent is for MLA models")
    if cache == "full":
        return cost.layers_kv_bytes(a, layers, context=context, batch=batch, dtype=dtype)
    if cache.startswith("window:"):
        try:
            window = int(cache.split(":", 1)[1])
        except ValueError:
            raise MultiheadError(f"cache {cache!r}: give window:N with N a number of tokens") from None
        sink = cost.sink_cache_bytes(a, window=window, sink_tokens=4, batch=batch, dtype=dtype)
        return sum(min(sink, cost.layers_kv_bytes(a, (layer,), context=context, batch=batch, dtype=dtype))
                   for layer in layers)
    if cache in ("int8", "int4", "int2"):
        return sum(cost.quantized_cache_bytes(
            dataclasses.replace(a, window=layer.window), context=context,
            bits=int(cache[3:]), group=min(32, a.head_dim), batch=batch, dtype=dtype) for layer in layers)
    raise MultiheadError(f"cache {cache!r} is unknown: choose full, window:N, int8, int4, int2 or latent")


def kv_max_context(model: ModelConfig, *, memory: int, batch: int, dtype: str, cache: str = "full") -> int | None:
    """The longest context whose KV cache alone (:func:`kv_bytes`, this cache kind) fits in ``memory``; None when
    any does (every layer's cache stops growing)."""
    def ok(c: int) -> bool:
        return kv_bytes(model, context=c, batch=batch, dtype=dtype, cache=cache) <= memory

    return _largest(ok, limit=1 << 50)


def _largest(ok: Callable[[int], bool], *, limit: int) -> int | None:
    """The largest n >= 1 with ``ok(n)`` for a test that holds up to some n and fails after it: 0 when not even 1,
    None when it still holds at ``limit`` (doubling, then bisecting)."""
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class FitModel:
    """What is counted on each device (the one fit model of `count` and `compare`): the weights (split over ``tp``
    devices by heads and columns; embeddings and LM head on every device unless ``shard_embeddings``, as vLLM shards
    them by vocabulary), the KV cache at the context (each device its KV heads; an MLA latent on every device), the
    activations of a prefill of ``prefill_chunk`` tokens (None: the whole context at once), and ``reserve`` bytes
    kept back for the runtime (CUDA context, allocator, graphs: vLLM's gpu_memory_utilization)."""

    dtype: str = "bf16"
    weights_dtype: str = "bf16"
    cache: str = "full"
    tp: int = 1
    prefill_chunk: int | None = None
    reserve: int = 0
    shard_embeddings: bool = False

    def describe(self, seq: int, *, latent: bool = False) -> str:
        """What is counted, in words; ``latent``: the model is MLA, whose full cache is its latent (so said)."""
        chunk = seq if self.prefill_chunk is None else min(seq, self.prefill_chunk)
        kind = "latent: MLA's full cache" if cache_label(self.cache, latent=latent) == "latent" else self.cache
        return (f"weights ({self.weights_dtype}) + KV cache ({kind}, {self.dtype}) "
                "+ activations of a prefill "
                f"of {chunk:,} tokens ({activation_dtype(self.dtype)})"
                + (f" + a reserve of {self.reserve:,} B" if self.reserve else "")
                + (f", over {self.tp} devices" if self.tp > 1 else "")
                + ("; embeddings and LM head sharded by vocabulary" if self.shard_embeddings and self.tp > 1 else ""))


def cache_label(cache: str, *, latent: bool = False) -> str:
    """The cache kind counted: an MLA model's full cache is its latent (kv_lora_rank + the shared RoPE key per token
    and layer; :func:`kv_bytes` counts "full" and "latent" alike for one), so it is called that."""
    return "latent" if latent and cache == "full" else cache


def replicated_parts(size: ModelSize, *, shard_embeddings: bool = False) -> list[str]:
    """The parts of ``size`` every device holds whole under tensor parallelism (:data:`REPLICATED_PARTS`; the
    embeddings and LM head are split by vocabulary with ``shard_embeddings``)."""
    vocab = ("embeddings", "lm_head") if shard_embeddings else ()
    return [k for k in REPLICATED_PARTS if k in size.parts and k not in vocab]


@dataclass(frozen=True)
class Fit:
    weights: int  # the model's weights, counted once
    kv: int  # the model's KV cache, counted once
    activations: int  # per device
    per_device: int  # the sum of the four per-device terms
    memory: int
    tp: int
    weights_per_device: int = 0
    kv_per_device: int = 0
    reserve: int = 0
    weights_replicated: int = 0  # of weights_per_device: the parts every device holds whole (replicated_parts)

    @property
    def fits(self) -> bool:
        return self.per_device <= self.memory

    @property
    def weights_all_devices(self) -> int:
        """What the tp devices hold together: tp x weights_per_device (the replicated parts tp times)."""
        return self.tp * self.weights_per_device

    @property
    def kv_all_devices(self) -> int:
        return self.tp * self.kv_per_device


def kv_share(model: ModelConfig, tp: int) -> tuple[int, int]:
    """(KV heads on each device, devices holding each KV head) over ``tp`` devices: (g / tp, 1) when tp divides the
    g KV heads; (1, tp / g) when there are fewer KV heads than devices, which serving engines replicate (vLLM: "Number
    of KV heads is less than TP size, so we replicate the KV heads across multiple tensor parallel GPUs", each
    device at least one; its QKVParallelLinear holds num_kv_heads = max(1, g // tp)). An MLA latent is shared by
    every head: (1, tp), the whole latent cache on each device."""
    if model.mla is not None:
        return 1, tp
    g = int(model.attention.n_kv_heads or model.attention.n_heads)
    return max(1, g // tp), max(1, tp // g)


def kv_on_device(model: ModelConfig, kv: int, tp: int) -> int:
    """One device's share of ``kv`` bytes of the model's KV cache (:func:`kv_share`): kv x heads on it / g."""
    if model.mla is not None:
        return kv
    g = int(model.attention.n_kv_heads or model.attention.n_heads)
    return -(-kv * kv_share(model, tp)[0] // g)


def weights_on_device(model: ModelConfig, size: ModelSize, *, params: int, weights_dtype: str, tp: int,
                      shard_embeddings: bool = False) -> tuple[int, int]:
    """(bytes on one device, of them the bytes every device holds whole) of ``params`` of the model's weights
    (``size.total``, or ``size.active`` for what a token reads) over ``tp`` devices: the replicated parts
    (:func:`replicated_parts`) whole, the K and V projections of the KV heads the device holds (:func:`kv_share`:
    each head's on every device that holds it), the rest split::

        replicated + ceil((weights - replicated - kv_proj) / tp) + ceil(kv_proj x heads on the device / g)
    """
    parts = size_parts(size, params)
    weights = parts_weight_bytes(parts, weights_dtype, name=size.name)
    if tp == 1:
        return weights, weights
    rep = sum(weight_bytes(size.parts[k], weights_dtype, part=k)
              for k in replicated_parts(size, shard_embeddings=shard_embeddings))
    heads, copies = kv_share(model, tp)
    kv_proj, kv_proj_dev = 0, 0
    if model.mla is None and copies > 1:
        p = cost.parameters(model.attention)
        g = int(model.attention.n_kv_heads or model.attention.n_heads)
        kv_proj = weight_bytes(model.n_layers * (p.k_proj + p.v_proj), weights_dtype, part="attention")
        kv_proj_dev = -(-kv_proj * heads // g)
    return rep + -(-(weights - rep - kv_proj) // tp) + kv_proj_dev, rep


def fit(model: ModelConfig, size: ModelSize, *, seq: int, batch: int, dtype: str, weights_dtype: str, memory: int,
        tp: int = 1, cache: str = "full", prefill_chunk: int | None = None, reserve: int = 0,
        shard_embeddings: bool = False) -> Fit:
    """Memory per device (:class:`FitModel`): weights_per_device + kv_per_device + activations + reserve, the
    weights split as multihead.layers.parallel splits them (attention and MLP by heads and columns; norms and routers on
    every device, embeddings and the LM head too unless ``shard_embeddings``: :func:`weights_on_device`), the KV
    cache by KV heads, a head on several devices where there are fewer than ``tp`` (:func:`kv_share`)."""
    check_tp(model, tp)
    weights = parts_weight_bytes(size.parts, weights_dtype, name=size.name)
    weights_dev, rep = weights_on_device(model, size, params=size.total, weights_dtype=weights_dtype, tp=tp,
                                         shard_embeddings=shard_embeddings)
    kv = kv_bytes(model, context=seq, batch=batch, dtype=dtype, cache=cache)
    kv_dev = kv_on_device(model, kv, tp)
    chunk = seq if prefill_chunk is None else min(seq, prefill_chunk)
    act = prefill_activation_bytes(model, size, seq=chunk, batch=batch, dtype=dtype, tp=tp,
                                   shard_embeddings=shard_embeddings)
    per_device = weights_dev + kv_dev + act + reserve
    return Fit(weights=weights, kv=kv, activations=act, per_device=per_device, memory=memory, tp=tp,
               weights_per_device=weights_dev, kv_per_device=kv_dev, reserve=reserve, weights_replicated=rep)


def valid_tp(model: ModelConfig) -> list[int]:
    """The tensor-parallel sizes the fit model takes: those that divide the query heads and either divide the KV
    heads or are a multiple of them (vLLM's rule: fewer KV heads than devices are replicated, :func:`kv_share`)."""
    from multihead.divisors import divisors

    a = model.attention
    heads = model.mla.n_heads if model.mla is not None else a.n_heads
    kv = heads if model.mla is not None else int(a.n_kv_heads or a.n_heads)
    return [t for t in divisors(heads) if kv % t == 0 or t % kv == 0]


def check_tp(model: ModelConfig, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or tp not in valid_tp(model):
        a = model.attention
        heads = model.mla.n_heads if model.mla is not None else a.n_heads
        kv = heads if model.mla is not None else a.n_kv_heads
        raise MultiheadError(f"--tp {tp!r} must divide the {heads} query heads and divide, or be a multiple of, "
                             f"the {kv} KV heads (fewer KV heads than devices are replicated, as vLLM does): choose "
                             f"one of {', '.join(map(str, valid_tp(model)))}")


def fit_kwargs(f: FitModel) -> dict[str, Any]:
    """The keywords of :func:`fit` (and largest, devices_needed) that a :class:`FitModel` sets, all but ``tp``."""
    return {"dtype": f.dtype, "weights_dtype": f.weights_dtype, "cache": f.cache, "prefill_chunk": f.prefill_chunk,
            "reserve": f.reserve, "shard_embeddings": f.shard_embeddings}


def devices_needed(model: ModelConfig, size: ModelSize, *, seq: int, batch: int, dtype: str, weights_dtype: str,
                   memory: int, cache: str = "full", prefill_chunk: int | None = None, reserve: int = 0,
                   shard_embeddings: bool = False) -> int | None:
    """The fewest devices (a valid tensor-parallel size) on which the model fits; None if none does."""
    for tp in valid_tp(model):
        if fit(model, size, seq=seq, batch=batch, dtype=dtype, weights_dtype=weights_dtype, memory=memory, tp=tp,
               cache=cache, prefill_chunk=prefill_chunk, reserve=reserve, shard_embeddings=shard_embeddings).fits:
            return tp
    return None


def largest(model: ModelConfig, size: ModelSize, *, seq: int, batch: int, dtype: str, weights_dtype: str,
            memory: int, tp: int = 1, cache: str = "full", what: str = "context", prefill_chunk: int | None = None,
            reserve: int = 0, shard_embeddings: bool = False) -> int:
    """The largest context (at ``batch``) or batch (at ``seq``) that fits in memory; 0 if not even one. (Memory
    alone: :func:`whole_model` caps the context at the model's own limit.)"""
    def ok(n: int) -> bool:
        s, b = (n, batch) if what == "context" else (seq, n)
        return fit(model, size, seq=s, batch=b, dtype=dtype, weights_dtype=weights_dtype, memory=memory, tp=tp,
                   cache=cache, prefill_chunk=prefill_chunk, reserve=reserve, shard_embeddings=shard_embeddings).fits

    found = _largest(ok, limit=1 << 40)
    return 1 << 40 if found is None else found  # it still fits at 2**40: that is reported


def context_limit(model: ModelConfig) -> int | None:
    """The model's own longest context (max_position_embeddings, or a RoPE scaling's longer one), if it says."""
    return model.hf.context_limit if model.hf is not None else model.max_context


def check_seq(model: ModelConfig, seq: int) -> None:
    """The one rule for a context past the model's own (:func:`context_limit`): refused, naming both, by every
    figure that takes one (whole_model, attention_report, compare, the hardware estimate), never answered as if the
    model could run it. A model that states no limit (sizes given alone) takes any."""
    limit = context_limit(model)
    if limit is not None and seq > limit:
        why = ("max_position_embeddings" if model.hf is None or model.hf.context_limit == model.hf.max_context
               else "its rope_scaling's factor x original_max_position_embeddings")
        raise MultiheadError(f"--seq {seq:,} is past {model.name}'s own context of {limit:,} tokens ({why}): give "
                             f"--seq {limit:,} or less")


def largest_context(model: ModelConfig, size: ModelSize, *, seq: int, batch: int, memory: int,
                    fitting: FitModel) -> tuple[int, int, int | None]:
    """(the context that fits: memory's answer capped at the model's limit, memory's answer, the limit)."""
    by_memory = largest(model, size, seq=seq, batch=batch, memory=memory, tp=fitting.tp, what="context",
                        **fit_kwargs(fitting))
    limit = context_limit(model)
    return (by_memory if limit is None else min(by_memory, limit)), by_memory, limit


# ---------------------------------------------------------------------------------------------- the whole model
def whole_model(model: ModelConfig, *, seq: int, batch: int, dtype: str, weights_dtype: str, tp: int = 1,
                cache: str = "full", memory: int | None = None, prefill_chunk: int | None = None, reserve: int = 0,
                shard_embeddings: bool = False) -> dict[str, Any] | None:
    """The whole model's parameters, memory and fit (what `multihead count` reports as ``whole_model``), or None for
    a model described by its attention sizes alone (no vocabulary). A model whose parts cannot be sized gives
    ``{"unavailable": why}``, or with ``memory`` raises (:func:`cannot_fit`: no fit answer without the weights).
    With ``memory`` (bytes per device): whether it fits, on how few devices, and the
    largest context (capped at the model's own, ``context_limit_binds`` when that is what stops it) and batch that
    do. Every ``*_per_device`` term is one device's; they add up to ``bytes_per_device``; ``*_all_devices`` is tp
    times one device's (``replicated_parts``, ``weight_bytes_replicated_per_device``: what each device holds whole),
    where ``weight_bytes`` and ``kv_bytes`` count the model's once. A ``seq`` past the
    model's own context is refused (:func:`check_seq`)."""
    check_seq(model, seq)
    if model.hf is None or "vocab_size" not in model.hf:
        return None
    try:
        size = model_size(model)
    except NotCounted as err:  # a family or layout the count does not know: said; a fit answer refused
        if memory is not None:
            raise cannot_fit(model, memory, str(err)) from None
        return {"unavailable": str(err)}
    check_tp(model, tp)
    fitting = FitModel(dtype=dtype, weights_dtype=weights_dtype, cache=cache, tp=tp, prefill_chunk=prefill_chunk,
                       reserve=reserve, shard_embeddings=shard_embeddings)
    out: dict[str, Any] = {
        "total_parameters": size.total, "active_parameters": size.active, "parameters_by_part": size.parts,
        "tied_embeddings": size.tied, "notes": list(size.notes), "weights_dtype": weights_dtype, "tp": tp,
        "cache": cache_label(cache, latent=model.mla is not None),
        "counted": fitting.describe(seq, latent=model.mla is not None), "activation_dtype": activation_dtype(dtype),
        "prefill_chunk": seq if prefill_chunk is None else min(seq, prefill_chunk), "reserve_bytes": reserve,
        "shard_embeddings": shard_embeddings, "layer_kinds": cost.layers_summary(model.layers()),
        "context_limit": context_limit(model),
    }
    f = fit(model, size, seq=seq, batch=batch, memory=memory or 0, tp=tp, **fit_kwargs(fitting))
    out.update({"weight_bytes": f.weights, "kv_bytes": f.kv, "activation_bytes": f.activations,
                "weight_bytes_per_device": f.weights_per_device, "kv_bytes_per_device": f.kv_per_device,
                "activation_bytes_per_device": f.activations, "bytes_per_device": f.per_device,
                "weight_bytes_all_devices": f.weights_all_devices, "kv_bytes_all_devices": f.kv_all_devices,
                "replicated_parts": replicated_parts(size, shard_embeddings=shard_embeddings) if tp > 1 else [],
                "weight_bytes_replicated_per_device": f.weights_replicated if tp > 1 else 0})
    heads, copies = kv_share(model, tp)
    out["kv_heads_per_device"], out["devices_per_kv_head"] = heads, copies
    if model.mla is not None and tp > 1:
        out["kv_note"] = "the latent cache, shared by every head, on each device"
    elif copies > 1:
        g = model.attention.n_kv_heads
        out["kv_note"] = f"each of the {g} KV heads, its cache and its K and V projections, on {copies} devices"
        out["notes"].append(f"{g} KV heads over {tp} devices: each device holds 1, each head on {copies} devices, as "
                            "vLLM replicates KV heads when there are fewer than devices (multihead.layers.parallel "
                            "itself needs --tp to divide them)")
    if memory is not None:
        common: dict[str, Any] = {"memory": memory, **fit_kwargs(fitting)}
        out["fits"] = f.fits
        out["devices_needed"] = devices_needed(model, size, seq=seq, batch=batch, **common)
        if f.fits:
            capped, by_memory, _ = largest_context(model, size, seq=seq, batch=batch, memory=memory, fitting=fitting)
            out["largest_context"] = capped
            out["largest_context_by_memory"] = by_memory
            out["context_limit_binds"] = capped < by_memory
            out["largest_batch"] = largest(model, size, seq=seq, batch=batch, tp=tp, what="batch", **common)
    return out


# ---------------------------------------------------------------------------------------------- attention alone
def attention_report(model: ModelConfig, *, seq: int, batch: int, dtype: str, causal: bool, cache: str = "full",
                     memory: int | None = None) -> dict[str, Any]:
    """The attention figures `multihead count` prints (cost.report, summed layer by layer over ``model.layers()``).
    For an MLA model the top level is its latent attention (parameters, FLOPs of the expanded path, the latent
    cache); the same heads as plain MHA, for comparison, go under ``as_mha``, and ``mla`` keeps mla_report's figures.
    ``max_context_in_device_memory``: the longest context whose cache of kind ``cache`` alone fits in ``memory``,
    capped at the model's own context (``context_limit_binds`` when that is what stops it)."""
    check_seq(model, seq)
    a, layers = model.attention, model.layers()
    if model.mla is None:
        r = cost.report(a, seq=seq, batch=batch, dtype=dtype, causal=causal, layers=layers)
    else:
        m = model.mla
        n = model.n_layers
        mha = cost.report(a, n_layers=n, seq=seq, batch=batch, dtype=dtype, causal=causal)
        r = dict(mha)
        mla = cost.mla_report(m, n_layers=n, seq=seq, batch=batch, dtype=dtype, causal=causal)
        f = cost.mla_flops(m, s=seq, batch=batch, causal=causal)
        dense = cost.mla_flops(m, s=seq, batch=batch, causal=False)
        p = cost.mla_parameters(m)
        per_token = m.latent_dim * cost.dtype_bytes(dtype)
        r.update({
            "variant": "MLA", "n_kv_heads": 1, "params_per_layer": p.total,
            "params_per_layer_by_projection": {k: v for k, v in dataclasses.asdict(p).items()
                                               if k.endswith("proj")},
            "params_total": p.total * n, "flops_forward": f.forward * n, "flops_forward_per_layer": f.forward,
            "flops_forward_by_part_per_layer": dataclasses.asdict(f), "flops_attention_core": f.attention * n,
            "flops_backward": 2 * f.forward * n, "flops_forward_dense_mask": dense.forward * n,
            "kv_cache_bytes_per_token_per_layer": per_token, "kv_cache_bytes_per_token": per_token * n,
            "kv_cache_tokens": seq, "kv_cache_bytes_total": mla["cache_bytes_total"],
            "layer_kinds": cost.layers_summary(layers),
            "as_mha": {k: mha[k] for k in ("variant", "config", "n_kv_heads", "params_per_layer",
                                           "params_per_layer_by_projection", "params_total", "flops_forward",
                                           "flops_forward_per_layer", "flops_forward_by_part_per_layer",
                                           "flops_attention_core", "flops_backward", "flops_forward_dense_mask",
                                           "kv_cache_bytes_per_token_per_layer", "kv_cache_bytes_per_token",
                                           "kv_cache_tokens", "kv_cache_bytes_total")},
            "mla": mla,
        })
    r["model"] = model.name
    r["cache"] = cache_label(cache, latent=model.mla is not None)
    r["kv_cache_bytes_as_cached"] = kv_bytes(model, context=seq, batch=batch, dtype=dtype, cache=cache)
    if memory is not None:
        # never past the model's own context (the rule of check_seq): the memory's answer, capped, and which binds
        by_memory = kv_max_context(model, memory=memory, batch=batch, dtype=dtype, cache=cache)
        limit = context_limit(model)
        r["device_memory_bytes"] = memory
        r["context_limit"] = limit
        r.update(_capped(by_memory, limit))
        if model.mla is not None:  # the same heads as plain MHA: their own full cache's answer, capped the same way
            r["mla"]["max_context_in_device_memory"] = r["max_context_in_device_memory"]
            r["as_mha"]["cache"] = "full"
            r["as_mha"].update(_capped(cost.max_context(a, memory_bytes=memory, batch=batch, n_layers=model.n_layers,
                                                        dtype=dtype), limit))
    return r


def _capped(by_memory: int | None, limit: int | None) -> dict[str, Any]:
    """The memory's answer (None: any context) capped at the model's own context, and whether that cap binds."""
    return {"max_context_in_device_memory": (by_memory if limit is None else limit if by_memory is None
                                             else min(by_memory, limit)),
            "context_limit_binds": limit is not None and (by_memory is None or by_memory > limit),
            "max_context_by_memory": by_memory}  # the memory's own answer (None: any), past the limit or not
