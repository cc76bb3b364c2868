"""multihead.layers.linear: the split product of decoding equals F.linear, and stays an nn.Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multihead.errors import MultiheadError
from multihead.kernels import cpu, native
from multihead.kernels.cpu import SPLIT_MAX_ROWS as MAX_ROWS
from multihead.kernels.cpu import SPLIT_MIN_WEIGHT as MIN_WEIGHT
from multihead.layers import linear as linear_module
from multihead.layers.linear import Linear, linear
from multihead.layers.linear import kinds as linear_kinds
from multihead.layers.linear import run as linear_run
from tests_support import aten_ops

pytestmark = pytest.mark.usefixtures("two_threads")  # the split needs at least two threads, whatever the machine


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS, MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_split_product_equals_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(384, 192, bias=bias)
    assert layer.weight.numel() >= MIN_WEIGHT
    x = torch.randn(1, rows, 384)
    assert cpu.split_product(rows, layer.weight, x) == (2 if rows <= MAX_ROWS else 1)
    with aten_ops() as ops:
        got = layer(x)
    assert ("bmm.default" in ops.names) == (rows <= MAX_ROWS)  # the split product ran, up to MAX_ROWS rows
    assert got.shape == (1, rows, 192)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_uneven_widths_other_dtypes_and_gradients_fall_back_or_agree() -> None:
    torch.manual_seed(0)
    odd = Linear(65536, 7)  # 7 rows do not split in 2: plain F.linear
    x = torch.randn(2, 65536)
    assert torch.equal(odd(x), F.linear(x, odd.weight, odd.bias))
    small = Linear(64, 72)  # under MIN_WEIGHT: plain F.linear
    x = torch.randn(1, 64)
    with aten_ops() as ops:
        assert torch.equal(small(x), F.linear(x, small.weight, small.bias))
    assert "bmm.default" not in ops.names
    w64 = torch.randn(6, 8, dtype=torch.float64)
    x64 = torch.randn(1, 8, dtype=torch.float64)
    assert torch.equal(linear(x64, w64), F.linear(x64, w64))  # float32 only
    layer = Linear(512, 128)
    x = torch.randn(1, 512, requires_grad=True)
    layer(x).square().sum().backward()
    want = torch.autograd.grad(F.linear(x, layer.weight, layer.bias).square().sum(), [x, layer.weight])
    assert x.grad is not None and layer.weight.grad is not None
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(layer.weight.grad, want[1])


def test_it_is_an_nn_linear_with_its_hooks_and_state_dict() -> None:
    layer = Linear(16, 32)
    assert isinstance(layer, nn.Linear)
    assert set(layer.state_dict()) == {"weight", "bias"}
    seen = []
    layer.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    layer(torch.randn(1, 16))
    assert seen == [torch.Size([1, 32])]


def test_the_result_is_laid_out_like_f_linears() -> None:
    """Kernels downstream (SDPA's flash path) need a contiguous last dimension, as F.linear gives."""
    layer = Linear(512, 128)
    for rows in (1, 5):
        y = layer(torch.randn(1, rows, 512))
        assert y.is_contiguous() and y.stride() == F.linear(torch.randn(1, rows, 512), layer.weight).stride()


def test_a_width_mismatch_gets_f_linears_error() -> None:
    layer = Linear(512, 256)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        layer(torch.randn(1, 500))


def test_the_product_kind_is_the_tables_else_the_rule_and_a_forced_one_wins(tuning_table) -> None:  # type: ignore[no-untyped-def]
    cpu.force_product(None)
    shape = (1536, 576, torch.float32, 1, 2, 2)
    key = cpu.product_key(*shape)
    kinds = ("linear", "mv", "split")
    assert cpu.product_kind(shape, kinds, native_default=False) == "linear"  # no table: F.linear
    assert cpu.product_kind(shape, (*kinds, "native"), native_default=True) == "native"  # one bfloat16 row: native
    tuning_table({key: "mv"})
    assert cpu.product_kind(shape, kinds, native_default=False) == "mv"
    tuning_table({key: "native"})  # a kind this call cannot take: the rule
    assert cpu.product_kind(shape, kinds, native_default=False) == "linear"
    cpu.force_product("split")
    try:
        assert cpu.product_kind(shape, kinds, native_default=False) == "split"
        with pytest.raises(MultiheadError, match=r"unknown product kind .fast.*linear, mv, split, blas, native"):
            cpu.force_product("fast")
    finally:
        cpu.force_product(None)


def test_tuning_keeps_the_fastest_median_only_under_the_margin_and_skips_each_first_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """measure() runs the kinds in turn, the order rotated, one untimed first pass each (a first pass that takes a
    second does not decide), and fastest() keeps a kind only under KIND_MARGIN of the plain one's median."""
    from multihead.kernels import tuning

    clock = [0.0]
    order: list[str] = []

    def run(name: str, cost: float, first: float):  # type: ignore[no-untyped-def]
        calls = [0]

        def go() -> None:
            order.append(name)
            clock[0] += first if calls[0] == 0 else cost
            calls[0] += 1
        return go

    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    medians = tuning.measure({"linear": run("linear", 4e-4, 4e-4), "split": run("split", 1e-4, 1.0)}, repeats=3)
    assert medians == pytest.approx({"linear": 4e-4, "split": 1e-4})
    assert order == ["linear", "split", "linear", "split", "split", "linear", "linear", "split"]
    assert tuning.fastest(medians, "linear") == "split"
    assert tuning.fastest({"linear": 4e-4, "split": 3.9e-4}, "linear") == "linear"  # within the margin: plain
    assert tuning.fastest({"linear": 4e-4, "blas": 1e-4, "mv": 2e-4}, "linear") == "blas"


def test_tuning_a_shape_writes_the_hosts_table_and_the_product_then_runs_that_kind(tuning_table) -> None:  # type: ignore[no-untyped-def]
    from multihead.kernels import tuning

    cpu.force_product(None)
    weights = [torch.randn(1536, 576) for _ in range(3)]
    entries, measured = tuning.tune_products(weights, rows=1, repeats=2, flush=False)
    key = cpu.product_key(1536, 576, torch.float32, 1, 2, 2)
    one_row = linear_kinds(1, torch.float32)  # float32's kinds at one row: "native" too where it built with AVX-512
    assert set(one_row) == {"linear", "mv", "split"} | ({"native"} if native.avx512() else set())
    assert set(entries) == {key} and entries[key] in one_row
    assert set(measured[key]) == set(one_row) and all(t > 0 for t in measured[key].values())
    tuning_table({key: "mv"})  # (what the table holds decides, whatever was measured)
    seen: list[str] = []
    real = torch.mv
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "mv", lambda *a: seen.append("mv") or real(*a))
        y = linear(torch.randn(1, 576), weights[0])
    assert seen == ["mv"] and y.shape == (1, 1536)


