"""One decoder, whichever engine runs it: multihead's own port or a transformers causal LM on multihead's attention.

A :class:`Decoder` is what the head tools (:mod:`multihead.heads`) and the cache trade-offs
(:mod:`multihead.tradeoff`) need of a causal language model, and all they ask of one::

    decoder.tokenizer                                the model's own tokenizer (:class:`Tokenizer`): a prompt starts
                                                     with its BOS where it adds one
    decoder.shape                                    layers, query and KV heads, head_dim, context, vocabulary and
                                                     each layer's window (:class:`DecoderShape`)
    decoder(ids, cache=, logits_to_keep=, valid=)    logits (b, s, vocab); a cached call is committed by
                                                     ``cache.advance(s)``
    decoder.new_cache(b, max_len, spec=)             a multihead cache of any kind, sized for this model
    decoder.attention_layers()                       each layer's attention module, with its hook points
    decoder.final_hidden(ids)                        the hidden states after the final norm
    decoder.block_inputs(ids, valid)                 every block's input, to resume a run at a block
    decoder.logits_from(h, start, valid)             (``[]`` and a refusal where the engine cannot resume)

:class:`PortDecoder` holds a :class:`~multihead.models.llama.LlamaModel` and its
:class:`~multihead.models.tokenizer.TextTokenizer`; :class:`TransformersDecoder` a transformers model (switched to
multihead's attention by :func:`multihead.hf.enable`) and its tokenizer wrapped in :class:`TransformersTokenizer`,
the one wrapper of a transformers tokenizer. :func:`as_decoder` wraps a model of either; :func:`load_decoder` loads
what ``--model`` names on the engine :func:`multihead.models.route.route` decides; :func:`load_tokenizer` reads
the tokenizer of a model file or folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import Tensor, nn

from multihead.errors import MultiheadError
from multihead.layers.hooks import HookedAttention

ENGINE_LABELS = {"ours": "multihead's own port", "transformers": "transformers, attention on multihead"}


# ---------------------------------------------------------------------------------------------------------- tokenizers
@runtime_checkable
class Tokenizer(Protocol):
    """A model's own tokenizer as the tools call it: ``encode`` a prompt (``bos_id`` first where ``add_bos``),
    ``token_ids`` a piece of text without special tokens, ``decode``; ``stop_ids`` its special tokens."""

    bos_id: int | None
    add_bos: bool
    stop_ids: set[int]

    def encode(self, text: str) -> list[int]: ...

    def token_ids(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def transformers_bos(tokenizer: Any) -> int | None:
    """The id a transformers tokenizer puts before a text's own tokens (its BOS: Gemma's 2, Llama's 1), or None
    where it puts none (GPT-2, SmolLM2, Qwen). Read from the tokenizer itself: "a" encoded with and without its
    special tokens; what comes before the bare tokens is the start. Tokens it appends (an EOS) are not a prompt's."""
    bare = [int(i) for i in tokenizer("a", add_special_tokens=False)["input_ids"]]
    full = [int(i) for i in tokenizer("a", add_special_tokens=True)["input_ids"]]
    starts = [i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare]
    if not bare or not starts:
        raise MultiheadError(f"{type(tokenizer).__name__} encodes 'a' as {full} with its special tokens and {bare} "
                             "without: the tokens it adds before a text cannot be told apart")
    prefix = full[:starts[0]]
    if len(prefix) > 1:
        raise MultiheadError(f"{type(tokenizer).__name__} puts {len(prefix)} tokens {prefix} before every text: a "
                             "prompt here starts with one BOS token at most")
    return prefix[0] if prefix else None


