"""`multihead circuit`: DLA, composition and the EAP circuit through the command on a tiny random-weight Llama (GQA:
4 query heads, 2 KV heads), against independent computations: the model's own logits for DLA, NumPy for a
composition score, the JSON's edges for the SVG graph; the report in headless Chromium; bad flags and files; one
SmolLM2 run on a shipped pair."""

from __future__ import annotations

import itertools
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from multihead import MultiheadError
from multihead.cli import main
from multihead.heads.circuit import from_embed, read_pairs, select_edges
from multihead.heads.circuit_report import HELPS_COLOUR, LEGEND, OPPOSES_COLOUR, circuit_svg
from tests_support import browse, console_errors

HOSTILE = "<script>window.pwned=1</script>&amp;"
PAIRS = {"about": "tiny pairs", "pairs": [
    {"clean": "abcab", "corrupt": "abdab", "answer": "c", "wrong": "x"},
    {"clean": "xyzxy", "corrupt": "xyqxy", "answer": "z", "wrong": "q"},
    {"clean": "the cat " + HOSTILE, "corrupt": "the hat " + HOSTILE, "answer": "a", "wrong": "b"},
]}
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tiny_checkpoints import write_tiny_gguf

    folder = tmp_path_factory.mktemp("circuit")
    pairs = folder / "pairs.json"
    pairs.write_text(json.dumps(PAIRS))
    return {"gguf": write_tiny_gguf(folder / "tiny.gguf"), "pairs": pairs, "folder": folder}


