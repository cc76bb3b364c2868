"""A small, strict reader for the GGUF container: metadata and tensor table parsed with ``struct`` over a memory
map, tensor data dequantised by the ``gguf`` package.

The ``gguf`` package's own GGUFReader builds a numpy view per metadata item, which takes seconds for a vocabulary of
50k tokens; this reader takes a fraction of a second, and checks every length against the file's size so a truncated
or corrupt file fails at once with a clear message instead of allocating or reading past its end.

Layout (little-endian)::

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv x       (string key, u32 type, value)           string = u64 length + UTF-8 bytes
    n_tensors x  (string name, u32 n_dims, u64 dims[n_dims] innermost first, u32 ggml type, u64 offset)
    padding to general.alignment (default 32), then the tensor data at those offsets
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from multihead.errors import MultiheadError

_MAX_DEPTH = 8  # arrays of arrays: real files nest one level at most
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # outermost first (numpy order): (rows, columns) for a weight matrix
    ggml_type: int
    offset: int  # from the start of the file
    nbytes: int


class GGUFFile:
    """Metadata (``fields``) and tensors (``tensors``) of a GGUF file; ``tensor(name)`` gives float32 data."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise MultiheadError(f"GGUF file {str(self.path)!r} does not exist")
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise MultiheadError(f"GGUF file {str(self.path)!r} is empty") from None
        self._pos = 0
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    # ------------------------------------------------------------------ low-level reads
    def _fail(self, what: str) -> MultiheadError:
        return MultiheadError(f"GGUF file {str(self.path)!r} is truncated or corrupt: {what} "
                              f"(at byte {self._pos} of {len(self._map)})")

    def _take(self, n: int) -> bytes:
        if n < 0 or self._pos + n > len(self._map):
            raise self._fail(f"needs {n} more bytes")
        out = self._map[self._pos:self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        n = self._unpack("<Q")
        try:
            return self._take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail("a string is not UTF-8") from None

    def _value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<I"), self._unpack("<Q")
            if item in _SCALARS:
                size = struct.calcsize(_SCALARS[item])
                raw = self._take(count * size)
                return np.frombuffer(raw, dtype=np.dtype(_SCALARS[item])).tolist()
            if count > len(self._map) - self._pos:  # every item takes at least one byte
                raise self._fail(f"an array claims {count} items")
            if item == _ARRAY and depth >= _MAX_DEPTH:
                raise self._fail(f"arrays nest more than {_MAX_DEPTH} deep")
            return [self._value(item, depth + 1) for _ in range(count)]
        raise self._fail(f"unknown value type {kind}")

    # ------------------------------------------------------------------ structure
    def _parse(self) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        if self._take(4) != b"GGUF":
            raise MultiheadError(f"{str(self.path)!r} is not a GGUF file (its first bytes are not 'GGUF')")
        version = self._unpack("<I")
        if version not in (2, 3):
            raise MultiheadError(f"GGUF file {str(self.path)!r} has version {version}: versions 2 and 3 are read")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        if n_kv > len(self._map) or n_tensors > len(self._map):
            raise self._fail(f"it claims {n_kv} metadata items and {n_tensors} tensors")
        for _ in range(n_kv):
            key = self._string()
            if key in self.fields:
                raise self._fail(f"metadata key {key!r} appears twice")
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            if not 1 <= n_dims <= 8:
                raise self._fail(f"tensor {name!r} claims {n_dims} dimensions (1 to 8 are read)")
            dims = [self._unpack("<Q") for _ in range(n_dims)]
            if any(d == 0 for d in dims):
                raise self._fail(f"tensor {name!r} has an empty dimension: {dims}")
            infos.append((name, tuple(reversed(dims)), self._unpack("<I"), self._unpack("<Q")))
        raw_alignment = self.fields.get("general.alignment", 32)
        alignment = raw_alignment if isinstance(raw_alignment, int) and not isinstance(raw_alignment, bool) else 0
        if not 1 <= alignment <= 1 << 16 or alignment & (alignment - 1):
            raise MultiheadError(f"GGUF file {str(self.path)!r}: general.alignment = {raw_alignment!r}: expected a "
                                 "power of two from 1 to 65,536")
        start = -(-self._pos // alignment) * alignment
        for name, shape, kind, offset in infos:
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise MultiheadError(f"GGUF file {str(self.path)!r}: tensor {name!r} has unknown type {kind}") from None
            if name in self.tensors:
                raise MultiheadError(f"GGUF file {str(self.path)!r}: tensor {name!r} appears twice")
            n = math.prod(shape)  # Python ints: no overflow, whatever the dims claim
            if shape[-1] % block:
                raise MultiheadError(f"GGUF file {str(self.path)!r}: tensor {name!r} of shape {shape} does not "
                                     f"split into blocks of {block} values (its type {kind} needs that)")
            if offset % alignment:
                raise MultiheadError(f"GGUF file {str(self.path)!r}: tensor {name!r} starts at offset {offset}, "
                                     f"not a multiple of the alignment {alignment}")
            nbytes = n // block * block_bytes
            if start + offset + nbytes > len(self._map):
                raise MultiheadError(
                    f"GGUF file {str(self.path)!r} is truncated: tensor {name!r} needs bytes up to "
                    f"{start + offset + nbytes} but the file has {len(self._map)}"
                )
            self.tensors[name] = TensorInfo(name, shape, kind, start + offset, nbytes)

    def field(self, key: str, default: Any = ...) -> Any:
        if key in self.fields:
            return self.fields[key]
        if default is not ...:
            return default
        raise MultiheadError(f"GGUF file {str(self.path)!r} has no {key!r} field")

    def tensor(self, name: str) -> np.ndarray:
        """The tensor's values as a float32 array of its shape (dequantised by the gguf package)."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors.get(name)
        if info is None:
            raise MultiheadError(f"GGUF file {str(self.path)!r} has no tensor {name!r}")
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        kind = GGMLQuantizationType(info.ggml_type)
        if kind == GGMLQuantizationType.F32:
            values = raw.view(np.float32)
        elif kind == GGMLQuantizationType.F16:
            values = raw.view(np.float16)
        else:
            try:
                values = dequantize(raw.reshape(math.prod(info.shape[:-1]), -1), kind)
            except NotImplementedError:
                raise MultiheadError(f"GGUF file {str(self.path)!r}: tensor {name!r} has type {kind.name}, which "
                                     "the gguf package cannot dequantise") from None
        return np.array(values, dtype=np.float32).reshape(info.shape)

    def close(self) -> None:
        self._map.close()


# GGUF's general.architecture -> the model_type of a Hugging Face config.json (Mistral's GGUF files say "llama")
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "gpt-oss": "gpt_oss",
                "gptoss": "gpt_oss", "deepseek2": "deepseek_v2"}
# {arch}.<key> -> the config.json key it fills
_CONFIG_KEYS = {"embedding_length": "hidden_size", "attention.head_count": "num_attention_heads",
                "attention.head_count_kv": "num_key_value_heads", "block_count": "num_hidden_layers",
                "context_length": "max_position_embeddings", "feed_forward_length": "intermediate_size",
                "attention.key_length": "head_dim", "rope.freq_base": "rope_theta",
                "attention.sliding_window": "sliding_window", "vocab_size": "vocab_size",
                "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
                "expert_feed_forward_length": "moe_intermediate_size"}


def hf_config(path: str | Path) -> dict[str, Any]:
    """The config.json a GGUF file's metadata describes (its sizes, read as ``{arch}.embedding_length`` and the
    like; the vocabulary from the tokenizer when the file states no size; tied embeddings when it holds no
    ``output.weight``), for multihead.sizing.presets.from_hf_dict: what `count --config FILE.gguf` sizes. Only the
    metadata and tensor table are read, never the weights."""
    gguf = GGUFFile(path)
    try:
        arch = gguf.field("general.architecture")
        if not isinstance(arch, str):
            raise MultiheadError(f"GGUF file {str(gguf.path)!r}: general.architecture is {arch!r}, not a name")
        cfg: dict[str, Any] = {"model_type": _MODEL_TYPES.get(arch, arch)}
        for key, name in _CONFIG_KEYS.items():
            value = gguf.field(f"{arch}.{key}", None)
            if isinstance(value, list) and value and all(v == value[0] for v in value):
                value = value[0]  # a per-layer array holding one value
            if value is not None:
                cfg[name] = value
        if "vocab_size" not in cfg and isinstance(gguf.field("tokenizer.ggml.tokens", None), list):
            cfg["vocab_size"] = len(gguf.field("tokenizer.ggml.tokens"))
        cfg["tie_word_embeddings"] = "output.weight" not in gguf.tensors
        return cfg
    finally:
        gguf.close()
