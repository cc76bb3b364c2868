"""SmolLM2 greedy decoding, batch 1: this checkout against another git revision, in one process, alternating.

    .venv/bin/python benchmarks/ab_decode.py --base REV [--new-tokens 128] [--rounds 5] [--compile] [--record]

The package at ``--base`` is exported with ``git archive`` into a temporary folder and its imports renamed to
``multihead_base``, so the two versions load side by side in one process on the same weights; each round times the
current version and the base one, each round starting with the other side (eager, and with ``--compile`` the
compiled decoding step of each), and the ratio
of medians is new tok/s over base tok/s (above 1: the current checkout is faster).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import io
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench
import torch
from results import publish

ROOT = Path(__file__).resolve().parents[1]


def export(rev: str, into: Path) -> str:
    """Write the package at ``rev`` to ``into/multihead_base`` with its imports renamed; return the short hash."""
    short = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True,
                           text=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src/multihead"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "src" / "multihead").rename(into / "multihead_base")
    for path in (into / "multihead_base").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        text = re.sub(r"\b(from|import) multihead\b", r"\1 multihead_base", text)
        # module names in strings too (the lazy loaders' import_module(f"multihead.{name}")): without this the
        # base's lazily loaded names (multihead_base.MultiHeadAttention, its KVCache) came from this checkout
        text = re.sub(r"(?<=[\"'])multihead\.", "multihead_base.", text)
        # its torch operators in a namespace of their own: one process cannot define multihead::x twice
        for old, new in (('"multihead::', '"multihead_base::'), ('Library("multihead"', 'Library("multihead_base"'),
                         ("torch.ops.multihead.", "torch.ops.multihead_base."),
                         ('NAMESPACE = "multihead"', 'NAMESPACE = "multihead_base"')):
            text = text.replace(old, new)
        path.write_text(text, encoding="utf-8")
    if (into / "multihead_base" / "kernels" / "native" / "ops.cpp").exists():
        # a tree whose kernels are a PyTorch extension: its operators' namespace is compiled in, so its library is
        # built for the renamed namespace (once; the file is named by a hash that includes it)
        subprocess.run([sys.executable, "-c", "from multihead_base.kernels import native; "
                        "import sys; why = native.build_now(); sys.exit(0 if why is None else why)"],
                       check=True, cwd=into, env={**os.environ, "PYTHONPATH": str(into)})
    return short


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time each version's compiled decoding step")
    parser.add_argument("--record", action="store_true", help="append the results to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    tmp = Path(tempfile.mkdtemp(prefix="multihead-ab-"))
    base_rev = export(args.base, tmp)
    sys.path.insert(0, str(tmp))
    head_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src"], capture_output=True,
                                text=True).stdout.strip())
    versions: dict[str, Any] = {
        "new": (importlib.import_module("multihead.models"), importlib.import_module("multihead.models.generate")),
        "base": (importlib.import_module("multihead_base.models"),
                 importlib.import_module("multihead_base.models.generate")),
    }
    lines, notes = [], []
    for dtype in (torch.float32, torch.bfloat16):
        runs: dict[str, Callable[[], int]] = {}
        prompt: list[int] = []
        for name, (models, generate) in versions.items():
            model, tok = models.load_llama(dtype=dtype)
            prompt = tok.encode("Once upon a time, in a land far away, there lived")
            runs[f"{name} eager"] = (lambda m=model, g=generate, p=prompt: sum(
                1 for _ in g.generate_ids(m, [p], max_new_tokens=args.new_tokens)))
            if args.compile:
                runs[f"{name} compiled"] = (lambda m=model, g=generate, p=prompt: sum(
                    1 for _ in g.generate_ids(m, [p], max_new_tokens=args.new_tokens, compile=True)))
                t = time.perf_counter()
                runs[f"{name} compiled"]()
                took = time.perf_counter() - t
                notes.append(f"{str(dtype).removeprefix('torch.')} {name}: compiling took {took:.0f} s")
        speeds: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(args.rounds):
            order = list(runs.items())
            # the side timed first measured up to 3-8% slower here: each round starts with the other side
            for name, run in (order if r % 2 == 0 else order[::-1]):
                t = time.perf_counter()
                n = run()
                speeds[name].append(n / (time.perf_counter() - t))
        for mode in ("eager", "compiled") if args.compile else ("eager",):
            new, base = statistics.median(speeds[f"new {mode}"]), statistics.median(speeds[f"base {mode}"])
            lines.append(f"| {str(dtype).removeprefix('torch.')} | {mode} | {new:.1f} | {base:.1f} | "
                         f"{new / base:.3f} |")
    text = "\n".join([
        f"### SmolLM2-135M greedy decode, {head_rev}{' + uncommitted' if dirty else ''} against {base_rev} "
        f"({datetime.date.today()})",
        f"machine: {bench.machine()}, torch {torch.__version__}; batch 1, {args.new_tokens} new tokens; one process, "
        f"median of {args.rounds} alternating rounds (benchmarks/ab_decode.py --base {args.base})",
        *notes,
        "",
        "| dtype | step | new tok/s | base tok/s | new / base |",
        "|---|---|---|---|---|",
        *lines,
    ]) + "\n"
    publish(text, args.record)


if __name__ == "__main__":
    main()
