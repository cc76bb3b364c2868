"""Retrieval scores (multihead.heads.retrieval): Wu et al.'s score on a hand-set copy model (1 for the copying head, 0
for heads that cannot copy), the blockwise dropped-mass score against the dense pattern for every block size, the KV
aggregation, the ablation against an independent count, bad input, and the peak memory of scoring a long input."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from multihead import MultiheadError
from multihead.cache import KVCache
from multihead.evals.needles import Case
from multihead.heads.capture import capture_weights
from multihead.heads.retrieval import (
    RetrievalSettings,
    ablation,
    kv_aggregate,
    mass_outside_block,
    razor_scores,
    retrieval_scores,
)
from multihead.models import LlamaConfig, LlamaModel
from toys import wire_previous_token_and_induction, zeroed_layers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from retrieval_memory import peak_cpu_bytes

# ---------------------------------------------------------------------------------------------- a hand-set copy model
V, N = 32, 96  # vocabulary, positions
TOK, POS, PREV, OUT = 0, V, V + N, 2 * V + N  # residual subspaces: token, position, previous token, copied token
D, C = 3 * V + N, 30.0


class CopyToy(nn.Module):
    """Two attention-only layers of two heads, weights set by hand. L0H0: previous-token head (writes the previous
    token into PREV); L0H1: zero weights (uniform); L1H0: induction head (the key whose previous token is the
    current one; writes that key's token into OUT, the logits); L1H1: attends to position 0 (a sink)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = zeroed_layers(2, d_model=D, head_dim=N)
        prev, ind = self.attn
        wire_previous_token_and_induction(prev, ind, vocab=V, positions=N, c=C)
        with torch.no_grad():
            for t in range(V):
                ind.v_proj.weight[t, TOK + t] = 1.0
                ind.o_proj.weight[OUT + t, t] = 1.0
            ind.q_proj.weight[N, POS:POS + N] = C  # head 1: every query the same ...
            ind.k_proj.weight[N, POS] = 1.0  # ... matching only position 0

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(batch=batch, n_kv_heads=2, head_dim=N, max_len=max_len, n_layers=2)

    def forward(self, ids: Tensor, *, cache: KVCache | None = None, logits_to_keep: int = 0) -> Tensor:
        b, s = ids.shape
        start = 0 if cache is None else int(cache.lengths[0])
        h = torch.zeros(b, s, D)
        h[..., TOK:TOK + V] = nn.functional.one_hot(ids, V).float()
        h[..., POS + start:POS + start + s] = torch.eye(s)
        step = self.attn[0].step(h, causal=True, cache=cache)
        for i, layer in enumerate(self.attn):
            h = h + layer(h, step=step, cache=None if cache is None else cache.layer(i))
        h = h[:, -logits_to_keep:] if logits_to_keep else h  # as LlamaModel's: the last rows only
        return h[..., OUT:OUT + V]  # (b, s, V): the copied token


def copy_case(depth: int, seed: int, answer: tuple[int, ...] = (1, 2, 3), n: int = 70) -> Case:
    """Haystack tokens 12..31 (repeating), a needle KEY v1 v2 v3 (tokens 0..3) at ``depth``, the question Q KEY."""
    gen = torch.Generator().manual_seed(seed)
    hay = (12 + torch.randint(0, V - 12, (n,), generator=gen)).tolist()
    needle = [0, 1, 2, 3]
    context = hay[:depth] + needle + hay[depth:]
    return Case(id=f"copy-{seed}", task="single-number", length=len(context) + 2, depth=depth / n,
                haystack="toy", seed=seed, context_ids=tuple(context), question_ids=(10, 0), answer_ids=answer,
                answer=" ".join(map(str, answer)), needles=((depth, depth + 4),), group=f"p{seed}")


SETTINGS = RetrievalSettings(sinks=1, window=4, block=16, chunk=32)


def test_the_copying_head_scores_one_and_heads_that_cannot_copy_score_zero() -> None:
    cases = [copy_case(d, s) for s, d in enumerate((5, 60))]
    got = retrieval_scores(CopyToy(), cases, SETTINGS)
    assert [c["correct"] for c in got.cases] == [True] * 2  # the toy copies: greedy = the needle's value
    assert [c["copyable_steps"] for c in got.cases] == [3] * 2
    np.testing.assert_array_equal(got.query, [[0.0, 0.0], [1.0, 0.0]])  # only L1H0 copies
    assert got.top(1, kind="query") == [(1, 0, 1.0)]
    # dropped mass: the previous-token and sink heads keep within 1 sink + a window of 4, the uniform head does not
    assert got.mass_outside[0, 0] < 1e-6 and got.mass_outside[1, 1] < 1e-6
    assert got.mass_outside[0, 1] > 0.5


def test_a_wrong_answer_is_left_out_unless_asked_and_counts_no_copy() -> None:
    wrong = copy_case(20, 7, answer=(1, 3, 2))  # the toy answers 1 2 3: wrong, and at its steps 2 and 3 no copy
    with pytest.raises(MultiheadError, match="answers none of the 1 cases"):
        retrieval_scores(CopyToy(), [wrong], SETTINGS)
    got = retrieval_scores(CopyToy(), [wrong], RetrievalSettings(sinks=1, window=4, correct_only=False))
    # step 0 (after KEY) copies 1; step 1 is fed 1 and the head attends to 2 where 3 is asked; step 2 fed 3 -> none
    assert got.query[1, 0] == pytest.approx(1 / 3)
    assert got.cases[0]["used"] and not got.cases[0]["correct"]


def _dense_mass(model: LlamaModel, ids: list[int], rows: list[int], sinks: int, window: int) -> np.ndarray:
    """The reference: every layer's full (1, h, n, n) pattern from hook_pattern, reduced by plain loops."""
    weights = capture_weights([b.attn for b in model.layers], lambda: model(torch.tensor([ids])))
    out = np.zeros((len(weights), weights[0].shape[1]))
    for li, w in enumerate(weights):
        for p in rows:
            out[li] += [float(w[0, h, p, sinks:p - window + 1].double().sum()) for h in range(w.shape[1])]
    return out / len(rows)


def _tiny(n_heads: int = 4, n_kv_heads: int = 2, d_model: int = 32, layers: int = 2, context: int = 512
          ) -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, d_model=d_model, n_layers=layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                         ffn_dim=48, max_context=context)
    return LlamaModel(config).eval()