def test_a_real_layer_computes_the_same_from_its_first_call() -> None:
    """No call is a trial: the first call of a shape already runs the kind every later one runs (bitwise the same
    output), one row or several, float32 or bfloat16."""
    cpu.force_product(None)
    for dtype in (torch.float32, torch.bfloat16):
        layer = Linear(576, 1536, bias=False, dtype=dtype)
        for rows in (1, 5):
            x = torch.randn(1, rows, 576, dtype=dtype)
            first = layer(x)
            assert all(torch.equal(layer(x), first) for _ in range(20))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_linear_gives_f_linear_whichever_kind_runs(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w, x = torch.randn(1536, 576, dtype=dtype), torch.randn(1, 1, 576, dtype=dtype)
    exact = F.linear(x.double(), w.double())
    # float32: the same sum in another order (sums of 576 products of size ~1, values ~24); bfloat16: each output
    # rounded once to bfloat16 from a float32 sum, within 1.5 steps of the float64 product
    tol = 1e-4 if dtype == torch.float32 else 1.5 * 2.0**-8
    for kind in ("linear", "mv", "split", "blas", "native", None):
        cpu.force_product(kind)
        try:
            with torch.no_grad():
                got = linear(x, w)
        finally:
            cpu.force_product(None)
        assert got.dtype == dtype and got.is_contiguous()
        assert ((got.double() - exact).abs() <= tol * exact.abs().clamp_min(1.0)).all(), kind
    assert torch._C._get_mkldnn_enabled()  # the "blas" kind put oneDNN back


def test_the_blas_kind_puts_onednn_and_the_thread_count_back_when_the_product_raises() -> None:
    from multihead.layers.linear import run

    threads = torch.get_num_threads()
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        run("blas", torch.randn(1, 500, dtype=torch.bfloat16), w, None, 2, True)
    assert torch._C._get_mkldnn_enabled() and torch.get_num_threads() == threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_flop_counter_or_fake_tensors_see_pytorchs_own_product(dtype: torch.dtype) -> None:
    """Under a dispatch mode the product is PyTorch's plain one whatever the table or rule would pick (a native
    kernel is invisible to a FLOP counter and reads memory a fake tensor does not have)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    cpu.force_product(None)
    w, x = torch.randn(1536, 576, dtype=dtype), torch.randn(1, 576, dtype=dtype)
    with FlopCounterMode(display=False) as counter:
        linear(x, w)
    assert counter.get_total_flops() == 2 * 1536 * 576
    with FakeTensorMode() as mode:
        y = linear(mode.from_tensor(x), mode.from_tensor(w))
    assert y.shape == (1, 1536) and y.dtype == dtype


def test_under_compile_blas_becomes_the_tables_compiled_choice_and_the_rest_is_kept(tuning_table,  # type: ignore[no-untyped-def]
                                                                                     monkeypatch: pytest.MonkeyPatch
                                                                                     ) -> None:
    """"blas" (oneDNN off, a process setting, not an op) cannot run in a graph: there the table's compiled choice
    for the key runs (the fastest other kind tuning measured), F.linear without one; every other kind is kept."""
    cpu.force_product(None)
    kinds = ("linear", "mv", "split", "blas", "native")
    shapes = {name: (100 + i, 576, torch.bfloat16, 1, 2, 2) for i, name in
              enumerate(("mv", "blas", "blas, native next", "never tuned"))}
    keys = {name: cpu.product_key(*shape) for name, shape in shapes.items()}
    tuning_table({keys["mv"]: "mv", keys["blas"]: "blas", keys["blas, native next"]: "blas",
                  keys["blas, native next"] + " compiled": "native"})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert cpu.product_kind(shapes["never tuned"], kinds, native_default=False) == "linear"
    assert cpu.product_kind(shapes["mv"], kinds, native_default=False) == "mv"
    assert cpu.product_kind(shapes["blas"], kinds, native_default=False) == "linear"
    assert cpu.product_kind(shapes["blas, native next"], kinds, native_default=False) == "native"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert cpu.product_kind(shapes["blas, native next"], kinds, native_default=False) == "blas"  # eager: blas


@pytest.mark.parametrize("bias", [False, True])
def test_the_upcast_product_is_the_float64_product_rounded_once(monkeypatch: pytest.MonkeyPatch, bias: bool) -> None:
    """A prefill's bfloat16 product in float32, block by block (blocks of 7 rows of W here, 200 rows: the last block
    short): within one bfloat16 rounding of the float64 product of the same values, as F.linear in bfloat16 is."""
    from multihead.layers.linear import upcast

    monkeypatch.setattr(cpu, "UPCAST_BLOCK", 7 * 96)
    torch.manual_seed(0)
    x = torch.randn(2, 40, 96).bfloat16()
    w, b = torch.randn(200, 96).bfloat16(), torch.randn(200).bfloat16() if bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = upcast(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 40, 200)
    ulp = want.abs() * 2.0**-8  # half a bfloat16 step at each value, and a float32 sum's error
    assert bool(((got.double() - want).abs() <= ulp + 1e-4).all())
    # the whole float32 product rounded once: the same but where a float32 sum in another order (a 7-column block's
    # kernel, not a 200-column one's: on this AMD EPYC 2 of 16,000 with the bias) lands across a rounding boundary
    whole = F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
    apart = got != whole
    assert int(apart.sum()) <= got.numel() // 1000
    assert bool(((got.float() - whole.float()).abs()[apart] <= whole.float().abs()[apart] * 2.0**-7).all())


def test_upcast_runs_for_a_prefills_bfloat16_rows_on_a_cpu_without_bfloat16_instructions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.zeros(192, 384, dtype=torch.bfloat16)
    many, few = torch.zeros(MAX_ROWS + 1, 384, dtype=torch.bfloat16), torch.zeros(MAX_ROWS, 384, dtype=torch.bfloat16)
    for flags, expected in ((frozenset({"sse2", "avx512f"}), True), (frozenset({"sse2", "avx512_bf16"}), False),
                            (frozenset({"sse2", "amx_bf16"}), False), (frozenset(), False)):
        monkeypatch.setattr(cpu, "no_bf16_matmul", lambda flags=flags: "sse2" in flags and not {
            "avx512_bf16", "amx_bf16"} & flags)
        assert cpu.upcast_product(MAX_ROWS + 1, w, many) is expected, flags
        assert not cpu.upcast_product(MAX_ROWS, w, few)  # a decode step's rows: the split's kinds
    monkeypatch.setattr(cpu, "no_bf16_matmul", lambda: True)
    assert not cpu.upcast_product(MAX_ROWS + 1, w.float(), many.float())  # float32 is F.linear's already
    with cpu.disabled():
        assert not cpu.upcast_product(MAX_ROWS + 1, w, many)
    grad = w.clone().requires_grad_()
    assert not cpu.upcast_product(MAX_ROWS + 1, grad, many)  # training: PyTorch's own product and its backward
    layer = Linear(384, 192, bias=False).bfloat16()
    with torch.no_grad(), aten_ops() as ops:
        layer(many)
    assert "mm.default" in ops.names and "_to_copy.default" not in ops.names  # a watching mode sees F.linear
    with torch.no_grad():
        got = layer(many)
    torch.testing.assert_close(got, F.linear(many.float(), layer.weight.float()).bfloat16(), atol=0, rtol=0)


def test_this_cpus_flags_decide_the_upcast() -> None:
    from multihead.kernels import native

    flags = native.cpu_flags()
    assert cpu.no_bf16_matmul() is ("sse2" in flags and not {"avx512_bf16", "amx_bf16"} & flags)


def test_the_cpu_flags_are_read_once_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from multihead.kernels import native

    reads = []
    monkeypatch.setattr(native, "cpu_flags", lambda: reads.append(1) or frozenset({"sse2", "avx512f"}))
    monkeypatch.setattr(cpu, "_no_bf16", [])
    assert all(cpu._no_bf16_matmul() for _ in range(5)) and len(reads) == 1


@pytest.mark.parametrize("rows", [2, 4, 13, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_the_onednn_kind_is_the_float64_product_to_float32s_rounding(rows: int, bias: bool) -> None:
    """oneDNN's float32 matmul (the kind "onednn") computes F.linear's product: within the float32 rounding F.linear
    itself is off the float64 product by (the same sums in another order), any batch shape, a bias or none."""
    torch.manual_seed(0)
    w = torch.randn(640, 384) * 0.05
    b = torch.randn(640) if bias else None
    x = torch.randn(1, rows, 384)
    assert cpu.onednn_fits(x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = linear_run("onednn", x, w, b, 1)
    assert got.shape == (1, rows, 640) and got.dtype == torch.float32 and got.is_contiguous()
    theirs = (F.linear(x, w, b).double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 4 * theirs + 1e-6


def test_the_onednn_kind_gives_way_to_f_linear_where_it_cannot_run() -> None:
    """No backward, no other dtype, no mode watching: F.linear runs there (and a FLOP counter sees the product)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    w = torch.randn(256, 128, requires_grad=True)
    x = torch.randn(8, 128)
    assert not cpu.onednn_fits(x, w, None)  # a gradient is wanted
    y = linear_run("onednn", x, w, None, 1)
    y.sum().backward()
    assert w.grad is not None and torch.equal(w.grad, x.sum(0).expand(256, 128))
    with torch.no_grad():
        assert cpu.onednn_fits(x, w, None)
        assert not cpu.onednn_fits(x.bfloat16(), w.bfloat16(), None)
        assert not cpu.onednn_fits(x, w, torch.zeros(255))  # F.linear says what is wrong with the bias
        with FlopCounterMode(display=False) as counter:
            assert not cpu.onednn_fits(x, w, None)
            linear_run("onednn", x, w, None, 1)
        assert counter.get_total_flops() == 2 * 8 * 256 * 128
        with cpu.disabled():
            assert not cpu.onednn_fits(x, w, None)


