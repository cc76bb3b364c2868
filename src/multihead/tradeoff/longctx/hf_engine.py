"""A transformers causal LM behind the decoding interface of multihead's own port, for the long-context evaluation
(``tradeoff --long --engine transformers``): the model on multihead's attention (:func:`multihead.hf.enable`), its
caches multihead's (:mod:`multihead.hf.cache`), its tokenizer as the evaluation calls it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from multihead import hf
from multihead.errors import MultiheadError
from multihead.hf.cache import MultiheadCache, new_cache


@dataclass(frozen=True)
class DecoderShape:
    """The numbers of a transformers decoder that multihead's long-context evaluation reads (as of our port's
    LlamaConfig): its context, layers and heads."""

    max_context: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int


class TransformersDecoder:
    """A transformers causal LM switched to multihead's attention, behind the decoding interface of multihead's own
    port (what :mod:`multihead.tradeoff.longctx` and :mod:`multihead.evals.answers` call): ``model(tokens,
    cache=, logits_to_keep=)`` gives the logits (b, s, vocab), ``new_cache(b, max_len, ...)`` a
    :class:`~multihead.hf.cache.MultiheadCache` of any kind, ``config`` its :class:`DecoderShape`. A forward through
    a cache commits it (the cache's ``advance`` then only checks the count)."""

    def __init__(self, model: Any) -> None:
        config: Any = getattr(model, "config", None)
        if config is None or getattr(config, "_attn_implementation", None) != "multihead":
            raise MultiheadError("TransformersDecoder takes a transformers model on multihead's attention: "
                                 "multihead.hf.enable(model) first")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        h = int(text.num_attention_heads)
        self.model = model
        self.config = DecoderShape(max_context=int(getattr(text, "max_position_embeddings", 0) or 0),
                                   n_layers=int(text.num_hidden_layers), n_heads=h,
                                   n_kv_heads=int(getattr(text, "num_key_value_heads", None) or h),
                                   head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // h))

    @property
    def dtype(self) -> torch.dtype:
        param: Tensor = next(self.model.parameters())
        return param.dtype

    @property
    def device(self) -> torch.device:
        param: Tensor = next(self.model.parameters())
        return param.device

    def __call__(self, tokens: Tensor, *, cache: MultiheadCache | None = None, logits_to_keep: int = 0) -> Tensor:
        out = self.model(tokens, cache=cache, use_cache=cache is not None, logits_to_keep=logits_to_keep)
        logits: Tensor = out.logits
        return logits

    def new_cache(self, batch: int, max_len: int | None = None, **kind: Any) -> MultiheadCache:
        """:func:`multihead.hf.cache.new_cache` of the model: any kind, as options or ``spec=`` (a
        :class:`~multihead.cache.CacheSpec`); ``layers="global"`` on a hybrid model's global layers only."""
        return new_cache(self.model, max_len, batch=batch, **kind)

    def eval(self) -> TransformersDecoder:
        self.model.eval()
        return self


def load_decoder(path: str | Any, *, dtype: torch.dtype = torch.float32) -> tuple[TransformersDecoder, Any]:
    """A local folder (config.json, safetensors, a tokenizer) or a .gguf file as a transformers causal LM on
    multihead's attention (:func:`multihead.hf.load`), behind the decoding interface, with its tokenizer: a
    folder's own (transformers' AutoTokenizer), a GGUF file's as its metadata holds it
    (:func:`multihead.models.loaders.read_gguf_tokenizer`, for byte-level BPE; transformers' reading of the file
    otherwise, e.g. Gemma's SentencePiece; llama.cpp's pre-tokenizer for the named type: the
    tokenizer transformers builds from SmolLM2's GGUF file reads "Introduction\\n\\n1." of the Jargon File as two
    newline tokens where multihead's reading of the file, with llama.cpp's smollm pre-tokenizer, has one: the
    cases' ids would differ)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from multihead.heads.engines import TransformersTokenizer  # the one wrapper of a transformers tokenizer

    p = Path(path)
    model = hf.load(p, dtype=dtype, task="causal-lm")
    if p.is_file():
        from multihead.models.gguf_file import GGUFFile
        from multihead.models.loaders import read_gguf_tokenizer

        if GGUFFile(p).field("tokenizer.ggml.model", None) == "gpt2":  # byte-level BPE: multihead reads it
            return TransformersDecoder(model).eval(), read_gguf_tokenizer(p)
    try:  # a folder's tokenizer, or a GGUF file's that multihead does not read (Gemma's SentencePiece)
        tokenizer = (AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name) if p.is_file()
                     else AutoTokenizer.from_pretrained(str(p)))
    except (OSError, ValueError, KeyError) as err:
        raise MultiheadError(f"transformers could not load a tokenizer for {str(p)!r}: {err}") from None
    return TransformersDecoder(model).eval(), TransformersTokenizer(tokenizer)


__all__ = ["DecoderShape", "TransformersDecoder", "load_decoder"]
