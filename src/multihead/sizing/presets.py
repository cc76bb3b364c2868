"""Configurations of real models, and reading any Hugging Face ``config.json``.

Each preset is the attention-relevant part of the model's published ``config.json``, read by the same
:func:`from_hf_dict` that reads user files (through :mod:`multihead.hf.config`, the one reader of config.json), so a
preset and the file it was copied from give the same config.
Names are exact (no fuzzy matching): an unknown name raises and lists the known ones.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multihead.config import AttentionConfig, MLAConfig
from multihead.errors import MultiheadError
from multihead.hf.config import HFConfig, read_config
from multihead.sizing import cost
from multihead.sizing.cost import LayerAttention
from multihead.values import MAX_PARAMETERS


@dataclass(frozen=True)
class ModelConfig:
    """A model's attention layer and how many of them it has."""

    name: str
    attention: AttentionConfig
    n_layers: int
    causal: bool
    max_context: int | None = None
    source: str = ""
    note: str = ""  # what the name alone does not say (a preset's version: NOTES)
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek); ``attention`` is then MHA with its heads
    hf: HFConfig | None = None  # the config it was read from (for the whole-model count, multihead.sizing)
    layer_kinds: tuple[LayerAttention, ...] | None = None  # each layer's kind, read from the config (HFConfig)

    def layers(self) -> tuple[LayerAttention, ...]:
        """Each of the n_layers layers' attention kind: latent for an MLA model; the config's kinds (Gemma 2's
        alternation, ``layer_types``, ...; a pattern repeated when n_layers differs); else every layer as
        ``attention`` (sliding with its window)."""
        if self.mla is not None:
            return (LayerAttention("latent"),) * self.n_layers
        kinds = self.layer_kinds
        if kinds and not any(k.kind == "latent" for k in kinds):
            return tuple(kinds[i % len(kinds)] for i in range(self.n_layers))
        return (LayerAttention.of(self.attention),) * self.n_layers