class TransformersTokenizer:
    """A transformers tokenizer as a :class:`Tokenizer` (as multihead's own
    :class:`~multihead.models.tokenizer.TextTokenizer`): ``encode`` gives a whole text's ids with the model's BOS
    first where its tokenizer adds one (``bos_id``, ``add_bos``: :func:`transformers_bos`) and no other special
    token; ``token_ids`` the same without the BOS; ``decode``; ``stop_ids`` (the special tokens, which random token
    draws leave out). ``tokenizer`` is the transformers tokenizer itself."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.stop_ids: set[int] = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
        self.bos_id = transformers_bos(tokenizer)
        self.add_bos = self.bos_id is not None

    def token_ids(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def encode(self, text: str) -> list[int]:
        ids = self.token_ids(text)
        return [self.bos_id, *ids] if self.bos_id is not None else ids

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))


def as_tokenizer(tokenizer: Any) -> Any:
    """A transformers tokenizer wrapped in :class:`TransformersTokenizer`; any other as it is."""
    if callable(tokenizer) and hasattr(tokenizer, "all_special_ids") and not hasattr(tokenizer, "stop_ids"):
        return TransformersTokenizer(tokenizer)
    return tokenizer


def transformers_tokenizer(path: str | Path) -> Any:
    """transformers' own tokenizer of a model folder or a GGUF file (AutoTokenizer), or a MultiheadError naming
    the path."""
    from transformers import AutoTokenizer

    p = Path(path)
    try:
        if p.is_file():
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        return AutoTokenizer.from_pretrained(str(p))
    except (OSError, ValueError, KeyError) as err:
        raise MultiheadError(f"transformers could not load a tokenizer for {str(p)!r}: {err}") from None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a decoder's GGUF file or folder, as the model reads a prompt: multihead's reading of a GGUF
    file's byte-level BPE (:func:`multihead.models.loaders.read_gguf_tokenizer`, with llama.cpp's pre-tokenizer for
    the named type: the tokenizer transformers builds from SmolLM2's file reads "Introduction\\n\\n1." of the Jargon
    File as two newline tokens where llama.cpp's smollm pre-tokenizer has one), transformers' for anything else
    (a folder's own, a GGUF file's SentencePiece such as Gemma's)."""
    p = Path(path)
    if p.is_file():
        from multihead.models.gguf_file import GGUFFile
        from multihead.models.loaders import read_gguf_tokenizer

        if GGUFFile(p).field("tokenizer.ggml.model", None) == "gpt2":  # byte-level BPE: multihead reads it
            return read_gguf_tokenizer(p)
    return TransformersTokenizer(transformers_tokenizer(p))


# ---------------------------------------------------------------------------------------------------------- decoders
@dataclass(frozen=True)
class DecoderShape:
    """A decoder's numbers: its context, layers, query and KV heads (the same in every layer), head_dim,
    vocabulary, and each layer's attention window (None: the layer sees every earlier key)."""

    max_context: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    windows: tuple[int | None, ...]


@runtime_checkable
class Decoder(Protocol):
    """A causal language model as the head tools and the trade-offs call it (the module docstring lists it).
    ``engine``: "ours" or "transformers", for people (tables, plans); nothing branches on it. A decoder made
    without a tokenizer (``tokenizer`` None) runs token ids only."""

    name: str
    engine: str
    tokenizer: Tokenizer
    shape: DecoderShape

    @property
    def model(self) -> nn.Module:
        """The module that runs (the port's LlamaModel, the transformers model)."""

    def __call__(self, ids: Tensor, *, cache: Any = None, logits_to_keep: int = 0,
                 valid: Tensor | None = None) -> Tensor: ...

    def new_cache(self, batch: int, max_len: int | None = None, **kind: Any) -> Any: ...

    def attention_layers(self) -> list[HookedAttention]: ...

    def final_hidden(self, ids: Tensor) -> Tensor: ...

    def block_inputs(self, ids: Tensor, valid: Tensor | None = None) -> list[Tensor]: ...

    def logits_from(self, h: Tensor, start: int, valid: Tensor | None = None) -> Tensor: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...


def _padding(valid: Tensor | None) -> Tensor | None:
    """A (b, s) validity mask, or None where every token is real."""
    return None if valid is None or bool(valid.all()) else valid


class _Parameters:
    model: Any

    @property
    def device(self) -> torch.device:
        param: Tensor = next(self.model.parameters())
        return param.device

    @property
    def dtype(self) -> torch.dtype:
        param: Tensor = next(self.model.parameters())
        return param.dtype

    def eval(self) -> Any:
        self.model.eval()
        return self


