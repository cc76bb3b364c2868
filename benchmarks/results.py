"""Print a benchmark's table and, with --record, append it to benchmarks/RESULTS.md (shared by the scripts here)."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def publish(text: str, record: bool) -> None:
    print(text)
    if record:
        with open(RESULTS, "a", encoding="utf-8") as f:
            f.write("\n" + text)
