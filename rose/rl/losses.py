"""Token-level policy-gradient losses: pure functions of log-probabilities and advantages.

All take `[B, T]` tensors where `mask` marks the generated tokens that count.

- PPO's clipped surrogate as GRPO uses it (DeepSeekMath eq. 3), with DAPO's decoupled clip range
  ("clip-higher", Yu et al. 2025 section 3.1): the ratio is clipped to
  `[1 - clip_low, 1 + clip_high]`.
- The k3 estimator of KL(pi_theta || pi_ref) (DeepSeekMath eq. 4, after Schulman's "Approximating
  KL divergence"): `pi_ref/pi_theta - log(pi_ref/pi_theta) - 1`, unbiased and never negative.
- Aggregation: `"sequence"` averages each sequence's tokens, then the sequences (GRPO's
  1/G sum_i 1/|o_i| sum_t); `"token"` averages over every token of the batch, so longer
  sequences weigh more (DAPO's token-level loss, section 3.3). `denominator` lets gradient
  accumulation and data parallelism divide by the whole batch's count rather than a slice's.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("sequence", "token")


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss `-min(ratio * A, clip(ratio) * A)` and where the clip is active (there the
    token gives no gradient)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def check_aggregation(aggregation: str) -> str:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
    return aggregation


def count(mask: torch.Tensor, aggregation: str) -> int:
    """What `aggregate` divides by: the masked tokens, or the sequences with any."""
    if check_aggregation(aggregation) == "token":
        return int(mask.sum())
    return int(mask.any(-1).sum())


def aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: str,
              denominator: int | None = None) -> torch.Tensor:
    """Reduce per-token `values` `[B, T]` to a scalar (see the module notes)."""
    denominator = count(mask, aggregation) if denominator is None else denominator
    masked = values * mask
    if check_aggregation(aggregation) == "sequence":
        masked = masked.sum(-1) / mask.sum(-1).clamp(min=1)
    return masked.sum() / max(denominator, 1)
