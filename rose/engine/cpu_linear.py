"""The engine's linear layers on oneDNN with packed weights (CPU, float32).

PyTorch's `F.linear` runs on MKL on the CPU, at about 80 GFLOP/s on one core here; oneDNN with a
weight packed for its kernels (what vLLM's CPU backend uses) runs the same products 2-3x faster
from 8 rows up, and one row (a batch-1 decode, bound by reading the weights from memory) about
twice as fast once the weights are out of the caches, as a model's are (docs/engine.md, "Where the
time goes"). The packed copy
follows the weight: it is packed again when the weight tensor is replaced or changed in place
(a weight load, an optimizer step: `Tensor._version`), so the model stays the one source of
truth. Forwards that record gradients keep `F.linear`. The copy doubles the memory of the linear
weights. Several linears with one input can be packed as one (`PackedLinear(q, k, v)`): one
product, with fewer calls and wider outputs, in place of several.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN's kernel for one or two rows reads a packed weight slower than its kernel for three to
# six: SmolLM2's 120 layer products took 33.4 ms for one row, 38.4 for two, 28.6 for four (one
# core, weights streamed from memory, as in a decode). Fewer rows are padded to this many.
MIN_ROWS = 4


class PackedLinear:
    """One `nn.Linear` (set as the module's `forward`), or several with one input as one product
    whose output is theirs side by side (q, k and v; gate and up)."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self._pack()

    def _params(self) -> list[torch.Tensor]:
        return [p for linear in self.linears for p in (linear.weight, linear.bias) if p is not None]

    def _pack(self) -> None:
        weights = [linear.weight for linear in self.linears]
        biases = [linear.bias for linear in self.linears]
        self.source = [(param, param._version) for param in self._params()]
        weight = (weights[0] if len(weights) == 1 else torch.cat(weights)).detach()
        self.bias = (None if biases[0] is None else  # type: ignore[arg-type]
                     (biases[0] if len(biases) == 1 else torch.cat(biases)).detach())
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return torch.cat([F.linear(x, linear.weight, linear.bias) for linear in self.linears], -1)
        params = self._params()  # a weight or bias replaced or changed in place: pack again
        if len(params) != len(self.source) or any(
                param is not packed or param._version != version
                for param, (packed, version) in zip(params, self.source, strict=False)):
            self._pack()
        n = x.numel() // x.shape[-1]
        rows = x.reshape(n, x.shape[-1])
        if n < MIN_ROWS:  # zero rows added: the real rows' results are the same, and come sooner
            rows = torch.cat((rows, rows.new_zeros(MIN_ROWS - n, rows.shape[1])))
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [None], "")
        return out[:n].view(*x.shape[:-1], self.out_features)


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
