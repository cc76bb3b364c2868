"""benchmarks/kvpress_longctx.py reads its cases with multihead's reader (kvpress itself lives in its own environment
and is never imported here): one definition of a case, a well-formed case file reads back as written, and a
malformed case is refused with the file, the line and the field named."""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from multihead import MultiheadError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kvpress_longctx as bench

from multihead.tradeoff import longctx as lc


def _case(**change: Any) -> dict[str, Any]:
    case: dict[str, Any] = {"id": "passkey-1k-0", "task": "passkey", "length": 1024, "depth": 0.5,
                            "haystack": "filler", "seed": 7, "context_ids": [5, 6, 7], "question_ids": [8, 9],
                            "answer_ids": [216, 33], "answer": "1"}
    case.update(change)
    return case


def _write(tmp_path: Path, *lines: str) -> Path:
    p = tmp_path / "cases.jsonl"
    p.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return p


def test_the_benchmark_reads_cases_with_the_library_reader() -> None:
    assert bench.read_jsonl is lc.read_jsonl and bench.Case is lc.Case
    assert not hasattr(bench, "read_cases") and not hasattr(bench, "parse_case")


def test_a_case_file_reads_back_as_written(tmp_path: Path) -> None:
    second = _case(id="passkey-1k-1", depth=1, context_ids=[1] * 40)
    third = _case(id="passkey-1k-2", answer_ids=[7])  # the first one's context: the same prompt
    p = _write(tmp_path, json.dumps(_case()), "", json.dumps(second), json.dumps(third))
    cases = bench.read_jsonl(p)
    assert [c.id for c in cases] == ["passkey-1k-0", "passkey-1k-1", "passkey-1k-2"]
    assert cases[0].context_ids == (5, 6, 7) and cases[0].answer_ids == (216, 33) and cases[0].depth == 0.5
    assert cases[1].context_ids == (1,) * 40 and cases[1].depth == 1.0 and isinstance(cases[1].depth, float)
    assert [c.group for c in cases] == ["g0", "g1", "g0"]  # the benchmark prefills once per group
    assert [json.dumps(c.to_json()) for c in cases[:2]] == [json.dumps(_case()), json.dumps({**second, "depth": 1.0})]


@pytest.mark.parametrize(("line", "match"), [
    ("{not json", r"cases.jsonl:1: not a JSON object"),
    ("[1, 2]", r"cases.jsonl:1: a case must be a JSON object, got list"),
    (json.dumps({k: v for k, v in _case().items() if k not in ("answer_ids", "seed")}),
     r"cases.jsonl:1: case 'passkey-1k-0' lacks the field\(s\) seed, answer_ids: a case needs exactly the keys"),
    (json.dumps(_case(needles=[[0, 3]])), r"case 'passkey-1k-0' has unknown field\(s\) needles"),
    (json.dumps(_case(context_ids=[5, "6", 7])), r"context_ids\[1\] = '6' is not a token id"),
    (json.dumps(_case(question_ids=[8, -1])), r"question_ids\[1\] = -1 is not a token id"),
    (json.dumps(_case(answer_ids=[])), r"'answer_ids' must be a non-empty list of token ids, got \[\]"),
    (json.dumps(_case(depth=1.5)), r"'depth' must be a number in \[0, 1\], got 1.5"),
    (json.dumps(_case(length="1k")), r"'length' must be an integer >= 0, got '1k'"),
    (json.dumps(_case(answer="")), r"'answer' must be a non-empty string"),
], ids=["json", "not-object", "missing", "unknown", "string-id", "negative-id", "empty-answer", "depth", "length",
        "answer"])
def test_a_malformed_case_is_refused_with_its_line_and_field(tmp_path: Path, line: str, match: str) -> None:
    with pytest.raises(MultiheadError, match=match):
        bench.read_jsonl(_write(tmp_path, line))


def test_duplicate_ids_missing_and_empty_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(MultiheadError, match=r"cases.jsonl:2: case id 'passkey-1k-0' is already used on line 1"):
        bench.read_jsonl(_write(tmp_path, json.dumps(_case()), json.dumps(_case())))
    with pytest.raises(MultiheadError, match=r"holds no case"):
        bench.read_jsonl(_write(tmp_path, "", "  "))
    with pytest.raises(MultiheadError, match=r"nowhere.jsonl' does not exist"):
        bench.read_jsonl(tmp_path / "nowhere.jsonl")


