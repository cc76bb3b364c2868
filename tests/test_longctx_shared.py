"""The shared-prefill protocol (multihead.tradeoff.longctx.shared) on the tiny model: it equals the streaming path
where a method keeps every key, compresses after the prefill (the question unseen), resumes by skipping finished
cases, and its statistics (Wilson, McNemar's exact test) are the textbook ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from multihead.cache import sink_keep
from multihead.errors import MultiheadError
from multihead.evals.answers import run_prompt
from multihead.layers.linear import linear
from multihead.tradeoff import longctx as lc
from multihead.tradeoff.longctx import shared
from multihead.tradeoff.longctx.stats import mcnemar
from test_longctx import CHARS, TOK, _prose, _tiny


def _cases(tmp_path: Path, prompts: int = 3) -> list[lc.Case]:
    text = tmp_path / "text.txt"
    text.write_text(_prose(1400, seed=4))
    from multihead.evals.text import read_text, token_splits

    settings = lc.Settings(lengths=(300,), tasks=("passkey", "single-number"), prompts=prompts, sinks=2)
    return lc.make_cases(settings, TOK, token_splits(TOK.encode(read_text(str(text)))).test, max_context=1024)


METHODS = [lc.Method("full cache", "full"), lc.Method("2 sinks + window 400", "sinks + window", window=400, sinks=2),
           lc.Method("2 sinks + window 40", "sinks + window", window=40, sinks=2),
           lc.Method("int4 (g8, r16)", "quantized", bits=4, group=8, residual=16)]


def test_where_a_method_keeps_every_key_the_shared_prefill_answers_as_the_streaming_one(tmp_path: Path) -> None:
    model = _tiny(max_context=1024, vocab=len(CHARS))
    cases = _cases(tmp_path)
    records = shared.run_shared(model, cases, METHODS, out=tmp_path / "run", chunk=96, progress=False)
    assert [r["id"] for r in records] == [c.id for c in cases]
    for case, record in zip(cases, records, strict=True):
        for method in METHODS[:2]:  # the full cache, and a window longer than the prompt: every key kept
            (streamed,) = run_prompt(model, method, [case], chunk=96)
            got = record["methods"][method.name]
            assert (got["correct"], got["greedy_ids"]) == (streamed["correct"], streamed["greedy_ids"])
            assert got["answer_logprob"] == pytest.approx(streamed["answer_logprob"], abs=1e-4)
        assert record["methods"]["2 sinks + window 40"]["cache_bytes"] < record["methods"]["full cache"]["cache_bytes"]


def test_the_compression_comes_after_a_prefill_that_saw_every_key(tmp_path: Path) -> None:
    """A sinks + window method's answer equals the uncached model whose context rows saw every earlier key and
    whose question and answer rows see the sinks and the window only; the streaming prefill (keys computed through
    the small cache) gives another answer."""
    model = _tiny(max_context=1024, vocab=len(CHARS))
    case = _cases(tmp_path, prompts=1)[0]
    method = METHODS[2]
    record = shared.answer_case(model, case, [method], chunk=96)
    ids = [*case.context_ids, *case.question_ids, *case.answer_ids]
    n, c = len(ids), len(case.context_ids)
    pos = torch.arange(n)
    mask = pos[None] <= pos[:, None]
    mask[c:] = sink_keep(pos[c:], pos, window=40, sink_tokens=2)
    h = model.embed(torch.tensor([ids]))
    with torch.no_grad():
        for block in model.layers:
            h = block(h, step=block.attn.step(h, mask=mask[None, None]))
        logits = linear(model.norm(h), model.embed.weight)[0]
    start = n - len(case.answer_ids) - 1  # the position whose logits predict the first answer token
    logp = torch.log_softmax(logits[start:n - 1].float(), -1)
    want = float(logp.gather(-1, torch.tensor(case.answer_ids)[:, None]).sum())
    assert record["methods"][method.name]["answer_logprob"] == pytest.approx(want, abs=1e-3)
    (streamed,) = run_prompt(model, method, [case], chunk=96)
    assert streamed["answer_logprob"] != pytest.approx(want, abs=1e-3)


def test_a_stopped_run_resumes_skipping_the_cases_it_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    model = _tiny(max_context=1024, vocab=len(CHARS))
    cases = _cases(tmp_path)
    out = tmp_path / "run"
    first = shared.run_shared(model, cases[:3], METHODS, out=out, chunk=96, progress=False)
    lines = (out / shared.FILE).read_text().splitlines()
    assert len(lines) == 3 and [json.loads(x)["id"] for x in lines] == [c.id for c in cases[:3]]
    (out / shared.FILE).write_text("\n".join(lines) + "\n" + lines[-1][:20])  # a stop in the middle of a line
    calls: list[str] = []
    real = shared.answer_case

    def counted(model: Any, case: lc.Case, *args: Any) -> dict[str, Any]:
        calls.append(case.id)
        return real(model, case, *args)

    monkeypatch.setattr(shared, "answer_case", counted)
    again = shared.run_shared(model, cases, METHODS, out=out, chunk=96, progress=False)
    assert calls == [c.id for c in cases[3:]]  # the finished ones skipped; the cut line's case was whole before
    assert [c.task for c in shared.interleaved(cases)] == ["passkey", "single-number"] * 3  # cells take turns
    assert again[:3] == first and len(again) == len(cases)
    with pytest.raises(MultiheadError, match="other methods"):
        shared.run_shared(model, cases, METHODS[:2], out=out, chunk=96, progress=False)
    (out / shared.FILE).write_text("{not json\n" + "\n".join(lines) + "\n")
    with pytest.raises(MultiheadError, match="line 1 is not JSON"):
        shared.run_shared(model, cases, METHODS, out=out, chunk=96, progress=False)


def test_mcnemar_is_the_exact_binomial_test_on_the_discordant_cases() -> None:
    # 1 case only the reference gets, 6 only the other: p = 2 * (C(7,0) + C(7,1)) / 2^7 = 0.125
    ref = [True] + [False] * 6 + [True] * 5
    other = [False] + [True] * 6 + [True] * 5
    assert mcnemar(ref, other) == {"reference_only": 1, "other_only": 6, "p_value": 0.125}
    assert mcnemar([True] * 4, [True] * 4)["p_value"] == 1.0
    assert mcnemar([True] * 10, [False] * 10)["p_value"] == pytest.approx(2 / 1024)
    with pytest.raises(ValueError, match="the same cases"):
        mcnemar([True], [True, False])


def test_the_paired_difference_resamples_cases_with_both_answers() -> None:
    from multihead.tradeoff.longctx.stats import paired_difference

    ref = [True] * 50 + [False] * 50
    got = paired_difference(ref, ref)  # the same answers: no difference in any draw
    assert got == {"difference": 0.0, "difference95": (0.0, 0.0)}
    other = [True] * 40 + [False] * 10 + [True] * 30 + [False] * 20  # 10 lost, 30 gained: +20 points
    got = paired_difference(ref, other, draws=4000)
    assert got["difference"] == pytest.approx(0.2)
    lo, hi = got["difference95"]  # the paired difference's own spread: sd sqrt(0.4 - 0.04) / 10 = 0.06
    assert 0.07 < lo < 0.10 and 0.30 < hi < 0.33
    with pytest.raises(ValueError, match="the same cases"):
        paired_difference([True], [])


def test_the_summary_gives_each_cell_wilson_intervals_mcnemar_and_the_throughput(tmp_path: Path) -> None:
    model = _tiny(max_context=1024, vocab=len(CHARS))
    records = shared.run_shared(model, _cases(tmp_path), METHODS, out=tmp_path / "run", chunk=96, progress=False)
    out = shared.summary(records, METHODS, controls={"2 sinks + window 40": "2 sinks + window 400"})
    assert out["cases"] == 6 and set(out["cells"]) == {"300|passkey", "300|single-number", "300|all tasks"}
    both = out["cells"]["300|all tasks"]
    assert both["cases"] == 6
    for name, m in both["methods"].items():  # the pooled cell counts the two tasks' cases together
        assert m["correct"] == sum(out["cells"][f"300|{t}"]["methods"][name]["correct"]
                                   for t in ("passkey", "single-number"))
        if "vs_full" in m:
            v = m["vs_full"]
            assert v["difference"] == pytest.approx((v["other_only"] - v["reference_only"]) / 6)
            assert v["difference95"][0] <= v["difference"] <= v["difference95"][1]
    cell = out["cells"]["300|passkey"]
    full = cell["methods"]["full cache"]
    assert "vs_full" not in full and full["wilson95"][0] <= full["accuracy"] <= full["wilson95"][1]
    small = cell["methods"]["2 sinks + window 40"]
    assert set(small["vs_full"]) == {"reference_only", "other_only", "p_value", "difference", "difference95"}
    assert small["vs_control"]["control"] == "2 sinks + window 400"
    assert out["throughput"]["cases_per_hour"] > 0 and set(out["throughput"]["method_seconds_per_case"]) == {
        m.name for m in METHODS}
    assert "shared prefill" in out["protocol"]


def test_the_cli_runs_the_shared_protocol_resumes_it_and_refuses_other_settings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tradeoff --long --protocol shared` on a tiny GGUF: one JSON line a case, the result and table written, each
    method's bytes and accuracy per cell; a second call with the same settings answers nothing again, one with other
    settings is refused naming the settings file; --dtype without the shared protocol is refused."""
    from multihead.cli import main
    from tiny_checkpoints import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", context=512)
    text = tmp_path / "text.txt"
    text.write_text(_prose(3000, seed=4))
    argv = ["tradeoff", "--long", "--protocol", "shared", "--model", str(gguf), "--text", str(text), "--lengths",
            "300", "--tasks", "passkey,single-number", "--prompts", "2", "--keep", "0.5", "--bits", "4", "--group",
            "4", "--out", str(tmp_path / "out"), "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    lines = (tmp_path / "out" / shared.FILE).read_text().splitlines()
    assert len(lines) == result["cases"] == 4 and (tmp_path / "out" / "shared-table.txt").exists()
    cell = result["cells"]["300|passkey"]["methods"]
    assert cell["full cache"]["bytes_of_full"] == 1.0 and 0 < cell["int4 (g4, r128)"]["bytes_of_full"] < 1
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["cells"] == result["cells"]
    assert (tmp_path / "out" / shared.FILE).read_text().splitlines() == lines
    assert main([*argv, "--prompts", "3"]) == 2
    assert "holds a shared-prefill run with other settings" in capsys.readouterr().err
    assert main(["tradeoff", "--long", "--dtype", "bf16", "--out", str(tmp_path / "o2")]) == 2
    assert "--dtype is for --protocol shared" in capsys.readouterr().err
    # a second run of other methods on the same cases combines with the first, case by case
    more = tmp_path / "more"
    assert main([*argv[:-3], "--keep", "0.25", "--bits", "8", "--out", str(more)]) == 0
    capsys.readouterr()
    records, methods, agreement = shared.combine([tmp_path / "out", more])
    assert [m.name for m in methods] == ["full cache", "window 25%", "4 sinks + window 50%", "int4 (g4, r128)",
                                         "4 sinks + window 25%", "int8 (g4, r128)"]
    assert len(records) == 4 and all(set(r["methods"]) == {m.name for m in methods} for r in records)
    assert agreement["full cache"] == {"cases": 4, "same": 4, "first_only": 0, "other_only": 0}
    assert set(agreement) == {"full cache", "window 25%"}
    with pytest.raises(MultiheadError, match="does not exist"):
        shared.combine([tmp_path / "nowhere"])
    # cases to choose a plan on: the jargon haystacks from the text's training split, under another seed
    train = tmp_path / "train"
    assert main([*argv[:-3], "--split", "train", "--seed", "1", "--out", str(train)]) == 0
    capsys.readouterr()
    assert json.loads((train / "shared-settings.json").read_text())["split"] == "train"
    mine = {json.loads(x)["id"]: json.loads(x) for x in lines}
    other = [json.loads(x) for x in (train / shared.FILE).read_text().splitlines()]
    assert len(other) == 4 and all(r["methods"]["full cache"]["answer_logprob"]
                                   != mine[r["id"]]["methods"]["full cache"]["answer_logprob"] for r in other)
    # a folder written before --passkey-prompt and --layers existed resumes under their defaults, not another
    stamp = json.loads((train / "shared-settings.json").read_text())
    del stamp["settings"]["passkey_prompt"], stamp["settings"]["layers"]
    (train / "shared-settings.json").write_text(json.dumps(stamp))
    assert main([*argv[:-3], "--split", "train", "--seed", "1", "--out", str(train)]) == 0
    capsys.readouterr()
    assert len((train / shared.FILE).read_text().splitlines()) == 4
    (train / "shared-settings.json").write_text(json.dumps(stamp))
    assert main([*argv[:-3], "--split", "train", "--seed", "1", "--passkey-prompt", "colon", "--out", str(train)]) == 2
    assert "holds a shared-prefill run with other settings" in capsys.readouterr().err
    assert main([*argv[:-3], "--passkey-prompt", "loud", "--out", str(tmp_path / "o3")]) == 2
    assert "passkey prompt 'loud' is unknown: choose from cue, colon, number, important" in capsys.readouterr().err


def test_the_report_combines_runs_and_chooses_each_shares_plan_on_disjoint_cases(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/shared_report.py on tiny runs: the evaluation run's cells, its own throughput and threads, and per
    share of full KV heads the plan that answers best on the training-split run (accuracy, then mean answer
    log-likelihood), against the training run's own lines."""
    import sys

    from multihead.cache import HeadPlan
    from multihead.cli import main
    from tiny_checkpoints import write_tiny_gguf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import shared_report

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", context=512)
    text = tmp_path / "text.txt"
    text.write_text(_prose(3000, seed=4))
    plans = []
    for name, full in (("early", ((True, False), (False, False))), ("late", ((False, False), (False, True)))):
        plan = HeadPlan(full=full, sinks=2, window=24, model="tiny", shape=(2, 4, 2, 4), method=name)
        plans += ["--plan", str(plan.save(tmp_path / f"tiny-{name}-plan.json"))]
    base = ["tradeoff", "--long", "--protocol", "shared", "--model", str(gguf), "--text", str(text), "--lengths",
            "300", "--tasks", "passkey,single-number", "--prompts", "2", "--keep", "0.5", "--window-keep", "none",
            "--bits", "4", "--group", "4", *plans, "--no-mqa", "--prune", "none", "--json"]
    assert main([*base, "--out", str(tmp_path / "eval")]) == 0
    assert main([*base, "--split", "train", "--seed", "1", "--out", str(tmp_path / "train")]) == 0
    capsys.readouterr()
    out = tmp_path / "report.json"
    assert shared_report.main(["--runs", str(tmp_path / "eval"), "--choose-on", str(tmp_path / "train"),
                               "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["cases"] == 4 and report["runs"][0]["threads_per_case"] == {str(torch.get_num_threads()): 4}
    train = [json.loads(x) for x in (tmp_path / "train" / shared.FILE).read_text().splitlines()]

    def merit(name: str) -> tuple[float, float]:
        answers = [r["methods"][name] for r in train]
        return (sum(a["correct"] for a in answers) / 4, sum(a["answer_logprob"] for a in answers) / 4)

    best = max(["head-wise tiny-early", "head-wise tiny-late"], key=merit)
    assert report["choice"]["by_full_share"]["0.25"]["chosen"] == best
    assert "chosen at 25% full KV heads" in out.with_suffix(".txt").read_text()
    # a plan added later, in a run of its own on the same cases, is ranked with the others
    for name, plan in (("early", plans[:2]), ("late", plans[2:])):
        alone = [*base[:base.index("--plan")], *plan, *base[base.index("--plan") + 4:]]
        assert main([*alone, "--split", "train", "--seed", "1", "--out", str(tmp_path / f"train-{name}")]) == 0
    capsys.readouterr()
    both = shared_report.choose([tmp_path / "train-early", tmp_path / "train-late"])
    assert both["cases"] == 4 and both["by_full_share"]["0.25"]["chosen"] == best
    assert both["by_full_share"] == shared_report.choose(tmp_path / "train")["by_full_share"]
    cell = report["cells"]["300|all tasks"]["methods"]
    assert cell["head-wise tiny-early"]["vs_control"]["control"] == "4 sinks + window = bytes of 25% full, 2 + 24"
    # the two plans of one share, against each other on the evaluation's cases, counted from its own lines
    evaluated = [json.loads(x) for x in (tmp_path / "eval" / shared.FILE).read_text().splitlines()]
    [pair] = report["plan_pairs"]["0.25"]
    assert (pair["a"], pair["b"]) == ("head-wise tiny-early", "head-wise tiny-late")
    for scope, task in (("all tasks", None), ("passkey", "passkey"), ("single-number", "single-number")):
        rows = [r["methods"] for r in evaluated if task in (None, r["task"])]
        a = [m["head-wise tiny-early"]["correct"] for m in rows]
        b = [m["head-wise tiny-late"]["correct"] for m in rows]
        assert pair[scope] == {"cases": len(rows), "a_correct": sum(a), "b_correct": sum(b),
                               "a_only": sum(x and not y for x, y in zip(a, b, strict=True)),
                               "b_only": sum(y and not x for x, y in zip(a, b, strict=True)),
                               "p_value": mcnemar(a, b)["p_value"]}
    assert "plans at 25% full KV heads against each other" in out.with_suffix(".txt").read_text()


def test_the_cases_of_one_prompt_share_its_prefill_and_answer_as_alone(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """multikey's keys (one context, other questions): one prefill a prompt, each case's answers those of its own
    prefill; the throughput counts each prefill once; the prompt's cases stay together when cells take turns."""
    from multihead.evals.text import read_text, token_splits

    model = _tiny(max_context=1024, vocab=len(CHARS))
    text = tmp_path / "text.txt"
    text.write_text(_prose(1400, seed=4))
    settings = lc.Settings(lengths=(500,), tasks=("passkey", "multikey"), prompts=2, keys=3, sinks=2)
    cases = lc.make_cases(settings, TOK, token_splits(TOK.encode(read_text(str(text)))).test, max_context=1024)
    order = shared.interleaved(cases)
    assert [c.task for c in order] == ["passkey", "multikey", "multikey", "multikey"] * 2
    prefills: list[int] = []
    real = shared.prefill_full

    def counted(model: Any, ids: Any, room: int, chunk: int) -> Any:
        prefills.append(len(ids))
        return real(model, ids, room, chunk)

    monkeypatch.setattr(shared, "prefill_full", counted)
    records = shared.run_shared(model, cases, METHODS, out=tmp_path / "run", chunk=96, progress=False)
    assert len(prefills) == 4  # two passkey prompts, two multikey prompts of three keys each
    alone = {c.id: shared.answer_case(model, c, METHODS, 96) for c in cases}
    for r in records:
        for name, got in r["methods"].items():
            want = alone[r["id"]]["methods"][name]
            assert (got["correct"], got["greedy_ids"], got["cache_bytes"]) == (
                want["correct"], want["greedy_ids"], want["cache_bytes"])
            assert got["answer_logprob"] == pytest.approx(want["answer_logprob"], abs=1e-5)
    assert sum(r["prefill_shared"] for r in records) == 4  # the second and third keys of each multikey prompt
    out = shared.summary(records, METHODS)
    assert out["throughput"]["prefill_seconds_per_case"] == pytest.approx(
        sum(r["prefill_seconds"] for r in records if not r["prefill_shared"]) / 8)
