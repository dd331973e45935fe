"""LoRA adapters in the engine: many adapters, and the base model, in one batch.

The base forward runs once per iteration over every row; each targeted linear's output then
gains, for each adapter present in the batch, `scaling * (x[rows] @ A.T) @ B.T` on that
adapter's rows alone (index_select, two thin products, index_add_: S-LoRA's and punica's
gathered product, in PyTorch ops). An iteration without adapter rows runs no LoRA code at all.
The adapters' tensors live on the engine's device in its dtype, under `rose.model.lora`'s names.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import xxhash
from torch import nn

from rose.contracts.adapter import LoRAConfig
from rose.model.config import ModelConfig
from rose.model.lora import check_tensors

# One linear's share of a product's output: its module path and its columns there (a packed
# product, q/k/v or gate/up, holds several side by side).
Part = tuple[str, slice]
ALL_COLUMNS = slice(None)


class Adapter:
    """A loaded adapter. Its sequences hold it: a replace changes it in place, so they go on
    with the new tensors over their KV."""

    def __init__(self, name: str, config: LoRAConfig, tensors: dict[str, torch.Tensor], version: int,
                 serial: int) -> None:
        self.name = name
        self.set(config, tensors, version, serial)

    def set(self, config: LoRAConfig, tensors: dict[str, torch.Tensor], version: int, serial: int) -> None:
        self.config, self.tensors, self.version = config, tensors, version
        # Per targeted module: (A `[rank, in]`, B `[out, rank]`).
        self.weights = {name.removesuffix(".lora_A.weight"): (a, tensors[name.replace("lora_A", "lora_B")])
                        for name, a in tensors.items() if name.endswith(".lora_A.weight")}
        # Seeds its sequences' prefix-cache hash chains: KV computed with these tensors is shared
        # only with sequences of this very load (not the base, another adapter, another version,
        # nor a later load under the same name and version).
        self.hash_seed = xxhash.xxh3_64_intdigest(f"lora\0{self.name}\0{version}\0{serial}".encode())


class Rows:
    """One iteration's token rows per adapter present: `groups` of (adapter, row indices on the
    device, or None for every row)."""

    def __init__(self, groups: list[tuple[Adapter, torch.Tensor | None]]) -> None:
        self.groups = groups

    def add(self, x: torch.Tensor, out: torch.Tensor, parts: tuple[Part, ...]) -> None:
        """Add each adapter's products on input rows `x` `[T, in]` to its rows of `out` `[T, out]`,
        in place, for each linear of `parts` it targets. (Stacking a packed product's A's and
        block-diagonal B's, one pair of products in place of three, was slower on the CPU.)"""
        for adapter, rows in self.groups:
            weights = adapter.weights
            targeted = [(weights[module], cols) for module, cols in parts if module in weights]
            if not targeted:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            scaling = adapter.config.scaling
            for (a, b), cols in targeted:
                if rows is None:
                    out[:, cols].addmm_(xs @ a.t(), b.t(), alpha=scaling)
                else:
                    out[:, cols].index_add_(0, rows, (xs @ a.t()) @ b.t(), alpha=scaling)

    @contextlib.contextmanager
    def hooked(self, modules: Mapping[str, nn.Module]) -> Iterator[None]:
        """The model's own forward with the products added: a forward hook on each linear that an
        adapter of the batch targets, for this forward only (`modules`: path -> linear)."""
        paths = {path for adapter, _ in self.groups for path in adapter.weights}
        handles = [modules[path].register_forward_hook(self._hook(path)) for path in paths]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, path: str) -> Any:
        parts = ((path, ALL_COLUMNS),)

        def add(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            x = args[0]
            self.add(x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1]), parts)

        return add


class AdapterSlots:
    """The adapters loaded on one model, by name."""

    def __init__(self, model: nn.Module) -> None:
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.model_config: ModelConfig = model.config  # type: ignore[assignment]
        self.adapters: dict[str, Adapter] = {}
        self.linears = {path: module for path, module in model.named_modules()
                        if isinstance(module, nn.Linear) and path.startswith("model.layers.")}
        self._serials = itertools.count()

    def get(self, name: str) -> Adapter | None:
        return self.adapters.get(name)

    def load(self, name: str, config: LoRAConfig, named_tensors: Iterable[tuple[str, torch.Tensor]],
             version: int) -> None:
        """Load `name`, or replace a loaded one's tensors (all of them where its config changes,
        else any) as `version`. The tensors are copied to the model's device and dtype (the
        caller keeps its own). ValueError, with nothing changed, for an adapter of another base."""
        where = f"adapter {name!r}"
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter name {name!r}: expected a non-empty string")
        if not isinstance(config, LoRAConfig):
            raise ValueError(f"{where}: config is a {type(config).__name__}; expected a LoRAConfig")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"{where}: version {version!r}; expected an integer")
        tensors = dict(named_tensors)
        loaded = self.adapters.get(name)
        # Only a replace under the same settings may give just the tensors that changed.
        kept = loaded.tensors if loaded is not None and loaded.config == config else {}
        try:
            check_tensors(config, self.model_config, {**kept, **tensors}, where)
        except ValueError as exc:
            message = str(exc)
            raise ValueError(message if message.startswith(where) else f"{where}: {message}") from None
        copied = {name: t.to(self.device, self.dtype, copy=True) for name, t in tensors.items()}
        if loaded is None:
            self.adapters[name] = Adapter(name, config, copied, version, next(self._serials))
        else:
            loaded.set(config, {**kept, **copied}, version, next(self._serials))

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise ValueError(f"adapter {name!r} is not loaded; loaded: {self.names()}")

    def names(self) -> str:
        return ", ".join(sorted(self.adapters)) or "none"

    def rows(self, adapters: list[Adapter | None], num_tokens: list[int]) -> Rows | None:
        """The iteration's row mapping: sequence `i` (adapter `adapters[i]`) holds the next
        `num_tokens[i]` rows, in the order the forward lays them out. None without adapter rows."""
        owned: dict[Adapter, list[int]] = {}
        start = 0
        for adapter, n in zip(adapters, num_tokens, strict=True):
            if adapter is not None:
                owned.setdefault(adapter, []).extend(range(start, start + n))
            start += n
        if not owned:
            return None
        return Rows([(adapter, None if len(rows) == start else torch.tensor(rows, device=self.device))
                     for adapter, rows in owned.items()])
