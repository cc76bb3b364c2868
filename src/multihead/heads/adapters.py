"""One interface over the two real models for head analysis: tokenize, run, capture, ablate, convert to GQA."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention import MultiHeadAttention
from multihead.errors import MultiheadError
from multihead.heads.convert import pool_kv_heads
from multihead.models.bert import SentenceEncoder
from multihead.models.llama import LlamaModel
from multihead.models.tokenizer import TextTokenizer

MODEL_NAMES = ("smollm2", "minilm")


@dataclass
class Batch:
    ids: Tensor  # (b, s)
    valid: Tensor  # (b, s) bool
    lengths: list[int]


@contextmanager
def zero_head(layer: MultiHeadAttention, head: int) -> Iterator[None]:
    """Zero one query head's output before W_O while the block runs (the ablation of Michel et al. 2019)."""
    d = layer.head_dim

    def hook(_module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        merged = args[0].clone()
        merged[..., head * d:(head + 1) * d] = 0
        return (merged, *args[1:])

    handle = layer.o_proj.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


class HeadModel:
    """What the head tools need from a model."""

    name: str
    causal: bool
    max_tokens: int
    metric_name: str
    metric_is_change = False  # True when the metric is itself a change from the full model (0 for the full model)

    def relative(self, value: float, baseline: float) -> float:
        """The change a value makes, as a fraction: of the baseline, or the metric itself when it is a change."""
        if self.metric_is_change:
            return value - baseline
        return (value - baseline) / baseline if baseline else float("inf")

    def layers(self) -> list[MultiHeadAttention]:
        raise NotImplementedError

    def encode(self, texts: list[str]) -> Batch:
        raise NotImplementedError

    def token_strings(self, ids: list[int]) -> list[str]:
        raise NotImplementedError

    def run(self, batch: Batch) -> None:
        raise NotImplementedError

    def random_token_ids(self, n: int, generator: torch.Generator) -> Tensor:
        raise NotImplementedError

    def wrap_repeat(self, ids: Tensor) -> tuple[Tensor, int]:
        """Ids to run for a repeated-token sequence, and the offset of its first token."""
        return ids, 0

    def metric(self, batch: Batch, *, ablate: tuple[int, int] | None = None, start: int = 0,
               states: list[Tensor] | None = None) -> float:
        raise NotImplementedError

    def hidden_states(self, batch: Batch) -> list[Tensor]:
        raise NotImplementedError

    def with_kv_heads(self, n_kv_heads: int) -> HeadModel:
        raise NotImplementedError

    @property
    def n_layers(self) -> int:
        return len(self.layers())

    @property
    def n_heads(self) -> int:
        return self.layers()[0].n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.layers()[0].n_kv_heads


# ---------------------------------------------------------------------------------------------- decoder
class DecoderHeads(HeadModel):
    causal = True
    metric_name = "language-model loss (nats/token)"

    def __init__(self, model: LlamaModel, tokenizer: TextTokenizer, name: str = "smollm2") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.max_tokens = model.config.max_context

    def layers(self) -> list[MultiHeadAttention]:
        return [cast(MultiHeadAttention, block.attn) for block in self.model.layers]

    def encode(self, texts: list[str]) -> Batch:
        encoded = [self.tokenizer.encode(t) for t in texts]
        return _pad(encoded, self.max_tokens, texts)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]

    def run(self, batch: Batch) -> None:
        self.model(batch.ids, key_padding_mask=None if bool(batch.valid.all()) else batch.valid)

    def random_token_ids(self, n: int, generator: torch.Generator) -> Tensor:
        special = max(self.tokenizer.stop_ids | {self.tokenizer.bos_id or 0, self.tokenizer.eos_id or 0}) + 1
        low = max(special, 17)  # SmolLM2 keeps its control tokens at the start of the vocabulary
        return torch.randint(low, self.model.config.vocab_size, (n,), generator=generator)

    def hidden_states(self, batch: Batch) -> list[Tensor]:
        """The input of every block (and the final hidden state) of a baseline run."""
        states: list[Tensor] = []
        with torch.no_grad():
            h = self.model.embed(batch.ids)
            for block in self.model.layers:
                states.append(h)
                h = block(h, positions=None, cache=None, index=0, key_padding_mask=batch.valid)
        return states

    def metric(self, batch: Batch, *, ablate: tuple[int, int] | None = None, start: int = 0,
               states: list[Tensor] | None = None) -> float:
        """Mean next-token cross-entropy over the real tokens, optionally with one head zeroed; with ``states``
        (from hidden_states) the run starts at block ``start``."""
        with torch.no_grad(), _maybe_zero(self.layers(), ablate):
            h = self.model.embed(batch.ids) if states is None else states[start]
            for block in list(self.model.layers)[start if states is not None else 0:]:
                h = block(h, positions=None, cache=None, index=0, key_padding_mask=batch.valid)
            logits = F.linear(self.model.norm(h), self.model.embed.weight if self.model.lm_head is None
                              else self.model.lm_head.weight)
            target = batch.ids[:, 1:]
            mask = batch.valid[:, 1:]
            losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), target, reduction="none")
            return float(losses[mask].mean())

    def with_kv_heads(self, n_kv_heads: int) -> DecoderHeads:
        model = copy.deepcopy(self.model)
        for block in model.layers:
            block.attn = pool_kv_heads(cast(MultiHeadAttention, block.attn), n_kv_heads)
        return DecoderHeads(model, self.tokenizer, name=f"{self.name}-kv{n_kv_heads}")


