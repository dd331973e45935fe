"""The sampler: greedy, temperature, top-k, top-p, per-request seeds (its parameters are
`rose.contracts.SamplingParams`).

Everything runs on the logits' device, each row drawing from its request's own generator on that
device. A seed gives the same tokens on the same device type whatever else shares the batch; the
CPU's and CUDA's random streams differ, so a seed gives other tokens on the other device type.
"""

from __future__ import annotations

import math

import torch

from rose.contracts.sampling import SamplingParams


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude, row by row, in one sort."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    device = logits.device
    ranks = torch.arange(vocab, device=device).expand_as(sorted_logits)
    k = torch.tensor([min(kk, vocab) if kk > 0 else vocab for kk in top_k], device=device)[:, None]
    drop = ranks >= k
    p = torch.tensor(top_p, dtype=logits.dtype, device=device)[:, None]
    probs = sorted_logits.masked_fill(drop, -math.inf).softmax(-1)
    # Drop a token once the mass strictly before it already reaches top_p (the top one stays).
    drop |= (probs.cumsum(-1) - probs) >= p
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def unsampleable_rows(logits: torch.Tensor) -> list[int]:
    """Rows that no token can be drawn from: a NaN or +inf logit (a numerical fault upstream)."""
    return (logits.isnan() | logits.isposinf()).any(-1).nonzero()[:, 0].tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> tuple[list[int], list[float]]:
    """Pick one token per row; return them with their log-probability: under the raw softmax,
    or with `logprobs_at_temperature` under the softmax of logits / temperature, the policy the
    token was drawn from (RL's behaviour policy; over the whole vocabulary: top-k and top-p
    shape the draw, not the recorded policy, as the trainer recomputes it).

    Each row draws from its own generator, so a seeded request gives the same tokens whatever
    else shares its batch. Rows must be sampleable (see `unsampleable_rows`): a NaN would
    silently pick token 0.
    """
    logits = logits.float()
    device = logits.device
    scale = torch.tensor([p.temperature if p.logprobs_at_temperature and not p.greedy else 1.0
                          for p in params], device=device)[:, None]
    logprobs = (logits / scale).log_softmax(-1)
    tokens = logits.argmax(-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        temperatures = torch.tensor([params[i].temperature for i in sampled], device=device)
        rows = logits[sampled] / temperatures[:, None]
        if any(params[i].top_k > 0 or params[i].top_p < 1 for i in sampled):
            rows = _filter_top_k_top_p(rows, [params[i].top_k for i in sampled],
                                       [params[i].top_p for i in sampled])
        probs = rows.softmax(-1)
        # Exponential race (Gumbel-max in another guise): argmax p / E with E ~ Exp(1).
        noise = torch.stack([torch.empty(probs.shape[-1], device=device).exponential_(generator=generators[i])
                             for i in sampled])
        tokens[sampled] = (probs / noise).argmax(-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()