class PortDecoder(_Parameters):
    """multihead's own Llama-style port (:class:`~multihead.models.llama.LlamaModel`) as a :class:`Decoder`."""

    engine = "ours"

    def __init__(self, model: nn.Module, tokenizer: Any = None, name: str = "") -> None:
        from multihead.models.llama import LlamaModel

        if not isinstance(model, LlamaModel):
            raise MultiheadError(f"PortDecoder takes multihead's LlamaModel, not a {type(model).__name__}")
        self.model: LlamaModel = model
        self.tokenizer = cast(Tokenizer, as_tokenizer(tokenizer))
        self.name = name or type(model).__name__
        c = model.config
        a = c.attention()
        assert a.head_dim is not None
        self.shape = DecoderShape(max_context=int(c.max_context), n_layers=int(c.n_layers), n_heads=int(a.n_heads),
                                  n_kv_heads=int(a.n_kv_heads), head_dim=int(a.head_dim),
                                  vocab_size=int(c.vocab_size), windows=(None,) * int(c.n_layers))

    def __call__(self, ids: Tensor, *, cache: Any = None, logits_to_keep: int = 0,
                 valid: Tensor | None = None) -> Tensor:
        out: Tensor = self.model(ids, cache=cache, logits_to_keep=logits_to_keep, key_padding_mask=_padding(valid))
        return out

    def new_cache(self, batch: int, max_len: int | None = None, **kind: Any) -> Any:
        return self.model.new_cache(batch, max_len, **kind)

    def attention_layers(self) -> list[HookedAttention]:
        return [cast(HookedAttention, block.attn) for block in self.model.layers]

    def block_inputs(self, ids: Tensor, valid: Tensor | None = None) -> list[Tensor]:
        states: list[Tensor] = []
        with torch.no_grad():
            h = self.model.embed(ids)  # (b, s, d_model)
            step = self.model.step(h, key_padding_mask=_padding(valid))
            for block in self.model.layers:
                states.append(h)
                h = block(h, step=step)
        return states

    def _run_from(self, h: Tensor, start: int, valid: Tensor | None) -> Tensor:
        step = self.model.step(h, key_padding_mask=_padding(valid))
        for block in list(self.model.layers)[start:]:
            h = block(h, step=step)
        out: Tensor = self.model.norm(h)
        return out

    def logits_from(self, h: Tensor, start: int, valid: Tensor | None = None) -> Tensor:
        m = self.model
        weight = m.embed.weight if m.lm_head is None else m.lm_head.weight
        return torch.nn.functional.linear(self._run_from(h, start, valid), weight)  # (b, s, vocab)

    def final_hidden(self, ids: Tensor) -> Tensor:
        return self._run_from(self.model.embed(ids), 0, None)


