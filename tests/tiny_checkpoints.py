"""Tiny, valid checkpoint files written from scratch, for the hostile-file tests to damage: a Llama GGUF (our own
writer, so any value of any type can be put in any field), a Hugging Face Llama folder and a sentence-transformers
BERT folder."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
        I64: "<q", F64: "<d"}

Field = tuple[str, int, Any]  # key, type, value; for arrays the value is (item type, [items])


def _string(text: str | bytes) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: int, value: Any) -> bytes:
    if kind in _FMT:
        return struct.pack(_FMT[kind], value)
    if kind == STRING:
        return _string(value)
    if kind == ARRAY and isinstance(value, bytes):  # an array's body written by hand (e.g. nested 500 deep)
        return value
    if kind == ARRAY:
        item, items = value
        return struct.pack("<IQ", item, len(items)) + b"".join(_value(item, v) for v in items)
    raise ValueError(kind)


def gguf_bytes(fields: list[Field], tensors: dict[str, np.ndarray], *, alignment: int = 32,
               kinds: dict[str, int] | None = None) -> bytes:
    """A GGUF v3 file: the fields as given, float32 tensors (shape outermost first, as numpy); ``kinds`` labels a
    tensor's bytes with another ggml type code (its bytes unchanged)."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(fields))]
    for key, kind, value in fields:
        out.append(_string(key) + struct.pack("<I", kind) + _value(kind, value))
    offset = 0
    blobs = []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        dims = list(reversed(array.shape))
        out.append(_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
                   + struct.pack("<IQ", (kinds or {}).get(name, 0), offset))
        pad = -len(data) % alignment
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    head = b"".join(out)
    head += b"\0" * (-len(head) % alignment)
    return head + b"".join(blobs)


def nested_array(depth: int) -> bytes:
    """The body of an ARRAY field holding one array holding one array ... ``depth`` deep, around one u32."""
    return struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQI", U32, 1, 7)


def byte_tokens() -> list[str]:
    """The 256 byte-level BPE symbols (GPT-2's byte-to-unicode table), in byte order."""
    from tokenizers import pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    assert set(table.values()) == alphabet
    return [table[b] for b in range(256)]


TINY = {"d_model": 16, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 4, "ffn": 24}
MERGES = ["Ġ t", "h e", "Ġt he"]


