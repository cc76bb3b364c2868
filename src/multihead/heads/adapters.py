"""What the head tools need of a model (:class:`HeadModel`): tokenize, run, capture, ablate, convert to GQA, a metric.

A decoder of either engine is one :class:`DecoderHeads` over the :class:`~multihead.models.decoder.Decoder`
protocol; the encoders (multihead's BERT port, a transformers encoder) have an adapter each; :func:`head_model`
picks for a model in memory, :func:`load_head_model` for what ``--model`` names."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.errors import MultiheadError
from multihead.layers.attention import MultiHeadAttention
from multihead.layers.hooks import HookedAttention, HookFn, HookPoint, pool_kv_hook, zero_heads
from multihead.models.bert import SentenceEncoder
from multihead.models.decoder import ENGINE_LABELS, Decoder, as_decoder, load_tokenizer, transformers_tokenizer


@dataclass
class Batch:
    ids: Tensor  # (b, s)
    valid: Tensor  # (b, s) bool
    lengths: list[int]
    reference: Tensor | None = None  # an encoder's unedited embeddings of this batch, made on its first metric


Edit = tuple[HookPoint, HookFn]  # a hook to attach to one hook point for one run


def ablate_edit(layer: HookedAttention, head: int) -> Edit:
    """Zero one query head's output before W_O (the ablation of Michel et al. 2019), through its hook point z."""
    return layer.hook_z, zero_heads(head)


def pool_edits(layers: Sequence[HookedAttention], n_kv_heads: int) -> list[Edit]:
    """Mean-pool every layer's KV heads into n_kv_heads (Ainslie et al. 2023) through the hook points k and v."""
    pool = pool_kv_hook(n_kv_heads)
    return [edit for layer in layers for edit in ((layer.hook_k, pool), (layer.hook_v, pool))]


@contextmanager
def applied(edits: Sequence[Edit]) -> Iterator[None]:
    """The edits attached while the block runs."""
    handles = [point.add(fn) for point, fn in edits]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class HeadModel:
    """What the head tools need from a model: its attention layers' hook points, tokenizing, running, a metric."""

    name: str
    causal: bool
    max_tokens: int
    metric_name: str
    metric_is_change = False  # True when the metric is itself a change from the full model (0 for the full model)
    engine = "multihead's own port"

    def relative(self, value: float, baseline: float) -> float:
        """The change a value makes, as a fraction: of the baseline, or the metric itself when it is a change."""
        if self.metric_is_change:
            return value - baseline
        return (value - baseline) / baseline if baseline else float("inf")

    def layers(self) -> Sequence[HookedAttention]:
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

    def metric(self, batch: Batch, *, edits: Sequence[Edit] = (), start: int = 0,
               states: list[Tensor] | None = None) -> float:
        """The model's metric on ``batch`` with ``edits`` attached; with ``states`` (from hidden_states) the run
        starts at block ``start``."""
        raise NotImplementedError

    def hidden_states(self, batch: Batch) -> list[Tensor]:
        raise NotImplementedError

    def logits(self, ids: Tensor) -> Tensor:
        """Next-token logits (b, s, vocab) of a causal model (for patching)."""
        raise MultiheadError(f"{self.name} is not a causal language model: patching needs next-token logits")

    def token_ids(self, text: str) -> list[int]:
        """The text's tokens, without special tokens (a piece of a prompt, or an answer token)."""
        raise NotImplementedError

    bos_id: int | None = None  # the BOS the model's tokenizer puts before a prompt (None where it puts none)

    def prompt_ids(self, text: str) -> list[int]:
        """A prompt's ids as the model reads one: the tokenizer's BOS (``bos_id``) first where it adds one."""
        return ([] if self.bos_id is None else [self.bos_id]) + self.token_ids(text)

    @property
    def n_layers(self) -> int:
        return len(self.layers())

    @property
    def n_heads(self) -> int:
        """Query heads per layer: our layers know theirs (other adapters say it themselves)."""
        return int(cast(MultiHeadAttention, self.layers()[0]).n_heads)

    @property
    def n_kv_heads(self) -> int:
        return int(cast(MultiHeadAttention, self.layers()[0]).n_kv_heads)


