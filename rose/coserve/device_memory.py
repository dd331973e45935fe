"""One GPU's memory shared by the two models of `rose serve --engine vllm --device cuda`, sized
from one setting, vLLM's own `--gpu-memory-utilization` (`ExecutorConfig.gpu_memory_utilization`,
default 0.9): the share of the whole device's memory this process may take.

- vLLM takes `serving_pool_share` of it, passed as its own `gpu_memory_utilization`: its
  weights, activations and CUDA graphs, and in what is left its KV cache, which it sizes by
  profiling, as `vllm serve` does. It starts first, while ROSE holds nothing on the device.
- The rollout model takes the rest (less, if vLLM came to hold more than its share): its
  weights, the activations of one engine iteration, and in what is left its KV pool.

On the CPU neither applies: the pool is `pool_mb`, and vLLM's KV cache `serving_pool_share` of it
(its `kv_cache_memory_bytes`).
"""

from __future__ import annotations

import dataclasses

import torch

from rose.coserve.settings import ExecutorConfig
from rose.model.decoder import CausalLM

GiB = 1024**3


def check_memory_settings(config: ExecutorConfig, gpu_vllm: bool) -> None:
    """ValueError for a memory setting given where it sizes nothing: `pool_mb` with vLLM on a GPU
    (sized from `gpu_memory_utilization` there), `gpu_memory_utilization` anywhere else."""
    changed = config.changed()
    if gpu_vllm and "pool_mb" in changed:
        raise ValueError("pool_mb: with --engine vllm on cuda both models' memory is sized from "
                         "gpu_memory_utilization (vLLM's flag, a share of the whole GPU) and "
                         "serving_pool_share; leave pool_mb out")
    if not gpu_vllm and "gpu_memory_utilization" in changed:
        raise ValueError("gpu_memory_utilization: sizes the memory of --engine vllm on cuda; here the KV "
                         "pool is pool_mb")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class GpuBudget:
    """What this process may take of one GPU: `utilization` of its memory, counted from what was
    free when the budget was taken (as vLLM counts it: what this process held before, its CUDA
    context included, is outside)."""

    device: torch.device
    total: int
    free_at_start: int
    utilization: float

    @classmethod
    def take(cls, device: torch.device, utilization: float) -> GpuBudget:
        """ValueError where less than the budget is free."""
        free, total = torch.cuda.mem_get_info(device)
        budget = cls(device, total, free, utilization)
        if free < budget.bytes:
            raise ValueError(f"gpu_memory_utilization: {utilization:g} of {device}'s {_gib(total)} is "
                             f"{_gib(budget.bytes)}, but only {_gib(free)} is free (other processes hold the "
                             "rest); lower it")
        return budget

    @property
    def bytes(self) -> int:
        return int(self.total * self.utilization)

    def held(self) -> int:
        """What this process holds of the device now beyond what it held when the budget was
        taken, with its allocator's cached blocks given back first."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return self.free_at_start - torch.cuda.mem_get_info(self.device)[0]


def rollout_pool_bytes(budget: int, serving: int, weights: int, activations: int) -> int:
    """The rollout model's KV pool: what `budget` leaves once vLLM's part (`serving`), the rollout
    model's weights and one of its iterations' activations are counted. ValueError naming each
    when nothing is left."""
    pool = budget - serving - weights - activations
    if pool <= 0:
        raise ValueError(f"gpu_memory_utilization: its {_gib(budget)} leave the rollout model no KV pool "
                         f"once vLLM's {_gib(serving)} (serving_pool_share of it), the rollout model's "
                         f"weights ({_gib(weights)}) and one iteration's activations ({_gib(activations)}) "
                         "are counted; raise gpu_memory_utilization or lower serving_pool_share")
    return pool


def iteration_activations(model: CausalLM, tokens: int, rows: int) -> int:
    """What one engine iteration of `model` may take beside its weights: twice the peak of a
    dense forward of `tokens` tokens with the logits of `rows` of them (float32, and their
    log-softmax). Twice, for what the engine's paged forward keeps beside (its attention plans,
    the memory of its captured decode graphs) and for the allocator's fragments: a margin, not a
    measurement of the engine's own forward."""
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        hidden = model.model(torch.zeros(1, tokens, dtype=torch.long, device=device))
        model.lm_head(hidden[0, -rows:]).float().log_softmax(-1)
    del hidden
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return 2 * peak