def test_a_case_outside_the_vocabulary_or_the_context_is_refused(tmp_path: Path) -> None:
    case = bench.read_jsonl(_write(tmp_path, json.dumps(_case(context_ids=[5] * 10, answer_ids=[49152]))))[0]
    with pytest.raises(MultiheadError, match=r"answer_ids holds token id 49152, outside the model's vocabulary of "
                                             r"49152"):
        bench.check_fits(case, vocab_size=49152, max_context=8192)
    with pytest.raises(MultiheadError, match=r"take 13 tokens, more than the model's context of 12"):
        bench.check_fits(case, vocab_size=49153, max_context=12)
    bench.check_fits(case, vocab_size=49153, max_context=13)  # exactly full: accepted


def _kv(length: int, task: str, exact: bool, tensor: int, effective: int | None = None) -> dict[str, Any]:
    return {"length": length, "task": task, "exact": exact, "tf_exact": exact, "answer_logprob": -1.0 if exact
            else -9.0, "tensor_bytes": tensor, "storage_bytes": tensor, "prefill_s": 1.0,
            "effective_bytes": tensor if effective is None else effective}


def test_compare_keeps_multihead_s_gate_and_measures_bytes_against_the_same_cases(tmp_path: Path) -> None:
    lines = [_case(id="pk", task="passkey", length=64), _case(id="mk0", task="multikey", length=64, context_ids=[1]),
             _case(id="mk1", task="multikey", length=64, context_ids=[1], answer_ids=[3])]
    cases = {c.id: c for c in bench.read_jsonl(_write(tmp_path, *map(json.dumps, lines)))}
    cell = {"kv_bytes": 1000, "compared": lc.summarise([{"correct": True, "group": "p0", "length": 64,
                                                         "task": "passkey", "answer_logprob": -1.0}], draws=50),
            "tasks": {"passkey": {"correct": 1, "cases": 1}, "multikey": {"correct": 1, "cases": 2}}}
    result = {"settings": {"lengths": [64], "bootstrap": 50}, "excluded": [{"length": 64, "task": "multikey"}],
              "rows": [{"method": "full cache", "series": "full", "lengths": {"64": cell}}]}
    data = {"results": {
        "full@0.0": {"pk": _kv(64, "passkey", True, 800), "mk0": _kv(64, "multikey", True, 700),
                     "mk1": _kv(64, "multikey", False, 700)},
        "snapkv@0.5": {"pk": _kv(64, "passkey", False, 400), "mk0": _kv(64, "multikey", True, 350)},
        "adakv_snapkv@0.75": {"pk": _kv(64, "passkey", True, 800, effective=200)}}}
    cmp = bench.compare(data, result, cases, {"pk": True, "mk0": True, "mk1": True})
    rows = {r["method"]: r["lengths"]["64"] for r in cmp["rows"]}
    assert rows["full cache"]["bytes_share"] == 1.0 and rows["full cache"]["tasks"] == {"passkey": [1, 1]}
    # multikey is left out (multihead's full cache failed it), so each press is scored on the passkey case only
    assert [(rows[k]["correct"], rows[k]["cases"]) for k in ("full@0.0", "snapkv@0.5", "adakv_snapkv@0.75")] == [
        (1, 1), (0, 1), (1, 1)]
    assert rows["snapkv@0.5"]["bytes_share"] == 0.5 and rows["snapkv@0.5"]["effective_share"] == 0.5
    assert rows["adakv_snapkv@0.75"]["bytes_share"] == 1.0 and rows["adakv_snapkv@0.75"]["effective_share"] == 0.25
    assert rows["snapkv@0.5"]["wilson95"] == lc.wilson(0, 1)
    assert cmp["full_cache_agreement"] == {"cases": 3, "same_exact_match": 2, "differ": ["mk1"]}
    text = bench.compare_table(cmp)
    assert "left out: multikey at 64" in text and "differ: mk1" in text


def test_results_of_runs_made_side_by_side_merge_and_a_case_in_two_is_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"meta": {"threads": 1}, "results": {"full@0.0": {"x": _kv(64, "passkey", True, 8)}}}))
    b.write_text(json.dumps({"meta": {"threads": 2}, "results": {"full@0.0": {"y": _kv(128, "passkey", True, 16)},
                                                                 "snapkv@0.5": {"y": _kv(128, "passkey", True, 8)}}}))
    data = bench.read_results([str(a), str(b)])
    assert {k: sorted(v) for k, v in data["results"].items()} == {"full@0.0": ["x", "y"], "snapkv@0.5": ["y"]}
    assert [m["threads"] for m in data["metas"].values()] == [1, 2]
    with pytest.raises(MultiheadError, match=r"full@0.0 'x' is in more than one of the results files"):
        bench.read_results([str(a), str(a)])


