"""Rewards to advantages: pure functions over one batch of trajectories' scalar rewards.

- `group_advantages`: GRPO's outcome supervision (Shao et al. 2024, DeepSeekMath, section 4.1.2):
  each reward minus the mean of its group (the samples of one prompt), divided by the group's
  standard deviation plus `eps`. The std is the unbiased one (Bessel-corrected, as torch's
  default); a group of one sample has advantage 0.
  Dr. GRPO (Liu et al. 2025, arXiv 2503.20783) drops the division: near-equal rewards (a
  group of successes, one of them with an invalid reply) otherwise get advantages as large as
  a success against a failure.
- `informative_groups`: DAPO's dynamic sampling (Yu et al. 2025, section 3.2): a group whose
  rewards all equal has all-zero advantages and gives no gradient, so it is dropped.
- `returns_to_go`: each turn's discounted return from that turn on, for step-level credit in
  multi-turn episodes (GiGPO, Feng et al. 2025, arXiv 2505.10978): the turns of a group's
  trajectories that start from the same state ("anchor state") are a group of their own, and
  `group_advantages` over their returns says which action was better from there.
- `overlong_penalty`: DAPO's soft overlong punishment (section 3.4, eq. 13): 0 up to
  `max_tokens - cache_tokens` generated tokens, then falling linearly to -1 at `max_tokens`,
  and -1 beyond.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def _group_index(groups: Sequence[Hashable], device: torch.device) -> tuple[torch.Tensor, int]:
    ids: dict[Hashable, int] = {}
    index = torch.tensor([ids.setdefault(g, len(ids)) for g in groups], dtype=torch.int64, device=device)
    return index, len(ids)


def _as_rewards(rewards: Sequence[float] | torch.Tensor, groups: Sequence[Hashable]) -> torch.Tensor:
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.ndim != 1 or len(r) != len(groups):
        raise ValueError(f"expected one reward per group id; got {tuple(r.shape)} rewards for "
                         f"{len(groups)} group ids")
    return r


def group_advantages(rewards: Sequence[float] | torch.Tensor, groups: Sequence[Hashable],
                     eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """`(r - mean_g) / (std_g + eps)` for each reward `r` of group `g`, as float32; without
    `scale`, `r - mean_g` (Dr. GRPO)."""
    r = _as_rewards(rewards, groups)
    index, n = _group_index(groups, r.device)
    count = r.new_zeros(n).index_add_(0, index, torch.ones_like(r))
    mean = r.new_zeros(n).index_add_(0, index, r) / count
    centred = r - mean[index]
    var = r.new_zeros(n).index_add_(0, index, centred**2) / (count - 1).clamp(min=1)
    adv = centred / (var.sqrt()[index] + eps) if scale else centred
    return torch.where(count[index] > 1, adv, torch.zeros_like(adv)).float()


def informative_groups(rewards: Sequence[float] | torch.Tensor, groups: Sequence[Hashable],
                       tol: float = 1e-9) -> torch.Tensor:
    """A bool per sample: whether its group's rewards differ (max - min > `tol`)."""
    r = _as_rewards(rewards, groups)
    index, n = _group_index(groups, r.device)
    high = r.new_full((n,), -torch.inf).scatter_reduce_(0, index, r, "amax")
    low = r.new_full((n,), torch.inf).scatter_reduce_(0, index, r, "amin")
    return (high - low)[index] > tol


def returns_to_go(rewards: Sequence[float], discount: float) -> list[float]:
    """`R_t = r_t + discount * R_{t+1}` for each turn's reward `r_t` of one episode."""
    out, total = [], 0.0
    for r in reversed(rewards):
        total = r + discount * total
        out.append(total)
    return out[::-1]


def overlong_penalty(lengths: Sequence[int] | torch.Tensor, max_tokens: int,
                     cache_tokens: int) -> torch.Tensor:
    """DAPO's length-aware penalty for each response length (generated tokens)."""
    if not 0 <= cache_tokens < max_tokens:
        raise ValueError(f"overlong penalty: expected 0 <= cache_tokens < max_tokens, got "
                         f"cache_tokens={cache_tokens}, max_tokens={max_tokens}")
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    soft = max_tokens - cache_tokens
    ramp = (soft - lengths) / max(cache_tokens, 1)
    return torch.where(lengths <= soft, 0.0, torch.where(lengths <= max_tokens, ramp, -1.0)).float()
