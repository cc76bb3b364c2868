"""The one reader of a Hugging Face ``config.json``: bounded JSON, file errors in one line, typed and ranged values.

:mod:`multihead.sizing.presets` (and through it ``multihead count --config`` and ``compare --config``),
:mod:`multihead.sizing` and the model loaders read config.json here, so a key means the same and is checked the same
everywhere::

    cfg = read_config("path/to/model")       # a folder holding config.json, or the file
    cfg.d_model, cfg.n_heads, cfg.n_kv_heads  # resolved from every spelling real configs use (hidden_size, n_embd...)
    cfg.integer("intermediate_size")          # any other field of the table below, typed and ranged
    cfg.attention()                           # the AttentionConfig it describes (cfg.mla() for DeepSeek's MLA)

**Parsing is bounded.** A file larger than ``MAX_JSON_BYTES``, nested deeper than ``MAX_JSON_DEPTH`` or holding an
integer literal longer than ``MAX_INT_DIGITS`` is refused before Python's json module could fail on it (a
RecursionError, the 4,300-digit limit of ``int()``). A file that is missing, not a file, refused by the OS, not UTF-8,
not JSON or not an object ends in one :class:`MultiheadError` line naming it.

**Values are checked when the config is read.** Every key of :data:`FIELDS` that the file holds is checked for its
type and range at once (and the keys read by their spellings, such as hidden_size / n_embd, at the spelling used), so
a bad value is refused by name whichever tool reads the file, and each error names the file, the key, the value and
what was expected. The upper bounds are those of :mod:`multihead.values` (far above any real model). ``null`` is
refused, except for the keys where transformers itself reads it as "absent, use the default" (head_dim,
num_key_value_heads, n_inner, sliding_window, q_lora_rank, kv_lora_rank, ...: ``nullable`` below). Keys outside the
table are kept (``cfg["key"]``) and not checked: nothing here reads them.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multihead.config import AttentionConfig, MLAConfig, RopeConfig
from multihead.errors import MultiheadError
from multihead.values import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_FFN,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_VOCAB,
    MAX_WIDTH,
    Values,
)

if TYPE_CHECKING:
    from multihead.sizing.cost import LayerAttention


def _layer(kind: str, window: int | None = None) -> LayerAttention:
    """A layer's attention kind for the sizing (:class:`multihead.sizing.cost.LayerAttention`), imported when first
    made: the sizing package reads configs through this module, so this module does not import it at load time."""
    from multihead.sizing.cost import LayerAttention

    return LayerAttention(kind, window)

MAX_JSON_BYTES = 64 << 20  # configs are kilobytes; a DeepSeek-V3 safetensors index, the largest JSON read, is ~9 MB
MAX_JSON_DEPTH = 100  # real configs nest 3 to 5 levels; Python's json recurses once per level
MAX_INT_DIGITS = 64  # no size, count or id of a model is longer than 20 digits (2^64)


# ---------------------------------------------------------------------------------------------- bounded JSON
def _shown(path: Path) -> str:
    text = str(path)
    return repr(text if len(text) <= 200 else text[:197] + "...")


class _LongInteger(Exception):
    def __init__(self, digits: int) -> None:
        self.digits = digits


def _integer_literal(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _LongInteger(digits)
    return int(text)


# a JSON string (escapes included), to be blanked out before the brackets are counted
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings are not counted)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:  # cannot be deeper: no need to look closer
        return text.count("[") + text.count("{")
    brackets = _NOT_BRACKET.sub("", _STRING.sub('""', text))
    return max(accumulate(_STEP[c] for c in brackets), default=0)


def parse_json(text: str, where: str) -> Any:
    """``json.loads(text)``, bounded: nesting past MAX_JSON_DEPTH and integers longer than MAX_INT_DIGITS digits are
    refused; any failure is one MultiheadError that begins with ``where``."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise MultiheadError(f"{where} nests arrays or objects {depth:,} deep: more than {MAX_JSON_DEPTH} is no "
                             "model's config (multihead.hf.config.MAX_JSON_DEPTH)")
    try:
        return json.loads(text, parse_int=_integer_literal)
    except _LongInteger as err:
        raise MultiheadError(f"{where} holds an integer of {err.digits:,} digits: more than {MAX_INT_DIGITS} is no "
                             "size, count or id of a model (multihead.hf.config.MAX_INT_DIGITS)") from None
    except json.JSONDecodeError as err:
        raise MultiheadError(f"{where} is not valid JSON: {err}") from None
    except RecursionError:  # not reached after the depth check; kept so that no traceback can escape
        raise MultiheadError(f"{where} nests arrays or objects too deep to read") from None