def test_compare_shared_pairs_each_press_with_multihead_on_the_cases_both_ran() -> None:
    """The comparison with a shared-prefill run: only the cases both sides answered, each press setting against
    multihead's full cache and against the uniform sinks + window holding the press's share of the bytes (50% for
    compression 0.5), by McNemar's test on the same cases; bytes against each side's own full cache."""
    full, half = "full cache", "4 sinks + window 50%"
    methods = [{"name": full, "series": "full", "keep": None},
               {"name": half, "series": "sinks + window", "keep": 0.5}]
    ours = {"a": (True, True), "b": (True, False), "c": (True, True), "d": (False, False), "e": (True, True)}
    records = [{"id": i, "length": 4096, "task": "passkey",
                "methods": {full: {"correct": f, "cache_bytes": 100}, half: {"correct": h, "cache_bytes": 51}}}
               for i, (f, h) in ours.items()]
    press = {"a": False, "b": False, "c": True, "d": False}  # "e" not run by kvpress: left out

    def res(exact: bool, nbytes: int) -> dict[str, Any]:
        return {"exact": exact, "tensor_bytes": nbytes, "effective_bytes": nbytes}

    data = {"results": {"full@0.0": {i: res(ours[i][0], 200) for i in press},
                        "streaming_llm@0.5": {i: res(x, 100) for i, x in press.items()}}}
    cell = bench.compare_shared(data, records, methods)["cells"]["4096|passkey"]
    assert cell["cases"] == 4 and cell["full_cache_agreement"] == {"cases": 4, "same_exact_match": 4}
    s = cell["kvpress"]["streaming_llm@0.5"]
    assert (s["correct"], s["bytes_share"]) == (1, 0.5)
    assert s["vs_multihead_full"] == {"reference_only": 2, "other_only": 0, "p_value": 0.5}  # a, b
    assert s["vs_uniform"] == {"method": half, "reference_only": 1, "other_only": 0, "p_value": 1.0}  # a
    assert cell["multihead"][half]["bytes_share"] == 0.51 and cell["multihead"][full]["correct"] == 3
    assert "kvpress" in bench.compare_shared_table({"cells": {"4096|passkey": cell}})
    # beside a named method too (a plan of its bytes, say); a name the run does not hold is refused
    cell = bench.compare_shared(data, records, methods, against=[half])["cells"]["4096|passkey"]
    assert cell["kvpress"]["streaming_llm@0.5"]["vs"] == {half: {"reference_only": 1, "other_only": 0, "p_value": 1.0}}
    assert f"{half}: 1/0 p 1" in bench.compare_shared_table({"cells": {"4096|passkey": cell}})
    with pytest.raises(MultiheadError, match="--against 'duo 50%' is not a method of the multihead run"):
        bench.compare_shared(data, records, methods, against=["duo 50%"])


