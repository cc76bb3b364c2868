"""One Decoder protocol over both engines (multihead.models.decoder): multihead's Llama port and a transformers causal
LM on the same weights give transformers' own logits, cached and uncached; the head tools run one code path
(DecoderHeads) on either, padded batches scored on their real tokens; tokenizers come from one loader; bad inputs
are refused by name."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers

from multihead.errors import MultiheadError
from multihead.models.decoder import (
    Decoder,
    DecoderShape,
    PortDecoder,
    Tokenizer,
    TransformersDecoder,
    as_decoder,
    load_decoder,
    load_tokenizer,
)
from multihead.models.llama import LlamaModel
from tests_support import llama_pair

VOCAB = 97


class Letters:
    """A transformers-style tokenizer of letters: 'a' is 10, 'b' 11 ...; BOS 1 put first."""

    all_special_ids = (0, 1)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [10 + ord(c) - ord("a") for c in text if c.isalpha()]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i - 10) if i >= 10 else "" for i in ids)


def _pair() -> tuple[Any, LlamaModel, Any]:
    """A tiny random transformers Llama (its own sdpa attention, untouched), a copy of it for multihead's attention,
    and multihead's port with the same weights."""
    reference, ours = llama_pair(VOCAB, ffn=96, context=256, std=0.2)
    reference.set_attn_implementation("sdpa")
    return reference, ours, copy.deepcopy(reference)


def _decoders() -> tuple[Any, list[Decoder]]:
    reference, ours, theirs = _pair()
    return reference, [as_decoder(ours, Letters(), "port"), as_decoder(theirs, Letters(), "transformers")]


def test_both_engines_are_decoders_with_one_shape() -> None:
    _, decoders = _decoders()
    port, hf = decoders
    assert isinstance(port, PortDecoder) and isinstance(hf, TransformersDecoder)
    for d in decoders:
        assert isinstance(d, Decoder) and isinstance(d.tokenizer, Tokenizer)
        assert len(d.attention_layers()) == 2 and all(hasattr(m, "hook_z") for m in d.attention_layers())
    assert port.shape == hf.shape == DecoderShape(max_context=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                                  vocab_size=VOCAB, windows=(None, None))
    assert hf.model.config._attn_implementation == "multihead"  # as_decoder switched it
    assert (port.engine, hf.engine) == ("ours", "transformers")


def test_both_engines_give_transformers_own_logits_uncached_and_cached() -> None:
    """transformers' own sdpa model (never switched) is the reference: each decoder's logits equal it uncached,
    through a full cache (a prefill then one token a step) and for the last positions only."""
    reference, decoders = _decoders()
    ids = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits
        for d in decoders:
            torch.testing.assert_close(d(ids), want, atol=1e-4, rtol=1e-4)
            cache = d.new_cache(2, 12)
            steps = [d(ids[:, :8], cache=cache)]
            cache.advance(8)
            for i in range(8, 12):
                steps.append(d(ids[:, i:i + 1], cache=cache))
                cache.advance(1)
            torch.testing.assert_close(torch.cat(steps, dim=1), want, atol=1e-4, rtol=1e-4)
            kept = d(ids, logits_to_keep=3)
            torch.testing.assert_close(kept, want[:, -3:], atol=1e-4, rtol=1e-4)