def read_json(path: str | Path, what: str = "JSON file") -> Any:
    """The JSON value of a file, bounded (MAX_JSON_BYTES, MAX_JSON_DEPTH, MAX_INT_DIGITS). A file that is missing,
    not a regular file, refused by the OS, too large, not UTF-8 or not JSON raises one MultiheadError naming it."""
    p = Path(path)
    where = f"{what} {_shown(p)}"
    try:
        info = os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        raise MultiheadError(f"{where} does not exist") from None
    except (OSError, ValueError) as err:  # ValueError: a NUL in the path
        raise MultiheadError(f"{where} cannot be read: {getattr(err, 'strerror', None) or err}") from None
    if stat.S_ISDIR(info.st_mode):
        raise MultiheadError(f"{where} is a folder, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise MultiheadError(f"{where} is not a file (a device, pipe or socket)")
    if info.st_size > MAX_JSON_BYTES:
        raise MultiheadError(f"{where} is {info.st_size:,} bytes: more than {MAX_JSON_BYTES:,} is no model's "
                             "config (multihead.hf.config.MAX_JSON_BYTES)")
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)  # (a file that grows while it is read stops here too)
    except OSError as err:
        raise MultiheadError(f"{where} cannot be read: {err.strerror or err}") from None
    if len(data) > MAX_JSON_BYTES:
        raise MultiheadError(f"{where} is more than {MAX_JSON_BYTES:,} bytes: no model's config is "
                             "(multihead.hf.config.MAX_JSON_BYTES)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise MultiheadError(f"{where} is not UTF-8 text: byte {data[err.start]:#04x} at offset {err.start:,}") \
            from None
    return parse_json(text, where)


def read_json_object(path: str | Path, what: str = "JSON file") -> dict[str, Any]:
    """:func:`read_json` of a file that must hold a JSON object."""
    data = read_json(path, what)
    if not isinstance(data, dict):
        raise MultiheadError(f"{what} {_shown(Path(path))} must hold a JSON object, not {_json_kind(data)}")
    return data


def _json_kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "true or false", type(None): "null"}.get(
        type(value), "a number")


# ---------------------------------------------------------------------------------------------- the table of keys
@dataclass(frozen=True)
class Field:
    """What one config.json key must hold: ``kind`` (int, ints: a list of ints, int or ints, number, flag, text,
    texts: a list of strings, object), a range for numbers (``open_low``: the low end excluded), and whether null
    means "absent"."""

    kind: str
    low: float = 1
    high: float = 0
    limit: str = ""
    nullable: bool = False
    open_low: bool = False


def _sizes(high: int, limit: str, *keys: str, low: int = 1, nullable: bool = False) -> dict[str, Field]:
    return {k: Field("int", low, high, limit, nullable) for k in keys}


def _flags(*keys: str) -> dict[str, Field]:
    return {k: Field("flag") for k in keys}


# Our name of a field read by several spellings -> its spellings, in the order they are looked for.
SPELLINGS: dict[str, tuple[str, ...]] = {
    "d_model": ("hidden_size", "n_embd", "d_model", "dim", "model_dim"),
    "n_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads"),
    "n_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "n_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "n_kv_heads", "multi_query_group_num"),
    "max_context": ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"),
}
_SPELLING_FIELDS: dict[str, Field] = {
    "d_model": Field("int", 1, MAX_WIDTH, "width"),
    "n_heads": Field("int", 1, MAX_HEADS, "heads"),
    "n_layers": Field("int", 1, MAX_LAYERS, "layers"),
    "n_kv_heads": Field("int", 1, MAX_HEADS, "heads", nullable=True),
    "max_context": Field("int", 1, MAX_CONTEXT, "context"),
}