# ---------------------------------------------------------------------------------------------- encoder
class EncoderHeads(HeadModel):
    causal = False
    metric_name = "1 - cosine similarity to the full model's sentence embeddings"
    metric_is_change = True

    def __init__(self, encoder: SentenceEncoder, name: str = "minilm",
                 reference: Callable[[Batch], Tensor] | None = None) -> None:
        self.encoder = encoder
        self.name = name
        self.max_tokens = encoder.max_length
        self._reference: dict[int, Tensor] = {}
        self._reference_fn = reference

    def layers(self) -> list[MultiHeadAttention]:
        return [cast(MultiHeadAttention, layer.attn) for layer in self.encoder.encoder.layers]

    def encode(self, texts: list[str]) -> Batch:
        encoded = [self.encoder.tokenizer.tokenizer.encode(t).ids for t in texts]
        return _pad(encoded, self.max_tokens, texts)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.encoder.tokenizer.tokenizer.id_to_token(i) or "?" for i in ids]

    def run(self, batch: Batch) -> None:
        self.encoder.encoder(batch.ids, batch.valid)

    def random_token_ids(self, n: int, generator: torch.Generator) -> Tensor:
        return torch.randint(1000, self.encoder.encoder.config.vocab_size, (n,), generator=generator)

    def wrap_repeat(self, ids: Tensor) -> tuple[Tensor, int]:
        cls = self.encoder.tokenizer.tokenizer.token_to_id("[CLS]")
        sep = self.encoder.tokenizer.tokenizer.token_to_id("[SEP]")
        if cls is None or sep is None:
            raise MultiheadError("this encoder's vocabulary has no [CLS] or [SEP] token")
        b = ids.shape[0]
        return torch.cat([torch.full((b, 1), cls), ids, torch.full((b, 1), sep)], dim=1), 1

    def hidden_states(self, batch: Batch) -> list[Tensor]:
        enc = self.encoder.encoder
        states: list[Tensor] = []
        with torch.no_grad():
            s = batch.ids.shape[1]
            h = enc.embed_norm(enc.word_embeddings(batch.ids) + enc.position_embeddings(torch.arange(s))
                               + enc.token_type_embeddings(torch.zeros_like(batch.ids)))
            for layer in enc.layers:
                states.append(h)
                h = layer(h, batch.valid)
        return states

    def embeddings(self, batch: Batch, *, ablate: tuple[int, int] | None = None, start: int = 0,
                   states: list[Tensor] | None = None) -> Tensor:
        enc = self.encoder.encoder
        with torch.no_grad(), _maybe_zero(self.layers(), ablate):
            if states is None:
                h = enc(batch.ids, batch.valid)
            else:
                h = states[start]
                for layer in list(enc.layers)[start:]:
                    h = layer(h, batch.valid)
            return self.encoder.pool(h, batch.valid)

    def metric(self, batch: Batch, *, ablate: tuple[int, int] | None = None, start: int = 0,
               states: list[Tensor] | None = None) -> float:
        key = id(batch)
        if key not in self._reference:
            self._reference[key] = (self._reference_fn(batch) if self._reference_fn is not None
                                    else self.embeddings(batch))
        e = self.embeddings(batch, ablate=ablate, start=start, states=states)
        return float(1.0 - F.cosine_similarity(e, self._reference[key], dim=-1).mean())

    def with_kv_heads(self, n_kv_heads: int) -> EncoderHeads:
        encoder = copy.deepcopy(self.encoder)
        for layer in encoder.encoder.layers:
            layer.attn = pool_kv_heads(cast(MultiHeadAttention, layer.attn), n_kv_heads)
        return EncoderHeads(encoder, name=f"{self.name}-kv{n_kv_heads}", reference=self.embeddings)


@contextmanager
def _maybe_zero(layers: list[MultiHeadAttention], ablate: tuple[int, int] | None) -> Iterator[None]:
    if ablate is None:
        yield
        return
    with zero_head(layers[ablate[0]], ablate[1]):
        yield


def _pad(encoded: list[list[int]], limit: int, texts: list[str]) -> Batch:
    for text, e in zip(texts, encoded, strict=True):
        if not e:
            raise MultiheadError(f"text {text[:40]!r} has no tokens: give a non-empty text")
        if len(e) > limit:
            raise MultiheadError(
                f"text {text[:40]!r}... has {len(e)} tokens, more than the model's context of {limit}: shorten it"
            )
    lengths = [len(e) for e in encoded]
    ids = torch.zeros(len(encoded), max(lengths), dtype=torch.long)
    valid = torch.zeros(len(encoded), max(lengths), dtype=torch.bool)
    for i, e in enumerate(encoded):
        ids[i, :len(e)] = torch.tensor(e)
        valid[i, :len(e)] = True
    return Batch(ids, valid, lengths)


def split_sentences(text: str) -> list[str]:
    """Sentences of a passage (for the encoder, which embeds sentences)."""
    parts = [p.strip() for p in re.split(r"(?<=[.;!?])\s+", text) if p.strip()]
    return parts or [text]


def load_head_model(name: str | None) -> HeadModel:
    """'smollm2' (default), 'minilm', a GGUF file or Llama folder, or a sentence-transformers folder."""
    from multihead.models import load_llama, load_sentence_encoder

    if name in (None, "smollm2"):
        model, tok = load_llama()
        return DecoderHeads(model, tok)
    if name == "minilm":
        return EncoderHeads(load_sentence_encoder())
    path = Path(name)
    if not path.exists():
        raise MultiheadError(f"unknown model {name!r}: give one of {', '.join(MODEL_NAMES)}, a .gguf file or a model "
                             "folder")
    if path.is_file() or ((path / "config.json").exists() and '"llama"' in (path / "config.json").read_text()):
        model, tok = load_llama(path)
        return DecoderHeads(model, tok, name=path.stem)
    return EncoderHeads(load_sentence_encoder(path), name=path.name)
