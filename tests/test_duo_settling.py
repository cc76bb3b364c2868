"""benchmarks/duo_settling.py: how far a gate run's snapshots are from its last, read as the plans they make."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from multihead import MultiheadError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import duo_settling as ds


def _snap(tmp_path: Path, step: int, gates: np.ndarray) -> Path:
    p = tmp_path / f"step-{step}.json"
    p.write_text(json.dumps({"step": step, "gates": gates.tolist()}), encoding="utf-8")
    return p


def test_each_snapshot_is_read_against_the_last_as_the_plans_it_would_make(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    last = rng.random((6, 2))  # 12 KV heads, distinct gates
    last[0, 0], last[1, 1], last[2, 0] = 0.0, 1.0, 0.9995  # two settled at 1 (within 0.001), one at 0
    earlier = last.copy()
    earlier[[3, 4], [0, 1]] = earlier[[4, 3], [1, 0]]  # two heads swap places: a plan may change
    paths = [_snap(tmp_path, 40, last), _snap(tmp_path, 20, earlier)]  # out of order on purpose
    result = ds.settling([ds.read_snapshot(p) for p in paths], [0.25, 0.5])
    assert [r["step"] for r in result["snapshots"]] == [20, 40] and result["last_step"] == 40
    first, final = result["snapshots"]
    assert (final["at_0"], final["at_1"], final["spearman_with_last"]) == (1, 2, pytest.approx(1.0))
    for budget in (0.25, 0.5):
        k = round(12 * budget)  # the top k gates, the plans' rule (independent of HeadPlan here)
        top = {divmod(int(i), 2) for i in np.argsort(-last, axis=None)[:k]}
        top_before = {divmod(int(i), 2) for i in np.argsort(-earlier, axis=None)[:k]}
        assert ds.full_heads(last, budget) == top
        assert (first[f"full_{budget:g}"], first[f"same_full_{budget:g}"]) == (k, len(top & top_before))
    ranks = [np.argsort(np.argsort(x.ravel())) for x in (earlier, last)]
    assert first["spearman_with_last"] == pytest.approx(np.corrcoef(*ranks)[0, 1])
    assert "20 | " in ds.table(result)


def test_snapshots_of_different_runs_or_broken_files_are_refused(tmp_path: Path) -> None:
    a = ds.read_snapshot(_snap(tmp_path, 2, np.zeros((3, 2))))
    with pytest.raises(MultiheadError, match=r"different shapes \[\(3, 2\), \(4, 2\)\]: not one run"):
        ds.settling([a, (4, np.zeros((4, 2)))], [0.5])
    with pytest.raises(MultiheadError, match=r"two snapshots of the same step in \[2, 2\]"):
        ds.settling([a, a], [0.5])
    bad = tmp_path / "bad.json"
    bad.write_text('{"step": 3}', encoding="utf-8")
    with pytest.raises(MultiheadError, match=r"bad.json: not a gates.json snapshot \(step and gates\)"):
        ds.read_snapshot(bad)
    assert ds.main([str(bad)]) == 2
    assert ds.main([str(_snap(tmp_path, 2, np.zeros((3, 2)))), "--budget", "1.5"]) == 2


def test_the_halves_after_a_step_are_averaged_apart_and_their_plans_compared() -> None:
    rng = np.random.default_rng(5)
    centre = rng.random((4, 3))
    snaps = [(s, np.clip(centre + rng.normal(0, 0.05, centre.shape), 0, 1)) for s in range(2, 42, 2)]
    h = ds.halves(snaps, [0.25, 0.5], after=20)
    later = [g for s, g in snaps if s > 20]  # steps 22-40: 10 snapshots, 5 a half
    assert (h["first"], h["second"]) == ({"snapshots": 5, "steps": [22, 30]}, {"snapshots": 5, "steps": [32, 40]})
    for b in (0.25, 0.5):
        a, c = ds.full_heads(np.mean(later[:5], axis=0), b), ds.full_heads(np.mean(later[5:], axis=0), b)
        assert h[f"same_full_{b:g}"] == {"shared": len(a & c), "of": len(a)}
    with pytest.raises(MultiheadError, match=r"1 snapshot\(s\) after step 38: two halves need at least 2"):
        ds.halves(snaps, [0.5], after=38)


def test_the_command_writes_the_table_and_the_halves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(6)
    paths = [_snap(tmp_path, s, rng.random((4, 3))) for s in (2, 4, 6, 8)]
    out = tmp_path / "settling.json"
    assert ds.main([*map(str, paths), "--halves-after", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mean gates of steps 4-4 (1 snapshots) against 6-8 (2)" in printed
    saved = json.loads(out.read_text())
    assert saved["halves"]["after"] == 2 and [r["step"] for r in saved["snapshots"]] == [2, 4, 6, 8]
