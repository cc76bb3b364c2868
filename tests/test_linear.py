"""multihead.linear: the split product of decoding equals F.linear, and stays an nn.Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multihead import cpu
from multihead.cpu import SPLIT_MAX_ROWS as MAX_ROWS
from multihead.cpu import SPLIT_MIN_WEIGHT as MIN_WEIGHT
from multihead.linear import Linear, linear
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


def _measure(key: tuple[object, ...], kinds: tuple[str, ...], seconds: dict[str, float]) -> list[str]:
    """Calls of ``key`` as linear() makes them, each kind's product "taking" ``seconds[kind]``, until decided."""
    ran = []
    while key not in cpu.measured():
        kind, timed = cpu.product_kind(key, kinds)
        assert timed
        ran.append(kind)
        cpu.record_time(key, kind, seconds[kind])
    return ran


def test_the_product_kind_is_measured_on_the_real_calls_and_the_fastest_kept() -> None:
    cpu.force_product(None)
    keys = [("test", name) for name in ("linear wins", "blas wins", "within the margin")]
    try:
        ran = _measure(keys[0], ("linear", "split"), {"linear": 1e-4, "split": 1.4e-4})
        assert cpu.measured()[keys[0]] == "linear"
        # each kind in turn: one untimed first call each, then MEASURE_REPEATS timed ones
        assert ran == ["linear", "split"] * (1 + cpu.MEASURE_REPEATS)
        # a kind over DROP_OVER times the best after 2 timed calls each leaves the running: F.linear (4x) and the
        # split (2x) stop after their 2 timed calls, and the one kind left is the choice at once
        ran = _measure(keys[1], ("linear", "split", "blas"), {"linear": 4e-4, "split": 2e-4, "blas": 1e-4})
        assert cpu.measured()[keys[1]] == "blas"
        assert ran == ["linear", "split", "blas"] * 3
        # a kind under KIND_MARGIN of F.linear's time only: level ones keep F.linear
        _measure(keys[2], ("linear", "split"), {"linear": 4e-4, "split": 3.8e-4})
        assert cpu.measured()[keys[2]] == "linear"
        assert cpu.product_kind(keys[1], ("linear", "split", "blas")) == ("blas", False)  # kept, not timed again
        cpu.force_product("split")
        assert cpu.product_kind(keys[0], ("linear", "split")) == ("split", False)
        with pytest.raises(ValueError, match=r"unknown product kind .fast.*linear, mv, split, blas, native"):
            cpu.force_product("fast")
    finally:
        cpu.force_product(None)
        for key in keys:
            cpu.forget_measured(key)


def test_several_rows_are_measured_up_front_so_every_call_computes_the_same_way() -> None:
    from collections import Counter

    ran: Counter[str] = Counter()

    def trial(kind: str):  # type: ignore[no-untyped-def]
        def run() -> None:
            ran[kind] += 1
            if kind == "linear":
                import time as _time
                _time.sleep(0.001)
        return run

    cpu.force_product(None)
    key = ("test", "up front")
    try:
        assert cpu.product_kind(key, ("linear", "split"), trial) == ("split", False)  # decided before the call
        assert ran == {"linear": 1 + cpu.MEASURE_REPEATS, "split": 1 + cpu.MEASURE_REPEATS}
        assert cpu.measured()[key] == "split"
    finally:
        cpu.forget_measured(key)
    # a real layer: the first call already runs the kind every later call runs (bitwise the same output)
    cpu.forget_measured()
    layer = Linear(576, 1536, bias=False)
    x = torch.randn(1, 5, 576)
    first = layer(x)
    assert all(torch.equal(layer(x), first) for _ in range(3))
    cpu.forget_measured()


