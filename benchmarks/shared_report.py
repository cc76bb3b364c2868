"""One report of several shared-prefill runs on the same cases (issue 39): the JSON and table of docs/experiments.

    .venv/bin/python benchmarks/shared_report.py --runs out/runs/shared-4k [out/runs/more-methods ...] \
        [--choose-on out/runs/train-4k] [--kvpress out/kvpress/shared-4k.json] \
        --out docs/experiments/long-context-shared-4k.json

Each run is the --out folder of ``multihead tradeoff --long --protocol shared``. The runs are combined case by case
(:func:`multihead.tradeoff.longctx.shared.combine`: the cases every run answered, each with every run's methods; a
method two runs share keeps the first run's answer and the agreement is reported), then summarised
(:func:`~multihead.tradeoff.longctx.shared.summary`: per cell and pooled over tasks, Wilson intervals, each method
against the full cache and each head plan against the uniform sinks + window of its bytes, McNemar's exact test and
the paired bootstrap interval of the difference). Each run's own throughput (cases an hour, its methods, its
threads) is reported beside it, never the combined one's.

``--choose-on`` names a run on cases disjoint from the evaluation's (``--split train --seed 1``): per share of full
KV heads, the plan with the highest accuracy there over every task and length is the chosen one (ties: the higher
mean answer log-likelihood), and the report says which. ``--kvpress`` adds kvpress's presses on the same cases
(``benchmarks/kvpress_longctx.py compare_shared``). ``--streaming`` sets a streaming-protocol run
(``tradeoff --long --protocol streaming``: each method prefills through its own cache) beside the shared answers:
per method of the same name, on the cases both answered, each protocol's correct count, how often they agree and
McNemar's p of the difference. Plans of the same share of full KV heads are also tested against each other
(``plan_pairs``: every pair, pooled over tasks and per task, McNemar's exact test on the same cases): the report
says which head choice is better at a budget only where that test separates them.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from datetime import date
from pathlib import Path
from typing import Any

from multihead.errors import MultiheadError
from multihead.tradeoff.longctx import shared
from multihead.tradeoff.longctx.methods import Method, load_plan


def run_facts(folder: Path) -> dict[str, Any]:
    """What one run was: its settings stamp, cases, torch threads per case and its own throughput."""
    records = list(shared.finished(folder / shared.FILE).values())
    methods = shared.methods_of(folder)
    stamp = json.loads((folder / "shared-settings.json").read_text(encoding="utf-8"))
    threads: dict[str, int] = {}
    for r in records:
        key = str(r.get("threads", "not recorded"))
        threads[key] = threads.get(key, 0) + 1
    return {"folder": str(folder), "settings": stamp, "cases": len(records), "methods": [m.name for m in methods],
            "threads_per_case": threads,
            "throughput": shared.summary(records, methods)["throughput"] if records else None}


def plans_by_share(methods: list[Method]) -> dict[str, list[Method]]:
    """The head plans among ``methods`` by the share of KV heads they keep full (two decimals: "0.24", "0.50")."""
    out: dict[str, list[Method]] = {}
    for m in methods:
        if m.plan is not None:
            out.setdefault(f"{load_plan(m.plan).full_fraction:.2f}", []).append(m)
    return out


def choose(folders: Path | list[Path]) -> dict[str, Any]:
    """Per share of full KV heads, the plan that answers best on the run in ``folders`` (every task and length), or
    on several runs of the same cases (plans added later in a run of their own), over the cases all of them
    answered (:func:`multihead.tradeoff.longctx.shared.combine`)."""
    runs = folders if isinstance(folders, list) else [folders]
    records, methods, _ = shared.combine(runs)
    if not records:
        raise MultiheadError(f"{', '.join(map(str, runs))}: no case answered by every run to choose a plan on")
    by_share: dict[str, list[tuple[float, float, str, str]]] = {}
    for share, plans in plans_by_share(methods).items():
        for m in plans:
            answers = [r["methods"][m.name] for r in records]
            accuracy = sum(bool(a["correct"]) for a in answers) / len(answers)
            logp = statistics.fmean(a["answer_logprob"] for a in answers)
            by_share.setdefault(share, []).append((accuracy, logp, m.name, str(m.plan)))
    out = {}
    for share, plans in sorted(by_share.items()):
        ranked = sorted(plans, reverse=True)
        out[share] = {"chosen": ranked[0][2], "plan": ranked[0][3],
                      "ranking": [{"method": n, "accuracy": a, "mean_answer_logprob": lp} for a, lp, n, _ in ranked]}
    return {"folder": ", ".join(map(str, runs)), "cases": len(records), "by_full_share": out}


def plan_pairs(records: list[dict[str, Any]], methods: list[Method]) -> dict[str, list[dict[str, Any]]]:
    """Per share of full KV heads (two decimals), every pair of plans of that share on the same ``records``: for all
    tasks together and for each task (pooled over lengths), the cases, each plan's correct count, the cases only one
    of them got right and McNemar's exact p."""
    from multihead.tradeoff.longctx.stats import mcnemar

    scopes = ["all tasks", *sorted({str(r["task"]) for r in records})]
    out: dict[str, list[dict[str, Any]]] = {}
    for share, plans in sorted(plans_by_share(methods).items()):
        names = [m.name for m in plans]
        pairs = []
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                pair: dict[str, Any] = {"a": a, "b": b}
                for scope in scopes:
                    rows = [r for r in records if scope == "all tasks" or r["task"] == scope]
                    x = [bool(r["methods"][a]["correct"]) for r in rows]
                    y = [bool(r["methods"][b]["correct"]) for r in rows]
                    test = mcnemar(x, y)
                    pair[scope] = {"cases": len(rows), "a_correct": sum(x), "b_correct": sum(y),
                                   "a_only": test["reference_only"], "b_only": test["other_only"],
                                   "p_value": test["p_value"]}
                pairs.append(pair)
        if pairs:
            out[share] = pairs
    return out


