"""Tokenizers for the real models, built with the ``tokenizers`` library: from a tokenizer.json, or from the
vocabulary and merges stored in a GGUF file's metadata."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from multihead.errors import MultiheadError

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4


@dataclass
class TextTokenizer:
    """Text <-> token ids, with the model's special tokens and chat template."""

    tokenizer: Tokenizer
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    stop_ids: set[int] = field(default_factory=set)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def token_ids(self, text: str) -> list[int]:
        """The text's tokens without special tokens (a piece of a prompt, an answer token)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        """The text as a prompt: the BOS first where the model's tokenizer adds one (``add_bos``)."""
        ids = self.token_ids(text)
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special))

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """Render the model's own chat template (Jinja, as stored with the model)."""
        if not self.chat_template:
            raise MultiheadError("this model has no chat template: use the prompt as it is (without --chat)")
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        template = env.from_string(self.chat_template)
        bos = self.tokenizer.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos = self.tokenizer.id_to_token(self.eos_id) if self.eos_id is not None else ""
        return str(template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=bos, eos_token=eos))

    def stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Decode ids one at a time, yielding text as soon as it is complete (never half a UTF-8 character)."""
        seen: list[int] = []
        emitted = ""
        for i in ids:
            seen.append(i)
            text = self.decode(seen)
            if text.endswith("\ufffd"):
                continue
            yield text[len(emitted):]
            emitted = text


def from_tokenizer_json(path: str | Path, **kwargs: object) -> TextTokenizer:
    p = Path(path)
    if not p.is_file():
        raise MultiheadError(f"tokenizer file {str(p)!r} does not exist")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as err:  # the library raises plain Exception subclasses for malformed files
        raise MultiheadError(f"tokenizer file {str(p)!r} could not be read: {err}") from None
    return TextTokenizer(tok, **kwargs)  # type: ignore[arg-type]


def check_against_model(tokenizer: TextTokenizer, vocab_size: int, where: str) -> None:
    """Refuse, at load, a tokenizer that would fail at encode or embed time: a token of its vocabulary (added tokens
    included) or a special token its post-processor adds ([CLS], [SEP], ...) whose id is past the model's
    ``vocab_size`` embedding rows, or an unknown-word token (WordPiece's [UNK]) missing from its vocabulary. Errors
    begin with ``where`` and name the token and its id."""
    tok = tokenizer.tokenizer
    last = vocab_size - 1
    vocab = tok.get_vocab(with_added_tokens=True)
    if vocab:
        token, top = max(vocab.items(), key=lambda item: item[1])
        if top > last:
            raise MultiheadError(f"{where}: token {token[:60]!r} has id {top:,}, past the model's embedding of "
                                 f"{vocab_size:,} tokens (ids 0 to {last:,}): it could not be embedded")
    unk = getattr(tok.model, "unk_token", None)
    if unk is not None and tok.model.token_to_id(unk) is None:
        raise MultiheadError(f"{where}: its unknown-word token {unk[:60]!r} is not in its vocabulary: a word it "
                             "cannot split into known pieces would fail to encode")
    try:  # the special tokens its post-processor adds, with their ids (a pair, or a single text without a pair rule)
        probe = tok.encode("a", "b", add_special_tokens=True)
    except Exception:  # (the library raises plain Exception subclasses)
        try:
            probe = tok.encode("a", add_special_tokens=True)
        except Exception as err:
            raise MultiheadError(f"{where}: it cannot encode the text 'a': {err}") from None
    for token, token_id in zip(probe.tokens, probe.ids, strict=True):
        if token_id > last:
            raise MultiheadError(f"{where}: it adds the special token {token[:60]!r} with id {token_id:,}, past the "
                                 f"model's embedding of {vocab_size:,} tokens (ids 0 to {last:,})")


def from_gguf_metadata(
    *,
    model: str,
    pre: str | None,
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    bos_id: int | None,
    eos_id: int | None,
    add_bos: bool,
    chat_template: str | None,
    where: str = "GGUF metadata",
) -> TextTokenizer:
    """A byte-level BPE tokenizer (GGUF ``tokenizer.ggml.model == "gpt2"``) from the file's vocabulary and merges.

    The pre-tokenizer follows llama.cpp's for the named ``pre`` type: ``smollm`` (and ``qwen2``, ``deepseek-llm``...
    are not supported here) splits every digit on its own before the GPT-2 split.
    """
    if model != "gpt2":
        raise MultiheadError(f"{where!r}: GGUF tokenizer model {model[:60]!r} is not supported: only byte-level BPE "
                             "('gpt2') is")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise MultiheadError(f"{where!r}: tokenizer.ggml.tokens holds {dup!r} twice")
    pairs = []
    for k, merge in enumerate(merges):
        pair = merge.split(" ", 1)
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
            raise MultiheadError(f"{where!r}: tokenizer.ggml.merges[{k}] = {merge[:60]!r}: expected two tokens of "
                                 "the vocabulary, separated by a space, whose join is a token too")
        pairs.append((pair[0], pair[1]))
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    except Exception as err:  # the library raises plain Exception subclasses
        raise MultiheadError(f"{where!r}: the tokenizer cannot be built: {err}") from None
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm",):
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in (None, "default", "gpt2", "gpt-2"):
        tok.pre_tokenizer = byte_level
    else:
        raise MultiheadError(f"{where!r}: GGUF pre-tokenizer {pre[:60]!r} is not supported: supported are smollm "
                             "and gpt2")
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, kind in enumerate(token_types)
               if kind == _CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, kind in enumerate(token_types)
            if kind == _USER_DEFINED]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    stop = {i for i in (eos_id,) if i is not None}
    # ChatML models end a turn with <|im_end|>: stop there too.
    if "<|im_end|>" in vocab:
        stop.add(vocab["<|im_end|>"])
    return TextTokenizer(tok, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, chat_template=chat_template,
                         stop_ids=stop)