# ---------------------------------------------------------------------------------------------- decoder
class DecoderHeads(HeadModel):
    """A causal language model's heads, whichever engine runs it: a :class:`~multihead.models.decoder.Decoder`
    (or a model :func:`~multihead.models.decoder.as_decoder` wraps: multihead's LlamaModel, a transformers causal LM,
    with ``tokenizer``). Prompts are the model's own (its tokenizer's BOS first where it adds one, ``bos_id``); the
    metric is the language-model loss over the real tokens; a decoder that can resume at a block
    (``block_inputs``) lets the sweeps start there."""

    causal = True
    metric_name = "language-model loss (nats/token)"

    def __init__(self, decoder: Decoder | nn.Module, tokenizer: Any = None, name: str = "") -> None:
        self.decoder = as_decoder(decoder, tokenizer, name)
        self.name = name or self.decoder.name
        self.engine = ENGINE_LABELS.get(self.decoder.engine, self.decoder.engine)  # a user's decoder: its own
        self.tokenizer = self.decoder.tokenizer
        self.max_tokens = self.decoder.shape.max_context or 2048
        tok: Any = self.tokenizer
        self.bos_id = tok.bos_id if tok is not None and getattr(tok, "add_bos", False) else None
        self._layers = self.decoder.attention_layers()

    @property
    def model(self) -> nn.Module:
        """The module the decoder runs (the port's LlamaModel, or the transformers model)."""
        return self.decoder.model

    def layers(self) -> list[HookedAttention]:
        return self._layers

    @property
    def n_heads(self) -> int:
        return self.decoder.shape.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.decoder.shape.n_kv_heads

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise MultiheadError(f"{self.name} was given no tokenizer: text goes through the model's own")
        return self.tokenizer

    def encode(self, texts: list[str]) -> Batch:
        """Each text as a prompt: the BOS first where the tokenizer adds one (``bos_id``), no other special token."""
        return _pad([self.prompt_ids(t) for t in texts], self.max_tokens, texts)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self._tokenizer().decode([i]) for i in ids]

    def token_ids(self, text: str) -> list[int]:
        return list(self._tokenizer().token_ids(text))

    def run(self, batch: Batch) -> None:
        self.decoder(batch.ids, valid=batch.valid)

    def logits(self, ids: Tensor) -> Tensor:
        return self.decoder(ids)

    def random_token_ids(self, n: int, generator: torch.Generator) -> Tensor:
        """Random ids above the tokenizer's special tokens and a vocabulary's control tokens at its start (SmolLM2
        keeps them below 17), drawn alike on both engines so that their scores agree."""
        tok: Any = self._tokenizer()
        special = {*tok.stop_ids, tok.bos_id or 0, getattr(tok, "eos_id", None) or 0}
        vocab = self.decoder.shape.vocab_size
        low = max(max(special) + 1, 17)
        return torch.randint(min(low, vocab - n - 1), vocab, (n,), generator=generator)

    def wrap_repeat(self, ids: Tensor) -> tuple[Tensor, int]:
        if self.bos_id is None:
            return ids, 0
        return torch.cat([torch.full((ids.shape[0], 1), self.bos_id), ids], dim=1), 1

    def hidden_states(self, batch: Batch) -> list[Tensor]:
        """The input of every block of a baseline run (none where the decoder starts every run at the embeddings)."""
        return self.decoder.block_inputs(batch.ids, batch.valid)

    def metric(self, batch: Batch, *, edits: Sequence[Edit] = (), start: int = 0,
               states: list[Tensor] | None = None) -> float:
        """Mean next-token cross-entropy over the real tokens, with ``edits`` attached; with ``states`` (from
        hidden_states) the run starts at block ``start``."""
        with torch.no_grad(), applied(edits):
            if states:
                logits = self.decoder.logits_from(states[start], start, batch.valid)
            else:
                logits = self.decoder(batch.ids, valid=batch.valid)
            losses = F.cross_entropy(logits.float()[:, :-1].transpose(1, 2), batch.ids[:, 1:], reduction="none")
            return float(losses[batch.valid[:, 1:]].mean())