def test_the_rule_runs_float32_products_of_four_rows_and_more_in_onednn_on_its_hosts(
        tuning_table, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Where :func:`multihead.kernels.cpu.onednn_host` holds (AMD CPUs with AVX-512), a float32 product of 4 rows or
    more runs in oneDNN, a decode step's few rows and a prefill's many alike; fewer rows, bfloat16 and other hosts
    run as before; a tuning table's entry (a prefill's rows share one key) decides over the rule."""
    cpu.force_product(None)
    calls: list[int] = []
    plain = linear_module.onednn_linear
    monkeypatch.setattr(linear_module, "onednn_linear",
                        lambda x, w, b: calls.append(x.numel() // x.shape[-1]) or plain(x, w, b))
    layer = Linear(576, 1536)
    for host in (True, False):
        monkeypatch.setattr(cpu, "onednn_host", lambda host=host: host)
        cpu.reload_table()  # the memo of decisions
        calls.clear()
        with torch.no_grad():
            for rows in (1, 2, 3, 4, 13, 64, 65, 512):
                x = torch.randn(rows, 576)
                torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=2e-5, rtol=1e-5)
            layer.bfloat16()(torch.randn(512, 576, dtype=torch.bfloat16))
            layer.float()
        assert calls == ([4, 13, 64, 65, 512] if host else [])
    monkeypatch.setattr(cpu, "onednn_host", lambda: True)
    tuning_table({cpu.product_key(1536, 576, torch.float32, 512, 1, 2): "linear",
                  cpu.product_key(1536, 576, torch.float32, 2, 2, 2): "onednn"})
    assert cpu.product_key(1536, 576, torch.float32, 65, 1, 2) == "product 1536x576 float32 rows=65+ blocks=1 threads=2"
    calls.clear()
    with torch.no_grad():
        for rows in (2, 100, 512):
            layer(torch.randn(rows, 576))
    assert calls == [2]


def test_onednn_hosts_are_amd_cpus_with_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule's hosts: an AMD CPU (where MKL's float32 GEMM ran at half oneDNN's speed), not an Intel one, and not
    without AVX-512, read once a process."""
    for vendor, flags, want in (("AuthenticAMD", {"avx512f", "avx2"}, True), ("GenuineIntel", {"avx512f"}, False),
                                ("AuthenticAMD", {"avx2"}, False), ("", set(), False)):
        monkeypatch.setattr(cpu, "_onednn_float32", [])
        monkeypatch.setattr(cpu, "_cpu_vendor", lambda vendor=vendor: vendor)
        monkeypatch.setattr(native, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert cpu._onednn_host() is want, vendor
    monkeypatch.setattr(cpu, "_onednn_float32", [])
    monkeypatch.setattr(cpu, "_cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert cpu._onednn_host() is True
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset())
    assert cpu._onednn_host() is True  # read once a process: the first answer kept
