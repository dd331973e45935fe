"""What rolls out beside serving in `rose bench coserve` and its `--burst`: a rollout model, or
(`--rollout adapter`) the policy as a LoRA adapter of the serving model, run two ways in one
benchmark: as a second model beside serving (a second copy of the serving checkpoint with the
adapter: mode `rose`, `rose serve --rollout-model`), and riding the serving model's own forward
(mode `rose_adapter`, `rose serve --rollout-adapter` alone: the executor's adapter mode)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from safetensors import safe_open

from rose.contracts.adapter import LoRAConfig
from rose.engine.kv_pool import KVSpec
from rose.model import ModelConfig
from rose.model.lora import save_adapter

ADAPTER = "policy"  # the name the backlog's turns give the adapter
ADAPTER_MODE = "rose_adapter"


@dataclasses.dataclass(frozen=True)
class Rollouts:
    model: Path  # the rollout model of the two-model modes
    adapter: Path | None = None  # `--rollout adapter`: the policy, an adapter of the serving model

    @property
    def turn_adapter(self) -> str | None:
        """The adapter the backlog's turns name (None: the rollout model's own weights)."""
        return None if self.adapter is None else ADAPTER

    def server_args(self, mode: str) -> tuple[str, ...]:
        """`rose serve`'s rollout flags in `mode`."""
        if self.adapter is None:
            return ("--rollout-model", str(self.model))
        adapter = ("--rollout-adapter", str(self.adapter), "--rollout-adapter-name", ADAPTER)
        return adapter if mode == ADAPTER_MODE else ("--rollout-model", str(self.model), *adapter)


def adapter_rollouts(serving: Path, directory: Path, rank: int) -> Rollouts:
    """`--rollout adapter`'s: a LoRA adapter of `serving` (rank `rank`, alpha 2 x rank, on the
    attention and MLP projections), A and B random as a trained adapter's (a fresh one's B is
    zero), written as a PEFT directory; the two-model modes' rollout model is `serving` again."""
    config = LoRAConfig(rank=rank, alpha=2.0 * rank)
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen) * 0.02
               for name, shape in config.shapes(ModelConfig.from_dir(serving)).items()}
    return Rollouts(serving, save_adapter(directory, config, tensors, str(serving)))


def second_model_pages(serving: Path, rank: int, dtype: torch.dtype) -> dict[str, float]:
    """What adapter mode gives back of a device: the second copy of the model's weights less the
    adapter's, in MiB and in KV pages of the serving model (`dtype`: as the executor loads it)."""
    config = ModelConfig.from_dir(serving)
    weights = 0
    for file in sorted(serving.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            weights += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())  # noqa: SIM118
    shapes = LoRAConfig(rank=rank, alpha=2.0 * rank).shapes(config)
    adapter = sum(math.prod(shape) for shape in shapes.values())
    freed = (weights - adapter) * dtype.itemsize
    return {"weights_mb": round(weights * dtype.itemsize / 2**20, 1),
            "adapter_mb": round(adapter * dtype.itemsize / 2**20, 2),
            "kv_pages_given_back": freed // KVSpec.of(config, dtype).block_bytes}