def _llama3_rope(factor: float) -> dict[str, Any]:
    """Llama 3.1/3.2/3.3's published rope_scaling (rope_type llama3, from Llama 3's 8,192), with its factor."""
    return {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"}


# Excerpts of the published config.json of each model (Hugging Face Hub, the model's own repository).
_PUBLISHED: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("openai-community/gpt2", {
        "model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257}),
    "gpt2-medium": ("openai-community/gpt2-medium", {
        "model_type": "gpt2", "n_embd": 1024, "n_head": 16, "n_layer": 24, "n_positions": 1024, "vocab_size": 50257}),
    "gpt2-large": ("openai-community/gpt2-large", {
        "model_type": "gpt2", "n_embd": 1280, "n_head": 20, "n_layer": 36, "n_positions": 1024, "vocab_size": 50257}),
    "gpt2-xl": ("openai-community/gpt2-xl", {
        "model_type": "gpt2", "n_embd": 1600, "n_head": 25, "n_layer": 48, "n_positions": 1024, "vocab_size": 50257}),
    "bert-base": ("google-bert/bert-base-uncased", {
        "model_type": "bert", "hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12,
        "max_position_embeddings": 512, "vocab_size": 30522, "intermediate_size": 3072, "type_vocab_size": 2}),
    "all-minilm-l6-v2": ("sentence-transformers/all-MiniLM-L6-v2", {
        "model_type": "bert", "hidden_size": 384, "num_attention_heads": 12, "num_hidden_layers": 6,
        "max_position_embeddings": 512, "vocab_size": 30522, "intermediate_size": 1536, "type_vocab_size": 2}),
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", {
        "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
        "num_hidden_layers": 32, "max_position_embeddings": 4096, "rope_theta": 10000.0, "vocab_size": 32000,
        "intermediate_size": 11008, "tie_word_embeddings": False}),
    "llama-2-70b": ("meta-llama/Llama-2-70b-hf", {
        "model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
        "num_hidden_layers": 80, "max_position_embeddings": 4096, "rope_theta": 10000.0, "vocab_size": 32000,
        "intermediate_size": 28672, "tie_word_embeddings": False}),
    "llama-3-8b": ("meta-llama/Meta-Llama-3-8B", {
        "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "max_position_embeddings": 8192, "rope_theta": 500000.0, "vocab_size": 128256,
        "intermediate_size": 14336, "tie_word_embeddings": False}),
    "llama-3-70b": ("meta-llama/Meta-Llama-3-70B", {
        "model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
        "num_hidden_layers": 80, "max_position_embeddings": 8192, "rope_theta": 500000.0, "vocab_size": 128256,
        "intermediate_size": 28672, "tie_word_embeddings": False}),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", {
        "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": _llama3_rope(8.0), "vocab_size": 128256, "intermediate_size": 14336,
        "tie_word_embeddings": False}),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B", {
        "model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
        "num_hidden_layers": 80, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": _llama3_rope(8.0), "vocab_size": 128256, "intermediate_size": 28672,
        "tie_word_embeddings": False}),
    "llama-3.1-405b": ("meta-llama/Llama-3.1-405B", {
        "model_type": "llama", "hidden_size": 16384, "num_attention_heads": 128, "num_key_value_heads": 8,
        "num_hidden_layers": 126, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": _llama3_rope(8.0), "vocab_size": 128256, "intermediate_size": 53248,
        "tie_word_embeddings": False}),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B", {
        "model_type": "llama", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "num_hidden_layers": 16, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": _llama3_rope(32.0), "vocab_size": 128256, "intermediate_size": 8192,
        "tie_word_embeddings": True}),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B", {
        "model_type": "llama", "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
        "head_dim": 128, "num_hidden_layers": 28, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": _llama3_rope(32.0), "vocab_size": 128256, "intermediate_size": 8192,
        "tie_word_embeddings": True}),
    "llama-3.3-70b": ("meta-llama/Llama-3.3-70B-Instruct", {
        "model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
        "num_hidden_layers": 80, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": _llama3_rope(8.0), "vocab_size": 128256, "intermediate_size": 28672,
        "tie_word_embeddings": False}),
    "mistral-7b": ("mistralai/Mistral-7B-v0.1", {
        "model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "max_position_embeddings": 32768, "rope_theta": 10000.0, "sliding_window": 4096,
        "vocab_size": 32000, "intermediate_size": 14336, "tie_word_embeddings": False}),
    "falcon-7b": ("tiiuae/falcon-7b", {
        "model_type": "falcon", "hidden_size": 4544, "n_head": 71, "n_layer": 32, "multi_query": True,
        "bias": False, "alibi": False, "new_decoder_architecture": False, "parallel_attn": True,
        "vocab_size": 65024}),
    "gemma-7b": ("google/gemma-7b", {
        "model_type": "gemma", "hidden_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 16,
        "head_dim": 256, "num_hidden_layers": 28, "max_position_embeddings": 8192, "rope_theta": 10000.0,
        "attention_bias": False, "vocab_size": 256000, "intermediate_size": 24576}),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", {
        "model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
        "num_hidden_layers": 28, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
        "sliding_window": 131072, "use_sliding_window": False, "vocab_size": 152064, "intermediate_size": 18944,
        "tie_word_embeddings": False}),
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M", {
        "model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "num_hidden_layers": 30, "max_position_embeddings": 8192, "rope_theta": 100000.0, "vocab_size": 49152,
        "intermediate_size": 1536, "tie_word_embeddings": True}),
    "deepseek-v2-lite": ("deepseek-ai/DeepSeek-V2-Lite", {
        "model_type": "deepseek_v2", "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_hidden_layers": 27, "max_position_embeddings": 163840, "rope_theta": 10000, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "attention_bias": False, "rms_norm_eps": 1e-06, "vocab_size": 102400, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "tie_word_embeddings": False}),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", {
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128,
        "num_hidden_layers": 61, "max_position_embeddings": 163840, "rope_theta": 10000, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "attention_bias": False, "rms_norm_eps": 1e-06, "vocab_size": 129280, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False}),
    # issue 40's families. Multimodal configs keep their nesting (a text_config beside a vision_config, of which only
    # the model type and sizes are kept): the count is the text model's, and says so.
    "gpt-oss-20b": ("openai/gpt-oss-20b", {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_hidden_layers": 24, "max_position_embeddings": 131072, "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12, "attention_bias": True,
        "vocab_size": 201088, "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4,
        "tie_word_embeddings": False}),
    "gpt-oss-120b": ("openai/gpt-oss-120b", {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_hidden_layers": 36, "max_position_embeddings": 131072, "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18, "attention_bias": True,
        "vocab_size": 201088, "intermediate_size": 2880, "num_local_experts": 128, "num_experts_per_tok": 4,
        "tie_word_embeddings": False}),
    "gemma-3-1b": ("google/gemma-3-1b-it", {
        "model_type": "gemma3_text", "hidden_size": 1152, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "num_hidden_layers": 26, "max_position_embeddings": 32768, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144, "intermediate_size": 6912}),
    "gemma-3-4b": ("google/gemma-3-4b-it", {
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                          "num_attention_heads": 16, "num_hidden_layers": 27, "image_size": 896, "patch_size": 14}}),
    "gemma-3-27b": ("google/gemma-3-27b-it", {
        "model_type": "gemma3",
        "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                        "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                          "num_attention_heads": 16, "num_hidden_layers": 27, "image_size": 896, "patch_size": 14}}),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_hidden_layers": 48, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "sliding_window": None, "use_sliding_window": False, "max_window_layers": 48, "vocab_size": 151936,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}),
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B", {
        "model_type": "qwen3_moe", "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 4,
        "head_dim": 128, "num_hidden_layers": 94, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "sliding_window": None, "use_sliding_window": False, "max_window_layers": 94, "vocab_size": 151936,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}),
    "llama-4-scout": ("meta-llama/Llama-4-Scout-17B-16E", {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text", "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8,
            "head_dim": 128, "num_hidden_layers": 48, "max_position_embeddings": 10485760, "rope_theta": 500000.0,
            "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "attention_chunk_size": 8192, "use_qk_norm": True, "vocab_size": 202048, "intermediate_size": 8192,
            "intermediate_size_mlp": 16384, "num_local_experts": 16, "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1, "tie_word_embeddings": False},
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 1408, "num_attention_heads": 16,
                          "num_hidden_layers": 34, "image_size": 336, "patch_size": 14}}),
    "llama-4-maverick": ("meta-llama/Llama-4-Maverick-17B-128E", {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text", "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8,
            "head_dim": 128, "num_hidden_layers": 48, "max_position_embeddings": 1048576, "rope_theta": 500000.0,
            "rope_scaling": None, "attention_chunk_size": 8192, "use_qk_norm": False, "vocab_size": 202048,
            "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_local_experts": 128,
            "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "tie_word_embeddings": False},
        "vision_config": {"model_type": "llama4_vision_model"}}),
    "mistral-small-3.1-24b": ("mistralai/Mistral-Small-3.1-24B-Instruct-2503", {
        "model_type": "mistral3",
        "text_config": {"head_dim": 128, "hidden_size": 5120, "intermediate_size": 32768,
                        "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32,
                        "num_hidden_layers": 40, "num_key_value_heads": 8, "rope_theta": 1000000000.0,
                        "sliding_window": None, "vocab_size": 131072},
        "vision_config": {"hidden_size": 1024, "head_dim": 64, "image_size": 1540}}),
    "ministral-8b": ("mistralai/Ministral-8B-Instruct-2410", {
        "model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "num_hidden_layers": 36, "max_position_embeddings": 32768, "rope_theta": 100000000.0,
        "sliding_window": 32768, "vocab_size": 131072, "intermediate_size": 12288, "tie_word_embeddings": False}),
    "phi-4": ("microsoft/phi-4", {
        "model_type": "phi3", "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 10,
        "num_hidden_layers": 40, "max_position_embeddings": 16384, "original_max_position_embeddings": 16384,
        "rope_theta": 250000, "sliding_window": None, "vocab_size": 100352, "intermediate_size": 17920,
        "tie_word_embeddings": False}),
    "phi-4-mini": ("microsoft/Phi-4-mini-instruct", {
        "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "vocab_size": 200064, "intermediate_size": 8192,
        "tie_word_embeddings": True}),
}

