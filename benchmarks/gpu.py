"""GPU benchmarks of issue 6 (G1-G4), bfloat16, one run under 5 minutes on one GPU.

First G1-G4 (``bench.run_gpu``) and P4 on the GPU (peak memory of a 16k-token forward, exact from the
CUDA allocator), each row printed as it completes; then the correctness harness on the GPU (``multihead check
--device cuda``: SDPA and math in float32, float16 and bfloat16; flex, which compiles a Triton kernel per shape, in
bfloat16). Prints the table last and writes everything as JSON:

    python benchmarks/gpu.py [--repeats 20] [--json gpu-results.json] [--skip-checks]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time

import bench
import torch

from multihead.verify.check import run_checks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default="gpu-results.json", help="where to write the results")
    parser.add_argument("--skip-checks", action="store_true", help="benchmarks only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs CUDA: torch.cuda.is_available() is False here")
    start = time.perf_counter()
    results = []
    for name in bench.GPU_BENCHMARKS:
        try:
            results += bench.run_gpu(args.repeats, (name,))
        except Exception as e:  # one failing benchmark must not hide the others' figures
            results.append(bench.Result(name, "failed", "-", "-", "-", f"{type(e).__name__}: {e}"[:200], "-", False))
        print(bench.table(results[-1:]), flush=True)
    results.append(bench.p4(device="cuda", dtype=torch.bfloat16))
    print(bench.table(results[-1:]), flush=True)
    checks = []
    if not args.skip_checks:
        checks = run_checks(device="cuda", dtypes=["float32", "float16", "bfloat16"], backends=("sdpa", "math"))
        checks += run_checks(device="cuda", dtypes=["bfloat16"], backends=("flex",))
    failed = [c for c in checks if not c.passed]
    for c in checks:
        print(f"{'ok  ' if c.passed else 'FAIL'} {c.dtype:<9} {c.backend:<5} {c.check:<14} {c.detail}", flush=True)
    seconds = time.perf_counter() - start
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"date": str(datetime.date.today()), "machine": bench.machine(), "torch": torch.__version__,
                   "seconds": seconds, "checks_failed": len(failed),
                   "checks": [dataclasses.asdict(c) for c in checks], "results": bench.as_dicts(results)}, f,
                  indent=1)
    print(f"\n{len(checks) - len(failed)} of {len(checks)} checks passed; {seconds:.0f} s")
    print(bench.header("bfloat16", args.repeats))
    print(bench.table(results))


if __name__ == "__main__":
    main()
