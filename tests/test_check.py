"""multihead check: passes on a correct layer, fails (exit 1) on a broken kernel, refuses bad arguments (exit 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from multihead import kernels
from multihead.cli import main
from multihead.verify import check
from multihead.verify.check import run_checks


def test_every_check_passes_here(capsys: pytest.CaptureFixture[str]) -> None:
    # flex compiles a kernel per shape (minutes for the whole harness on 2 cores): its outputs are tested against
    # the oracle in test_flex.py, and its empty-row check below
    assert main(["check", "--dtype", "float32,bfloat16", "--backend", "sdpa,math", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] and len(data["results"]) == 2 * 2 * 4
    assert {r["check"] for r in data["results"]} == {"2x rule", "empty rows", "cache", "deterministic"}


def test_the_flex_backend_is_checked_too() -> None:
    (result,) = run_checks(dtypes=["float32"], backends=("flex",), checks=("empty rows",))
    assert result.passed and result.backend == "flex" and "no NaN" in result.detail


def test_a_broken_kernel_fails_the_harness(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    real = kernels.sdpa_attention

    def noisy(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        return out + 1e-3 * torch.rand_like(out)  # wrong, and different on every call

    monkeypatch.setattr(kernels, "sdpa_attention", noisy)
    results = {(r.check, r.backend): r.passed for r in run_checks(dtypes=["float32"], backends=("sdpa", "math"))}
    assert not results[("2x rule", "sdpa")] and not results[("deterministic", "sdpa")]
    assert results[("2x rule", "math")]
    assert main(["check", "--dtype", "float32", "--backend", "sdpa"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_2x_rule_fails_a_kernel_with_3x_the_plain_error(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose error is exactly k times plain math's, case by case: 1.5x passes, 3x fails (in float32 the old
    fixed floor of 1e-6 let such a kernel through)."""
    real = check._case
    for factor, passes in ((1.5, True), (3.0, False)):
        def scaled(*args, factor=factor):  # type: ignore[no-untyped-def]
            want, _, plain = real(*args)
            return want, want + factor * (plain - want), plain

        monkeypatch.setattr(check, "_case", scaled)
        (result,) = run_checks(dtypes=[dtype], backends=("sdpa",), checks=("2x rule",))
        assert result.passed == passes, result.detail
    want, _, plain = real("sdpa", torch.float32, "cpu", 8, "none")
    err = float(np.abs(plain - want).max())
    assert 3 * err < 2 * err + 1e-6  # what the fixed floor allowed
    assert not check.two_x_rule(3 * err, err, float(np.abs(want).max()), torch.float32)


@pytest.mark.parametrize(("argv", "message"), [
    (["check", "--dtype", "float8"], "dtype 'float8' is unknown"),
    (["check", "--device", "tpu"], "device 'tpu' is not supported"),
    (["check", "--backend", "cudnn"], "backend 'cudnn' is unknown: choose from sdpa, math, flex"),
])
def test_bad_check_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no GPU")
def test_cuda_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--device", "cuda"]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err
