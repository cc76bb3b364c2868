"""A prompt starts with the BOS of the model's own tokenizer where that tokenizer adds one (issue 49): the head tools'
prompts (`heads`, `patch`, `circuit`), the needle cases and the long-context evaluation's tokenizer, on a tiny
transformers tokenizer that adds a BOS (as Gemma's and Llama's do) and one that adds none (as GPT-2's and SmolLM2's);
pieces joined into one prompt carry no BOS of their own. Each expectation is read from the tokenizer itself
(``tokenizer(text)``, which adds its own special tokens), not typed in."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from multihead import MultiheadError
from multihead.evals.needles import CaseSettings, Haystacks, make_cases, piece_ids, start_ids
from multihead.heads.adapters import DecoderHeads
from multihead.heads.patching import PromptPair, patch_pairs
from multihead.models.decoder import TransformersTokenizer, transformers_bos
from multihead.models.tokenizer import TextTokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_VOCABULARY = ("<pad> <bos> <eos> <unk> the a cat dog sat on mat and then Mary John gave went to store . , ? ! : "
               "hills quiet river runs slowly past mill bird crosses grey sky road goes between fields here "
               "afternoon is long nothing happens it all begins once more pass key hidden somewhere in text below "
               "find remember you will be asked for at end what special magic number numbers word words are them "
               "about of order they appear one 0 1 2 3 4 5 6 7 8 9")
WORDS = _VOCABULARY.split()


def _tokenizer(template: str | None) -> Any:
    """A word-level transformers tokenizer over WORDS; ``template`` its post-processor's single-text rule
    (``"<bos> $A"`` adds a BOS, ``"<bos> $A <eos>"`` a BOS and an EOS, None nothing)."""
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    if template is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(t, vocab[t]) for t in ("<bos>", "<eos>") if t in template])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                                pad_token="<pad>", unk_token="<unk>")


BOS = WORDS.index("<bos>")


@pytest.mark.parametrize(("template", "expected"), [("<bos> $A", BOS), ("<bos> $A <eos>", BOS), (None, None)],
                         ids=["bos", "bos-and-eos", "none"])
def test_the_bos_is_read_from_the_tokenizer(template: str | None, expected: int | None) -> None:
    tok = _tokenizer(template)
    assert transformers_bos(tok) == expected
    full = tok("the cat sat")["input_ids"]  # the tokenizer's own encoding, its special tokens added
    for wrapped in (TransformersTokenizer(tok),):
        assert wrapped.bos_id == expected and wrapped.add_bos == (expected is not None)
        ids = wrapped.encode("the cat sat")
        assert ids == (full if template != "<bos> $A <eos>" else full[:-1])  # a prompt never ends in an EOS
        assert piece_ids(wrapped, "the cat sat") == tok("the cat sat", add_special_tokens=False)["input_ids"]


def test_a_tokenizer_adding_two_tokens_first_is_refused_by_name() -> None:
    tok = _tokenizer(None)
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<bos> <eos> $A",
                                                                  special_tokens=[("<bos>", BOS), ("<eos>", 2)])
    with pytest.raises(MultiheadError, match=r"puts 2 tokens \[1, 2\] before every text"):
        transformers_bos(tok)


def _tiny_llama() -> Any:
    config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
    from multihead import hf

    return hf.enable(model)


@pytest.mark.parametrize("template", ["<bos> $A", None], ids=["bos", "none"])
def test_head_tools_prompts_start_with_the_tokenizers_bos(template: str | None) -> None:
    """`heads` encodes a text as the tokenizer does; `patch` and `circuit` run each prompt with one BOS at its start
    (the ids the forward receives are recorded) and answers without it."""
    tok = _tokenizer(template)
    heads = DecoderHeads(_tiny_llama(), tok, "tiny")
    text = "the cat sat on the mat"
    assert heads.encode([text]).ids[0].tolist() == tok(text)["input_ids"]
    assert heads.token_ids(text) == tok(text, add_special_tokens=False)["input_ids"]
    assert heads.prompt_ids(text) == tok(text)["input_ids"]
    seen: list[list[int]] = []

    def forward(ids: torch.Tensor) -> torch.Tensor:
        seen.extend(ids.tolist())
        return heads.logits(ids)

    pairs = [PromptPair("Mary and John went to the store . John gave the cat to", "Mary and John went to the store . "
                        "Mary gave the cat to", " Mary", " John")]
    patch_pairs(forward, heads.layers(), heads.token_ids, pairs, attribution=False, prompt=heads.prompt_ids)
    want = {tuple(tok(p)["input_ids"]) for p in (pairs[0].clean, pairs[0].corrupt)}
    assert {tuple(row) for row in seen} == want
    assert all(row.count(BOS) == (template is not None) for row in seen)
    from multihead.heads.circuit import encode_pairs

    (encoded,) = encode_pairs(pairs, heads.token_ids, heads.max_tokens, prompt=heads.prompt_ids)
    assert (tuple(encoded.clean), tuple(encoded.corrupt)) == tuple(tuple(tok(p)["input_ids"]) for p in (
        pairs[0].clean, pairs[0].corrupt))
    assert encoded.answer == tok(" Mary", add_special_tokens=False)["input_ids"][0]
    repeated, offset = heads.wrap_repeat(torch.tensor([[5, 6, 5, 6]]))
    assert repeated[0].tolist() == ([BOS] if template else []) + [5, 6, 5, 6] and offset == int(template is not None)


def _port_tokenizer(add_bos: bool) -> TextTokenizer:
    """multihead's own tokenizer over the same words: BOS by ``add_bos``, as a GGUF file says."""
    inner = _tokenizer(None)._tokenizer
    return TextTokenizer(inner, bos_id=BOS, eos_id=2, add_bos=add_bos)


@pytest.mark.parametrize("kind", ["transformers", "port"])
def test_needle_prompts_hold_one_bos_at_their_start(kind: str) -> None:
    """Every case's prompt (context + question) starts with the BOS and holds no other; its length is exact; with
    the BOS taken away it is the prompt the same tokenizer makes without one."""
    tok: Any = {"transformers": lambda: TransformersTokenizer(_tokenizer("<bos> $A")),
                "port": lambda: _port_tokenizer(True)}[kind]()
    plain: Any = {"transformers": lambda: TransformersTokenizer(_tokenizer(None)),
                  "port": lambda: _port_tokenizer(False)}[kind]()
    assert start_ids(tok) == [BOS] and start_ids(plain) == []
    settings = CaseSettings(lengths=(120,), tasks=("passkey", "multikey"), haystacks=("filler",), keys=2)
    cases = make_cases(settings, tok, None, max_context=256)
    without = make_cases(settings, plain, None, max_context=256)
    for case, other in zip(cases, without, strict=True):
        prompt = [*case.context_ids, *case.question_ids]
        assert len(prompt) == case.length and prompt[0] == BOS and prompt.count(BOS) == 1
        assert case.answer_ids == other.answer_ids and BOS not in case.answer_ids
        assert list(case.question_ids) == list(other.question_ids)
        assert list(case.context_ids[1:21]) == list(other.context_ids[:20])  # the intro, after the BOS
    assert Haystacks(tok, None).filler == Haystacks(plain, None).filler
