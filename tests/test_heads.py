"""Head analysis: capture against transformers' eager weights, detectors on a hand-built model, the report in a
browser, ablation and GQA conversion against independent computations, and bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from multihead import MultiHeadAttention, MultiheadError
from multihead.cli import main
from multihead.heads.adapters import Batch, DecoderHeads, EncoderHeads, HeadModel, ablate_edit, applied, load_head_model
from multihead.heads.analysis import analyse
from multihead.heads.capture import capture_weights
from multihead.heads.convert import pooled_layer
from multihead.heads.report import write_all
from multihead.heads.scores import pattern_scores, repeat_scores
from multihead.verify.reference import Weights, multihead_attention
from tests_support import browse
from toys import wire_previous_token_and_induction, zeroed_layers

TEXT = "The cat sat on the mat because the cat was tired, and the mat was warm."


# ---------------------------------------------------------------------------------------------- against transformers
def test_scores_equal_those_from_transformers_eager_weights(smollm2, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tok = smollm2
    hf, _ = hf_smollm2
    heads = DecoderHeads(model, tok)
    batch = heads.encode([TEXT])
    ours = capture_weights(heads.layers(), lambda: heads.run(batch))
    gen = torch.Generator().manual_seed(3)
    repeated = torch.stack([heads.random_token_ids(20, gen) for _ in range(2)]).repeat(1, 2)  # (2, 40)
    ours_rep = capture_weights(heads.layers(), lambda: heads.run(Batch(repeated, torch.ones_like(repeated).bool(),
                                                                       [40, 40])))
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            theirs = [a.float() for a in hf(batch.ids, output_attentions=True).attentions]
            theirs_rep = [a.float() for a in hf(repeated, output_attentions=True).attentions]
    finally:
        hf.set_attn_implementation("sdpa")
    assert len(theirs) == 30 and theirs[0].shape == ours[0].shape
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    mine = {**pattern_scores(ours, batch.lengths, causal=True), **repeat_scores(ours_rep, 20)}
    ref = {**pattern_scores(theirs, batch.lengths, causal=True), **repeat_scores(theirs_rep, 20)}
    for name in mine:
        np.testing.assert_allclose(mine[name], ref[name], atol=1e-4, rtol=0, err_msg=name)


# ---------------------------------------------------------------------------------------------- a hand-built model
V, N = 32, 64  # vocabulary (distinct random tokens for T = 24), positions
TOK, POS, PREV = 0, V, V + N  # subspaces of the residual stream: token one-hot, position one-hot, previous token
D_MODEL, HEAD_DIM, C = 2 * V + N, 64, 30.0


class Toy(nn.Module):
    """Two attention-only layers of two heads. Layer 0 head 0 attends to the previous position and writes that
    token into the PREV subspace; layer 1 head 0 matches the current token against PREV: an induction head.
    Heads 1 of both layers have zero weights (uniform attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = zeroed_layers(2, d_model=D_MODEL, head_dim=HEAD_DIM)
        wire_previous_token_and_induction(*self.attn, vocab=V, positions=N, c=C)

    def forward(self, ids: Tensor) -> Tensor:
        s = ids.shape[1]
        h = torch.zeros(ids.shape[0], s, D_MODEL)
        h[..., TOK:TOK + V] = nn.functional.one_hot(ids, V).float()
        h[..., POS:POS + s] = torch.eye(s)
        for layer in self.attn:
            h = h + layer(h, causal=True)
        return h


class ToyHeads(HeadModel):
    name, causal, max_tokens, metric_name = "toy", True, N, "none"

    def __init__(self) -> None:
        self.model = Toy()

    def layers(self) -> list[MultiHeadAttention]:
        return list(self.model.attn)  # type: ignore[arg-type]

    def encode(self, texts: list[str]) -> Batch:
        ids = torch.tensor([[ord(c) % V for c in texts[0][:N]]])
        return Batch(ids, torch.ones_like(ids, dtype=torch.bool), [ids.shape[1]])

    def token_strings(self, ids: list[int]) -> list[str]:
        return [chr(97 + i) for i in ids]

    def run(self, batch: Batch) -> None:
        self.model(batch.ids)

    def random_token_ids(self, n: int, generator: torch.Generator) -> Tensor:
        return torch.randperm(V, generator=generator)[:n] if n <= V else torch.randint(0, V, (n,), generator=generator)


def test_detectors_find_exactly_the_built_heads() -> None:
    report = analyse(ToyHeads(), "the quick brown fox jumps over the lazy dog " * 2, repeat_len=24, seeds=4)
    labels = report.scores.labels
    assert labels[0][0] == "previous-token"
    assert labels[1][0] == "induction"
    found = {(layer, head) for layer in range(2) for head in range(2)
             if labels[layer][head] in ("previous-token", "induction")}
    assert found == {(0, 0), (1, 0)}
    assert report.scores.top("previous_token", 1)[0][:2] == (0, 0)
    assert report.scores.top("induction", 1)[0][:2] == (1, 0)
    assert report.scores.scores["previous_token"][0, 0] > 0.9
    assert report.scores.scores["induction"][1, 0] > 0.9


# ---------------------------------------------------------------------------------------------- the report
@pytest.mark.slow
def test_html_report_renders_in_a_browser_and_shows_script_as_text(tmp_path: Path) -> None:
    evil = "Heads <script>document.title='pwned';window.pwned=1</script> & <b>bold</b> text."
    report = analyse(load_head_model("minilm"), evil, display_tokens=24)
    files = write_all(report, tmp_path)
    html = Path(files["html"])
    dom = browse(html, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-ready="1"' in dom.stdout  # the script ran to its end
    assert "<title>multihead: what each head does</title>" in dom.stdout  # the passage's script never ran
    assert "&lt;script&gt;document.title='pwned';window.pwned=1&lt;/script&gt;" in dom.stdout  # shown as text
    assert "<b>bold</b>" not in dom.stdout
    best = max(report.scores.records(), key=lambda r: r["previous_token"])  # the head the report opens on
    assert (f'<span id="headinfo">L{best["layer"]}H{best["head"]} (KV head {best["kv_head"]}) | label: '
            in dom.stdout)  # heads named as TransformerLens names them
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    shot = tmp_path / "shot.png"
    taken = browse(html, f"--screenshot={shot}")
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))
    assert pixels.std() > 0.05  # not blank
    assert "<script src" not in html.read_text() and "http" not in html.read_text().split("<body>")[1][:200]
    for key in ("grid_png", "heads_png"):
        assert Path(files[key]).read_bytes()[:4] == b"\x89PNG"


