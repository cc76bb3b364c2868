"""The long-context evaluation on the transformers engine (multihead.models.decoder.TransformersDecoder):
every cache kind and head plan gives the answers multihead's own port gives on the same weights and cases; the
methods that change the model are left out and said; `tradeoff --long --engine` picks and refuses by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from multihead.errors import MultiheadError
from multihead.models.llama import LlamaModel
from multihead.tradeoff import longctx as lc
from test_longctx import CHARS, TOK, _prose
from tests_support import llama_pair


def _pair() -> tuple[Any, LlamaModel]:
    """A tiny random transformers Llama on multihead's attention, and multihead's port with its weights (large
    weights: attention far from uniform, so evictions show)."""
    from multihead import hf
    from multihead.models.decoder import TransformersDecoder

    theirs, ours = llama_pair(len(CHARS), ffn=64, context=1024, std=0.3)
    return TransformersDecoder(hf.enable(theirs)), ours


def _settings(plan: str) -> lc.Settings:
    return lc.Settings(lengths=(400,), tasks=("passkey", "multikey"), keys=2, prompts=2, chunk=96, sinks=2,
                       keep=(0.5,), window_keep=(), windows=(), bits=(4,), group=8, residual=16, mqa=False,
                       uptrain_steps=0, prune=(), plans=(plan,), ppl_context=256, ppl_scored=64, threshold=0.0,
                       bootstrap=50)


def _answers(folder: Path) -> dict[str, dict[str, Any]]:
    return {f"{path.parent.name}/{r['id']}": r for path in sorted((folder / "results").glob("*/*.json"))
            for r in json.loads(path.read_text())}


def test_the_transformers_engine_answers_as_the_port_for_every_cache_kind_and_plan(tmp_path: Path) -> None:
    from multihead.cache import HeadPlan

    theirs, ours = _pair()
    text = tmp_path / "text.txt"
    text.write_text(_prose(1400, seed=4))
    plan = str(HeadPlan(full=((True, False), (False, True)), sinks=2, window=24, model="tiny", shape=(2, 4, 2, 16),
                        method="test", budget=0.5).save(tmp_path / "mixed-plan.json"))
    settings = _settings(plan)
    port = lc.run(settings, out=tmp_path / "ours", progress=False, text_path=str(text), model=ours, tokenizer=TOK)
    other = lc.run(settings, out=tmp_path / "theirs", progress=False, text_path=str(text), model=theirs,
                   tokenizer=TOK)
    names = [r["method"] for r in port["rows"]]
    assert names == [r["method"] for r in other["rows"]]
    assert {"full cache", "2 sinks + window 50%", "int4 (g8, r16)"} <= set(names) and any("mixed" in n for n in names)
    mine, yours = _answers(tmp_path / "ours"), _answers(tmp_path / "theirs")
    assert mine.keys() == yours.keys() and len(mine) == len(names) * 2 * 3
    for key, a in mine.items():
        b = yours[key]
        assert (a["correct"], a["greedy_ids"]) == (b["correct"], b["greedy_ids"]), key
        assert a["answer_logprob"] == pytest.approx(b["answer_logprob"], abs=1e-3), key
        assert a["cache_bytes"] == b["cache_bytes"], key
    for a, b in zip(port["rows"], other["rows"], strict=True):
        assert a["perplexity"]["perplexity"] == pytest.approx(b["perplexity"]["perplexity"], rel=1e-4)
        assert a["lengths"]["400"]["kv_bytes"] == b["lengths"]["400"]["kv_bytes"]


def test_the_engine_is_resolved_from_the_path_and_refused_by_name(tmp_path: Path) -> None:
    from multihead.models import default_gemma3_path, default_gguf_path
    from multihead.tradeoff.longctx.runner import resolve_engine

    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    gguf, gemma = default_gguf_path(), default_gemma3_path()  # (the GGUFs' metadata is read, never their weights)
    assert resolve_engine(None) == "ours" and resolve_engine(None, "transformers") == "transformers"
    assert resolve_engine(str(gguf)) == "ours" and resolve_engine(str(gguf), "transformers") == "transformers"
    assert resolve_engine(str(folder)) == "transformers"
    assert resolve_engine(str(gemma)) == "transformers" and resolve_engine("gemma3") == "transformers"
    with pytest.raises(MultiheadError, match="qwen is a qwen2 folder: multihead has no port of it"):
        resolve_engine(str(folder), "ours")
    with pytest.raises(MultiheadError, match="engine 'vllm' is unknown"):
        resolve_engine(None, "vllm")
    with pytest.raises(MultiheadError, match="does not exist"):
        resolve_engine(str(tmp_path / "nothing"))
    with pytest.raises(MultiheadError, match="minilm is a bert sentence encoder"):
        resolve_engine("minilm")
    done = subprocess.run([sys.executable, "-m", "multihead", "tradeoff", "--engine", "transformers"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--engine is for `tradeoff --long`: add --long" in done.stderr


@pytest.mark.slow
def test_smollm2_on_transformers_answers_as_the_port_on_the_same_cases(tmp_path: Path) -> None:
    """The real model through `multihead tradeoff --long --protocol shared`: the GGUF on transformers (every cache
    kind and the shipped DuoAttention plan, on multihead's attention and caches, each compressed from one full
    prefill) and on multihead's own port give the same answers to the same cases, with the same cache bytes. (The
    streaming protocol on both engines: the tiny model's test above.)"""
    from multihead.models import default_gguf_path
    from multihead.tradeoff.longctx import shared

    plan = Path(__file__).parents[1] / "docs" / "experiments" / "smollm2-duo-50-plan.json"
    procs = {engine: subprocess.Popen(  # the two engines side by side, one thread each
        [sys.executable, "-m", "multihead", "tradeoff", "--long", "--protocol", "shared",
         "--model", str(default_gguf_path()), "--engine", engine, "--lengths", "512",
         "--tasks", "passkey,single-number", "--prompts", "1", "--keep", "0.5",
         "--window-keep", "none", "--bits", "4", "--plan", str(plan), "--no-mqa",
         "--out", str(tmp_path / engine), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}) for engine in ("ours", "transformers")}
    runs = {}
    for engine, proc in procs.items():
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        runs[engine] = shared.finished(tmp_path / engine / shared.FILE)
    mine, yours = runs["ours"], runs["transformers"]
    assert mine.keys() == yours.keys() and len(mine) == 2
    for case, record in mine.items():
        assert record["methods"].keys() == yours[case]["methods"].keys() and len(record["methods"]) == 5
        for method, a in record["methods"].items():
            b = yours[case]["methods"][method]
            assert (a["correct"], a["greedy_ids"], a["cache_bytes"]) == (b["correct"], b["greedy_ids"],
                                                                          b["cache_bytes"]), (case, method)
    assert json.loads((tmp_path / "transformers" / "shared-settings.json").read_text())["engine"] == "transformers"


