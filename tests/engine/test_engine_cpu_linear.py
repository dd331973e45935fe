"""The engine's linear layers on oneDNN (`rose.engine.cpu_linear`): the same products as
`F.linear`, following every change of the weight, out of the way of autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rose.engine.cpu_linear import PackedLinear, available, pack_linears

pytestmark = pytest.mark.skipif(not available(torch.ones(1)), reason="PyTorch has no oneDNN here")


def _linear(bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(96, 80, bias=bias)


# Fewer rows than MIN_ROWS (0 to 3 here) are padded with zero rows.
@pytest.mark.parametrize("shape", [(0, 96), (1, 96), (2, 96), (8, 96), (2, 5, 96), (3, 1, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_products_match_f_linear(shape: tuple[int, ...], bias: bool) -> None:
    lin = _linear(bias)
    assert pack_linears(lin) == 1 and isinstance(lin.forward, PackedLinear)
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert pack_linears(lin) == 0  # once


def test_the_packed_copy_follows_the_weight() -> None:
    lin = _linear()
    pack_linears(lin)
    x = torch.randn(8, 96)
    with torch.no_grad():
        lin.weight.mul_(2)  # in place, as a weight load or an optimizer step
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight = nn.Parameter(torch.randn(80, 96))  # replaced
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_forwards_that_record_gradients_keep_f_linear() -> None:
    lin = _linear()
    pack_linears(lin)
    lin(torch.randn(8, 96)).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


def test_only_cpu_float32_layers_are_packed() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16))
    assert pack_linears(model) == 1
    assert not isinstance(model[1].forward, PackedLinear)
