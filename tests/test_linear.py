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


def test_the_split_is_measured_once_against_f_linear_and_the_faster_kept() -> None:
    import time as _time

    calls = {"slow": 0, "fast": 0}

    def slow() -> None:
        calls["slow"] += 1
        _time.sleep(0.002)

    def fast() -> None:
        calls["fast"] += 1

    cpu.force_split(None)
    key_a, key_b = ("test", "split slower"), ("test", "split faster")
    try:
        assert cpu.split_pays(key_a, slow, fast) is False
        assert cpu.split_pays(key_b, fast, slow) is True
        assert calls == {"slow": 2 * (1 + cpu.MEASURE_REPEATS), "fast": 2 * (1 + cpu.MEASURE_REPEATS)}
        assert cpu.split_pays(key_a, fast, slow) is False  # kept for the process: not measured again
        assert calls["fast"] == 2 * (1 + cpu.MEASURE_REPEATS)
        cpu.force_split(True)
        assert cpu.split_pays(key_a, slow, fast) is True
    finally:
        cpu.force_split(None)
        for key in (key_a, key_b):
            cpu.forget_measured(key)


def test_linear_gives_f_linear_whichever_way_the_measurement_goes() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(1536, 576), torch.randn(1, 1, 576)
    for forced in (True, False, None):
        cpu.force_split(forced)
        try:
            # the same sum in another order: float32 rounding of sums of 576 products of size ~1 (values ~24)
            torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
        finally:
            cpu.force_split(None)


def test_a_flop_counter_sees_one_product_not_the_measurement() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    cpu.force_split(None)
    cpu.forget_measured()
    w, x = torch.randn(1536, 576), torch.randn(1, 576)
    with FlopCounterMode(display=False) as counter:
        linear(x, w)
    assert counter.get_total_flops() == 2 * 1536 * 576
