"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import dataclasses
import math

import torch

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this a temperature divides logits into inf/NaN (float32): such requests are greedy.
MIN_TEMPERATURE = 1e-5


def _check_int(name: str, value: object, low: int) -> None:
    """An integer from `low` up to int64's largest (what torch and the wire formats hold)."""
    # bool is an int subclass: True would pass as 1.
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= INT64_MAX:
        shown = "-2**63" if low == INT64_MIN else low
        raise ValueError(f"{name} must be an integer >= {shown} and < 2**63, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # under MIN_TEMPERATURE (0 included): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k; beyond the vocabulary: the whole vocabulary
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep going past the model's end-of-sequence ids

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (integers must fit int64; floats must be
        finite)."""
        _check_int("max_tokens", self.max_tokens, 1)
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, -1)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN)
        for token in self.stop_token_ids:
            _check_int("stop_token_ids[]", token, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def _filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p exclude, row by row, in one sort."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab).expand_as(sorted_logits)
    k = torch.tensor([min(kk, vocab) if kk > 0 else vocab for kk in top_k])[:, None]
    drop = ranks >= k
    p = torch.tensor(top_p, dtype=logits.dtype)[:, None]
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
    """Pick one token per row; return them with their log-probability under the raw softmax.

    Each row draws from its own generator, so a seeded request gives the same tokens whatever
    else shares its batch. Rows must be sampleable (see `unsampleable_rows`): a NaN would
    silently pick token 0.
    """
    logits = logits.float()
    logprobs = logits.log_softmax(-1)
    tokens = logits.argmax(-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = logits[sampled] / torch.tensor([params[i].temperature for i in sampled])[:, None]
        if any(params[i].top_k > 0 or params[i].top_p < 1 for i in sampled):
            rows = _filter_top_k_top_p(rows, [params[i].top_k for i in sampled],
                                       [params[i].top_p for i in sampled])
        probs = rows.softmax(-1)
        # Exponential race (Gumbel-max in another guise): argmax p / E with E ~ Exp(1).
        noise = torch.stack([torch.empty(probs.shape[-1]).exponential_(generator=generators[i])
                             for i in sampled])
        tokens[sampled] = (probs / noise).argmax(-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()
