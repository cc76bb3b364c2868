"""The head tools on Gemma 3 270M through transformers (issue 49), on the session's `gemma3` fixture: prompts start
with the tokenizer's own BOS, so `heads` finds the attention-sink heads and `patch`'s indirect-object pair keeps its
clean logit difference above the corrupted one; direct logit attribution's parts sum to the model's own logit
difference through Gemma's post-attention norms. Each figure is held against transformers' own forward (its eager
or sdpa attention, none of multihead's)."""

from __future__ import annotations

from typing import Any

import torch

from multihead.heads.adapters import DecoderHeads
from multihead.heads.analysis import analyse
from multihead.heads.attribution import direct_logit_attribution, logit_lens
from multihead.heads.patching import patch_pairs, shipped_pairs
from tests_support import attention

SINK = "attention-sink"


def _sinks(report: Any) -> int:
    return sum(label == SINK for row in report.scores.labels for label in row)


def test_heads_finds_attention_sinks_on_gemma3_with_its_bos(gemma3: Any) -> None:
    """The tokenizer puts BOS (id 2) first; every head's first-token score is transformers' own eager weights'
    mean over rows i >= 1 of w[i, 0]; heads labelled sinks hold at least half their weight there, and without the
    BOS (the issue's bug) fewer heads are sinks."""
    model, tok = gemma3
    with attention(model, "multihead"):
        heads = DecoderHeads(model, tok, "gemma3")
        assert heads.bos_id == tok.bos_token_id == tok("hello")["input_ids"][0]
        text = "The quick brown fox jumps over the lazy dog. It was a sunny day and the fox was happy."
        report = analyse(heads, text, seeds=1, progress=False)
        ids = heads.encode([text]).ids
        assert ids[0].tolist() == tok(text)["input_ids"]
        heads.bos_id = None  # the prompts as they were fed before: no BOS
        without = analyse(heads, text, seeds=1, progress=False)
    with attention(model, "eager"), torch.no_grad():
        weights = model(ids, output_attentions=True, use_cache=False).attentions
    first = torch.stack([w[0, :, 1:, 0].mean(-1) for w in weights]).double().numpy()  # (n_layers, n_heads)
    assert abs(report.scores.scores["first_token"] - first).max() < 1e-4
    sinks = _sinks(report)
    for layer, row in enumerate(report.scores.labels):
        for head, label in enumerate(row):
            if label == SINK:
                assert first[layer, head] >= 0.5
    print(f"gemma3 heads: {sinks} of {first.size} heads labelled attention sinks with BOS, {_sinks(without)} without")
    assert sinks > _sinks(without) and sinks >= 10


def test_patch_and_dla_on_gemma3_with_its_bos(gemma3: Any) -> None:
    """`patch` on the shipped Mary/John pair: the clean logit difference is transformers' own (sdpa, the tokenizer
    adding its BOS) and above the corrupted one. DLA of the clean prompt: its parts plus a remainder within its
    bound equal that logit difference; the last layer's lens is the model's own top tokens."""
    model, tok = gemma3
    pair = shipped_pairs()[0]
    assert "Mary" in pair.clean
    answer, wrong = (tok(t, add_special_tokens=False)["input_ids"][0] for t in (pair.answer, pair.wrong))
    with torch.no_grad():
        own = {}
        for name, text in (("clean", pair.clean), ("corrupt", pair.corrupt)):
            logits = model(torch.tensor([tok(text)["input_ids"]]), use_cache=False).logits[0, -1].double()
            own[name] = float(logits[answer] - logits[wrong])
    with attention(model, "multihead"):
        heads = DecoderHeads(model, tok, "gemma3")
        # one layer's heads patched (the clean and corrupted figures are the command's whatever it patches)
        result = patch_pairs(heads.logits, heads.layers()[11:12], heads.token_ids, [pair], attribution=False,
                             prompt=heads.prompt_ids)
        ids = torch.tensor([heads.prompt_ids(pair.clean)])
        dla = direct_logit_attribution(model, ids, answer, wrong)
        lens = logit_lens(model, ids, k=5)
    print(f"gemma3 patch: clean {result.clean:.4f}, corrupted {result.corrupted:.4f} (transformers: "
          f"{own['clean']:.4f}, {own['corrupt']:.4f}); DLA parts {float(dla.total()[0, -1]):.6f} + remainder "
          f"{float(dla.remainder[0, -1]):.2e} = {float(dla.logit_diff[0, -1]):.6f}")
    assert abs(result.clean - own["clean"]) < 1e-3 and abs(result.corrupted - own["corrupt"]) < 1e-3
    assert result.clean > result.corrupted and result.patching is not None and result.patching.shape == (1, 4)
    assert abs(float(dla.logit_diff[0, -1]) - own["clean"]) < 1e-3
    assert float(dla.remainder.abs().max()) < 1e-3
    with torch.no_grad():
        top = model(ids, use_cache=False).logits.topk(5, dim=-1).indices
    assert torch.equal(lens.top_ids[-1], top)