# ---------------------------------------------------------------------------------------------- encoder
class EncoderHeads(HeadModel):
    causal = False
    metric_name = "1 - cosine similarity to the full model's sentence embeddings"
    metric_is_change = True

    def __init__(self, encoder: SentenceEncoder, name: str = "minilm") -> None:
        self.encoder = encoder
        self.name = name
        self.max_tokens = encoder.max_length

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
            step = enc.step(h, batch.valid)
            for layer in enc.layers:
                states.append(h)
                h = layer(h, step)
        return states

    def embeddings(self, batch: Batch, *, edits: Sequence[Edit] = (), start: int = 0,
                   states: list[Tensor] | None = None) -> Tensor:
        enc = self.encoder.encoder
        with torch.no_grad(), applied(edits):
            if states is None:
                h = enc(batch.ids, batch.valid)
            else:
                h = states[start]
                step = enc.step(h, batch.valid)
                for layer in list(enc.layers)[start:]:
                    h = layer(h, step)
            return self.encoder.pool(h, batch.valid)

    def metric(self, batch: Batch, *, edits: Sequence[Edit] = (), start: int = 0,
               states: list[Tensor] | None = None) -> float:
        if batch.reference is None:
            batch.reference = self.embeddings(batch)
        e = self.embeddings(batch, edits=edits, start=start, states=states)
        return float(1.0 - F.cosine_similarity(e, batch.reference, dim=-1).mean())


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


# ---------------------------------------------------------------------------------------------- transformers encoders
class TransformersHeads(HeadModel):
    """A transformers encoder (BERT, RoBERTa, ...) with its attention on multihead (:func:`multihead.hf.enable`):
    the same hook points serve capture, ablation and KV pooling; the metric is 1 - cosine of its mean-pooled,
    normalised embeddings to the unedited model's. A transformers decoder is a :class:`DecoderHeads`
    (:func:`head_model` picks)."""

    causal = False
    metric_name = "1 - cosine similarity to the full model's mean-pooled embeddings"
    metric_is_change = True
    engine = ENGINE_LABELS["transformers"]

    def __init__(self, model: Any, tokenizer: Any, name: str) -> None:
        from multihead import hf

        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise MultiheadError(f"{name}: an encoder-decoder model ({type(model).__name__}); the head tools take "
                                 "decoder-only and encoder models")
        if callable(getattr(model, "generate", None)):
            raise MultiheadError(f"{name}: {type(model).__name__} is a causal language model: its heads are a "
                                 "DecoderHeads (multihead.heads.adapters.head_model picks)")
        self.model, self.tokenizer, self.name = model, tokenizer, name
        text = config.get_text_config()
        self.max_tokens = int(getattr(text, "max_position_embeddings", None) or 2048)
        self._heads = int(text.num_attention_heads)
        self._kv_heads = int(getattr(text, "num_key_value_heads", None) or self._heads)
        self._layers = cast(list[HookedAttention], list(hf.attention_modules(model).values()))

    def layers(self) -> list[HookedAttention]:
        return self._layers

    @property
    def n_heads(self) -> int:
        return self._heads

    @property
    def n_kv_heads(self) -> int:
        return self._kv_heads

    def encode(self, texts: list[str]) -> Batch:
        """Each text with all its special tokens ([CLS] .. [SEP])."""
        return _pad([list(self.tokenizer(t)["input_ids"]) for t in texts], self.max_tokens, texts)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def _forward(self, batch: Batch) -> Any:
        return self.model(batch.ids, attention_mask=batch.valid.long())

    def token_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def run(self, batch: Batch) -> None:
        with torch.no_grad():
            self._forward(batch)

    def random_token_ids(self, n: int, generator: torch.Generator) -> Tensor:
        """Random ids above the special tokens, drawn as our BERT port draws them (so scores agree between
        engines): BERT vocabularies keep [unused*] and special tokens below id 1000."""
        vocab = int(self.model.config.get_text_config().vocab_size)
        unused = self.tokenizer.convert_tokens_to_ids("[unused0]")
        if unused is not None and unused != self.tokenizer.unk_token_id and vocab > 2000:
            low = 1000
        else:
            low = max(max([*self.tokenizer.all_special_ids, 0]) + 1, 17)
        return torch.randint(min(low, vocab - n - 1), vocab, (n,), generator=generator)

    def wrap_repeat(self, ids: Tensor) -> tuple[Tensor, int]:
        cls, sep = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        if cls is None or sep is None:
            return ids, 0
        b = ids.shape[0]
        return torch.cat([torch.full((b, 1), cls), ids, torch.full((b, 1), sep)], dim=1), 1

    def hidden_states(self, batch: Batch) -> list[Tensor]:
        return []  # every run starts from the embeddings

    def _embeddings(self, batch: Batch) -> Tensor:
        hidden = self._forward(batch).last_hidden_state  # (b, s, d)
        w = batch.valid.unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * w).sum(1) / w.sum(1).clamp(min=1e-9), dim=-1)

    def metric(self, batch: Batch, *, edits: Sequence[Edit] = (), start: int = 0,
               states: list[Tensor] | None = None) -> float:
        with torch.no_grad():
            if batch.reference is None:
                batch.reference = self._embeddings(batch)
            with applied(edits):
                e = self._embeddings(batch)
            return float(1.0 - F.cosine_similarity(e, batch.reference, dim=-1).mean())