def _random_case(n: int, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(8, 64, (n,), generator=gen).tolist()
    ctx[n // 2:n // 2 + 3] = [1, 2, 3]
    return Case(id=f"r{seed}", task="passkey", length=n + 2, depth=0.5, haystack="random", seed=seed,
                context_ids=tuple(ctx), question_ids=(4, 1), answer_ids=(2, 3), answer="2 3",
                needles=((n // 2, n // 2 + 3),))


@pytest.mark.parametrize(("block", "rows"), [(3, None), (16, None), (1000, None), (1, 5)])
def test_the_blockwise_mass_equals_the_dense_pattern_for_every_block_size(block: int, rows: int | None) -> None:
    model = _tiny()
    case = _random_case(100)
    sinks, window, chunk = 2, 16, 40
    st = RetrievalSettings(sinks=sinks, window=window, block=block, rows=rows, chunk=chunk, correct_only=False)
    got = retrieval_scores(model, [case], st)
    n = len(case.context_ids)
    chosen = [p for p in range(n) if p >= sinks + window]
    if rows is not None:  # the last `rows` of each chunk: chunks of 40 end at 39, 79, 99
        chosen = [p for p in chosen if any(end - rows < p <= end for end in (39, 79, 99))]
    assert got.mass_rows == len(chosen)
    want = _dense_mass(model, list(case.context_ids), chosen, sinks, window)
    np.testing.assert_allclose(got.mass_outside, want, atol=1e-5, rtol=0)
    assert got.mass_outside.shape == (2, 4) and got.kv.shape == (2, 2)


def test_one_block_equals_the_softmax_of_repeated_keys() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 6, 5, 8, generator=gen), torch.randn(2, 3, 20, 8, generator=gen)
    positions = torch.tensor([9, 12, 15, 18, 19])
    got = mass_outside_block(q, k, positions, scale=0.3, sinks=2, window=3)
    rep = k.repeat_interleave(2, dim=1)  # (2, 6, 20, 8): query head i reads KV head i // 2
    w = torch.softmax((q @ rep.transpose(-1, -2) * 0.3).masked_fill(
        torch.arange(20)[None, :] > positions[:, None], float("-inf")), dim=-1)
    want = sum(w[:, :, r, 2:int(p) - 3 + 1].sum(-1) for r, p in enumerate(positions)).sum(0)
    torch.testing.assert_close(got, want.double(), atol=1e-6, rtol=0)


def test_a_kv_head_aggregates_its_query_heads() -> None:
    x = np.arange(24, dtype=float).reshape(2, 12) ** 1.5 % 7
    for g in (12, 4, 3, 1):
        grouped = [[x[layer, j * (12 // g):(j + 1) * (12 // g)] for j in range(g)] for layer in range(2)]
        np.testing.assert_array_equal(kv_aggregate(x, g, "max"), [[max(c) for c in row] for row in grouped])
        np.testing.assert_allclose(kv_aggregate(x, g, "mean"), [[np.mean(c) for c in row] for row in grouped])
    got = retrieval_scores(_tiny(), [_random_case(60)], RetrievalSettings(sinks=1, window=8, correct_only=False))
    np.testing.assert_array_equal(got.kv, got.query.reshape(2, 2, 2).max(-1))
    np.testing.assert_allclose(got.kv_mean, got.query.reshape(2, 2, 2).mean(-1))
    np.testing.assert_array_equal(got.mass_outside_kv, got.mass_outside.reshape(2, 2, 2).max(-1))
    j = got.to_json()
    assert np.array(j["kv"]).shape == (2, 2) and j["cases_used"] == 1
    np.testing.assert_array_equal(got.for_plan("retrieval"), got.kv)
    np.testing.assert_array_equal(got.for_plan("mass"), got.mass_outside_kv)
    got.razor = {"echo": np.eye(2, 4), "induction": np.eye(2, 4)[::-1]}
    np.testing.assert_array_equal(got.for_plan("razor"), [[1, 0], [1, 0]])


def test_ablating_the_copying_head_loses_every_answer_and_random_heads_lose_what_they_break() -> None:
    model = CopyToy()
    cases = [copy_case(40, 0)]
    ranking = retrieval_scores(model, cases, SETTINGS).query
    got = ablation(model, cases, ranking, 1, draws=2, seed=0, chunk=32)
    assert got["baseline"] == 1.0 and got["top_heads"] == [[1, 0]] and got["top_k"] == 0.0
    # without the previous-token head L0H0 the induction head has nothing to match: the only other head that matters
    want = [0.0 if [0, 0] in heads else 1.0 for heads in got["random_heads"]]
    assert got["random"] == want
    assert all([1, 0] not in heads for heads in got["random_heads"])  # drawn from the other heads


def test_razor_scores_find_the_induction_head() -> None:
    found = razor_scores(CopyToy(), vocab=(0, V), repeat_len=24, seeds=2)
    assert found["induction"].shape == (2, 2)
    assert np.unravel_index(found["induction"].argmax(), (2, 2)) == (1, 0) and found["induction"][1, 0] > 0.9


def test_bad_input_is_refused_with_the_values_named() -> None:
    with pytest.raises(MultiheadError, match=r"no answer token of case copy-0 .*occurs in its needle"):
        retrieval_scores(CopyToy(), [copy_case(5, 0, answer=(20, 21))], SETTINGS)
    with pytest.raises(MultiheadError, match=r"block \(0\) must be an integer of at least 1"):
        RetrievalSettings(block=0)
    with pytest.raises(MultiheadError, match=r"window \(2\) keeps fewer tokens than the 4 sinks"):
        RetrievalSettings(window=2, sinks=4)
    with pytest.raises(MultiheadError, match=r"has 74 context tokens, too few .* 4 sinks \+ a window of 256"):
        retrieval_scores(CopyToy(), [copy_case(5, 0)], RetrievalSettings())
    with pytest.raises(MultiheadError, match="no needle spans"):
        retrieval_scores(CopyToy(), [Case("x", "passkey", 5, 0.5, "toy", 0, (1, 2, 3), (0,), (1,), "1")], SETTINGS)
    with pytest.raises(MultiheadError, match=r"k \(4\) must be smaller than the 4 heads"):
        ablation(CopyToy(), [copy_case(5, 0)], np.zeros((2, 2)), 4)
    with pytest.raises(MultiheadError, match="12 query heads cannot be grouped into 5 KV heads"):
        kv_aggregate(np.zeros((2, 12)), 5)


# ---------------------------------------------------------------------------------------------- bounded memory
def test_scoring_a_long_input_stays_far_below_one_layers_attention_matrix() -> None:
    n = 1536
    model = _tiny(n_heads=8, n_kv_heads=2, d_model=64, layers=1, context=4096)
    case = _random_case(n)
    st = RetrievalSettings(sinks=4, window=64, block=32, chunk=128, correct_only=False)
    got: list[object] = []
    peak, _ = peak_cpu_bytes(lambda: got.append(retrieval_scores(model, [case], st)))
    matrix = 1 * 8 * n * n * 4  # one layer's (b, h, s, t) float32 weights: 72 MiB
    assert got and peak < matrix / 16, f"peak {peak / 2**20:.1f} MiB against a {matrix / 2**20:.0f} MiB matrix"


# ---------------------------------------------------------------------------------------------- the command
def test_heads_retrieval_json_carries_the_scores_per_query_and_kv_head(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from multihead.cli import main
    from multihead.evals import text
    from tiny_checkpoints import write_tiny_gguf

    real = text.read_text()
    monkeypatch.setattr(text, "read_text", lambda path=None: real[:40_000])  # the byte-level toy encodes it slowly

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", context=512)
    argv = ["heads", "--model", str(gguf), "--text", "the cat sat on the mat", "--out", str(tmp_path / "h"),
            "--retrieval", "--lengths", "300", "--tasks", "passkey", "--prompts", "1", "--sinks", "2", "--window",
            "16", "--all-cases", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    r = data["retrieval"]
    assert np.array(r["query"]).shape == (2, 4) and np.array(r["kv"]).shape == (2, 2)
    np.testing.assert_allclose(r["kv"], np.array(r["query"]).reshape(2, 2, 2).max(-1), atol=1e-6)
    assert np.array(r["razor_kv"]["razor"]).shape == (2, 2)
    assert r["cases_used"] == 1 and r["settings"]["window"] == 16 and "ablation" not in r
    assert Path(data["files"]["retrieval_png"]).is_file()
    assert main(["heads", "--model", str(gguf), "--window", "16", "--out", str(tmp_path / "g")]) == 2
    assert "--window is for --retrieval: add --retrieval" in capsys.readouterr().err


def test_heads_retrieval_puts_its_scores_in_the_report_and_names_every_file(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 42: `heads --retrieval` wrote no retrieval score into report.html and its summary left out retrieval.png
    and heads.json. The summary names all five files; the page, rendered in headless Chromium, shows the top KV
    heads with the scores heads.json holds for them, what the scores are, and the retrieval picture."""
    import html

    from multihead.cli import main
    from multihead.evals import text
    from tests_support import browse, console_errors
    from tiny_checkpoints import write_tiny_gguf

    real = text.read_text()
    monkeypatch.setattr(text, "read_text", lambda path=None: real[:40_000])  # the byte-level toy encodes it slowly
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", context=512)
    out = tmp_path / "h"
    assert main(["heads", "--model", str(gguf), "--text", "the cat sat on the mat", "--out", str(out),
                 "--retrieval", "--lengths", "300", "--tasks", "passkey", "--prompts", "1", "--sinks", "2",
                 "--window", "16", "--all-cases"]) == 0
    printed = capsys.readouterr().out
    assert f"report: {out / 'report.html'}" in printed
    assert (f"pictures: {out / 'heads-grid.png'}, {out / 'chosen-heads.png'}, {out / 'retrieval.png'}"
            in printed) and f"data: {out / 'heads.json'}" in printed
    r = json.loads((out / "heads.json").read_text())["retrieval"]
    dom = browse(out / "report.html", "--dump-dom")
    assert dom.returncode == 0 and 'data-ready="1"' in dom.stdout, dom.stderr[-2000:]
    assert not console_errors(dom.stderr), console_errors(dom.stderr)
    page = html.unescape(dom.stdout)
    table = page.split('<table id="retrieval-top">')[1].split("</table>")[0]
    rows = [re.findall(r"<td[^>]*>([^<]*)</td>", row) for row in table.split("</tr>") if "<td" in row]
    want = [[f"L{k['layer']}KV{k['kv_head']}", f"{r['kv'][k['layer']][k['kv_head']]:.3f}",
             f"{r['kv_mean'][k['layer']][k['kv_head']]:.3f}",
             f"{r['mass_outside_kv'][k['layer']][k['kv_head']]:.3f}",
             f"{r['razor_kv']['razor'][k['layer']][k['kv_head']]:.3f}"] for k in r["top_kv"]]
    assert rows == want and len(rows) == 4  # 2 layers x 2 KV heads
    assert "Retrieval score (Wu et al. 2024): the share of a case's copyable answer steps" in page
    assert "a cache of 2 sinks + a window of 16 would drop" in page
    assert 'alt="retrieval scores per layer and head" src="data:image/png;base64,' in page
