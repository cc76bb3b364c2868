"""Configurations of real models, and reading any Hugging Face ``config.json``.

Each preset is the attention-relevant part of the model's published ``config.json``, read by the same
:func:`from_hf_dict` that reads user files, so a preset and the file it was copied from give the same config.
Names are exact (no fuzzy matching): an unknown name raises and lists the known ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multihead.config import AttentionConfig, MLAConfig, RopeConfig
from multihead.errors import MultiheadError


@dataclass(frozen=True)
class ModelConfig:
    """A model's attention layer and how many of them it has."""

    name: str
    attention: AttentionConfig
    n_layers: int
    causal: bool
    max_context: int | None = None
    source: str = ""
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek); ``attention`` is then MHA with its heads
    hf: dict[str, Any] | None = None  # the config it was read from (for the whole-model count, multihead.sizing)


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
}

PRESET_NAMES: tuple[str, ...] = tuple(_PUBLISHED)

# Encoders attend both ways; everything else here is a causal decoder.
_ENCODERS = {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "mpnet", "albert", "deberta", "deberta-v2"}
# Families whose attention projections have biases by design (no flag in their config).
_BIASED = {"gpt2", "bert", "roberta", "xlm-roberta", "distilbert", "electra", "mpnet", "albert", "gpt_neox",
           "gptj", "opt", "bloom", "phi"}
_ABSOLUTE = {"gpt2", "bert", "roberta", "xlm-roberta", "distilbert", "electra", "mpnet", "albert", "opt", "bloom"}

_SPELLINGS = {
    "d_model": ("hidden_size", "n_embd", "d_model", "dim", "model_dim"),
    "n_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads"),
    "n_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "n_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "n_kv_heads", "multi_query_group_num"),
    "max_context": ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"),
}


def _first(cfg: dict[str, Any], field: str, *, required: bool, where: str) -> Any:
    for key in _SPELLINGS[field]:
        if cfg.get(key) is not None:
            return cfg[key]
    if required:
        raise MultiheadError(
            f"{where} has no {field}: expected one of the fields {', '.join(_SPELLINGS[field])}"
        )
    return None


def from_hf_dict(cfg: dict[str, Any], *, name: str = "config", source: str = "") -> ModelConfig:
    """A :class:`ModelConfig` from the contents of a Hugging Face ``config.json``.

    Reads the spellings real configs use: hidden_size / n_embd / d_model; num_attention_heads / n_head;
    num_key_value_heads / num_kv_heads / n_head_kv, or ``multi_query: true`` (one KV head, Falcon);
    head_dim; num_hidden_layers / n_layer; sliding_window (unless use_sliding_window is false); rope_theta;
    attention_bias / bias (and the families whose projections are biased by design: GPT-2, BERT, ...; Qwen2 has q/k/v
    biases and none on W_O).
    """
    if not isinstance(cfg, dict):
        raise MultiheadError(f"{name}: a config must be a JSON object, got {type(cfg).__name__}")
    text_cfg = cfg.get("text_config")
    if isinstance(text_cfg, dict) and not any(k in cfg for k in _SPELLINGS["d_model"]):
        cfg = {**text_cfg, "model_type": text_cfg.get("model_type", cfg.get("model_type"))}
    model_type = str(cfg.get("model_type", "")).lower()
    d_model = _first(cfg, "d_model", required=True, where=name)
    n_heads = _first(cfg, "n_heads", required=True, where=name)
    n_layers = _first(cfg, "n_layers", required=True, where=name)
    n_kv_heads = _first(cfg, "n_kv_heads", required=False, where=name)
    if n_kv_heads is None and cfg.get("multi_query"):
        n_kv_heads = 1
    if model_type == "falcon" and not cfg.get("new_decoder_architecture"):
        n_kv_heads = 1 if cfg.get("multi_query", True) else n_heads  # num_kv_heads counts only in the new layout
    head_dim = cfg.get("head_dim")
    mla = _mla(cfg, d_model, n_heads, name) if cfg.get("kv_lora_rank") is not None else None
    if mla is not None:
        head_dim = mla.v_head_dim  # the MHA it is compared with: n_heads keys and values of v_head_dim
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    if model_type == "qwen2" or cfg.get("qkv_bias") is True:
        bias, out_bias = True, False  # q/k/v biases, none on W_O (Qwen2; Qwen2-MoE says qkv_bias)
    elif "attention_bias" in cfg:
        bias = out_bias = bool(cfg["attention_bias"])
    elif "bias" in cfg and isinstance(cfg["bias"], bool):
        bias = out_bias = cfg["bias"]
    else:
        bias = out_bias = model_type in _BIASED
    rope: RopeConfig | None = None
    if model_type not in _ABSOLUTE and not cfg.get("alibi") and cfg.get("position_embedding_type") in (
            None, "rotary", "rope"):
        rope = RopeConfig(base=float(cfg.get("rope_theta", 10000.0)))
    try:
        attention = AttentionConfig(
            d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, bias=bias,
            out_bias=out_bias, rope=rope, window=window,
        )
    except MultiheadError as err:
        raise MultiheadError(f"{name}: {err}") from None
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise MultiheadError(f"{name}: n_layers ({n_layers!r}) must be a positive int")
    causal = model_type not in _ENCODERS or bool(cfg.get("is_decoder"))
    return ModelConfig(
        name=name, attention=attention, n_layers=n_layers, causal=causal,
        max_context=_first(cfg, "max_context", required=False, where=name), source=source, mla=mla, hf=cfg,
    )


def _mla(cfg: dict[str, Any], d_model: Any, n_heads: Any, name: str) -> MLAConfig:
    """The MLA layer of a DeepSeek-V2/V3 config (YaRN rope scaling changes the softmax scale, not the cost)."""
    try:
        fields: dict[str, Any] = {
            "d_model": d_model, "n_heads": n_heads, "kv_lora_rank": cfg["kv_lora_rank"],
            "qk_nope_head_dim": cfg.get("qk_nope_head_dim"), "qk_rope_head_dim": cfg.get("qk_rope_head_dim"),
            "v_head_dim": cfg.get("v_head_dim"), "q_lora_rank": cfg.get("q_lora_rank"),
            "rope": float(cfg.get("rope_theta", 10000.0)), "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "bias": bool(cfg.get("attention_bias", False))}
        return MLAConfig(**fields)
    except (MultiheadError, TypeError, ValueError) as err:
        raise MultiheadError(f"{name}: its MLA fields: {err}") from None


def from_hf_config(path: str | Path) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` file (or a folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise MultiheadError(f"config file {str(p)!r} does not exist")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MultiheadError(f"config file {str(p)!r} is not valid JSON: {err}") from None
    return from_hf_dict(cfg, name=p.parent.name or str(p), source=str(p))


def preset(name: str) -> ModelConfig:
    """The named preset, by its exact name (see PRESET_NAMES)."""
    if name not in _PUBLISHED:
        raise MultiheadError(f"unknown preset {name!r}: known presets are {', '.join(PRESET_NAMES)}")
    source, cfg = _PUBLISHED[name]
    return from_hf_dict(cfg, name=name, source=f"https://huggingface.co/{source}/blob/main/config.json")