PRESET_NAMES: tuple[str, ...] = tuple(_PUBLISHED)
# What a preset's name alone does not say (its version, where later ones differ)
NOTES: dict[str, str] = {
    "mistral-7b": "Mistral 7B v0.1: a sliding window of 4,096 on every layer (v0.2 and v0.3 have none: they "
                  "attend to their whole 32,768-token context)",
    "llama-3-8b": "Llama 3 (April 2024): a context of 8,192; Llama 3.1 is llama-3.1-8b",
    "llama-3-70b": "Llama 3 (April 2024): a context of 8,192; Llama 3.1 and 3.3 are llama-3.1-70b, llama-3.3-70b",
}


def from_hf_dict(cfg: Mapping[str, Any], *, name: str = "config", source: str = "") -> ModelConfig:
    """A :class:`ModelConfig` from the contents of a Hugging Face ``config.json``, read by
    :class:`multihead.hf.config.HFConfig` (every value typed and ranged; errors name ``name``).

    Reads the spellings real configs use: hidden_size / n_embd / d_model; num_attention_heads / n_head;
    num_key_value_heads / num_kv_heads / n_head_kv, or ``multi_query: true`` (one KV head, Falcon);
    head_dim; num_hidden_layers / n_layer; sliding_window (unless use_sliding_window is false); rope_theta;
    attention_bias / bias (and the families whose projections are biased by design: GPT-2, BERT, ...; Qwen2 has q/k/v
    biases and none on W_O).
    """
    return _model(HFConfig(cfg, where=name), name=name, source=source)