@pytest.fixture(scope="module")
def run_json(tiny: dict[str, Path]) -> dict[str, Any]:
    """One --json run of the command on the tiny model (4 edges kept, 2 checked), shared by the tests below."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["circuit", "--model", str(tiny["gguf"]), "--pairs", str(tiny["pairs"]), "--edges", "4",
                       "--check", "2", "--out", str(tiny["folder"] / "out"), "--json"])
    assert status == 0
    data: dict[str, Any] = json.loads(out.getvalue())
    return data


def _logit_diffs(gguf: Path) -> list[float]:
    """logit[answer] - logit[wrong] at each clean prompt's last token, from the model's own forward."""
    from multihead.heads.adapters import load_head_model

    model = load_head_model(str(gguf))
    found = []
    for pair in PAIRS["pairs"]:
        with torch.no_grad():
            logits = model.logits(torch.tensor([model.token_ids(pair["clean"])]))[0, -1].double()
        found.append(float(logits[model.token_ids(pair["answer"])[0]] - logits[model.token_ids(pair["wrong"])[0]]))
    return found


def test_json_holds_dla_composition_edges_and_faithfulness(tiny: dict[str, Path], run_json: dict[str, Any]) -> None:
    data = run_json
    assert {"model", "n_layers", "n_heads", "n_kv_heads", "pairs", "dla", "composition", "circuit", "seconds",
            "files"} <= set(data)
    assert (data["n_layers"], data["n_heads"], data["n_kv_heads"]) == (2, 4, 2)
    dla = data["dla"]
    real = _logit_diffs(tiny["gguf"])
    assert [p["logit_diff"] for p in data["pairs"]] == pytest.approx(real, abs=1e-4)
    assert dla["logit_diff"] == pytest.approx(np.mean(real), abs=1e-4)
    parts = dla["embed"] + np.sum(dla["heads"]) + np.sum(dla["mlps"]) + dla["constant"] + dla["remainder"]
    assert parts == pytest.approx(np.mean(real), abs=1e-4)  # the parts, averaged, still sum to the mean
    assert np.array(dla["heads"]).shape == (2, 4) and np.array(dla["kv_heads"]).shape == (2, 2)
    assert np.array(dla["kv_heads"]) == pytest.approx(np.array(dla["heads"]).reshape(2, 2, 2).sum(-1))
    circuit = data["circuit"]
    assert circuit["method"] == "eap" and circuit["select"] == "greedy" and len(circuit["checks"]) == 2
    edges = [_Edge(e["sender"], e["receiver"], e["score"]) for e in circuit["edges"]]
    assert len(edges) >= 4 and from_embed(edges, 2) == edges  # every edge on a path from the embeddings
    scores = [abs(e.score) for e in edges]
    assert scores == sorted(scores, reverse=True)
    f = circuit["faithfulness"]
    assert f["n_edges"] == len(edges) and f["ablation"] == "corrupt" and np.isfinite(f["kept"])
    assert f["kept"] == pytest.approx((f["circuit_metric"] - f["corrupted_metric"])
                                      / (f["clean_metric"] - f["corrupted_metric"]))
    assert f["clean_metric"] == pytest.approx(np.mean(real), abs=1e-4)
    comp = data["composition"]
    assert comp["reason"] is None and set(comp["kinds"]) == {"q", "k", "v", "k_kv", "v_kv"}
    assert all(re.fullmatch(r"L1KV[01]", r) for r in comp["kinds"]["k_kv"]["readers"])
    assert Path(data["files"]["html"]).is_file() and Path(data["files"]["dla_png"]).read_bytes()[:4] == b"\x89PNG"
    assert json.loads(Path(data["files"]["json"]).read_text())["dla"] == dla


def test_a_composition_cell_equals_numpy(tiny: dict[str, Path], run_json: dict[str, Any]) -> None:
    """One Q-composition and one per-KV-head K-composition cell of the report against Elhage's formula in float64
    NumPy from the weights (the score minus the reported baseline)."""
    from multihead.heads.adapters import load_head_model
    from multihead.heads.composition import circuits

    circ = circuits(load_head_model(str(tiny["gguf"])))
    comp = run_json["composition"]

    def c(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.linalg.norm(a @ b) / (np.linalg.norm(a) * np.linalg.norm(b)))

    def ov(layer: int, head: int) -> np.ndarray:
        lc = circ.layers[layer]
        return np.asarray(lc.w_v[lc.kv_head(head)].numpy() @ lc.w_o[head].numpy())

    q = comp["kinds"]["q"]
    reader, writer = q["readers"][0], q["writers"][0]
    (lr, hr), (lw, hw) = (tuple(map(int, re.findall(r"\d+", n))) for n in (reader, writer))
    lc = circ.layers[lr]
    w_qk = lc.w_q[hr].numpy() @ lc.w_k[lc.kv_head(hr)].numpy().T
    base = comp["baseline"]["per_query_head"]["mean"]
    assert q["scores"][0][0] == pytest.approx(c(ov(lw, hw), w_qk) - base, abs=1e-9)
    k = comp["kinds"]["k_kv"]
    lr, g = map(int, re.findall(r"\d+", k["readers"][0]))
    r = circ.layers[lr].group
    side = np.concatenate([circ.layers[lr].w_q[i].numpy().T for i in range(g * r, g * r + r)], axis=1)
    read = circ.layers[lr].w_k[g].numpy() @ side  # (D, r D): the KV head's keys read by its group's queries
    base_kv = comp["baseline"]["per_kv_head"][str(r)]["mean"]
    assert k["scores"][0][0] == pytest.approx(c(ov(lw, hw), read) - base_kv, abs=1e-9)


def _svg(page: str, cls: str) -> list[ET.Element]:
    return [ET.fromstring(m) for m in re.findall(rf'<svg xmlns="http://www.w3.org/2000/svg" class="{cls}".*?</svg>',
                                                    page, re.S)]


@pytest.mark.slow
def test_the_report_draws_every_edge_and_renders_in_chromium(run_json: dict[str, Any]) -> None:
    html = Path(run_json["files"]["html"])
    page = html.read_text()
    (graph,) = _svg(page, "circuit")  # valid XML
    paths = graph.findall(f".//{SVG}path")
    edges = run_json["circuit"]["edges"]
    assert len(paths) == len(edges)
    drawn = {(p.get("data-sender"), p.get("data-receiver")): p for p in paths}
    assert set(drawn) == {(e["sender"], e["receiver"]) for e in edges}
    for e in edges:
        p = drawn[(e["sender"], e["receiver"])]
        assert p.get("stroke") == (HELPS_COLOUR if e["score"] < 0 else OPPOSES_COLOUR)  # corrupting it lowers the diff
    nodes = {g.get("data-node") for g in graph.iter(f"{SVG}g") if g.get("data-node")}
    assert nodes == {n for e in edges for n in (e["sender"], e["receiver"])} | {"embed", "logits"}
    assert len(_svg(page, "heatmap")) == 5  # Q, K, V and K, V per KV head (GQA)
    dom = browse(html, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-ready="1"' in dom.stdout  # the page's script ran to its end (it checks the edge count too)
    assert not console_errors(dom.stderr), console_errors(dom.stderr)
    assert "<title>multihead: the circuit</title>" in dom.stdout and "pwned" not in dom.stdout.split("<body")[0]
    assert "&lt;script&gt;window.pwned=1&lt;/script&gt;&amp;amp;" in dom.stdout  # the prompt shown as text


_MEASURE = """<script>
"use strict";
const faults = [];
document.querySelectorAll("svg").forEach((svg, k) => {
  const box = svg.getBoundingClientRect();
  svg.querySelectorAll("text").forEach((t) => {
    const r = t.getBoundingClientRect();
    if (r.width > 0 && (r.left < box.left - 1 || r.right > box.right + 1 || r.top < box.top - 1 ||
                        r.bottom > box.bottom + 1)) faults.push("svg " + k + " cuts " + t.textContent);
  });
});
document.querySelectorAll("body *:not(svg):not(svg *)").forEach((el) => {
  const style = getComputedStyle(el);
  if (style.overflow !== "visible" && (el.scrollWidth > el.clientWidth + 1 || el.scrollHeight > el.clientHeight + 1))
    faults.push(el.tagName + "#" + el.id + " clips its content");
});
const legend = Array.from(document.querySelectorAll("#legend .swatch")).map((s) => {
  const r = s.getBoundingClientRect();
  return {meaning: s.dataset.meaning, colour: getComputedStyle(s).backgroundColor, text: s.parentNode.textContent,
          x: r.left + r.width / 2, y: r.top + r.height / 2};
});
document.body.setAttribute("data-measured", JSON.stringify({faults: faults, legend: legend}));
</script>"""


def _measure(page: Path) -> dict[str, Any]:
    import html as htmllib

    dom = browse(page, "--dump-dom")
    assert dom.returncode == 0 and not console_errors(dom.stderr), dom.stderr[-2000:]
    found = re.search(r'data-measured="([^"]*)"', dom.stdout)
    assert found is not None, "the measuring script did not run"
    data: dict[str, Any] = json.loads(htmllib.unescape(found.group(1)))
    return data


def test_the_report_says_what_each_colour_means_and_nothing_is_cut(run_json: dict[str, Any]) -> None:
    """issue 42: red meant three things on circuit.html (a helping DLA part, an opposing edge, composition above its
    baseline). A copy of the page with a measuring script, in headless Chromium: its legend holds one colour per
    meaning, all distinct; no SVG text lies outside its picture and no element clips its content. The screenshot of
    the page itself shows each legend colour where the swatch is, and the graph and the DLA table use the two sign
    colours by the meaning the legend gives them."""
    html = Path(run_json["files"]["html"])
    page = html.read_text()
    measured = html.with_name("measured.html")
    measured.write_text(page.replace("</body>", _MEASURE + "</body>"))
    data = _measure(measured)
    assert data["faults"] == []
    cut = html.with_name("cut.html")  # the measure sees a text outside its picture
    cut.write_text(page.replace("</svg>", '<text x="-60" y="12">outside</text></svg>', 1)
                   .replace("</body>", _MEASURE + "</body>"))
    assert _measure(cut)["faults"] == ["svg 0 cuts outside"]
    legend = data["legend"]
    assert [k["meaning"] for k in legend] == [name for name, _, _ in LEGEND]
    rgb = [tuple(int(v) for v in re.findall(r"\d+", k["colour"])[:3]) for k in legend]
    assert rgb == [tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for _, c, _ in LEGEND]
    assert all(sum(abs(a - b) for a, b in zip(p, q, strict=True)) > 90 for p, q in itertools.combinations(rgb, 2))
    shot = html.with_name("shot.png")
    taken = browse(html, f"--screenshot={shot}")
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    import matplotlib.image

    pixels = (matplotlib.image.imread(str(shot))[..., :3] * 255).round().astype(int)  # (rows, columns, rgb)
    for k, colour in zip(legend, rgb, strict=True):
        assert tuple(pixels[round(k["y"]), round(k["x"])]) == colour, k["meaning"]
    for e in run_json["circuit"]["edges"]:
        want = HELPS_COLOUR if e["score"] < 0 else OPPOSES_COLOUR
        assert re.search(rf"data-score=\"{e['score']:.6g}\"[^>]*stroke=\"{want}\"", page), e
    dla = re.search(r"<table id='dla-top'>(.*?)</table>", page, re.S)
    assert dla is not None
    for colour, value in re.findall(r"<td style='color:(#[0-9a-f]{6})'>([+-][0-9.]+)</td>", dla.group(1)):
        assert colour == (HELPS_COLOUR if float(value) >= 0 else OPPOSES_COLOUR), value


@dataclass(frozen=True)
class _Edge:
    sender: str
    receiver: str
    score: float


def test_the_graph_has_a_path_per_edge_coloured_by_sign_and_wide_by_size() -> None:
    edges = [_Edge("embed", "L0.H1", 0.5), _Edge("L0.H1", "L2.KV0.k", -1.0), _Edge("L0.MLP", "L2.KV1.v", 0.25),
             _Edge("L2.H3", "L2.MLP", -0.125), _Edge("L2.MLP", "logits", 0.75), _Edge("L0.H1", "logits", 0.0625)]
    svg = ET.fromstring(circuit_svg(edges, n_heads=4, n_kv_heads=2, title="a <test> & more"))
    paths = svg.findall(f".//{SVG}path")
    assert len(paths) == len(edges)
    width = {(p.get("data-sender"), p.get("data-receiver")): float(p.get("stroke-width") or 0) for p in paths}
    by_size = sorted(edges, key=lambda e: abs(e.score))
    assert [width[(e.sender, e.receiver)] for e in by_size] == sorted(width.values())
    assert {p.get("stroke") for p in paths if float(p.get("data-score") or 0) < 0} == {HELPS_COLOUR}
    assert {p.get("stroke") for p in paths if float(p.get("data-score") or 0) >= 0} == {OPPOSES_COLOUR}
    rows = {g.get("data-node"): float(g.find(f"{SVG}rect").get("y")) for g in svg.iter(f"{SVG}g")  # type: ignore[union-attr]
            if g.get("data-node")}
    assert rows["embed"] < rows["L0.H1"] < rows["L0.MLP"] < rows["L2.KV0.k"] == rows["L2.H3"] < rows["L2.MLP"]
    assert rows["L2.MLP"] < rows["logits"]
    with pytest.raises(MultiheadError, match="not a circuit node"):
        circuit_svg([_Edge("L0.H1", "L1.attn", 1.0)])


def test_greedy_selection_keeps_the_paths_from_the_embeddings() -> None:
    """The two largest scores reach the logits from nodes the embeddings never reach (a corrupt-ablated circuit of
    them keeps nothing); the greedy circuit follows the logits back to the embeddings instead."""
    scores = {("L1.MLP", "logits"): 10.0, ("L0.H0", "L1.MLP"): 0.01, ("L1.H2", "logits"): -3.0,
              ("embed", "L1.KV1.v"): 2.0, ("embed", "L0.H0"): 0.001, ("L0.H3", "L1.H2"): 1.5}
    top = select_edges(scores, 2, select="top", group=2)
    assert [(e.sender, e.receiver) for e in top] == [("L1.MLP", "logits"), ("L1.H2", "logits")]
    assert from_embed(top, 2) == []
    greedy = select_edges(scores, 2, select="greedy", group=2)
    assert [(e.sender, e.receiver, e.score) for e in greedy] == [("L1.H2", "logits", -3.0),
                                                                 ("embed", "L1.KV1.v", 2.0)]
    everything = select_edges(scores, 99, select="greedy", group=2)  # all that reaches: L0.H3 is never reached
    assert {(e.sender, e.receiver) for e in everything} == {("L1.H2", "logits"), ("embed", "L1.KV1.v"),
                                                            ("embed", "L0.H0"), ("L0.H0", "L1.MLP"),
                                                            ("L1.MLP", "logits")}


def test_edges_unreached_from_the_embeddings_change_nothing(tiny: dict[str, Path]) -> None:
    """What the pruning relies on, measured by eap.faithfulness (forwards): under corrupt ablation a circuit and its
    edges reached from the embeddings give the same metric."""
    from multihead.heads.adapters import load_head_model
    from multihead.heads.eap import edge_attribution, faithfulness
    from multihead.heads.patching import logit_difference

    model = load_head_model(str(tiny["gguf"]))
    pair = PAIRS["pairs"][0]
    clean, corrupt = (torch.tensor([model.token_ids(pair[k])]) for k in ("clean", "corrupt"))
    metric = logit_difference(model.token_ids(pair["answer"])[0], model.token_ids(pair["wrong"])[0])
    edges = edge_attribution(model, clean, corrupt, metric).edges
    n = next(n for n in range(1, len(edges)) if 0 < len(from_embed(edges[:n], 2)) < n)
    whole = faithfulness(model, clean, corrupt, metric, edges[:n])
    pruned = faithfulness(model, clean, corrupt, metric, from_embed(edges[:n], 2))
    assert pruned.circuit_metric == pytest.approx(whole.circuit_metric, abs=1e-5)
    assert whole.circuit_metric != pytest.approx(whole.corrupted_metric, abs=1e-4)  # the circuit does something


def test_progress_on_stderr_and_a_table_on_stdout(tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["circuit", "--model", str(tiny["gguf"]), "--pairs", str(tiny["pairs"]), "--max-pairs", "2", "--edges",
            "3", "--check", "1", "--method", "eap-ig", "--steps", "2", "--out", str(tiny["folder"] / "table"),
            "--html", str(tiny["folder"] / "elsewhere" / "c.html")]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    for stage in ("direct logit attribution over 2 prompt pair(s)", "edge attribution (eap-ig, 2 steps) over 2 "
                  "prompt pair(s)", "faithfulness of the circuit (", "exact check of the top 1 edges"):
        assert stage in err and "2/2" in err, stage
    assert "circuit (eap-ig, 2 steps; " in out and "faithfulness (corrupt-ablation" in out
    # what a sign means is said where signed figures are printed (issue 42)
    assert "largest parts (+ raises the logit difference: helps the answer; - lowers it: opposes): " in out
    assert ("edge scores: the change of the logit difference when the edge carries the corrupted prompt's write "
            "(- the edge carries the behaviour, + it works against it)") in out
    assert f"report: {tiny['folder'] / 'elsewhere' / 'c.html'}" in out
    assert (tiny["folder"] / "elsewhere" / "c.html").is_file()
    assert not (tiny["folder"] / "table" / "circuit.html").exists()


def test_ctrl_c_exits_130_and_leaves_no_folder(tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.heads import circuit

    def interrupted(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(circuit, "analyse_circuit", interrupted)
    out = tiny["folder"] / "new" / "folder"
    assert main(["circuit", "--model", str(tiny["gguf"]), "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip() == "multihead: interrupted"
    assert not (tiny["folder"] / "new").exists()


def _write(folder: Path, name: str, content: Any) -> str:
    path = folder / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_bad_flags_and_files_exit_2_with_one_line(tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    folder = tiny["folder"]
    one = PAIRS["pairs"][0]
    cases = [
        (["--edges", "0"], "argument --edges: 0 must be a positive integer"),
        (["--method", "acdc"], "argument --method: invalid choice: 'acdc'"),
        (["--steps", "3"], "--steps is for --method eap-ig"),
        (["--pairs", str(folder / "missing.json")], "argument --pairs: cannot read the pairs file"),
        (["--pairs", _write(folder, "bad.json", "{")], "is not JSON"),
        (["--pairs", _write(folder, "empty.json", {"pairs": []})], "a non-empty list \"pairs\""),
        (["--pairs", _write(folder, "key.json", {"pairs": [{**one, "answr": "c"}]})], "unknown key(s) 'answr'"),
        (["--pairs", _write(folder, "lack.json", {"pairs": [{"clean": "a", "corrupt": "b"}]})],
         "pair 0 lacks answer, wrong"),
        (["--pairs", _write(folder, "num.json", {"pairs": [{**one, "clean": 3}]})], "pair 0's clean is int"),
        (["--pairs", _write(folder, "len.json", {"pairs": [one, {**one, "corrupt": "abdabd"}]})],
         "pair 1: the clean prompt has 5 tokens and the corrupted one 6"),
        (["--pairs", _write(folder, "multi.json", {"pairs": [{**one, "answer": "cab"}]})],
         "pair 0: the answers 'cab' and 'x' must be one token each (they are 3 and 1)"),
        (["--html", str(folder / "report.txt")], "argument --html:"),
        (["--out", str(tiny["pairs"] / "x")], "cannot write to the output folder"),
    ]
    for extra, message in cases:
        argv = ["circuit", "--model", str(tiny["gguf"]), "--out", str(folder / "bad"), *extra]
        assert main(argv) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (extra, err)
    assert not (folder / "bad").exists()  # a refused run leaves no folder behind


def test_a_transformers_model_gives_what_our_port_gives(tiny: dict[str, Path]) -> None:
    """The same tiny Llama as a transformers folder, run by transformers (attention on multihead) and by our port:
    the same DLA, edges, faithfulness and composition."""
    import contextlib
    import io

    from tiny_checkpoints import write_tiny_hf_llama

    folder = write_tiny_hf_llama(tiny["folder"] / "hf-llama")
    found = {}
    for engine in ("transformers", "ours"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["circuit", "--model", str(folder), "--engine", engine, "--pairs", str(tiny["pairs"]),
                         "--max-pairs", "2", "--edges", "3", "--check", "1", "--out",
                         str(tiny["folder"] / f"engine-{engine}"), "--json"]) == 0
        found[engine] = json.loads(out.getvalue())
    theirs, ours = found["transformers"], found["ours"]
    assert theirs["engine"] != ours["engine"]
    assert np.array(theirs["dla"]["heads"]) == pytest.approx(np.array(ours["dla"]["heads"]), abs=1e-5)
    assert [(e["sender"], e["receiver"]) for e in theirs["circuit"]["edges"]] == [
        (e["sender"], e["receiver"]) for e in ours["circuit"]["edges"]]
    assert [e["score"] for e in theirs["circuit"]["edges"]] == pytest.approx(
        [e["score"] for e in ours["circuit"]["edges"]], abs=1e-5)
    assert theirs["circuit"]["faithfulness"]["kept"] == pytest.approx(ours["circuit"]["faithfulness"]["kept"],
                                                                      abs=1e-5)
    assert theirs["circuit"]["checks"][0]["exact"] == pytest.approx(ours["circuit"]["checks"][0]["exact"], abs=1e-5)
    assert np.array(theirs["composition"]["kinds"]["k_kv"]["scores"]) == pytest.approx(
        np.array(ours["composition"]["kinds"]["k_kv"]["scores"]), abs=1e-9)


def test_read_pairs_reads_the_shipped_file() -> None:
    from importlib import resources

    from multihead.heads.patching import shipped_pairs

    path = Path(str(resources.files("multihead").joinpath("data/prompt_pairs.json")))
    assert read_pairs(path) == shipped_pairs()


def test_smollm2_one_pair(smollm2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """SmolLM2 on the first shipped pair: the DLA's logit difference is the model's own, the circuit's 5 edges are
    drawn, faithfulness and the exact check of the top edge are reported, and the page renders."""
    from multihead.heads.adapters import DecoderHeads
    from multihead.heads.circuit import analyse_circuit
    from multihead.heads.circuit_report import write_report
    from multihead.heads.patching import shipped_pairs

    model, tok = smollm2
    pair = shipped_pairs()[0]
    report = analyse_circuit(DecoderHeads(model, tok), [pair], edges=5, check=1, top=4, samples=20, select="top")
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(pair.clean)]))[0, -1].double()
    real = float(logits[tok.encode(pair.answer)[0]] - logits[tok.encode(pair.wrong)[0]])
    assert report.dla.logit_diff == pytest.approx(real, abs=1e-4) and real > 0
    assert report.dla.heads.shape == (30, 9) and report.dla.by_kv_head().shape == (30, 3)
    assert report.circuit is not None and len(report.circuit["edges"]) == 5 and len(report.circuit["checks"]) == 1
    assert report.circuit["clean_metric"] == pytest.approx(real, abs=1e-3)
    files = write_report(report, tmp_path)
    (graph,) = _svg(Path(files["html"]).read_text(), "circuit")
    assert len(graph.findall(f".//{SVG}path")) == 5
    dom = browse(Path(files["html"]), "--dump-dom")
    assert 'data-ready="1"' in dom.stdout, dom.stderr[-2000:]
    assert not console_errors(dom.stderr)


def test_each_progress_bar_writes_its_finished_line_once(tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """issue 42: in a log (stderr not a terminal) `circuit` wrote a bar's last line twice when its last update had
    been drawn (a step slower than tqdm's 0.1 s redraw interval; the composition here): once per bar now."""
    import time

    from multihead.heads import circuit

    real = circuit.composition_between

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.15)
        return real(*args, **kwargs)

    monkeypatch.setattr(circuit, "composition_between", slow)
    capsys.readouterr()
    assert main(["circuit", "--model", str(tiny["gguf"]), "--pairs", str(tiny["pairs"]), "--edges", "4", "--check",
                 "2", "--out", str(tiny["folder"] / "bars")]) == 0
    finished = [re.sub(r"\d+", "N", line.split(":")[0])
                for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "100%" in line]
    assert finished == ["direct logit attribution over N prompt pair(s)", "edge attribution (eap) over N prompt "
                        "pair(s)", "faithfulness of the circuit (N edges)", "exact check of the top N edges",
                        "composition scores"], finished