def test_a_hugging_face_folder_runs_both_protocols_on_transformers(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`tradeoff --long --model FOLDER` on a saved Qwen2 folder (config, safetensors and its own tokenizer: a model
    only transformers runs, so 'auto' takes the transformers engine and the folder's tokenizer): the streaming and the
    shared-prefill protocols both run every cache kind and a head plan, and where a method keeps every key (the full
    cache) the two protocols give the same answers to the same cases."""
    from multihead.cache import HeadPlan
    from multihead.cli import main
    from multihead.evals import text
    from multihead.tradeoff.longctx import shared
    from tiny_checkpoints import write_tiny_hf_qwen2

    real = text.read_text()
    monkeypatch.setattr(text, "read_text", lambda path=None: real[:40_000])  # the byte-level toy encodes it slowly
    folder = write_tiny_hf_qwen2(tmp_path / "tiny-qwen2")
    plan = HeadPlan(full=((True, False), (False, True)), sinks=2, window=24, model="tiny-qwen2", shape=(2, 4, 2, 8),
                    method="test", budget=0.5).save(tmp_path / "tiny-qwen2-plan.json")
    argv = ["tradeoff", "--long", "--model", str(folder), "--lengths", "300", "--tasks", "passkey,single-number",
            "--prompts", "2", "--chunk", "96", "--sinks", "2", "--keep", "0.5", "--window-keep", "none", "--bits", "4",
            "--group", "8", "--residual", "16", "--plan", str(plan), "--no-mqa", "--prune", "none",
            "--uptrain-steps", "0", "--threshold", "0", "--bootstrap", "50", "--json"]
    assert main([*argv, "--out", str(tmp_path / "streaming")]) == 0
    streaming = json.loads(capsys.readouterr().out)
    assert streaming["engine"] == "transformers, attention on multihead"
    assert main([*argv, "--protocol", "shared", "--dtype", "fp32", "--out", str(tmp_path / "shared")]) == 0
    capsys.readouterr()
    stamp = json.loads((tmp_path / "shared" / "shared-settings.json").read_text())
    assert stamp["engine"] == "transformers" and stamp["model"] == str(folder)
    records = shared.finished(tmp_path / "shared" / shared.FILE)
    methods = {"full cache", "2 sinks + window 50%", "int4 (g8, r16)", "head-wise tiny-qwen2",
               "2 sinks + window = bytes of 50% full, 2 + 24"}
    assert len(records) == 4 and all(set(r["methods"]) == methods for r in records.values())
    answers = _answers(tmp_path / "streaming")
    full = {key.split("/", 1)[1]: a for key, a in answers.items() if key.startswith("full-cache/")}
    assert full.keys() == records.keys(), (sorted(answers)[:3], sorted(records))
    for case, a in full.items():
        b = records[case]["methods"]["full cache"]
        assert (a["correct"], a["greedy_ids"]) == (b["correct"], b["greedy_ids"]), case
        assert a["answer_logprob"] == pytest.approx(b["answer_logprob"], abs=1e-3), case
    # the report sets the streaming run beside the shared one: per method, the cases both answered and how alike
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import shared_report

    beside = shared_report.streaming_beside(tmp_path / "streaming", list(records.values()))["methods"]
    assert set(beside) == methods and all(m["cases"] == 4 for m in beside.values())
    assert beside["full cache"]["same"] == 4 and beside["full cache"]["p_value"] == 1.0
    for name, m in beside.items():
        mine = [answers[k]["correct"] for k in answers if answers[k]["method"] == name]
        assert m["streaming_correct"] == sum(mine) and m["shared_correct"] == sum(
            r["methods"][name]["correct"] for r in records.values())
    with pytest.raises(MultiheadError, match="holds no streaming-protocol answer"):
        shared_report.streaming_beside(tmp_path / "shared", list(records.values()))
    broken = next((tmp_path / "streaming" / "results").glob("*/*.json"))
    broken.write_text('[{"id": "x"}]')
    with pytest.raises(MultiheadError, match=r"is not a streaming run's answer list \(records with id, method"):
        shared_report.streaming_beside(tmp_path / "streaming", list(records.values()))