def tiny_llama_gguf(context: int = 128) -> tuple[list[Field], dict[str, np.ndarray]]:
    """Fields and tensors of a 2-layer Llama (d_model 16, 4 query heads, 2 KV heads) with a byte-level BPE
    vocabulary of 256 bytes, 3 merges and 2 control tokens (262 tokens)."""
    tokens = [*byte_tokens(), "Ġt", "he", "Ġthe", "<s>", "</s>", "<pad>"]
    types = [1] * 259 + [3, 3, 3]
    d, f, h, g, k = TINY["d_model"], TINY["ffn"], TINY["n_heads"], TINY["n_kv_heads"], TINY["head_dim"]
    fields: list[Field] = [
        ("general.architecture", STRING, "llama"),
        ("general.alignment", U32, 32),
        ("llama.block_count", U32, TINY["n_layers"]),
        ("llama.context_length", U32, context),
        ("llama.embedding_length", U32, d),
        ("llama.feed_forward_length", U32, f),
        ("llama.attention.head_count", U32, h),
        ("llama.attention.head_count_kv", U32, g),
        ("llama.attention.key_length", U32, k),
        ("llama.rope.freq_base", F32, 10000.0),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("llama.vocab_size", U32, len(tokens)),
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.pre", STRING, "smollm"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        ("tokenizer.ggml.token_type", ARRAY, (I32, types)),
        ("tokenizer.ggml.merges", ARRAY, (STRING, MERGES)),
        ("tokenizer.ggml.bos_token_id", U32, 259),
        ("tokenizer.ggml.eos_token_id", U32, 260),
        ("tokenizer.ggml.add_bos_token", BOOL, False),
        ("tokenizer.chat_template", STRING, "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    ]
    gen = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return gen.standard_normal(shape).astype(np.float32) * 0.2

    tensors = {"token_embd.weight": w(len(tokens), d), "output_norm.weight": 1 + w(d)}
    for i in range(TINY["n_layers"]):
        tensors |= {f"blk.{i}.attn_norm.weight": 1 + w(d), f"blk.{i}.attn_q.weight": w(h * k, d),
                    f"blk.{i}.attn_k.weight": w(g * k, d), f"blk.{i}.attn_v.weight": w(g * k, d),
                    f"blk.{i}.attn_output.weight": w(d, h * k), f"blk.{i}.ffn_norm.weight": 1 + w(d),
                    f"blk.{i}.ffn_gate.weight": w(f, d), f"blk.{i}.ffn_up.weight": w(f, d),
                    f"blk.{i}.ffn_down.weight": w(d, f)}
    return fields, tensors


def write_tiny_gguf(path: Path, context: int = 128) -> Path:
    fields, tensors = tiny_llama_gguf(context)
    path.write_bytes(gguf_bytes(fields, tensors))
    return path


def write_tiny_hf_llama(folder: Path) -> Path:
    """config.json, model.safetensors and tokenizer.json of the same tiny Llama, as transformers writes them."""
    from safetensors.torch import save_file

    from multihead.models.loaders import read_gguf

    gguf = write_tiny_gguf(folder.parent / f"{folder.name}.gguf")
    config, state, tokenizer = read_gguf(gguf)
    folder.mkdir(parents=True, exist_ok=True)
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": config.vocab_size,
          "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
          "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
          "intermediate_size": config.ffn_dim, "head_dim": config.head_dim, "rope_theta": config.rope_base,
          "rms_norm_eps": config.rms_eps, "max_position_embeddings": config.max_context,
          "tie_word_embeddings": True, "bos_token_id": config.bos_id, "eos_token_id": config.eos_id}
    (folder / "config.json").write_text(json.dumps(hf, indent=1))
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    theirs = {}
    for ours, tensor in state.items():
        name = names.get(ours)
        if name is None:
            name = "model." + (ours.replace("attn.", "self_attn.").replace("attn_norm.", "input_layernorm.")
                               .replace("ffn_norm.", "post_attention_layernorm.")
                               .replace("gate_proj", "mlp.gate_proj").replace("up_proj", "mlp.up_proj")
                               .replace("down_proj", "mlp.down_proj"))
            name = name.replace("self_attn_norm.", "input_layernorm.")
        theirs[name] = tensor.contiguous()
    save_file(theirs, str(folder / "model.safetensors"))
    tokenizer.tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def write_tiny_hf_qwen2(folder: Path) -> Path:
    """save_pretrained of a tiny random Qwen2 (2 layers, 4 query and 2 KV heads of 8, context 512) and a tiny
    byte-level tokenizer (the tiny Llama's vocabulary of 262 tokens), as a Hugging Face folder: a model that only
    transformers runs (multihead's engine 'auto' takes transformers for it)."""
    import transformers
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    llama = write_tiny_hf_llama(folder.parent / "llama-for-its-tokenizer")
    config = transformers.Qwen2Config(vocab_size=262, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=259, eos_token_id=260, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(llama / "tokenizer.json")),
                                        bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(folder)
    return folder


def torch_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


TINY_BERT = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 8, "num_hidden_layers": 1,
             "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 64, "type_vocab_size": 2,
             "layer_norm_eps": 1e-12, "hidden_act": "gelu"}
ST_FILES = {
    "modules.json": [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                     {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                     {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}],
    "sentence_bert_config.json": {"max_seq_length": 32, "do_lower_case": False},
    "1_Pooling/config.json": {"word_embedding_dimension": 8, "pooling_mode_cls_token": False,
                              "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False},
}


def write_tiny_bert(folder: Path, minilm: Path) -> Path:
    """A sentence-transformers folder of a 1-layer BERT (d_model 8, 2 heads) with all-MiniLM-L6-v2's tokenizer."""
    from safetensors.torch import save_file

    from multihead.models.bert import BertConfig, BertEncoder

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_BERT, indent=1))
    for name, content in ST_FILES.items():
        (folder / name).write_text(json.dumps(content, indent=1))
    (folder / "tokenizer.json").write_bytes((minilm / "tokenizer.json").read_bytes())
    config = BertConfig.from_hf(TINY_BERT)
    torch.manual_seed(0)
    encoder = BertEncoder(config)
    state = encoder.state_dict()
    save_file({theirs: state[ours].contiguous() for ours, theirs in BertEncoder.hf_names(config).items()},
              str(folder / "model.safetensors"))
    return folder