class _Press:
    """A stand-in for a kvpress press with kvpress's contract: ``compress`` gets a layer's hidden states and full
    keys and values after its attention and returns what the cache keeps; ``with press(model)`` applies it during a
    prefill through a forward hook on every attention module (kvpress's BasePress.forward_hook, for a DynamicCache)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def post_init_from_model(self, model: Any) -> None:
        pass

    def compress(self, module: Any, hidden: Any, keys: Any, values: Any, attentions: Any, kwargs: Any) -> Any:
        import torch

        if self.kind == "mask":  # a head-wise press: every position stays, some are masked on one KV head
            masked = torch.zeros_like(keys[..., 0], dtype=torch.bool)
            masked[:, module.layer_idx % keys.shape[1], 1:4] = True
            module.masked_key_indices = torch.nonzero(masked, as_tuple=True)
            return keys, values
        keep = hidden[0].norm(dim=-1).argsort(descending=True)[: keys.shape[2] // 2].sort().values  # by the input
        return keys[:, :, keep], values[:, :, keep]

    @contextlib.contextmanager
    def __call__(self, model: Any) -> Any:
        def hook(module: Any, _args: Any, kwargs: Any, output: Any) -> Any:
            layer = kwargs.get("past_key_values", kwargs.get("cache")).layers[module.layer_idx]
            layer.keys, layer.values = self.compress(module, kwargs["hidden_states"], layer.keys, layer.values,
                                                     output[1], kwargs)
            return output

        handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def test_one_shared_prefill_gives_every_press_the_cache_of_its_own_prefill() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "sdpa"
    context = tuple(int(t) for t in torch.randint(0, 64, (24,)))
    presses = {"full@0.0": None, "half@0.5": _Press("half"), "mask@0.5": _Press("mask")}
    shared = bench.prefill_shared(model, presses, context)
    assert [shared["half@0.5"].lengths, shared["full@0.0"].lengths] == [[12] * 3, [24] * 3]
    assert shared["mask@0.5"].measured["masked_positions"] == 3 * 3
    assert shared["full@0.0"].measured["masked_positions"] == 0  # masks stay with the press that made them
    for setting, press in presses.items():
        bench.use_masks(model, None)
        alone = bench.prefill(model, press, context)
        assert bench.same_prefill(shared[setting], alone, [layer.self_attn.masked_key_indices
                                                           for layer in model.model.layers]) is None, setting
    # a press whose cache differs is caught
    other = bench.prefill(model, _Press("mask"), (*context[:-1], (context[-1] + 1) % 64))
    assert bench.same_prefill(shared["mask@0.5"], other, shared["mask@0.5"].measured["masks"]) is not None
    # each press decodes from a cache of its own: writing into one (kvpress's fake keys) leaves the others
    with torch.inference_mode():  # where kvpress's patch writes them: inside answer_case's inference mode
        shared["mask@0.5"].cache.layers[0].keys[0, 0, 1] = 1e4
    assert not torch.equal(shared["mask@0.5"].cache.layers[0].keys, shared["full@0.0"].cache.layers[0].keys)
    bench.use_masks(model, shared["mask@0.5"].measured["masks"])
    assert model.model.layers[2].self_attn.masked_key_indices is shared["mask@0.5"].measured["masks"][2]


def test_a_duo_pattern_becomes_the_plan_keeping_the_heads_kvpress_keeps(tmp_path: Path) -> None:
    import numpy as np

    from multihead.cache import HeadPlan

    rng = np.random.default_rng(0)
    scores = rng.random((30, 3))
    pattern = tmp_path / "pattern.json"
    pattern.write_text(json.dumps({"sink_size": 128, "recent_size": 256, "head_scores": scores.tolist(),
                                   "made_by": "a test"}), encoding="utf-8")
    for compression in (0.5, 0.75):
        streamed = np.zeros(scores.shape, dtype=bool)  # kvpress's DuoAttentionPress: the lowest scores stream
        lowest = np.argsort(scores, axis=None)[:round(scores.size * compression)]
        streamed[np.unravel_index(lowest, scores.shape)] = True
        out = tmp_path / f"plan-{compression}.json"
        argv = ["plan", "--pattern", str(pattern), "--fraction", str(1 - compression), "--out", str(out)]
        assert bench.main(argv) == 0
        plan = HeadPlan.load(out)
        assert np.array_equal(np.array(plan.full), ~streamed)
        assert (plan.sinks, plan.window, plan.shape) == (4, 256, (30, 9, 3, 64))
    pattern.write_text(json.dumps({"sink_size": 128, "recent_size": 256, "head_scores": [[1.0, 2.0]]}),
                       encoding="utf-8")
    with pytest.raises(MultiheadError, match=r"head scores of shape \(1, 2\): SmolLM2-135M has \(30, 3\)"):
        bench.pattern_plan(str(pattern), 0.5, sinks=4, window=256)


@pytest.mark.parametrize(("argv", "match"), [
    (["--protocol", "per-press", "--verify-shared", "2"],
     r"--verify-shared 2 checks the shared prefill; --protocol per-press has none"),
    (["--verify-shared", "-1"], r"--verify-shared: expected a whole number >= 0, got -1"),
    (["--limit", "-3"], r"--limit: expected a whole number >= 0, got -3"),
    (["--threads", "two"], r"--threads: expected a whole number >= 0, got 'two'"),
])
def test_run_refuses_flags_it_would_ignore_or_misread(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], match: str) -> None:
    """Before anything is read or loaded: a check the protocol cannot make, or a negative count, is an error
    naming the value, not a run that silently checks nothing."""
    cases = _write(tmp_path, json.dumps(_case()))
    with pytest.raises(SystemExit) as err:
        bench.main(["run", "--cases", str(cases), "--out", str(tmp_path / "r.json"), *argv])
    assert err.value.code == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "r.json").exists()
