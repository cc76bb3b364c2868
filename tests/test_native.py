"""multihead.native: the C kernels built on first use, their one-row bfloat16 product against float64, and what
happens without them (no compiler, a failed build, turned off)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from multihead import cpu, native
from multihead.linear import Linear, linear


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest error of a bfloat16 result in units of bfloat16's spacing at the exact value (float64)."""
    spacing = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(2.0**-126))) - 7)
    return ((got.double() - exact).abs() / spacing).max().item()


def test_the_kernels_build_here() -> None:
    """This machine (and CI's, the same kind) has a C compiler: the kernels must build, vectorised where the CPU has
    AVX512-BF16, so the speed path is really tested here and not only its fallback."""
    assert native.unavailable() is None
    assert native.library() is not None
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert native.vectorised() == (" avx512_bf16" in flags)


@pytest.mark.parametrize(("out", "inp"), [(1536, 576), (576, 1536), (7, 33), (5, 31), (4, 32), (1, 1), (3, 100)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_bf16_is_the_product_rounded_once(out: int, inp: int, bias: bool, threads: int) -> None:
    """Each output within one bfloat16 step of the float64 product of the same bfloat16 values (the float32 sum is
    rounded once to nearest); tails of rows (out % 4) and of columns (in % 32) included."""
    w = torch.randn(out, inp).bfloat16()
    x = torch.randn(1, 1, inp).bfloat16()
    b = torch.randn(out).bfloat16() if bias else None
    got = native.gemv_bf16(x, w, b, threads)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (1, 1, out) and got.is_contiguous()
    assert _ulps(got, exact) <= 1.0
    assert _ulps(F.linear(x, w, b), exact) <= 1.0  # the same bound holds for PyTorch's own product


def test_gemv_bf16_reads_rows_of_any_stride_and_carries_inf_and_nan() -> None:
    big = torch.randn(64, 200).bfloat16()
    w = big[:, :130]  # rows 200 apart
    x = torch.randn(130).bfloat16()
    assert _ulps(native.gemv_bf16(x, w), F.linear(x.double(), w.double())) <= 1.0
    w = torch.randn(8, 40).bfloat16()
    w[1, 3], w[2, 5] = float("inf"), float("nan")
    got = native.gemv_bf16(torch.ones(40).bfloat16(), w)
    assert got[1].item() == float("inf") and torch.isnan(got[2]) and torch.isfinite(got[[0, 3, 4, 5, 6, 7]]).all()


def test_gemv_bf16_names_what_does_not_fit() -> None:
    w = torch.randn(8, 16).bfloat16()
    x = torch.randn(1, 16).bfloat16()
    with pytest.raises(ValueError, match=r"dtypes torch.float32 and torch.bfloat16"):
        native.gemv_bf16(x.float(), w)
    with pytest.raises(ValueError, match=r"x of shape \(2, 16\) \(one contiguous row of 16\)"):
        native.gemv_bf16(torch.randn(2, 16).bfloat16(), w)
    with pytest.raises(ValueError, match=r"x of shape \(1, 15\)"):
        native.gemv_bf16(x[:, :15], w)
    with pytest.raises(ValueError, match=r"weight of shape \(8, 16\) and strides \(1, 8\)"):
        native.gemv_bf16(x, torch.randn(16, 8).bfloat16().t())
    with pytest.raises(ValueError, match=r"bias of shape \(7,\)"):
        native.gemv_bf16(x, w, torch.randn(7).bfloat16())


def test_linear_takes_the_native_kind_only_where_it_computes_the_same_thing() -> None:
    """Forced "native": one bfloat16 row runs the kernel (no aten product seen), within a step of float64; with
    autograd on, a strided row, or float32, it is PyTorch's product."""
    from tests_support import aten_ops

    layer = Linear(576, 1536, bias=False, dtype=torch.bfloat16)
    x = torch.randn(1, 576).bfloat16()
    exact = F.linear(x.double(), layer.weight.double())
    cpu.force_product("native")
    try:
        with torch.no_grad(), aten_ops() as ops:
            got = layer(x)
        assert not {"mm.default", "addmm.default", "bmm.default", "mv.default"} & set(ops.names)
        assert _ulps(got, exact) <= 1.0
        y = layer(x.requires_grad_())  # autograd: F.linear, and the gradient flows
        assert y.grad_fn is not None
        y.sum().backward()
        assert layer.weight.grad is not None and x.grad is not None
        strided = torch.randn(1, 1152).bfloat16()[:, ::2]
        with torch.no_grad():
            assert torch.equal(linear(strided, layer.weight), F.linear(strided, layer.weight))
            w32 = layer.weight.float()
            assert torch.equal(linear(x.detach().float(), w32), F.linear(x.detach().float(), w32))
    finally:
        cpu.force_product(None)


def test_measured_bfloat16_rows_try_the_native_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Left to measure, a bfloat16 row times the native kernel beside PyTorch's kinds; every call agrees."""
    calls = []
    kernel = native.gemv_bf16
    monkeypatch.setattr(native, "gemv_bf16", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    cpu.force_product(None)
    cpu.forget_measured()
    cpu.pin_spare_cores(64.0)
    try:
        layer = Linear(576, 1536, bias=False, dtype=torch.bfloat16)
        x = torch.randn(1, 576).bfloat16()
        exact = F.linear(x.double(), layer.weight.double())
        key = (1536, 576, torch.bfloat16, 1, cpu.split_product(1, layer.weight, x), torch.get_num_threads())
        with torch.no_grad():
            for _ in range(5 * (1 + cpu.MEASURE_REPEATS)):  # five kinds at most, each one untimed call first
                assert _ulps(layer(x), exact) <= 1.0
        assert key in cpu.measured() and calls
    finally:
        cpu.pin_spare_cores(None)
        cpu.forget_measured()


def _probe(env: dict[str, str], code: str = "from multihead import native; print(native.unavailable())") -> str:
    import os

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_without_the_kernels_everything_says_why_and_keeps_pytorchs_products(tmp_path: Path) -> None:
    assert _probe({"MULTIHEAD_NATIVE": "0"}) == "turned off by MULTIHEAD_NATIVE=0"
    assert _probe({"PATH": str(tmp_path), "CC": "no-such-cc"}) == (
        "no C compiler found (cc, gcc or clang on PATH, or $CC)")
    # the speed paths without the kernels: bfloat16 one-row products still agree, the native kind is not offered
    code = ("import torch, torch.nn.functional as F; from multihead import native; from multihead.linear import "
            "linear; w = torch.randn(1536, 576).bfloat16(); x = torch.randn(1, 576).bfloat16(); "
            "print(native.library() is None, [(linear(x, w) - F.linear(x, w)).abs().max().item() < 1 "
            "for _ in range(40)] == [True] * 40)")
    assert _probe({"MULTIHEAD_NATIVE": "0"}, code) == "True True"


def test_a_failed_build_says_what_the_compiler_said_and_a_good_one_is_kept(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "kernels.c"
    broken.write_text("int mh_gemv_bf16( {\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("MULTIHEAD_NATIVE_DIR", str(tmp_path / "built"))
    assert native.library() is None
    why = native.unavailable()
    assert why is not None and "kernels.c exited with 1" in why and "error" in why
    assert list((tmp_path / "built").iterdir()) == []  # no half-written library left behind
    monkeypatch.setattr(native, "SOURCE", Path(native.__file__).with_name("kernels.c"))
    monkeypatch.setattr(native, "_state", {})
    assert native.library() is not None
    built = list((tmp_path / "built").iterdir())
    assert len(built) == 1 and built[0].name.startswith("kernels-") and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_state", {})
    assert native.library() is not None and built[0].stat().st_mtime_ns == stamp  # found, not built again