def test_the_report_shows_activation_patching(smollm2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """heads --patch: SmolLM2 patched on one shipped pair; the report's patching section renders in Chromium and the
    JSON carries the same (n_layers, n_heads) effects."""
    from multihead.heads.patching import shipped_pairs

    model, tok = smollm2
    report = analyse(DecoderHeads(model, tok), TEXT, pairs=shipped_pairs()[:1], progress=False)
    assert report.patching is not None and np.array(report.patching["effects"]).shape == (30, 9)
    files = write_all(report, tmp_path)
    data = json.loads(Path(files["json"]).read_text())
    assert data["patching"]["effects"] == report.patching["effects"]
    dom = browse(Path(files["html"]), "--dump-dom")
    assert 'data-ready="1"' in dom.stdout, dom.stderr[-2000:]
    assert "activation patching of each head's hook_z from clean into corrupted prompts (1 pair(s)" in dom.stdout
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    with pytest.raises(MultiheadError, match="not a causal language model"):
        analyse(load_head_model("minilm"), TEXT, pairs=shipped_pairs()[:1], progress=False)


# ---------------------------------------------------------------------------------------------- ablation, conversion
def test_zeroing_a_head_equals_zeroing_its_columns_of_w_o() -> None:
    layer = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
    x = torch.randn(2, 5, 16)
    with applied([ablate_edit(layer, 2)]):
        ablated = layer(x, causal=True)
    manual = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)
    manual.load_state_dict(layer.state_dict())
    with torch.no_grad():
        manual.o_proj.weight[:, 8:12] = 0
    torch.testing.assert_close(ablated, manual(x, causal=True))
    assert not torch.allclose(ablated, layer(x, causal=True))  # the hook is gone after the block