def test_a_run_resumes_at_a_block_where_the_engine_can_and_is_refused_by_name_where_not() -> None:
    reference, (port, hf) = _decoders()
    ids = torch.randint(2, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        states = port.block_inputs(ids)
        assert len(states) == 2
        torch.testing.assert_close(port.logits_from(states[1], 1), reference(ids).logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(port.final_hidden(ids), hf.final_hidden(ids), atol=1e-4, rtol=1e-4)
    assert hf.block_inputs(ids) == []
    with pytest.raises(MultiheadError, match=r"transformers.*block_inputs"):
        hf.logits_from(ids, 1)


def test_the_head_tools_run_one_code_path_on_either_engine() -> None:
    """DecoderHeads over the port and over transformers on the same weights: the same prompt ids (BOS first), the
    same loss, and the same loss change when one head is ablated through its hook point z."""
    from multihead.heads.adapters import DecoderHeads, ablate_edit
    from multihead.heads.attribution import read_model
    from multihead.heads.patching import find_layers

    _, decoders = _decoders()
    losses = []
    for d in decoders:
        heads = DecoderHeads(d)
        assert heads.name == d.name and heads.causal and (heads.n_heads, heads.n_kv_heads) == (4, 2)
        batch = heads.encode(["abcabcabd", "cab"])
        assert batch.ids[1, :4].tolist() == [1, 12, 10, 11] and batch.valid.sum().item() == 14
        states = heads.hidden_states(batch)
        full = heads.metric(batch)
        alone = [heads.metric(heads.encode([t])) for t in ("abcabcabd", "cab")]
        assert full == pytest.approx((alone[0] * 9 + alone[1] * 3) / 12, rel=1e-5)  # the padding scores nothing
        ablated = heads.metric(batch, edits=[ablate_edit(heads.layers()[1], 2)])
        if states:  # the port resumes at block 1: the same number as a run from the embeddings
            assert heads.metric(batch, edits=[ablate_edit(heads.layers()[1], 2)], start=1,
                                states=states) == pytest.approx(ablated, rel=1e-6)
        losses.append((full, ablated))
        forward, layers = find_layers(d)  # patching and attribution take a bare decoder too
        assert layers == d.attention_layers()
        with torch.no_grad():
            assert torch.equal(forward(batch.ids), d(batch.ids))
        assert len(read_model(d).layers) == 2  # attribution reads the module inside
    assert losses[0][0] != losses[0][1]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_tokenizers_come_from_one_loader_with_the_models_bos() -> None:
    """SmolLM2's GGUF file: multihead's own reading of its byte-level BPE (what the port reads), prompts without a
    BOS (SmolLM2 adds none); ``token_ids`` is the prompt without its start."""
    from multihead.models import default_gguf_path
    from multihead.models.tokenizer import TextTokenizer

    tok = load_tokenizer(default_gguf_path())
    assert isinstance(tok, TextTokenizer) and isinstance(tok, Tokenizer)
    text = "Introduction\n\n1. The hacker"
    assert tok.encode(text) == tok.token_ids(text) and tok.bos_id is not None and not tok.add_bos
    wrapped = as_decoder(_pair()[1], Letters()).tokenizer
    assert wrapped.encode("ab") == [1, 10, 11] and wrapped.token_ids("ab") == [10, 11] and wrapped.bos_id == 1


def test_any_class_that_satisfies_the_protocol_is_a_decoder_as_it_is() -> None:
    """A user's own decoder (any class with the protocol's members) passes through as_decoder and DecoderHeads
    unchanged: the tools ask for the protocol, not for one of multihead's classes."""
    from multihead.heads.adapters import DecoderHeads

    _, (port, _) = _decoders()

    class Mine:  # delegates to the port, but is none of multihead's classes
        engine, name, tokenizer, shape = "mine", "mine", port.tokenizer, port.shape
        model = port.model
        device, dtype = port.device, port.dtype

        def __call__(self, ids: Any, **kw: Any) -> Any:
            return port(ids, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(port, name)

    mine = Mine()
    assert as_decoder(mine) is mine
    heads = DecoderHeads(mine)
    batch = heads.encode(["abcab"])
    assert heads.metric(batch) == pytest.approx(DecoderHeads(port).metric(batch), rel=1e-6)


def test_bad_models_and_routes_are_refused_by_name(tmp_path: Any) -> None:
    with pytest.raises(MultiheadError, match="Linear is not a decoder"):
        as_decoder(torch.nn.Linear(2, 2))
    with pytest.raises(MultiheadError, match="minilm is a bert sentence encoder"):
        load_decoder("minilm")
    with pytest.raises(MultiheadError, match="PortDecoder takes multihead's LlamaModel, not a Linear"):
        PortDecoder(torch.nn.Linear(2, 2))
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=32))
    with pytest.raises(MultiheadError, match="BertModel is not a causal language model"):
        TransformersDecoder(bert)
    with pytest.raises(MultiheadError, match="nothing"):
        load_tokenizer(tmp_path / "nothing")