# Every other key anything here reads, and what it must hold.
FIELDS: dict[str, Field] = {
    "model_type": Field("text", nullable=True),
    "position_embedding_type": Field("text", nullable=True),
    "hidden_act": Field("text"),
    **_sizes(MAX_WIDTH, "width", "head_dim", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim", nullable=True),
    **_sizes(MAX_VOCAB, "vocab", "vocab_size"),
    "intermediate_size": Field("int or ints", 1, MAX_FFN, "ffn"),  # a list of per-layer widths in Gemma 3n
    **_sizes(MAX_FFN, "ffn", "n_inner", "moe_intermediate_size", nullable=True),
    **_sizes(MAX_FFN, "ffn", "shared_expert_intermediate_size", low=0, nullable=True),
    **_sizes(1 << 16, "", "type_vocab_size", low=0),  # DeBERTa has none
    **_sizes(MAX_EXPERTS, "experts", "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok",
             nullable=True),
    **_sizes(MAX_EXPERTS, "experts", "n_shared_experts", low=0, nullable=True),
    **_sizes(MAX_LAYERS, "layers", "first_k_dense_replace", "num_nextn_predict_layers", low=0, nullable=True),
    **_sizes(MAX_LAYERS, "layers", "moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step",
             "no_rope_layer_interval"),
    "mlp_only_layers": Field("ints", 0, MAX_LAYERS, "layers", nullable=True),
    "moe_layers": Field("ints", 0, MAX_LAYERS, "layers", nullable=True),  # Llama 4's MoE layers, by index
    "no_rope_layers": Field("ints", 0, 1, "1 for a layer with RoPE, 0 for one without", nullable=True),
    **_sizes(MAX_FFN, "ffn", "intermediate_size_mlp"),  # Llama 4's dense layers (intermediate_size: its experts')
    **_sizes(MAX_CONTEXT, "context", "attention_chunk_size", nullable=True),
    "rope_theta": Field("number", 1, 1e12, open_low=True),
    "rope_parameters": Field("object", nullable=True),
    "rope_scaling": Field("object", nullable=True),
    "layer_types": Field("texts", nullable=True),
    **_sizes(MAX_LAYERS, "layers", "sliding_window_pattern", nullable=True),
    **_sizes(MAX_LAYERS, "layers", "max_window_layers", low=0, nullable=True),
    "rms_norm_eps": Field("number", 0, 1, open_low=True),
    "layer_norm_eps": Field("number", 0, 1, open_low=True),
    **_flags("tie_word_embeddings", "attention_bias", "mlp_bias", "qkv_bias", "bias", "multi_query", "alibi",
             "is_decoder", "new_decoder_architecture", "use_sliding_window"),
}

_ENCODERS = {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "mpnet", "albert", "deberta", "deberta-v2"}
# Families whose attention projections have biases by design (no flag in their config).
_BIASED = {"gpt2", "bert", "roberta", "xlm-roberta", "distilbert", "electra", "mpnet", "albert", "gpt_neox",
           "gptj", "opt", "bloom", "phi"}
_ABSOLUTE = {"gpt2", "bert", "roberta", "xlm-roberta", "distilbert", "electra", "mpnet", "albert", "opt", "bloom"}

_REQUIRED: Any = object()

# Families whose sliding_window applies to the layers from max_window_layers on, and only with use_sliding_window.
_QWEN = {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
# Families that alternate sliding and full layers without a layer_types list: the pattern's period (every
# period-th layer is full, the others sliding), transformers' defaults (Gemma 3's sliding_window_pattern 6, ...).
_ALTERNATING = {"gemma2": 2, "gpt_oss": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}
# Families whose layers attend within chunks of attention_chunk_size (Llama 4: the layers with RoPE; every
# no_rope_layer_interval-th layer, without RoPE, attends to the whole context).
_CHUNKED = {"llama4", "llama4_text"}

# What the published files of a family leave to transformers' defaults (its config class's), read from here when
# the file does not hold them and listed in HFConfig.defaulted: Gemma 3's multimodal configs give a text_config of
# six keys or so, and transformers' Gemma3TextConfig supplies the heads, head_dim, vocabulary and window.
_GEMMA3_TEXT = {"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                "max_position_embeddings": 131_072, "sliding_window": 4096}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {"gemma3_text": _GEMMA3_TEXT, "gemma3": _GEMMA3_TEXT}


class HFConfig(Mapping[str, Any]):
    """The values of one config.json (its ``text_config`` for a multimodal model), checked when made; read-only.

    As a mapping it holds the file's values as they are, and for a family whose published files leave keys to
    transformers' defaults (:data:`FAMILY_DEFAULTS`: Gemma 3) those defaults where the file has none
    (``defaulted`` lists them). A multimodal config's ``container`` is its own model_type, ``towers`` its parts other
    than the text model (vision_config, ...), which nothing here reads; its tie_word_embeddings stands for the text
    model's where the text_config does not say. Typed reads (:meth:`integer`,
    :meth:`number`, :meth:`flag`, :meth:`text`, :meth:`integers`) take a key of :data:`FIELDS`; a missing key gives
    ``default``, or, without one, an error naming the key. The fields every tool needs are properties, resolved
    once: d_model, n_heads, n_layers, n_kv_heads, head_dim, max_context, vocab_size, rope_theta
    (None without rotary embeddings), window, bias and out_bias, causal.
    """

    def __init__(self, values: Mapping[str, Any], *, where: str) -> None:
        if not isinstance(values, Mapping):
            raise MultiheadError(f"{where!r}: a config must be a JSON object, got {type(values).__name__}")
        text_cfg = values.get("text_config")
        self.container = ""  # the multimodal config's model_type (gemma3, mistral3, llama4) when text_config is read
        self.towers: tuple[str, ...] = ()  # that config's other parts (vision_config, audio_config), not read here
        if isinstance(text_cfg, Mapping) and not any(k in values for k in SPELLINGS["d_model"]):
            self.container = str(values.get("model_type") or "")
            self.towers = tuple(k for k, v in values.items() if k.endswith("_config") and isinstance(v, Mapping)
                                and k not in ("text_config", "quantization_config"))
            # whether the LM head is the embedding: the text_config's word where it says, else the outer config's
            tie = {"tie_word_embeddings": values["tie_word_embeddings"]} if (
                "tie_word_embeddings" in values and "tie_word_embeddings" not in text_cfg) else {}
            values = {**text_cfg, **tie, "model_type": text_cfg.get("model_type", values.get("model_type"))}
        family = values.get("model_type")
        defaults = FAMILY_DEFAULTS.get(family.lower(), {}) if isinstance(family, str) else {}
        self.defaulted: dict[str, Any] = {k: v for k, v in defaults.items() if k not in values}
        self._values: dict[str, Any] = {**self.defaulted, **values}
        self.where = str(where)
        self._check = Values(self.where, json=True)
        for key, spec in FIELDS.items():  # every value anything reads, checked now, whoever reads it later
            if key in self._values:
                self._read((key,), spec, None)
        for name, keys in SPELLINGS.items():
            self._read(keys, _SPELLING_FIELDS[name], None)

    # -- the mapping: the file's values as they are
    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"HFConfig({self.where!r}, {len(self._values)} keys)"

    # -- typed reads
    def _pick(self, keys: tuple[str, ...]) -> tuple[str, Any]:
        """The first of ``keys`` the config holds other than null; else the first it holds as null; else
        (keys[0], _REQUIRED)."""
        for key in keys:
            if self._values.get(key) is not None:
                return key, self._values[key]
        for key in keys:
            if key in self._values:
                return key, None
        return keys[0], _REQUIRED

    def _read(self, keys: tuple[str, ...], spec: Field, default: Any, name: str = "") -> Any:
        key, value = self._pick(keys)
        if value is _REQUIRED or (value is None and spec.nullable):
            if default is _REQUIRED:
                if len(keys) == 1:
                    raise MultiheadError(f"{self.where!r} has no {key!r} field")
                raise MultiheadError(f"{self.where!r} has no {name or keys[0]}: expected one of the fields "
                                     f"{', '.join(keys)}")
            return default
        v = self._check
        if spec.kind == "int" or (spec.kind == "int or ints" and not isinstance(value, list)):
            return v.integer(key, value, low=int(spec.low), high=int(spec.high), limit=spec.limit)
        if spec.kind in ("ints", "int or ints"):
            items = v.integers(key, value)
            for i, item in enumerate(items):
                v.integer(f"{key}[{i}]", item, low=int(spec.low), high=int(spec.high), limit=spec.limit)
            return items
        if spec.kind == "number":
            return v.number(key, value, low=spec.low, high=spec.high, open_low=spec.open_low)
        if spec.kind == "flag":
            if not isinstance(value, bool):  # "false" (a string) is not false; nor is 0 in a JSON file
                raise v.fail(key, value, "true or false")
            return value
        if spec.kind == "text":
            return v.text(key, value)
        if spec.kind == "texts":
            if not isinstance(value, list):
                raise v.fail(key, value, "a list of strings")
            return [v.text(f"{key}[{i}]", item) for i, item in enumerate(value)]
        if not isinstance(value, dict):
            raise v.fail(key, value, "an object")
        return value

    def integer(self, key: str, default: Any = _REQUIRED) -> Any:
        """The integer at ``key`` (a key of FIELDS), in its range; ``default`` when the config has none (or holds
        null, where null means absent)."""
        return self._read((key,), FIELDS[key], default)

    def integers(self, key: str, default: Any = _REQUIRED) -> Any:
        """A list of integers, each in the key's range."""
        return self._read((key,), FIELDS[key], default)

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._read((key,), FIELDS[key], default)

    def flag(self, key: str, default: Any = _REQUIRED) -> Any:
        """true or false (a string such as "false" is refused, not taken as true)."""
        return self._read((key,), FIELDS[key], default)

    def text(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._read((key,), FIELDS[key], default)

    def has(self, key: str) -> bool:
        """Whether the config holds ``key`` with a value other than null."""
        return self._values.get(key) is not None

    # -- the fields every tool reads
    def _spelled(self, name: str, default: Any = _REQUIRED) -> Any:
        return self._read(SPELLINGS[name], _SPELLING_FIELDS[name], default, name)

    @cached_property
    def model_type(self) -> str:
        """The family, lower case ("" when the config does not say)."""
        return str(self.text("model_type", default="")).lower()

    @cached_property
    def d_model(self) -> int:
        return int(self._spelled("d_model"))

    @cached_property
    def n_heads(self) -> int:
        return int(self._spelled("n_heads"))

    @cached_property
    def n_layers(self) -> int:
        return int(self._spelled("n_layers"))

    @cached_property
    def n_kv_heads(self) -> int:
        """num_key_value_heads (or its spellings); one with ``multi_query: true`` (Falcon); n_heads when absent.
        Falcon's old layout (new_decoder_architecture false) counts only multi_query."""
        if self.model_type == "falcon" and not self.flag("new_decoder_architecture", default=False):
            return 1 if self.flag("multi_query", default=True) else self.n_heads
        given = self._spelled("n_kv_heads", default=None)
        if given is None:
            return 1 if self.flag("multi_query", default=False) else self.n_heads
        return int(given)

    @cached_property
    def head_dim(self) -> int | None:
        """head_dim as given (None: d_model / n_heads)."""
        value = self.integer("head_dim", default=None)
        return None if value is None else int(value)

    @cached_property
    def max_context(self) -> int | None:
        """max_position_embeddings (or its spellings), None when the config has none."""
        value = self._spelled("max_context", default=None)
        return None if value is None else int(value)

    @cached_property
    def vocab_size(self) -> int | None:
        value = self.integer("vocab_size", default=None)
        return None if value is None else int(value)

    @cached_property
    def rotary(self) -> bool:
        """Whether the model rotates q and k (RoPE): not for the families with absolute positions, ALiBi, or a
        position_embedding_type other than rotary."""
        return (self.model_type not in _ABSOLUTE and not self.flag("alibi", default=False)
                and self.text("position_embedding_type", default=None) in (None, "rotary", "rope"))

    @cached_property
    def rope_theta(self) -> float:
        """rope_theta, or rope_parameters' (transformers 5 writes it there); 10000.0 when neither says."""
        if "rope_theta" in self._values:
            return float(self.number("rope_theta"))
        rope = self.get("rope_parameters")
        if isinstance(rope, Mapping) and "rope_theta" in rope:
            return self._check.number("rope_parameters.rope_theta", rope["rope_theta"], low=1, high=1e12,
                                      open_low=True)
        return 10000.0

    @cached_property
    def window(self) -> int | None:
        """sliding_window, unless use_sliding_window is false (Qwen2's switch, false when absent for the Qwen
        families, as transformers reads it); None for none."""
        if self.flag("use_sliding_window", default=self.model_type not in _QWEN) is False:
            return None
        value = self._values.get("sliding_window")
        if value is None:
            return None
        return self._check.integer("sliding_window", value, low=1, high=MAX_CONTEXT, limit="context")

    @cached_property
    def bias(self) -> tuple[bool, bool]:
        """(biases on W_Q, W_K, W_V; a bias on W_O): attention_bias or bias where the config says, Qwen2's q/k/v
        biases without one on W_O, else the family's design (GPT-2, BERT, ...: biased)."""
        if self.model_type == "qwen2" or self.flag("qkv_bias", default=False):
            return True, False  # q/k/v biases, none on W_O (Qwen2; Qwen2-MoE says qkv_bias)
        for key in ("attention_bias", "bias"):
            if self.has(key):
                flag = bool(self.flag(key))
                return flag, flag
        return self.model_type in _BIASED, self.model_type in _BIASED

    @cached_property
    def causal(self) -> bool:
        """Decoders are causal; encoders (BERT, RoBERTa, ...) not, unless is_decoder says so."""
        return self.model_type not in _ENCODERS or bool(self.flag("is_decoder", default=False))

    @cached_property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): the config has a kv_lora_rank."""
        return self.integer("kv_lora_rank", default=None) is not None

    @cached_property
    def context_limit(self) -> int | None:
        """The longest context the model is made for: max_position_embeddings, or with a RoPE scaling that gives
        a factor and original_max_position_embeddings (YaRN, as Qwen2.5 adds it), their product if larger (not for
        rope_type llama3, whose max_position_embeddings is the stretched context: Llama 3.2's factor 32 over 8,192
        would claim 262,144 where it is made for 131,072)."""
        base = self.max_context
        scaling = self.get("rope_scaling") or self.get("rope_parameters")
        if not isinstance(scaling, Mapping):
            return base
        factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
        if factor is None or original is None or scaling.get("rope_type", scaling.get("type")) == "llama3":
            return base  # (Llama 3.1's llama3 scaling stretches 8,192 to max_position_embeddings, never past it)
        f = self._check.number("rope_scaling.factor", factor, low=0, high=1e6, open_low=True)
        o = self._check.integer("rope_scaling.original_max_position_embeddings", original, low=1, high=MAX_CONTEXT,
                                limit="context")
        return max(base or 0, int(o * f))

    def layer_kinds(self, n_layers: int | None = None) -> tuple[LayerAttention, ...]:
        """Each layer's attention kind, as transformers builds the model's cache from this config: ``layer_types``
        where the config lists them (full_attention / sliding_attention / chunked_attention); else latent for an MLA
        model; else the family's pattern: Llama 4 attends within chunks of ``attention_chunk_size`` on the layers
        with RoPE (``no_rope_layers``, by default all but every ``no_rope_layer_interval``-th, 4) and to the whole
        context on the others; and with a sliding_window, Gemma 2 and gpt-oss alternate sliding and full (layer 0
        sliding), Gemma 3 makes every ``sliding_window_pattern``-th layer full (default 6), Qwen2/Qwen3 slide from
        layer ``max_window_layers`` on (with use_sliding_window), Mistral, Mixtral and the others slide on every
        layer. ``n_layers`` (default the config's) repeats a pattern over another depth."""
        n = self.n_layers if n_layers is None else n_layers
        if self.is_mla:
            return (_layer("latent"),) * n
        types = self.get("layer_types")
        if types is not None:
            named = self.text_list("layer_types")
            if len(named) != self.n_layers:
                raise MultiheadError(f"{self.where!r}: layer_types lists {len(named):,} layers; the config has "
                                     f"{self.n_layers:,} (num_hidden_layers)")
            kinds = [self._layer_type(i, t) for i, t in enumerate(named)]
            return tuple(kinds[i % len(kinds)] for i in range(n))
        if self.model_type in _CHUNKED:
            return self._chunked_layers(n)
        window = self.window
        if window is None:
            return (_layer("full"),) * n
        sliding, full = _layer("sliding", window), _layer("full")
        family = self.model_type
        if family in _ALTERNATING:
            period = int(self.integer("sliding_window_pattern", default=_ALTERNATING[family]))
            return tuple(sliding if (i + 1) % period else full for i in range(n))
        if family in _QWEN:
            first = int(self.integer("max_window_layers", default=28))
            return tuple(sliding if i >= first else full for i in range(n))
        return (sliding,) * n

    def _layer_type(self, i: int, name: str) -> LayerAttention:
        """The kind of layer i named ``name`` in layer_types."""
        if name not in _LAYER_TYPES:
            raise MultiheadError(f"{self.where!r}: layer_types[{i}] = {name!r} is not sized yet: expected "
                                 f"{' or '.join(_LAYER_TYPES)}")
        kind = _LAYER_TYPES[name]
        if kind == "full":
            return _layer("full")
        key = "sliding_window" if kind == "sliding" else "attention_chunk_size"
        size = self.window if kind == "sliding" else self.integer("attention_chunk_size", default=None)
        if size is None:
            raise MultiheadError(f"{self.where!r}: layer_types[{i}] is {name} but the config has no {key}")
        return _layer(kind, int(size))

    def _chunked_layers(self, n: int) -> tuple[LayerAttention, ...]:
        """Llama 4's layers without a layer_types list, as Llama4TextConfig derives them: chunked (of
        attention_chunk_size) where no_rope_layers holds 1 (RoPE), full where it holds 0 (NoPE); no_rope_layers
        absent or empty: 0 on every no_rope_layer_interval-th layer (default 4), 1 on the others; no
        attention_chunk_size: every layer full."""
        chunk = self.integer("attention_chunk_size", default=None)
        if chunk is None:
            return (_layer("full"),) * n
        rope = list(self.integers("no_rope_layers", default=None) or [])
        if not rope:
            every = int(self.integer("no_rope_layer_interval", default=4))
            rope = [int((i + 1) % every != 0) for i in range(self.n_layers)]
        if len(rope) != self.n_layers:
            raise MultiheadError(f"{self.where!r}: no_rope_layers lists {len(rope):,} layers; the config has "
                                 f"{self.n_layers:,} (num_hidden_layers)")
        kinds = [_layer("chunked", int(chunk)) if r else _layer("full") for r in rope]
        return tuple(kinds[i % len(kinds)] for i in range(n))

    def text_list(self, key: str) -> list[str]:
        """A list of strings (layer_types)."""
        return list(self._read((key,), FIELDS[key], []))

    # -- the layer it describes
    def attention(self) -> AttentionConfig:
        """The attention layer (for an MLA model: plain MHA with its heads, n_heads keys and values of v_head_dim, to
        compare with)."""
        mla = self.mla()
        try:
            return AttentionConfig(
                d_model=self.d_model, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                head_dim=mla.v_head_dim if mla is not None else self.head_dim, bias=self.bias[0],
                out_bias=self.bias[1], rope=RopeConfig(base=self.rope_theta) if self.rotary else None,
                window=self.window)
        except MultiheadError as err:
            raise MultiheadError(f"{self.where!r}: {err}") from None

    def mla(self) -> MLAConfig | None:
        """The MLA layer of a DeepSeek-V2/V3 config, or None (YaRN rope scaling changes the softmax scale, not the
        cost)."""
        if not self.is_mla:
            return None
        try:
            return MLAConfig(
                d_model=self.d_model, n_heads=self.n_heads, kv_lora_rank=self.integer("kv_lora_rank"),
                qk_nope_head_dim=self.integer("qk_nope_head_dim"), qk_rope_head_dim=self.integer("qk_rope_head_dim"),
                v_head_dim=self.integer("v_head_dim"), q_lora_rank=self.integer("q_lora_rank", default=None),
                rope=self.rope_theta, norm_eps=self.number("rms_norm_eps", default=1e-6),
                bias=self.flag("attention_bias", default=False))
        except MultiheadError as err:
            raise MultiheadError(f"{self.where!r}: its MLA fields: {err}") from None


def read_config(path: str | Path) -> HFConfig:
    """The config.json at ``path`` (or in the folder ``path``), read and checked; errors name the file."""
    p = Path(path)
    try:
        if p.is_dir():
            p = p / "config.json"
    except (OSError, ValueError):  # the read below says why
        pass
    return HFConfig(read_json_object(p, "config file"), where=str(p))

