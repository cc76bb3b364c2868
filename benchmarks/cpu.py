"""CPU benchmarks of issue 6 (P1-P5), float32: multihead against its anchors, side by side in one process
(``benchmarks/bench.py``; ``make bench`` runs this).

    .venv/bin/python benchmarks/cpu.py [--repeats 5] [--only P1,P4] [--record]

``--record`` appends the table to benchmarks/RESULTS.md with the machine, torch version and date.
"""

from __future__ import annotations

import argparse
import datetime
import os

import bench
import torch
from results import publish


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default=",".join(bench.CPU_BENCHMARKS))
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    names = tuple(n.strip().upper() for n in args.only.split(","))
    results = bench.run_cpu(args.repeats, names)
    text = "\n".join([
        f"### CPU benchmarks {', '.join(names)} ({datetime.date.today()})",
        bench.header("float32", args.repeats) + f" (P3: {args.repeats * 20})",
        "",
        bench.table(results),
    ]) + "\n"
    publish(text, args.record)


if __name__ == "__main__":
    main()
