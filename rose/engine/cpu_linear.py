"""The engine's linear layers on oneDNN with packed weights (CPU, float32).

PyTorch's `F.linear` runs on MKL on the CPU, at about 80 GFLOP/s on one core here; oneDNN with a
weight packed for its kernels (what vLLM's CPU backend uses) runs the same products 2-3x faster
from 8 rows up, and one row (a batch-1 decode, bound by reading the weights from memory) about
twice as fast once the weights are out of the caches, as a model's are (docs/engine.md, "Where the
time goes"). The packed copy
follows the weight: it is packed again when the weight tensor is replaced or changed in place
(a weight load, an optimizer step: `Tensor._version`), so the model stays the one source of
truth. Forwards that record gradients keep `F.linear`. The copy doubles the memory of the linear
weights.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear:
    """Replaces one `nn.Linear`'s `forward` (set as the module's attribute)."""

    def __init__(self, linear: nn.Linear) -> None:
        self.linear = linear
        self.dense = type(linear).forward.__get__(linear)
        self._pack()

    def _pack(self) -> None:
        weight = self.linear.weight
        self.source = (weight, weight._version)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.linear.weight
        if torch.is_grad_enabled():
            return self.dense(x)
        if self.source[0] is not weight or self.source[1] != weight._version:
            self._pack()
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, weight.shape[1]), self.packed,
                                                 self.linear.bias, "none", [None], "")
        return out.view(*x.shape[:-1], weight.shape[0])


def available(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_linears(model: nn.Module) -> int:
    """Put every CPU float32 `nn.Linear` of `model` on oneDNN; how many were."""
    packed = 0
    for module in model.modules():
        if (isinstance(module, nn.Linear) and available(module.weight)
                and not isinstance(module.forward, PackedLinear)):
            module.forward = PackedLinear(module)  # type: ignore[method-assign]
            packed += 1
    return packed