def _model(cfg: HFConfig, *, name: str, source: str) -> ModelConfig:
    attention, mla, n_layers = cfg.attention(), cfg.mla(), cfg.n_layers
    per_layer = cost.mla_parameters(mla).total if mla is not None else cost.parameters(attention).total
    if n_layers * per_layer > MAX_PARAMETERS:
        raise MultiheadError(
            f"{cfg.where!r}: {n_layers:,} layers of {per_layer:,} attention parameters make {n_layers * per_layer:,}: "
            "past MAX_PARAMETERS (2^61, whose float32 bytes pass 2^63, the most an int64 byte count holds): no "
            "machine can allocate them")
    return ModelConfig(name=name, attention=attention, n_layers=n_layers, causal=cfg.causal,
                       max_context=cfg.max_context, source=source, mla=mla, hf=cfg, layer_kinds=cfg.layer_kinds())


def from_hf_config(path: str | Path) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` file (or a folder holding one); every failure
    (a missing, unreadable or malformed file, a bad value) is one MultiheadError naming the file."""
    cfg = read_config(path)
    p = Path(cfg.where)
    return _model(cfg, name=p.parent.name or str(p), source=str(p))


def published(name: str) -> tuple[str, dict[str, Any]]:
    """(the address of its config.json, a copy of the excerpt the preset holds) of the named preset: what a test
    builds transformers' own model from."""
    if name not in _PUBLISHED:
        import difflib

        close = difflib.get_close_matches(name.lower(), PRESET_NAMES, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise MultiheadError(f"unknown preset {name!r}: {hint}known presets are {', '.join(PRESET_NAMES)} "
                             "(`multihead presets` shows their shapes)")
    source, cfg = _PUBLISHED[name]
    return f"https://huggingface.co/{source}/blob/main/config.json", copy.deepcopy(cfg)


def preset(name: str) -> ModelConfig:
    """The named preset, by its exact name (see PRESET_NAMES)."""
    source, cfg = published(name)
    return dataclasses.replace(from_hf_dict(cfg, name=name, source=source), note=NOTES.get(name, ""))