def streaming_beside(folder: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    """A streaming run's answers (``folder/results/<method>/<prompt id>.json``) beside the shared ``records``, by
    method name, on the cases both answered."""
    from multihead.tradeoff.longctx.runner import saved_answers
    from multihead.tradeoff.longctx.stats import mcnemar

    streamed: dict[str, dict[str, bool]] = {}
    for a in saved_answers(folder):
        streamed.setdefault(str(a["method"]), {})[str(a["id"])] = bool(a["correct"])
    by_id = {r["id"]: r for r in records}
    out: dict[str, Any] = {}
    for name, answers in streamed.items():
        ids = [i for i in answers if i in by_id and name in by_id[i]["methods"]]
        if not ids:
            continue
        shared_ok = [bool(by_id[i]["methods"][name]["correct"]) for i in ids]
        streaming_ok = [answers[i] for i in ids]
        test = mcnemar(shared_ok, streaming_ok)
        out[name] = {"cases": len(ids), "shared_correct": sum(shared_ok), "streaming_correct": sum(streaming_ok),
                     "same": sum(a == b for a, b in zip(shared_ok, streaming_ok, strict=True)),
                     "shared_only": test["reference_only"], "streaming_only": test["other_only"],
                     "p_value": test["p_value"]}
    if not out:
        raise MultiheadError(f"{folder} shares no (method, case) with the shared runs")
    return {"folder": str(folder), "methods": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="+", required=True, help="shared-prefill run folders on the same cases")
    p.add_argument("--choose-on", nargs="+", help="a run on cases disjoint from the evaluation's, to choose each "
                   "share's plan (or several runs of those same cases, their plans ranked together)")
    p.add_argument("--kvpress", nargs="*", default=[], help="kvpress_longctx.py results on the same cases")
    p.add_argument("--streaming", help="a streaming-protocol run on the same cases, set beside the shared answers")
    p.add_argument("--out", required=True, help="the report's JSON (its table beside it as .txt)")
    args = p.parse_args(argv)
    try:
        records, methods, agreement = shared.combine([Path(f) for f in args.runs])
        if not records:
            raise MultiheadError(f"the runs {args.runs} have no case in common")
        result = shared.summary(records, methods, controls=shared.controls_of(methods))
        result.pop("throughput")  # each run's own, below
        result["plan_pairs"] = plan_pairs(records, methods)
        result.update(runs=[run_facts(Path(f)) for f in args.runs], agreement=agreement,
                      methods=[{"name": m.name, "series": m.series, "plan": m.plan, "keep": m.keep, "bits": m.bits,
                                "equal_to": m.equal_to} for m in methods],
                      machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
                      date=date.today().isoformat())
        if args.choose_on:
            result["choice"] = choose([Path(f) for f in args.choose_on])
        if args.streaming:
            result["streaming"] = streaming_beside(Path(args.streaming), records)
        if args.kvpress:
            sys.path.insert(0, str(Path(__file__).parent))
            import kvpress_longctx as kv

            data = kv.read_results(args.kvpress)
            result["kvpress"] = kv.compare_shared(data, records, result["methods"])
    except MultiheadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


def table(result: dict[str, Any]) -> str:
    lines = [shared.table({**result, "throughput": {"cases_per_hour": None}}).split("\n", 2)[2].lstrip("\n")]
    lines.insert(0, f"{result['protocol']}\n{result['cases']:,} cases answered by every run")
    for run in result["runs"]:
        t = run["throughput"] or {}
        lines.append(f"run {run['folder']}: {run['cases']} cases, {len(run['methods'])} methods, threads "
                     f"{run['threads_per_case']}, {t.get('cases_per_hour') or 0:,.0f} cases an hour "
                     f"(prefill {t.get('prefill_seconds_per_case') or 0:.1f} s a case)")
    for name, a in result["agreement"].items():
        lines.append(f"{name}: right or wrong alike in {a['same']} of {a['cases']} cases across runs (right in the "
                     f"first run only: {a.get('first_only', '-')}, in another only: {a.get('other_only', '-')})")
    if "streaming" in result:
        lines.append(f"\nthe streaming protocol ({result['streaming']['folder']}: each method prefills through its "
                     "own cache) beside the shared prefill, on the cases both answered")
        for name, m in result["streaming"]["methods"].items():
            lines.append(f"  {name:<46} {m['cases']:>4} cases  shared {m['shared_correct']:>4}  streaming "
                         f"{m['streaming_correct']:>4}  alike {m['same']:>4}  McNemar p {m['p_value']:.2g}")
    for share, pairs in result.get("plan_pairs", {}).items():
        lines.append(f"\nplans at {float(share):.0%} full KV heads against each other (correct; right only in one; "
                     "McNemar p)")
        for pair in pairs:
            cells = [f"{scope} {c['a_correct']}/{c['b_correct']} of {c['cases']}, {c['a_only']}/{c['b_only']} "
                     f"p {c['p_value']:.2g}" for scope, c in pair.items() if scope not in ("a", "b")]
            lines.append(f"  {pair['a']} vs {pair['b']}: " + "; ".join(cells))
    for share, c in result.get("choice", {}).get("by_full_share", {}).items():
        ranking = ", ".join(f"{x['method']} {x['accuracy']:.1%}" for x in c["ranking"])
        lines.append(f"chosen at {float(share):.0%} full KV heads on {result['choice']['folder']}: {c['chosen']} "
                     f"({ranking})")
    if "kvpress" in result:
        import kvpress_longctx as kv

        lines.append("\nkvpress on the same cases\n" + kv.compare_shared_table(result["kvpress"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
