"""Token-level policy-gradient losses: pure functions of log-probabilities and advantages.

All take `[B, T]` tensors where `mask` marks the generated tokens that count.

- PPO's clipped surrogate as GRPO uses it (DeepSeekMath eq. 3), with DAPO's decoupled clip range
  ("clip-higher", Yu et al. 2025 section 3.1): the ratio is clipped to
  `[1 - clip_low, 1 + clip_high]`. Off-policy tokens (sampled by an older policy version, or by
  an engine whose numerics differ from the trainer's) can carry a ratio far from 1: the log-ratio
  is clamped to +-`log_ratio_limit` (20, as verl) before the exponential, and dual-clip PPO (Ye
  et al. 2020, arXiv 1912.09729) bounds a negative-advantage token's loss by `clip_ratio_c` x |A|
  (3.0, as verl), where plain PPO's grows with the ratio without bound.
- `truncated_is_weights`: truncated importance sampling (Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training"): when the trainer recomputes the old
  policy's logprobs, each token is weighted by min(pi_old / pi_behaviour, cap), the correction
  for the policy that actually sampled it.
- The k3 estimator of KL(pi_theta || pi_ref) (DeepSeekMath eq. 4, after Schulman's "Approximating
  KL divergence"): `pi_ref/pi_theta - log(pi_ref/pi_theta) - 1`, never negative; the log-ratio
  is clamped to +-20 and the estimate to at most 10, as verl's `low_var_kl`.
- Aggregation, named as verl names it: `token-mean` over every token of the batch (DAPO's
  token-level loss, section 3.3: longer sequences weigh more); `seq-mean-token-mean` averages
  each sequence's tokens, then the sequences (GRPO's 1/G sum_i 1/|o_i| sum_t);
  `seq-mean-token-sum` sums each sequence's tokens; `seq-mean-token-sum-norm` sums them and
  divides by a constant `norm_tokens` (Dr. GRPO, Liu et al. 2025: no 1/|o_i|, so a long failing
  episode is not penalised more thinly per token than a short one). `denominator` lets gradient
  accumulation and data parallelism divide by the whole batch's count rather than a slice's.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOG_RATIO_LIMIT = 20.0
KL_LIMIT = 10.0


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float, clip_ratio_c: float = 3.0,
                      log_ratio_limit: float = LOG_RATIO_LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss `-min(ratio * A, clip(ratio) * A)`, at most `clip_ratio_c * |A|` where
    A < 0 (dual clip; inf: off), and where a clip is active (there the token gives no gradient)."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-log_ratio_limit, log_ratio_limit))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    dual = (advantages < 0) & (loss > -clip_ratio_c * advantages)
    loss = torch.where(dual, -clip_ratio_c * advantages, loss)
    return loss, (clipped < unclipped) | dual


def truncated_is_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """min(pi_old / pi_behaviour, cap) per token, detached (a weight, not a path for gradients)."""
    log_ratio = (old_logprobs - behaviour_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(log_ratio).clamp(max=cap).detach()


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(max=KL_LIMIT)


def check_aggregation(aggregation: str) -> str:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
    return aggregation


def count(mask: torch.Tensor, aggregation: str) -> int:
    """What `aggregate` divides by: the masked tokens, or the sequences with any."""
    if check_aggregation(aggregation) == "token-mean":
        return int(mask.sum())
    return int(mask.any(-1).sum())


def aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: str, denominator: int | None = None,
              norm_tokens: int = 1) -> torch.Tensor:
    """Reduce per-token `values` `[B, T]` to a scalar (see the module notes)."""
    denominator = count(mask, aggregation) if denominator is None else denominator
    masked = values * mask
    if aggregation == "seq-mean-token-mean":
        masked = masked.sum(-1) / mask.sum(-1).clamp(min=1)
    elif aggregation == "seq-mean-token-sum-norm":
        masked = masked / norm_tokens
    return masked.sum() / max(denominator, 1)