class TransformersDecoder(_Parameters):
    """A transformers causal LM on multihead's attention (:func:`multihead.hf.enable`, applied here when the model
    is not switched yet) as a :class:`Decoder`: its caches are multihead's (:func:`multihead.hf.cache.new_cache`,
    any kind, ``spec=``, ``layers="global"`` on a hybrid model's global layers only); a forward through a cache
    commits it (the cache's ``advance`` then checks the count)."""

    engine = "transformers"

    def __init__(self, model: nn.Module, tokenizer: Any = None, name: str = "") -> None:
        from multihead import hf

        config: Any = getattr(model, "config", None)
        if config is None or not hasattr(model, "set_attn_implementation"):
            raise MultiheadError(f"{type(model).__name__} is not a transformers model (no config, no "
                                 "set_attn_implementation)")
        if getattr(config, "is_encoder_decoder", False) or not callable(getattr(model, "generate", None)):
            raise MultiheadError(f"{type(model).__name__} is not a causal language model (a decoder): the head tools "
                                 "of an encoder are multihead.heads.adapters' encoder adapters")
        if getattr(config, "_attn_implementation", None) != hf.NAME:
            hf.enable(model)
        from multihead.hf.cache import cache_shape

        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        cs = cache_shape(model)
        self.model = model
        self.tokenizer = cast(Tokenizer, as_tokenizer(tokenizer))
        path = str(getattr(config, "_name_or_path", "") or "")
        self.name = name or Path(path).name or path or type(model).__name__
        self.shape = DecoderShape(max_context=int(cs.context or 0), n_layers=len(cs.kv_heads), n_heads=cs.n_heads,
                                  n_kv_heads=cs.kv_heads[0], head_dim=cs.head_dim,
                                  vocab_size=int(text.vocab_size), windows=tuple(cs.windows))
        self._layers = cast(list[HookedAttention], list(hf.attention_modules(model).values()))

    def __call__(self, ids: Tensor, *, cache: Any = None, logits_to_keep: int = 0,
                 valid: Tensor | None = None) -> Tensor:
        mask = _padding(valid)
        out = self.model(ids, cache=cache, use_cache=cache is not None, logits_to_keep=logits_to_keep,
                         attention_mask=None if mask is None else mask.long())
        logits: Tensor = out.logits
        return logits

    def new_cache(self, batch: int, max_len: int | None = None, **kind: Any) -> Any:
        from multihead.hf.cache import new_cache

        return new_cache(self.model, max_len, batch=batch, **kind)

    def attention_layers(self) -> list[HookedAttention]:
        return self._layers

    def block_inputs(self, ids: Tensor, valid: Tensor | None = None) -> list[Tensor]:
        return []  # a run starts from the embeddings: transformers' forward is not entered at a block

    def logits_from(self, h: Tensor, start: int, valid: Tensor | None = None) -> Tensor:
        raise MultiheadError(f"{self.name} runs on transformers, whose forward starts at the embeddings: "
                             "block_inputs gave no states to resume from")

    def final_hidden(self, ids: Tensor) -> Tensor:
        base: Any = getattr(self.model, "base_model", self.model)
        out: Tensor = base(input_ids=ids, use_cache=False).last_hidden_state
        return out


def as_decoder(model: Any, tokenizer: Any = None, name: str = "") -> Decoder:
    """``model`` as a :class:`Decoder`: itself when it is one, else multihead's LlamaModel or a transformers causal
    LM with ``tokenizer`` (ours, or transformers' own, wrapped)."""
    if isinstance(model, PortDecoder | TransformersDecoder | Decoder):  # ours, or a user's own
        return cast(Decoder, model)
    from multihead.models.llama import LlamaModel

    if isinstance(model, LlamaModel):
        return cast(Decoder, PortDecoder(model, tokenizer, name))
    if hasattr(model, "set_attn_implementation") and hasattr(model, "config"):
        return cast(Decoder, TransformersDecoder(model, tokenizer, name))
    raise MultiheadError(f"{type(model).__name__} is not a decoder multihead runs: give multihead's LlamaModel or a "
                         "transformers causal language model")


def load_decoder(name: str | Path | None, engine: str = "auto", *, dtype: torch.dtype = torch.float32) -> Decoder:
    """What ``--model`` names ('smollm2' by default, 'gemma3', a GGUF file of any architecture transformers reads, a
    model folder) as a :class:`Decoder` in ``dtype``, on the engine :func:`multihead.models.route.route` decides
    ("auto": our port where one applies, transformers otherwise), with the model's own tokenizer; a sentence
    encoder is refused by name."""
    from multihead.models.route import route

    found = route(None if name is None else str(name), engine)
    if found.engine == "ours" and found.port != "llama":
        raise MultiheadError(f"{found.label} is a {found.arch} sentence encoder: this needs a causal language model "
                             "(a decoder)")
    if found.engine == "ours":
        from multihead.models.loaders import load_llama

        port, tokenizer = load_llama(found.path, dtype=dtype)
        return cast(Decoder, PortDecoder(port, tokenizer, found.label).eval())
    from multihead import hf

    model = hf.load(found.path, dtype=dtype, task="causal-lm")
    return cast(Decoder, TransformersDecoder(model, load_tokenizer(found.path), found.label).eval())


__all__ = [
    "ENGINE_LABELS",
    "Decoder",
    "DecoderShape",
    "PortDecoder",
    "Tokenizer",
    "TransformersDecoder",
    "TransformersTokenizer",
    "as_decoder",
    "as_tokenizer",
    "load_decoder",
    "load_tokenizer",
    "transformers_bos",
    "transformers_tokenizer",
]