def test_the_first_call_of_each_kind_is_not_counted() -> None:
    """A slow first call (allocation, kernel set-up) does not decide: only the timed rounds after it."""
    cpu.force_product(None)
    key = ("test", "slow first call")
    try:
        for kind, seconds in (("linear", 1e-4), ("split", 1.0)):  # the split's first call: a second
            assert cpu.product_kind(key, ("linear", "split")) == (kind, True)
            cpu.record_time(key, kind, seconds)
        _measure(key, ("linear", "split"), {"linear": 2e-4, "split": 1e-4})
        assert cpu.measured()[key] == "split"
    finally:
        cpu.forget_measured(key)


def test_a_real_layer_decides_within_its_first_calls_and_keeps_the_product() -> None:
    torch.manual_seed(0)
    cpu.force_product(None)
    cpu.forget_measured()
    cpu.pin_spare_cores(64.0)  # every core free: the key's one-thread flag stays False
    layer = Linear(576, 1536, bias=False, dtype=torch.bfloat16)
    x = torch.randn(1, 576, dtype=torch.bfloat16)
    want = F.linear(x.double(), layer.weight.double())
    key = (1536, 576, torch.bfloat16, 1, cpu.split_product(1, layer.weight, x), torch.get_num_threads())
    for _ in range(5 * (1 + cpu.MEASURE_REPEATS)):  # five kinds at one row in bfloat16 (with multihead.native)
        assert ((layer(x).double() - want).abs() <= 1.5 * 2.0**-8 * want.abs().clamp_min(1.0)).all()
    assert cpu.measured()[key] in cpu.PRODUCT_KINDS
    cpu.pin_spare_cores(None)
    cpu.forget_measured()


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
    from multihead.linear import _run

    threads = torch.get_num_threads()
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        _run("blas", torch.randn(1, 500, dtype=torch.bfloat16), w, None, 2, 1, 500, True)
    assert torch._C._get_mkldnn_enabled() and torch.get_num_threads() == threads


def test_a_flop_counter_sees_one_product_not_the_measurement() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    cpu.force_product(None)
    cpu.forget_measured()
    w, x = torch.randn(1536, 576), torch.randn(1, 576)
    with FlopCounterMode(display=False) as counter:
        linear(x, w)
    assert counter.get_total_flops() == 2 * 1536 * 576


def test_under_compile_an_undecided_product_is_f_linear_and_a_decided_one_kept(monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    """A graph traced before any eager call of a shape gets F.linear (the compiler's own product), one traced after
    the eager calls decided gets the measured kind; "blas" (oneDNN off, a process setting, not an op) becomes the
    fastest other kind measured for the key, F.linear where no other was under KIND_MARGIN of it."""
    cpu.force_product(None)
    kinds = ("linear", "mv", "split", "blas", "native")
    decided = {("test", "mv"): "mv", ("test", "split"): "split", ("test", "blas"): "blas"}
    try:
        for key, kind in decided.items():
            _measure(key, kinds, {name: 1e-4 if name == kind else 4e-4 for name in kinds})
            assert cpu.measured()[key] == kind
        # "blas" fastest, "native" next (what a graph can run), F.linear slowest: native in a graph
        _measure(("test", "blas, native next"), kinds,
                 {"linear": 4e-4, "mv": 3.9e-4, "split": 3.9e-4, "blas": 1e-4, "native": 1.4e-4})
        assert cpu.measured()[("test", "blas, native next")] == "blas"
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert cpu.product_kind(("test", "never called eagerly"), kinds) == ("linear", False)
        assert cpu.product_kind(("test", "mv"), kinds) == ("mv", False)
        assert cpu.product_kind(("test", "split"), kinds) == ("split", False)
        assert cpu.product_kind(("test", "blas"), kinds) == ("linear", False)  # the others all 4x: none under it
        assert cpu.product_kind(("test", "blas, native next"), kinds) == ("native", False)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
        assert cpu.product_kind(("test", "blas, native next"), kinds) == ("blas", False)  # eager: still blas
        assert ("test", "never called eagerly") not in cpu.measured()
    finally:
        monkeypatch.undo()
        cpu.forget_measured()
