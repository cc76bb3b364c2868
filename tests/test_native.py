"""multihead.kernels.native: the C kernels built by an explicit step (one build per instruction-set variant, the CPU's
best chosen at run time), never by a forward, registered as torch operators, each against float64 or SDPA, and what
happens without them (not built yet, no compiler, a failed build, turned off)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from multihead import quant
from multihead.kernels import cpu, native
from multihead.layers.linear import Linear, linear


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest error of a bfloat16 result in units of bfloat16's spacing at the exact value (float64)."""
    spacing = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(2.0**-126))) - 7)
    return ((got.double() - exact).abs() / spacing).max().item()


def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Each call of operator torch.ops.multihead.``name`` (what the package's hot paths call, eager and compiled),
    counted while the test runs."""
    calls: list[int] = []
    op = getattr(torch.ops.multihead, name)
    monkeypatch.setattr(torch.ops.multihead, name, lambda *a, **k: calls.append(1) or op(*a, **k))
    return calls


def test_the_kernels_build_here_as_the_best_variant_this_cpu_runs() -> None:
    """This machine (and CI's, the same kind) has a C compiler: the kernels must build, as the best variant this CPU's
    flags allow (never -march=native), so the speed path is really tested here and not only its fallback."""
    assert native.unavailable() is None
    assert native.library() is not None
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    want = ("avx512bf16" if " avx512_bf16" in flags else "avx512" if " avx512bw" in flags else "generic")
    assert native.loaded_variant() == want
    assert native.vectorised() == (want == "avx512bf16") and native.avx512() == (want != "generic")
    assert all("-march" not in " ".join(flags_) for flags_, _ in native.VARIANTS.values())


@pytest.mark.slow  # child processes that build or load torch: seconds each
@pytest.mark.parametrize("variant", ["generic", "avx512"])
def test_a_lower_variant_builds_loads_and_computes_the_same(variant: str, tmp_path: Path) -> None:
    """MULTIHEAD_NATIVE_VARIANT picks a lower variant (the portable loops): it builds apart, loads, its bfloat16
    product is the same function (within a step of float64) and its codec writes and reads the same bits as
    multihead.quant; a variant the CPU lacks, or no such name, is refused with the reason."""
    if not native.supported(variant):
        pytest.skip(f"this CPU does not run the {variant} variant")  # (every x86-64 CPU runs generic)
    code = ("import torch; from multihead.kernels import native; native.build_now(); "
            "w = torch.randn(33, 70).bfloat16(); x = torch.randn(1, 70).bfloat16(); "
            "e = (w.double() @ x.double().t()).t(); "
            "y = native.gemv_bf16(x, w); "
            "print(native.loaded_variant(), native.vectorised(), float(((y.double() - e).abs() / "
            "e.abs().clamp_min(1)).max()) < 2 ** -7); "
            "import sys; sys.path.insert(0, 'tests'); from test_native import _codec_case; "
            "print(all(_codec_case(dt, bits, d, group, axis) for dt in (torch.float32, torch.bfloat16) "
            "for bits in (2, 4, 8) for d, group in ((64, 32), (24, 8)) for axis in (0, 1)))")
    out = _probe({"MULTIHEAD_NATIVE_VARIANT": variant, "MULTIHEAD_NATIVE_DIR": str(tmp_path)}, code)
    assert out == f"{variant} False True\nTrue"  # the product, and the codec's bits (its portable loops)
    assert any(f.name.startswith(f"kernels-{variant}-") for f in tmp_path.iterdir())
    assert "is not a variant: choose one of avx512bf16, avx512, generic" in _probe(
        {"MULTIHEAD_NATIVE_VARIANT": "sse9"})
    if not native.supported("avx512bf16"):
        assert "needs CPU flags this CPU lacks" in _probe({"MULTIHEAD_NATIVE_VARIANT": "avx512bf16"})


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


def _f32_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    """The largest error of a float32 product against float64, in units of float32's epsilon times the sum of the
    terms' magnitudes (a dot product of n terms summed in any order is within n of those)."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    return ((got.double() - exact).abs() / (scale * 2.0**-23).clamp_min(1e-300)).max().item()


@pytest.mark.parametrize(("out", "inp"), [(1536, 576), (576, 1536), (7, 33), (5, 31), (4, 64), (1, 1), (3, 100),
                                          (9, 17)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_f32_is_the_product_in_another_order(out: int, inp: int, bias: bool, threads: int) -> None:
    """Each output within float32's rounding of the float64 product (a few epsilons of the terms' magnitudes, as
    PyTorch's own product is); tails of rows and of columns (in % 16, in % 64) included."""
    w = torch.randn(out, inp)
    x = torch.randn(1, 1, inp)
    b = torch.randn(out) if bias else None
    got = native.gemv_f32(x, w, b, threads)
    assert got.dtype == torch.float32 and got.shape == (1, 1, out) and got.is_contiguous()
    assert _f32_error(got, x, w, b) <= 4.0
    assert _f32_error(F.linear(x, w, b), x, w, b) <= 4.0  # the bound PyTorch's product meets too


def test_gemv_f32_reads_rows_of_any_stride_carries_inf_and_nan_and_names_what_does_not_fit() -> None:
    big = torch.randn(64, 200)
    w = big[:, :130]  # rows 200 apart
    x = torch.randn(130)
    assert _f32_error(native.gemv_f32(x, w), x, w, None) <= 4.0
    w = torch.randn(8, 40)
    w[1, 3], w[2, 5] = float("inf"), float("nan")
    got = native.gemv_f32(torch.ones(40), w)
    assert got[1].item() == float("inf") and torch.isnan(got[2]) and torch.isfinite(got[[0, 3, 4, 5, 6, 7]]).all()
    w, x = torch.randn(8, 16), torch.randn(1, 16)
    with pytest.raises(ValueError, match=r"gemv_f32: dtypes torch.bfloat16 and torch.float32 \(float32 both\)"):
        native.gemv_f32(x.bfloat16(), w)
    with pytest.raises(ValueError, match=r"x of shape \(2, 16\) \(one contiguous row of 16\)"):
        native.gemv_f32(torch.randn(2, 16), w)
    with pytest.raises(ValueError, match=r"weight of shape \(8, 16\) and strides \(1, 8\)"):
        native.gemv_f32(x, torch.randn(16, 8).t())
    with pytest.raises(ValueError, match=r"bias of shape \(7,\) and dtype torch.float32 \(contiguous float32 of 8\)"):
        native.gemv_f32(x, w, torch.randn(7))
    with pytest.raises(ValueError, match=r"gemv_f32: x \[1, 16\] BFloat16 and weight \[8, 16\]"):
        torch.ops.multihead.gemv_f32(x.bfloat16(), w, None)


def test_linear_takes_the_native_kind_only_where_it_computes_the_same_thing() -> None:
    """Forced "native": one bfloat16 or float32 row runs the kernel (no aten product seen), within the dtype's
    rounding of float64; with autograd on, a strided row, two rows or float16, it is PyTorch's product."""
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
            w16, x16 = layer.weight.half(), x.detach().half()
            assert torch.equal(linear(x16, w16), F.linear(x16, w16))
            w32, x32 = layer.weight.float(), x.detach().float()
            assert torch.equal(linear(x32.expand(2, 576), w32), F.linear(x32.expand(2, 576), w32))
            with aten_ops() as ops:
                got32 = linear(x32, w32)
            assert not {"mm.default", "addmm.default", "bmm.default", "mv.default"} & set(ops.names)
            assert _f32_error(got32, x32, w32, None) <= 4.0
    finally:
        cpu.force_product(None)


def test_an_untuned_bfloat16_row_runs_the_native_kind_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a tuning entry, one bfloat16 row is the native kernel's where it has AVX512-BF16 (the default rule),
    every call; the result within a step of float64."""
    calls = _counted(monkeypatch, "gemv_bf16")
    cpu.force_product(None)
    layer = Linear(576, 1536, bias=False, dtype=torch.bfloat16)
    x = torch.randn(1, 576).bfloat16()
    exact = F.linear(x.double(), layer.weight.double())
    with torch.no_grad():
        for _ in range(5):
            assert _ulps(layer(x), exact) <= 1.0
    assert len(calls) == (5 if native.vectorised() else 0)


def test_an_untuned_float32_row_runs_the_native_kind_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a tuning entry, one float32 row of a weight the split takes is the native kernel's where it built
    with AVX-512, every call, within float32's rounding; with autograd on, F.linear (the gradient flows)."""
    calls = _counted(monkeypatch, "gemv_f32")
    cpu.force_product(None)
    layer = Linear(576, 1536, bias=True)
    x = torch.randn(1, 576)
    with torch.no_grad():
        for _ in range(5):
            assert _f32_error(layer(x), x, layer.weight, layer.bias) <= 4.0
    assert len(calls) == (5 if native.avx512() and cpu.split_product(1, layer.weight, x) > 1 else 0)
    y = layer(x.requires_grad_())
    y.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    assert len(calls) == (5 if native.avx512() and cpu.split_product(1, layer.weight, x) > 1 else 0)


def test_the_kernels_are_torch_operators_with_schemas_and_fake_kernels() -> None:
    """torch.ops.multihead.*: each equals its function, checks what it is given (a clear error, never a bad read),
    and has a fake kernel, so a compiled graph sees an operator of the right shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    w, x = torch.randn(48, 64).bfloat16(), torch.randn(1, 64).bfloat16()
    assert torch.equal(torch.ops.multihead.gemv_bf16(x, w, None), native.gemv_bf16(x, w))
    assert torch.equal(torch.ops.multihead.gemv_f32(x.float(), w.float(), None),
                       native.gemv_f32(x.float(), w.float()))
    q, k, v = torch.randn(1, 6, 1, 64), torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    if native.avx512():
        assert torch.equal(torch.ops.multihead.attend_dense(q, k, v, 0.125), native.attend_dense(q, k, v, 0.125))
    with pytest.raises(ValueError, match=r"gemv_bf16: x \[1, 64\] Float and weight \[48, 64\]"):
        torch.ops.multihead.gemv_bf16(x.float(), w, None)
    with pytest.raises(ValueError, match=r"attend_dense: q \[1, 6, 1, 64\], k \[1, 2, 40, 32\] .* do not fit"):
        torch.ops.multihead.attend_dense(q, k[..., :32], v, 0.125)
    with pytest.raises(ValueError, match="attend_quantized: bits 3"):
        torch.ops.multihead.attend_quantized(3, q, k, k, k, k, k, k, 0, 32, k, v, 0.125)
    x32, w32 = x.float(), w.float()
    with FakeTensorMode() as mode:
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        assert torch.ops.multihead.attend_dense(fq, fk, fk, 0.125).shape == (1, 6, 1, 64)
        assert torch.ops.multihead.gemv_bf16(mode.from_tensor(x), mode.from_tensor(w), None).shape == (1, 48)
        assert torch.ops.multihead.gemv_f32(mode.from_tensor(x32), mode.from_tensor(w32), None).dtype == torch.float32
    for name, schema in (("gemv_bf16", "Tensor x, Tensor weight, Tensor? bias, int threads=0"),
                         ("gemv_f32", "Tensor x, Tensor weight, Tensor? bias, int threads=0"),
                         ("attend_dense", "Tensor q, Tensor k, Tensor v, float scale, Tensor? keep=None")):
        assert schema in str(getattr(torch.ops.multihead, name).default._schema)


@pytest.mark.slow  # a child process that loads torch
def test_a_first_call_straight_to_an_operator_loads_the_built_library() -> None:
    """A fresh process whose first use of the kernels is the operator itself (no function of native called before)
    gets the kernel's result; with the kernels turned off the operator raises naming why."""
    code = ("import torch; from multihead.kernels import native; w = torch.randn(48, 64).bfloat16(); "
            "x = torch.randn(1, 64).bfloat16(); y = torch.ops.multihead.gemv_bf16(x, w, None); "
            "e = x.double() @ w.double().t(); print(float(((y.double() - e).abs() / e.abs().clamp_min(1)).max()) "
            "< 2 ** -7, native.loaded_variant() is not None)")
    assert _probe({}, code) == "True True"
    off = ("import torch; from multihead.kernels import native\ntry:\n    torch.ops.multihead.gemv_bf16("
           "torch.ones(1, 4).bfloat16(), torch.ones(2, 4).bfloat16(), None)\nexcept RuntimeError as e:\n"
           "    print(e)")
    assert _probe({"MULTIHEAD_NATIVE": "0"}, off) == (
        "multihead's native kernels are not available: turned off by MULTIHEAD_NATIVE=0")


def _probe(env: dict[str, str], code: str = "from multihead.kernels import native; print(native.unavailable())") -> str:
    import os

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.slow  # child processes that build or load torch: seconds each
def test_without_the_kernels_everything_says_why_once_and_keeps_pytorchs_products(tmp_path: Path) -> None:
    assert _probe({"MULTIHEAD_NATIVE": "0"}) == "turned off by MULTIHEAD_NATIVE=0"
    assert _probe({"PATH": str(tmp_path), "CC": "no-such-cc"}) == (
        "no C compiler found (cc, gcc or clang on PATH, or $CC)")
    # said once a process (a warning), however often the kernels are asked for; not when turned off on purpose
    code = ("import warnings; warnings.simplefilter('always'); from multihead.kernels import native; "
            "[native.library() for _ in range(3)]; native.unavailable(); print('asked')")
    import os

    for env, said in (({"PATH": str(tmp_path), "CC": "no-such-cc"}, 1), ({"MULTIHEAD_NATIVE": "0"}, 0)):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **env})
        assert done.returncode == 0 and done.stdout.strip() == "asked", done.stderr
        assert done.stderr.count("native CPU kernels are not available") == said, done.stderr
    # the speed paths without the kernels: bfloat16 one-row products still agree, the native kind is not offered
    code = ("import torch, torch.nn.functional as F; from multihead.kernels import native; "
            "from multihead.layers.linear import linear; w = torch.randn(1536, 576).bfloat16(); "
            "x = torch.randn(1, 576).bfloat16(); "
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
    built_dir = tmp_path / "built"
    with pytest.warns(RuntimeWarning, match="not available .not built here yet: run `python -m "
                                               "multihead.kernels.native"):
        assert native.library() is None  # a forward never builds: not built yet, PyTorch's kernels run
    why = native.build_now()
    assert why is not None and "kernels.c exited with 1" in why and "error" in why
    assert native.unavailable() == why and native.library() is None
    assert list(built_dir.iterdir()) == []  # no half-written library left behind
    monkeypatch.setattr(native, "SOURCE", Path(native.__file__).with_name("kernels.c"))
    monkeypatch.setattr(native, "_state", {})
    assert native.build_now() is None and native.library() is not None
    built = list((tmp_path / "built").iterdir())
    assert len(built) == 1 and built[0].name.startswith(f"kernels-{native.variant()}-") and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_state", {})
    assert native.library() is not None and built[0].stat().st_mtime_ns == stamp  # found, not built again


def _filled_cache(b: int, g: int, d: int, t: int, group: int, dtype: torch.dtype = torch.float32, bits: int = 4):  # type: ignore[no-untyped-def]
    """A 4- or 8-bit cache (one layer) holding t random tokens, and its layer's keys and values as SDPA would read
    them for the next step (the reference path: dequantised, then the residual and the new token)."""
    from multihead.cache import QuantizedKVCache

    cache = QuantizedKVCache(batch=b, n_kv_heads=g, head_dim=d, max_len=t + 4, bits=bits, group=group, residual=40,
                             dtype=dtype)
    if t:
        cache.update(0, torch.randn(b, g, t, d, dtype=dtype), torch.randn(b, g, t, d, dtype=dtype) * 3,
                     cache.reserve(t, None, need_positions=False, attention_window=None, validate=True))
        cache.advance(t)
    return cache


KERNELS = {4: "attend_q4", 8: "attend_q8"}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("b", "h", "g", "d", "group", "t"), [
    (1, 9, 3, 64, 32, 8192 - 40),  # SmolLM2's heads, AVX-512 path, many chunks
    (1, 9, 3, 64, 32, 300), (2, 8, 2, 128, 32, 700), (1, 4, 4, 64, 32, 0), (1, 3, 1, 64, 32, 39),
    (1, 4, 1, 256, 32, 1000),  # Gemma 3's head (4 query heads, one KV head of 256), AVX-512 path
    (2, 6, 3, 32, 16, 200), (1, 2, 1, 8, 4, 97), (1, 10, 1, 64, 32, 500),  # the portable path (HPG 10 > 8 too)
])
def test_attend_quantized_is_softmax_attention_over_the_dequantised_cache(bits: int, b: int, h: int, g: int, d: int,
                                                                         group: int, t: int) -> None:
    """Against float64 attention over what the cache's reference read gives (codes dequantised, residual, new
    token): float32 sums, so within 1e-5 (the quantized part is there: n > 0 wherever t > residual)."""
    cache = _filled_cache(b, g, d, t, group, bits=bits)
    q, k1, v1 = torch.randn(b, h, 1, d), torch.randn(b, g, 1, d), torch.randn(b, g, 1, d)
    n, r = cache.quantized, cache.lengths[0].item() - cache.quantized
    assert (n > 0) == (t >= 40 + group)
    tk = torch.cat([cache.res_k[0, :, :, :r], k1], 2)
    tv = torch.cat([cache.res_v[0, :, :, :r], v1], 2)
    read = {"bits": bits, "group": group, "dtype": torch.float32}
    keys = torch.cat([quant.read_keys(cache.codes_k[0], cache.scale_k[0], cache.min_k[0], n, **read), tk], 2)
    values = torch.cat([quant.read_values(cache.codes_v[0], cache.scale_v[0], cache.min_v[0], n, **read), tv], 2)
    want = F.scaled_dot_product_attention(q.double(), keys.double().repeat_interleave(h // g, 1),
                                          values.double().repeat_interleave(h // g, 1))
    kernel = getattr(native, KERNELS[bits])
    for threads in (1, 2):
        got = kernel(q, cache.codes_k[0], cache.scale_k[0], cache.min_k[0], cache.codes_v[0], cache.scale_v[0],
                     cache.min_v[0], n, group, tk, tv, d**-0.5, threads)
        assert got.shape == (b, h, 1, d) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def _keep(b: int, t: int, hidden: slice, seed: int) -> torch.Tensor:
    """A (b, t) key mask: a run of keys hidden (a whole chunk of them where t is long), then a random tenth, each row
    keeping at least its last key (a decode query always sees itself)."""
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(b, t, generator=gen) > 0.1
    keep[:, hidden] = False
    keep[:, -1] = True
    return keep


def _masked_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """float64 attention over (b, g, t, d) keys and values, query head i reading KV head i // (h / g), the keys keep
    marks False never seen."""
    h, g = q.shape[1], keys.shape[1]
    mask = keep[:, None, None, :]  # (b, 1, 1, t)
    return F.scaled_dot_product_attention(q.double(), keys.double().repeat_interleave(h // g, 1),
                                          values.double().repeat_interleave(h // g, 1), attn_mask=mask)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("b", "h", "g", "d", "group", "t"), [
    (1, 9, 3, 64, 32, 2000),  # AVX-512 path: the first chunks hidden whole
    (2, 4, 1, 256, 32, 700),  # Gemma 3's head
    (1, 2, 1, 8, 4, 97),
])
def test_the_quantized_kernels_hide_the_keys_a_mask_hides(bits: int, b: int, h: int, g: int, d: int, group: int,
                                                          t: int) -> None:
    """``keep`` (a sliding layer's ring: slots out of the window or empty) hides keys in the codes and in the tail:
    float64 masked attention over the dequantised cache within 1e-5, whole hidden chunks included; a row hiding
    every key, or a mask of the wrong shape or dtype, is refused by name."""
    cache = _filled_cache(b, g, d, t, group, bits=bits)
    q, k1, v1 = torch.randn(b, h, 1, d), torch.randn(b, g, 1, d), torch.randn(b, g, 1, d)
    n, r = cache.quantized, cache.lengths[0].item() - cache.quantized
    tk = torch.cat([cache.res_k[0, :, :, :r], k1], 2)
    tv = torch.cat([cache.res_v[0, :, :, :r], v1], 2)
    read = {"bits": bits, "group": group, "dtype": torch.float32}
    keys = torch.cat([quant.read_keys(cache.codes_k[0], cache.scale_k[0], cache.min_k[0], n, **read), tk], 2)
    values = torch.cat([quant.read_values(cache.codes_v[0], cache.scale_v[0], cache.min_v[0], n, **read), tv], 2)
    keep = _keep(b, n + r + 1, slice(0, min(n, 600)), seed=t)
    keep[:, n:n + 5] = False  # tail keys too
    want = _masked_reference(q, keys, values, keep)
    kernel = getattr(native, KERNELS[bits])
    args = (cache.codes_k[0], cache.scale_k[0], cache.min_k[0], cache.codes_v[0], cache.scale_v[0], cache.min_v[0], n,
            group, tk, tv, d**-0.5)
    for threads in (1, 2):
        got = kernel(q, *args, threads, keep=keep)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    everything = torch.ones(b, n + r + 1, dtype=torch.bool)
    torch.testing.assert_close(kernel(q, *args, keep=everything), kernel(q, *args))
    none_left = keep.clone()
    none_left[-1] = False
    name = KERNELS[bits]
    with pytest.raises(ValueError, match=rf"{name}: keep hides every key of batch row\(s\) \[{b - 1}\]"):
        kernel(q, *args, keep=none_left)
    with pytest.raises(ValueError, match=rf"{name}: keep of shape \({b}, {n + r}\), torch.bool .*expected \({b}, "
                                         rf"{n + r + 1}\) bool"):
        kernel(q, *args, keep=keep[:, 1:])
    with pytest.raises(ValueError, match=r"keep of shape .* torch.uint8"):
        kernel(q, *args, keep=keep.to(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_dense_kernel_hides_the_keys_a_mask_hides(dtype: torch.dtype) -> None:
    """attend_dense with ``keep``: float64 masked attention within 1e-5 in float32 (a whole hidden chunk included),
    and within the output's rounding in bfloat16."""
    b, h, g, d, t = 2, 8, 2, 64, 1500
    k, v = torch.randn(b, g, t, d).to(dtype), torch.randn(b, g, t, d).to(dtype)
    q = torch.randn(b, h, 1, d).to(dtype)
    keep = _keep(b, t, slice(0, 700), seed=1)
    want = _masked_reference(q, k, v, keep)
    for threads in (1, 2):
        got = native.attend_dense(q, k, v, d**-0.5, threads, keep=keep)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        else:
            assert _ulps(got, want) <= 1.0 or (got.double() - want).abs().max() < 2e-3
    with pytest.raises(ValueError, match=r"attend_dense: keep of shape \(1, 1500\)"):
        native.attend_dense(q, k, v, d**-0.5, keep=keep[:1])


def test_attend_q4_names_what_does_not_fit() -> None:
    cache = _filled_cache(1, 3, 64, 200, 32)
    n = cache.quantized
    args = [cache.codes_k[0], cache.scale_k[0], cache.min_k[0], cache.codes_v[0], cache.scale_v[0], cache.min_v[0]]
    tail = torch.randn(1, 3, 5, 64)
    q = torch.randn(1, 9, 1, 64)
    with pytest.raises(ValueError, match=r"q of shape \(1, 9, 2, 64\) \(one query a head\)"):
        native.attend_q4(torch.randn(1, 9, 2, 64), *args, n, 32, tail, tail, 0.125)
    with pytest.raises(ValueError, match=r"8 query heads over 3 KV heads"):
        native.attend_q4(torch.randn(1, 8, 1, 64), *args, n, 32, tail, tail, 0.125)
    with pytest.raises(ValueError, match=r"group 32, 100 quantized"):
        native.attend_q4(q, *args, 100, 32, tail, tail, 0.125)
    with pytest.raises(ValueError, match=r"codes_k of shape \(1, 3, 204, 32\), strides .* torch.int16"):
        native.attend_q4(q, args[0].to(torch.int16), *args[1:], n, 32, tail, tail, 0.125)
    with pytest.raises(ValueError, match=r"tails of shapes \(1, 3, 5, 64\) and \(1, 3, 4, 64\)"):
        native.attend_q4(q, *args, n, 32, tail, tail[:, :, :4], 0.125)
    with pytest.raises(ValueError, match=r"attend_q8: codes_k of shape \(1, 3, 204, 32\).*\(b, g, >= 160, 64\)"):
        native.attend_q8(q, *args, n, 32, tail, tail, 0.125)  # 4-bit codes given to the 8-bit kernel
    wide = _filled_cache(1, 3, 64, 200, 32, bits=8)
    wide_args = [wide.codes_k[0], wide.scale_k[0], wide.min_k[0], wide.codes_v[0], wide.scale_v[0], wide.min_v[0]]
    with pytest.raises(ValueError, match=r"attend_q4: codes_k of shape \(1, 3, 204, 64\)"):
        native.attend_q4(q, *wide_args, n, 32, tail, tail, 0.125)
    with pytest.raises(ValueError, match=r"attend_q8: head_dim 64, group 32, 100 quantized"):
        native.attend_q8(q, *wide_args, 100, 32, tail, tail, 0.125)


def _tiny_llama(d_head: int = 64):  # type: ignore[no-untyped-def]
    from multihead.models.llama import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(vocab_size=64, d_model=3 * d_head, n_layers=2, n_heads=3, n_kv_heads=1,
                                  ffn_dim=96)).eval()


def _decode_quantized(model, tokens: torch.Tensor, prompt: int, bits: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    from tests_support import teacher_forced_logits

    cache = model.new_cache(tokens.shape[0], tokens.shape[1], bits=bits, group=32, residual=32)
    out = teacher_forced_logits(model, tokens, prompt, cache=cache)
    assert cache.quantized > 0
    return out  # type: ignore[no-any-return]


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_cache_decodes_over_its_codes_as_the_dequantising_path_does(monkeypatch: pytest.MonkeyPatch,
                                                                                 bits: int) -> None:
    """Every decode step of every layer attends in the kernel (counted), the logits equal the dequantise-then-SDPA
    path's (multihead.kernels.cpu off) within float32 rounding; a hooked pattern, weights or gradients keep the plain
    path."""
    from multihead.layers.hooks import hooks

    model = _tiny_llama()
    tokens = torch.randint(0, 64, (2, 150))
    calls = _counted(monkeypatch, "attend_quantized")
    got = _decode_quantized(model, tokens, 100, bits)
    assert len(calls) == 2 * 50  # two layers, fifty decode steps
    with cpu.disabled():
        want = _decode_quantized(model, tokens, 100, bits)
    assert len(calls) == 100
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    seen = []
    with hooks(model, {"layers.0.attn.hook_pattern": lambda w, point: seen.append(w.shape)}):
        hooked = _decode_quantized(model, tokens[:, :110], 100, bits)
    assert len(calls) == 100 + 10  # layer 1 only: layer 0's hooked pattern needs the keys
    assert seen and seen[-1][-1] == 110
    torch.testing.assert_close(hooked, want[:, :110], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_smollm2_decodes_over_its_quantized_codes_as_the_dequantising_path_does(smollm2, monkeypatch, bits) -> None:  # type: ignore[no-untyped-def]
    """The real model (float32, 9/3 heads, head_dim 64: the AVX-512 path) with a 4- or 8-bit cache holding 256
    tokens as codes: every layer's decode steps run in the kernel; the logits equal the dequantise-then-SDPA path's
    within float32 rounding and the greedy tokens are the same. The reference runs the same prefill (so it holds the
    same codes: a prefill computed another way can round a value across a code's edge) and only its decode steps'
    attention another way."""
    model, tok = smollm2
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. " * 40)[:400]])
    calls = _counted(monkeypatch, "attend_quantized")

    def decode() -> tuple[torch.Tensor, list[int]]:
        cache = model.new_cache(1, 410, bits=bits)
        with torch.no_grad():
            logits = [model(ids, cache=cache)[:, -1]]
            cache.advance(ids.shape[1])
            for _ in range(4):
                logits.append(model(logits[-1].argmax(-1, keepdim=True), cache=cache)[:, -1])
                cache.advance(1)
        assert cache.quantized == 256
        return torch.stack(logits), [int(x.argmax()) for x in logits]

    got, tokens = decode()
    assert len(calls) == 4 * model.config.n_layers
    monkeypatch.setattr(cpu, "native_quantized_decode", lambda bits: False)  # the codes read back for SDPA
    monkeypatch.setattr(cpu, "native_decode_attention", lambda *shape: None)  # (not the native dense kernel)
    want, plain_tokens = decode()
    assert len(calls) == 4 * model.config.n_layers  # no call more
    assert tokens == plain_tokens
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [4, 8, 2])
def test_explain_says_when_the_quantized_cache_attends_itself(bits: int) -> None:
    model = _tiny_llama()
    tokens = torch.randint(0, 64, (1, 101))
    cache = model.new_cache(1, 110, bits=bits, group=32, residual=32)
    with torch.no_grad():
        model(tokens[:, :100], cache=cache)
        cache.advance(100)
        layer = model.layers[0].attn
        h = torch.randn(1, 1, layer.config.d_model)
        step = layer.step(h, causal=True, cache=cache.layer(0))
        choice = layer.explain(h, step=step, cache=cache.layer(0))
        if bits == 2:  # no kernel reads 2-bit codes: read back, then dispatched as dense keys (the dense kernel)
            assert "2-bit codes are read back" in choice.reason
            assert "no native kernel reads 2-bit codes" in choice.reason
            assert choice.kernel in ("multihead.kernels.native.attend_dense", "flash"), choice
        else:
            assert choice.backend == "native" and choice.kernel == f"multihead.kernels.native.{KERNELS[bits]}", choice
            assert "never dequantised" in choice.reason
        assert cache.lengths.tolist() == [100]
        with cpu.disabled():
            assert layer.explain(h, step=layer.step(h, causal=True, cache=cache.layer(0)),
                                 cache=cache.layer(0)).backend == "sdpa"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("b", "h", "g", "d", "t"), [(1, 9, 3, 64, 3000), (2, 8, 2, 128, 700), (1, 4, 4, 64, 1),
                                                     (1, 3, 1, 64, 17), (3, 8, 1, 64, 256), (1, 2, 2, 128, 257),
                                                     (1, 4, 1, 256, 1030), (2, 8, 4, 256, 33)])
def test_attend_dense_is_sdpa_over_every_key(dtype: torch.dtype, b: int, h: int, g: int, d: int, t: int) -> None:
    """Against float64 attention of the same values: float32 within 1e-5; bfloat16 within its output's rounding
    (float32 sums rounded once). Keys and values as a cache holds them: views into a longer buffer."""
    k = torch.randn(b, g, t + 50, d).to(dtype)[:, :, :t]
    v = torch.randn(b, g, t + 50, d).to(dtype)[:, :, :t]
    q = torch.randn(b, h, 1, d).to(dtype)
    assert native.dense_fits(q, k, v)
    want = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(h // g, 1),
                                          v.double().repeat_interleave(h // g, 1))
    for threads in (1, 2):
        got = native.attend_dense(q, k, v, d**-0.5, threads)
        assert got.shape == (b, h, 1, d) and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        else:
            assert _ulps(got, want) <= 1.0 or (got.double() - want).abs().max() < 2e-3


def test_attend_dense_names_what_does_not_fit() -> None:
    k = torch.randn(1, 2, 10, 64)
    assert not native.dense_fits(torch.randn(1, 4, 2, 64), k, k)  # two queries a head
    assert not native.dense_fits(torch.randn(1, 4, 1, 32), k[..., :32], k[..., :32])  # head_dim 32
    assert not native.dense_fits(torch.randn(1, 20, 1, 64), k, k)  # 10 query heads a KV head
    assert not native.dense_fits(torch.randn(1, 4, 1, 64), k, k.bfloat16())  # k and v of two dtypes
    assert not native.dense_fits(torch.randn(1, 4, 1, 64), k.transpose(-1, -2).contiguous().transpose(-1, -2), k)
    assert not native.dense_fits(torch.randn(1, 4, 1, 64), k.double(), k.double())
    with pytest.raises(ValueError, match=r"attend_dense: q \(1, 4, 2, 64\) .* do not fit \(one query a head"):
        native.attend_dense(torch.randn(1, 4, 2, 64), k, k, 0.125)


def test_a_decode_step_attends_natively_from_its_length_or_where_the_table_says_and_agrees_either_way(
        monkeypatch: pytest.MonkeyPatch, tuning_table) -> None:  # type: ignore[no-untyped-def]
    """A full cache's decode steps: untuned, SDPA below NATIVE_DECODE_KEYS keys (a short cache: its call costs less)
    and the native dense kernel from there; where the host's table says native for the shape and power-of-two range
    of lengths, every step runs natively (no call timed); the logits equal the plain path's (multihead.kernels.cpu off)
    within float32 rounding either way, and explain names the kernel that runs."""
    threads = torch.get_num_threads()
    for dtype, least in cpu.NATIVE_DECODE_KEYS.items():
        assert cpu.native_decode_attention(1, 9, 3, dtype, least - 1) is None
        assert f"from {least:,} keys" in str(cpu.native_decode_attention(1, 9, 3, dtype, least))
        assert cpu.native_decode_attention(1, 9, 3, dtype, 4 * least) is not None
    calls = _counted(monkeypatch, "attend_dense")
    model = _tiny_llama()
    tokens = torch.randint(0, 64, (1, 120))

    def decode() -> torch.Tensor:
        from tests_support import teacher_forced_logits

        return teacher_forced_logits(model, tokens, 100)  # type: ignore[no-any-return]

    def explained() -> str:
        cache = model.new_cache(1, 120)
        with torch.no_grad():
            model(tokens[:, :100], cache=cache)
            cache.advance(100)
            layer = model.layers[1].attn
            h = torch.randn(1, 1, layer.config.d_model)
            return layer.explain(h, step=layer.step(h, causal=True, cache=cache.layer(1)), cache=cache.layer(1)).kernel

    with cpu.disabled():
        want = decode()
    torch.testing.assert_close(decode(), want, atol=1e-4, rtol=1e-4)
    assert calls == [] and explained() != "multihead.kernels.native.attend_dense"  # 100 .. 120 keys, untuned: SDPA
    tuning_table({cpu.attention_key("native-attention", 1, 3, 1, torch.float32, t, threads): "native"
                  for t in (64, 128)})  # the ranges 64-127 and 128-255: keys 100 .. 120
    torch.testing.assert_close(decode(), want, atol=1e-4, rtol=1e-4)
    assert len(calls) == 2 * 20  # two layers, twenty decode steps: every one
    assert explained() == "multihead.kernels.native.attend_dense"


@pytest.mark.parametrize("bits", [4, 8])
def test_an_odd_group_decodes_the_dequantising_way_in_4_bits_and_in_the_kernel_in_8(monkeypatch: pytest.MonkeyPatch,
                                                                                   bits: int) -> None:
    """The 4-bit kernel reads a value group as whole bytes: an odd group (head_dim 6, group 3) keeps update + SDPA
    there; the 8-bit kernel (one code a byte) takes it. Either way the output is the plain path's."""
    from multihead import AttentionConfig, MultiHeadAttention
    from multihead.cache import QuantizedKVCache

    layer = MultiHeadAttention(AttentionConfig(d_model=12, n_heads=2)).eval()
    x = torch.randn(1, 12, 12)
    calls = _counted(monkeypatch, "attend_quantized")

    def run() -> torch.Tensor:
        cache = QuantizedKVCache(batch=1, n_kv_heads=2, head_dim=6, max_len=12, bits=bits, group=3, residual=0)
        outs = []
        with torch.no_grad():
            for i in range(12):
                outs.append(layer(x[:, i:i + 1], causal=True, cache=cache.layer(0)))
                cache.advance(1)
        assert cache.quantized == 12
        return torch.cat(outs, 1)

    got = run()
    assert len(calls) == (0 if bits == 4 else 12)  # every step (the first over its own token alone)
    with cpu.disabled():
        want = run()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_threads_calling_the_kernels_at_once_each_get_their_own_answer() -> None:
    """The operators keep their working memory per thread (ops.cpp), so two threads may call them at once: kernels in
    two threads, on different inputs and of sizes past the kept buffer, give what each gives alone."""
    import threading

    if not native.avx512():
        pytest.skip("attend_dense needs the AVX-512 kernels")  # (this host and CI's have them)
    torch.manual_seed(0)
    inputs = [(torch.randn(1, 8, 1, 64), torch.randn(1, 2, t, 64), torch.randn(1, 2, t, 64)) for t in (300, 9000)]
    alone = [native.attend_dense(q, k, v, 0.125, threads=1) for q, k, v in inputs]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def work(i: int) -> None:
        for _ in range(20):
            got[i].append(native.attend_dense(*inputs[i], 0.125, threads=1))

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        assert len(got[i]) == 20 and all(torch.equal(out, alone[i]) for out in got[i])


@pytest.mark.slow  # child processes that load torch: seconds each
def test_a_first_forward_never_builds_and_the_build_step_does(tmp_path: Path) -> None:
    """On a machine where the kernels were never built, a forward runs on PyTorch's kernels at once (no compiler in
    the forward, nothing written), says so once with the command that builds them, and gives the same output; the
    explicit step builds them and the next process loads them."""
    env = {"MULTIHEAD_NATIVE_DIR": str(tmp_path)}
    code = ("import warnings, torch; warnings.simplefilter('always'); "
            "from multihead import MultiHeadAttention; from multihead.kernels import native; torch.manual_seed(0); "
            "a = MultiHeadAttention(d_model=64, n_heads=4).bfloat16(); "
            "x = torch.randn(1, 1, 64).bfloat16(); [a(x) for _ in range(3)]; print(native.available())")
    import os

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    assert done.stderr.count("python -m multihead.kernels.native build") == 1, done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was built
    step = subprocess.run([sys.executable, "-m", "multihead.kernels.native", "build"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
    assert step.returncode == 0 and f"variant {native.variant()}" in step.stdout, step.stderr
    assert [f.suffix for f in tmp_path.iterdir()] == [".so"]
    assert _probe(env, "from multihead.kernels import native; print(native.available())") == "True"
    bad = subprocess.run([sys.executable, "-m", "multihead.kernels.native", "compile"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "usage: python -m multihead.kernels.native [build] (got 'compile')" in bad.stderr


# ---------------------------------------------------------------------------------------------- the codec
def _codec_case(dtype: torch.dtype, bits: int, d: int, group: int, axis: int, scale: float = 1.0) -> bool:
    """quantize_into and dequantize_into on strided keys or values (a constant group among them) against
    multihead.quant's PyTorch code: the same codes, scales, minimums and read-back, bit for bit."""
    b, g = 2, 3
    n = 4 * group if axis == 0 else 40
    gen = torch.Generator().manual_seed(bits * 1000 + d + axis)
    x = (torch.randn(b, g, n + 5, d, generator=gen) * scale).to(dtype)[:, :, 2:2 + n]  # rows of a larger tensor
    x[0, 0, :group] = 0.5  # a constant group (keys) or row (values): scale 1, codes 0
    if axis == 0:
        c, sc, lo = quant.quantize(x.unflatten(-2, (-1, group)), bits, dim=-2)
        want = (quant.pack(c.flatten(-3, -2), bits), sc.squeeze(-2), lo.squeeze(-2))
    else:
        c, sc, lo = quant.quantize(x.unflatten(-1, (-1, group)), bits, dim=-1)
        want = (quant.pack(c.flatten(-2), bits), sc.squeeze(-1), lo.squeeze(-1))
    rows = want[1].shape[2]
    store = [torch.zeros(b, g, rows + 3, t.shape[3], dtype=t.dtype) for t in want[1:]]  # a store's buffers
    codes = torch.zeros(b, g, n + 7, want[0].shape[3], dtype=torch.uint8)
    views = (codes[:, :, 4:4 + n], store[0][:, :, 1:1 + rows], store[1][:, :, 1:1 + rows])  # written where they lie
    native.quantize_into(x, *views, bits=bits, group=group, axis=axis)
    out = torch.full((b, g, n, d), float("nan"), dtype=dtype)
    native.dequantize_into(out, *views, bits=bits, group=group, axis=axis)
    reference = (quant.read_keys if axis == 0 else quant.read_values)(*want, n, bits=bits, group=group, dtype=dtype)
    untouched = (codes[:, :, :4] == 0).all() and (codes[:, :, 4 + n:] == 0).all() and (store[0][:, :, 0] == 0).all()
    return (all(torch.equal(got, w) for got, w in zip(views, want, strict=True)) and torch.equal(out, reference)
            and bool(untouched))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(("d", "group", "scale"), [
    (64, 32, 1.0),  # SmolLM2's head and the cache's default group: the AVX-512 paths
    (256, 16, 300.0), (128, 128, 1e-6),  # Gemma 3's head; a group as wide as the head; scales below float16's normals
    (24, 8, 1.0),  # the portable loops (head_dim and group not multiples of 16)
])
@pytest.mark.parametrize("axis", [0, 1])
def test_the_codec_writes_and_reads_the_bits_multihead_quant_does(dtype: torch.dtype, bits: int, d: int, group: int,
                                                                  scale: float, axis: int) -> None:
    assert _codec_case(dtype, bits, d, group, axis, scale)


def test_the_codec_names_what_does_not_fit() -> None:
    x = torch.randn(1, 2, 64, 64)
    codes, sc = torch.zeros(1, 2, 64, 32, dtype=torch.uint8), torch.zeros(1, 2, 2, 64, dtype=torch.float16)
    native.quantize_into(x, codes, sc, sc.clone(), bits=4, group=32, axis=0)  # fits
    for args, kwargs, said in [
        ((x.double(), codes, sc, sc.clone()), {}, r"x as torch.float64"),
        ((x, codes[..., :16], sc, sc.clone()), {}, r"codes of shape \(1, 2, 64, 16\)"),
        ((x, codes, sc.float(), sc.clone()), {}, r"scale of shape \(1, 2, 2, 64\), .*torch.float32"),
        ((x, codes, sc, sc.clone()), {"group": 48}, r"group dividing n \(64\)"),
        ((x, codes, sc, sc.clone()), {"bits": 3}, r"bits 3"),
        ((x.transpose(2, 3), codes, sc, sc.clone()), {}, r"channels of unit stride"),
    ]:
        with pytest.raises(ValueError, match="quantize_into: .*" + said):
            native.quantize_into(*args, **{"bits": 4, "group": 32, "axis": 0, **kwargs})
    with pytest.raises(ValueError, match=r"dequantize_into: x of shape \(64, 64\)"):
        native.dequantize_into(x[0, 0], codes, sc, sc, bits=4, group=32, axis=0)
    wide = torch.randn(1, 1, 32, 2048)
    assert not native.codec_fits(wide, torch.zeros(1, 1, 32, 1024, dtype=torch.uint8),
                                 torch.zeros(1, 1, 1, 2048, dtype=torch.float16),
                                 torch.zeros(1, 1, 1, 2048, dtype=torch.float16), bits=4, group=32, axis=0)
    with pytest.raises(ValueError, match=r"quantize_into: x \[1, 2, 64, 64\] .* bits 4, group 32, axis 0 do not fit"):
        torch.ops.multihead.quantize_into(4, 32, 0, x, codes[..., :16], sc, sc.clone())  # the operator's own check
    from torch._subclasses.fake_tensor import FakeTensorMode

    fakes = (x, codes, sc, sc.clone())
    with FakeTensorMode() as mode:  # a compiled graph traces the in-place operators
        torch.ops.multihead.quantize_into(4, 32, 0, *(mode.from_tensor(t) for t in fakes))
    assert "Tensor(a!) codes" in str(torch.ops.multihead.quantize_into.default._schema)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("window", [None, 40])
def test_a_quantized_cache_writes_the_same_store_through_the_native_codec(monkeypatch: pytest.MonkeyPatch, bits: int,
                                                                          window: int | None) -> None:
    """A cache filled in chunks and decode steps (a ring of code groups with a window) holds the same bytes whether
    its writes ran in the native codec (counted) or in PyTorch (the fast paths off), and reads them back alike."""
    from multihead.cache import QuantizedKVCache, Slots
    from multihead.kernels import dense_view

    calls = _counted(monkeypatch, "quantize_into")

    def filled(fast: bool) -> QuantizedKVCache:
        cache = QuantizedKVCache(batch=2, n_kv_heads=2, head_dim=64, max_len=120, bits=bits, group=16, residual=8,
                                 n_layers=2, dtype=torch.bfloat16, window=window)
        gen = torch.Generator().manual_seed(bits)
        with torch.no_grad(), (contextlib.nullcontext() if fast else cpu.disabled()):
            for s in (37, 21, 1, 1, 1, 30):
                pos = torch.arange(cache.used, cache.used + s).expand(2, s)
                for layer in range(2):
                    k, v = (torch.randn(2, 2, s, 64, generator=gen).bfloat16() for _ in range(2))
                    cache.update(layer, k, v, Slots(s=s, t=cache.used + s, positions=pos, start=None,
                                                    aligned=True))
                cache.advance(s)
        return cache

    fast, plain = filled(True), filled(False)
    assert calls and fast.quantized == plain.quantized > 0
    for (name, a), (_, b) in zip(fast.named_buffers(), plain.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    with torch.no_grad():
        got = dense_view(fast.update(1, *(torch.ones(2, 2, 1, 64).bfloat16(),) * 2, Slots(
            s=1, t=fast.used + 1, positions=torch.full((2, 1), fast.used), start=None, aligned=True), read_only=True))
        with cpu.disabled():
            want = dense_view(plain.update(1, *(torch.ones(2, 2, 1, 64).bfloat16(),) * 2, Slots(
                s=1, t=plain.used + 1, positions=torch.full((2, 1), plain.used), start=None, aligned=True),
                read_only=True))
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
