"""multihead.linear: the split product of decoding equals F.linear, and stays an nn.Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multihead.linear import MAX_ROWS, Linear, linear, split_count


@pytest.fixture(autouse=True)
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the split needs at least two threads, whatever the machine
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS, MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_split_product_equals_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(96, 192, bias=bias)
    x = torch.randn(1, rows, 96)
    assert split_count(192) == 2
    got = layer(x)
    assert got.shape == (1, rows, 192)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_uneven_widths_other_dtypes_and_gradients_fall_back_or_agree() -> None:
    torch.manual_seed(0)
    odd = Linear(8, 7)  # 7 rows do not split in 2: plain F.linear
    x = torch.randn(2, 8)
    assert torch.equal(odd(x), F.linear(x, odd.weight, odd.bias))
    w64 = torch.randn(6, 8, dtype=torch.float64)
    x64 = torch.randn(1, 8, dtype=torch.float64)
    assert torch.equal(linear(x64, w64), F.linear(x64, w64))  # float32 only
    layer = Linear(16, 32)
    x = torch.randn(1, 16, requires_grad=True)
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
    layer = Linear(16, 32)
    for rows in (1, 5):
        y = layer(torch.randn(1, rows, 16))
        assert y.is_contiguous() and y.stride() == F.linear(torch.randn(1, rows, 16), layer.weight).stride()