def test_pooling_kv_heads_matches_the_oracle_with_averaged_projections() -> None:
    layer = MultiHeadAttention(d_model=24, n_heads=6, n_kv_heads=6, head_dim=4)
    pooled = pooled_layer(layer, 2)
    assert pooled.n_kv_heads == 2 and pooled.k_proj.weight.shape == (8, 24)
    w = Weights.of(layer)
    for name in ("wk", "wv"):
        setattr(w, name, getattr(w, name).reshape(2, 3, 4, 24).mean(1).reshape(8, 24))
    for name in ("bk", "bv"):
        setattr(w, name, getattr(w, name).reshape(2, 3, 4).mean(1).reshape(8))
    x = torch.randn(1, 7, 24)
    want, _ = multihead_attention(pooled.config, w, x.double().numpy(), causal=True)
    np.testing.assert_allclose(pooled(x, causal=True).detach().double().numpy(), want, atol=1e-5)
    with pytest.raises(MultiheadError, match=r"n_kv_heads \(4\) must divide the layer's current n_kv_heads \(6\)"):
        pooled_layer(layer, 4)


@pytest.mark.slow
def test_minilm_ablation_and_conversion() -> None:
    model = load_head_model("minilm")
    assert isinstance(model, EncoderHeads)
    report = analyse(model, TEXT, ablate=True, convert=True, progress=False)
    assert len(report.ablation) == 72 and report.baseline == pytest.approx(0.0, abs=1e-6)
    summary = report.ablation_summary()
    assert 0.0 <= summary["share_below_1_percent"] <= 1.0
    assert summary["most_important"][0]["delta"] == max(r["delta"] for r in report.ablation)
    assert [r["n_kv_heads"] for r in report.conversion] == [6, 4, 3, 2, 1]
    assert all(r["metric"] > 0 for r in report.conversion)