def head_model(model: Any, tokenizer: Any = None, name: str = "") -> HeadModel:
    """The head tools' adapter of a model: a :class:`DecoderHeads` for a decoder (a
    :class:`~multihead.models.decoder.Decoder`, multihead's LlamaModel, a transformers causal LM), an
    :class:`EncoderHeads` for multihead's sentence encoder, a :class:`TransformersHeads` for a transformers
    encoder."""
    if isinstance(model, HeadModel):
        return model
    if isinstance(model, SentenceEncoder):
        return EncoderHeads(model, name=name or "minilm")
    if hasattr(model, "set_attn_implementation") and not callable(getattr(model, "generate", None)):
        return TransformersHeads(model, tokenizer, name or type(model).__name__)
    return DecoderHeads(model, tokenizer, name)


def load_head_model(name: str | None, engine: str = "auto") -> HeadModel:
    """'smollm2' (default), 'minilm', 'gemma3', a GGUF file of any architecture or a model folder, on the engine
    :func:`multihead.models.route.route` decides (the one model route of every command).

    ``engine`` "ours" runs multihead's own ports (Llama-style decoders from GGUF or a Llama folder, BERT sentence
    encoders), "transformers" any model transformers loads, with its attention on multihead; "auto" takes our port
    where one applies (the fast path) and transformers otherwise.
    """
    from multihead.models import load_llama, load_sentence_encoder
    from multihead.models.route import route

    found = route(name, engine)
    if found.engine == "ours":
        if found.port == "llama":
            model, tok = load_llama(found.path)
            return DecoderHeads(model, tok, name=found.label)
        return EncoderHeads(load_sentence_encoder(found.path), name=found.label)
    from multihead import hf

    loaded = hf.load(found.path)
    if callable(getattr(loaded, "generate", None)):  # a decoder: the tokenizer every tool of a decoder reads
        return DecoderHeads(loaded, load_tokenizer(found.path), name=found.label)
    return TransformersHeads(loaded, transformers_tokenizer(found.path), name=found.label)