# ---------------------------------------------------------------------------------------------- CLI and bad input
@pytest.mark.slow
def test_heads_command_json_has_a_record_per_head(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["heads", "--model", "minilm", "--text", TEXT, "--out", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["heads"]) == 6 * 12
    first = data["heads"][0]
    for key in ("layer", "head", "kv_head", "previous_token", "first_token", "self", "next_token", "local",
                "entropy", "duplicate_token", "induction", "label"):
        assert key in first
    assert len(data["kv_heads"]) == 6 * 12 and data["kv_heads"][0]["query_heads"] == [0]  # MiniLM is MHA
    assert Path(data["files"]["html"]).exists()


@pytest.mark.slow
def test_heads_command_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["heads", "--model", "minilm", "--text", TEXT, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "previous_token" in out and "next_token" in out and f"report: {tmp_path}" in out
    assert ("a head's label is the first rule it meets, else mixed: induction (induction >= 0.30), duplicate-token "
            "(duplicate_token >= 0.30), previous-token (previous_token >= 0.40)") in out
    assert f"data: {tmp_path / 'heads.json'}" in out


def test_the_report_defines_every_column_and_every_label_rule(tmp_path: Path) -> None:
    """issue 42: the heads report never said what its score columns were nor where a label's threshold lay. In
    headless Chromium: every column of the scores table has a row saying what it is (the scores as scores.py defines
    them), and the label rules are listed with their thresholds, in the order they are tried."""
    import html

    from multihead.heads.scores import LABEL_RULES, SCORE_DEFINITIONS, SCORE_NAMES

    assert list(SCORE_DEFINITIONS) == sorted(SCORE_NAMES, key=SCORE_NAMES.index)
    report = analyse(ToyHeads(), "the quick brown fox jumps over the lazy dog " * 2, repeat_len=24, seeds=2)
    files = write_all(report, tmp_path)
    dom = browse(Path(files["html"]), "--dump-dom")
    assert dom.returncode == 0 and 'data-ready="1"' in dom.stdout, dom.stderr[-2000:]
    page = dom.stdout

    def table(name: str) -> list[list[str]]:
        body = page.split(f'<table id="{name}">')[1].split("</table>")[0]
        return [[html.unescape(cell) for cell in re.findall(r"<t[dh][^>]*>([^<]*)</t[dh]>", row)]
                for row in body.split("</tr>") if "<t" in row]

    columns = table("scores")[0]
    defined = dict(table("columns")[1:])
    assert columns == ["layer", "head", "kv_head", "label", *SCORE_NAMES] and list(defined) == columns
    assert all(defined[name] == SCORE_DEFINITIONS[name] for name in SCORE_NAMES)
    assert table("label-rules") == [["label", "score", "threshold"]] + [
        [label, score, f">= {threshold:.2f}"] for score, label, threshold in LABEL_RULES]
    assert "A head's label is the first rule of this table whose score it reaches" in page


@pytest.mark.parametrize(("argv", "message"), [
    (["heads", "--model", "minilm", "--text", "   "], "the text is empty"),
    (["heads", "--model", "minilm", "--text", "word " * 400], "more than the model's context of 256"),
    (["heads", "--model", "gpt5"], "model 'gpt5' does not exist: give one of smollm2, minilm, gemma3"),
    (["heads", "--model", "minilm", "--file", "/nonexistent.txt"], "cannot read --file"),
])
def test_heads_bad_input(argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_an_output_folder_that_cannot_be_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["heads", "--model", "minilm", "--text", TEXT, "--out", str(blocker / "report")]) == 2
    assert "cannot write to the output folder" in capsys.readouterr().err


HOSTILE_PASSAGE = ("Heads </script><script>window.pwned=1;document.title='pwned'</script> &amp; &lt;b&gt; &#x3C;i> "
                   "<!-- ]]> ${window.pwned=2} `x` \u202eevil\u202c \u05e9\u05dc\u05d5\u05dd "
                   "\u0645\u0631\u062d\u0628\u0627 zero\u200bwidth\u200d\ufeff joiners, "
                   "<img src=x onerror=window.pwned=3> \U0001f600 the end. ")


@pytest.mark.slow
def test_a_5000_token_hostile_passage_renders_safely(tmp_path: Path) -> None:
    """The report of a 5,000-token passage full of markup, entities, right-to-left and zero-width characters: every
    layer's weights are reduced as they are made (scores and the displayed tokens' patterns), the page renders in
    headless Chromium without a console error, and nothing in the passage runs. (A 2-layer random-weight Llama with
    an 8,192-token context: the model does not matter to the page, the passage's length and content do.)"""
    from tiny_checkpoints import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", context=8192)
    model = load_head_model(str(gguf))
    text = HOSTILE_PASSAGE * 24
    n_tokens = len(model.encode([text]).ids[0])
    assert 5000 <= n_tokens <= 8192, n_tokens
    report = analyse(model, text, display_tokens=64)
    assert len(report.tokens) == 64 and report.patterns[0].shape == (4, 64, 64)
    files = write_all(report, tmp_path / "out")
    html = Path(files["html"])
    dom = browse(html, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-ready="1"' in dom.stdout  # the page's own script ran to its end
    assert "<title>multihead: what each head does</title>" in dom.stdout  # the passage's did not
    assert "pwned" not in dom.stdout.split("<body")[0]
    assert "<img" not in dom.stdout and "<script>window" not in dom.stdout
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    assert dom.stdout.count("&lt;/script&gt;&lt;script&gt;window.pwned=1") == 24  # the whole passage, as text


def test_the_json_per_kv_head_groups_query_heads_as_the_cache_does() -> None:
    """kv_heads (one record per layer and KV head, the unit of a head-wise cache plan): query heads i with
    i // (h / g) == j, their labels, and each score the max over them (against a reshape of the (L, h) scores)."""
    from multihead.heads.report import kv_records
    from multihead.heads.scores import SCORE_NAMES, HeadScores, label_heads

    rng = np.random.default_rng(0)
    scores = {name: rng.random((3, 6)) for name in SCORE_NAMES}
    head_scores = HeadScores(scores=scores, n_kv_heads=2, labels=label_heads(scores))
    rows = kv_records(head_scores)
    assert [(r["layer"], r["kv_head"]) for r in rows] == [(la, j) for la in range(3) for j in range(2)]
    assert [r["query_heads"] for r in rows[:2]] == [[0, 1, 2], [3, 4, 5]]
    for name in SCORE_NAMES:
        want = scores[name].reshape(3, 2, 3).max(-1).ravel()
        np.testing.assert_allclose([r[name] for r in rows], want, atol=1e-6, err_msg=name)
    assert rows[3]["labels"] == head_scores.labels[1][3:]
