"""Co-serving policies: dual-SLO compute admission and the burst state machine for memory.

Pure decisions over plain numbers (no I/O, no tensors, no clock): the co-serving executor calls
them once per iteration with what it measured, and the cluster simulator calls the very same
code with what it simulated.

Compute (`admit`): for each serving request r the design defines
    prefill slack  S_prf = (t_arr + B_TTFT) - t_now - T_prf(L_r)
    decode slack   S_dec = (t_last + B_TPOT) - t_now - T_dec(b)
where T_prf(L_r) is the predicted time to prefill r's remaining prompt (with the chunks queued
ahead of it, FIFO, `chunk_tokens` of serving prefill per iteration) and T_dec(b) the predicted
time of the next iteration. Both are multiples of the predicted iteration time T, so every slack
is positive exactly while T stays under one ceiling (`iteration_limit`); rollout tokens join the
iteration while T with them added stays under it. Rollout decode sequences are admitted before
rollout prefill tokens: they already hold KV pages, and finishing them frees pages.

Memory (`BurstController`): one page pool, serving keeps a reserved headroom H. NORMAL: the
rollout budget follows serving usage (pool - H - serving). Burst trigger: serving usage crosses
the high-watermark inside H (free pages fall to (1 - high_watermark) * H). Emergency cut: the
rollout budget is halved and the newest rollout sequences that no longer fit are aborted (the
executor hands them back with their partial tokens). BURST lasts while free pages stay under
the watermark (each further crossing halves again); after it, FROZEN keeps the budget where it
is until `new_rl_step()`.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections.abc import Hashable, Sequence
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class TokenLoad:
    """One model's share of one iteration."""

    prefill_tokens: int = 0      # prompt tokens computed this iteration (chunked prefill)
    decode_seqs: int = 0         # sequences producing one token each
    context_tokens: int = 0      # KV tokens attention reads (sum over the decode sequences)



class LatencyModel(Protocol):
    """Predicted wall time of one iteration that runs `serving` and `rollout` together.

    Must be non-decreasing in every field of either load (admission searches over it).
    The executor profiles one at start-up and refits it online; the simulator uses a roofline."""

    def iteration_time(self, serving: TokenLoad, rollout: TokenLoad) -> float: ...


@dataclasses.dataclass(frozen=True)
class SLOBudgets:
    ttft_s: float    # B_TTFT: arrival to first token
    tpot_s: float    # B_TPOT: between consecutive tokens of one request

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO budgets must be positive, got ttft_s={self.ttft_s}, "
                             f"tpot_s={self.tpot_s}")


@dataclasses.dataclass(frozen=True)
class ServingState:
    """The serving side of the device at the start of an iteration.

    waiting: (arrival time, prompt tokens still to prefill) of each request not yet past its
        prefill, in FIFO order.
    decoding_last_token_s: time each decoding request emitted its last token.
    decode_context_tokens: KV tokens of the decoding requests (attention reads them).
    """

    waiting: Sequence[tuple[float, int]] = ()
    decoding_last_token_s: Sequence[float] = ()
    decode_context_tokens: int = 0

    def load(self, chunk_tokens: int) -> TokenLoad:
        """Serving's own share of the next iteration: one prefill chunk plus every decode."""
        pending = sum(tokens for _, tokens in self.waiting)
        return TokenLoad(min(chunk_tokens, pending), len(self.decoding_last_token_s),
                         self.decode_context_tokens)


@dataclasses.dataclass(frozen=True)
class RolloutDemand:
    """Rollout work ready on this device: the context length of each sequence ready to decode,
    in the order they should be admitted (oldest first), and prompt tokens awaiting prefill."""

    decode_context: Sequence[int] = ()
    prefill_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Admission:
    decode_seqs: int           # the first `decode_seqs` of RolloutDemand.decode_context join
    prefill_tokens: int        # rollout prompt tokens that join
    iteration_s: float         # predicted iteration time with them
    limit_s: float             # the iteration-time ceiling the slacks allow (inf: no serving)
    prefill_slack_s: float     # min S_prf over waiting requests with them (inf: none waiting)
    decode_slack_s: float      # min S_dec over decoding requests with them (inf: none decoding)

    @property
    def rollout_tokens(self) -> int:
        return self.decode_seqs + self.prefill_tokens


def _prefill_terms(now: float, serving: ServingState, slo: SLOBudgets,
                   chunk_tokens: int) -> list[tuple[float, int]]:
    """Per waiting request: (time left to its TTFT deadline, iterations until its prefill
    completes), FIFO at `chunk_tokens` of serving prefill per iteration."""
    out, ahead = [], 0
    for arrival, tokens in serving.waiting:
        ahead += tokens
        out.append((arrival + slo.ttft_s - now, max(1, math.ceil(ahead / chunk_tokens))))
    return out


def _limit(serving: ServingState, slo: SLOBudgets, now: float, terms: list[tuple[float, int]]) -> float:
    limit = math.inf
    if serving.decoding_last_token_s:
        limit = min(serving.decoding_last_token_s) + slo.tpot_s - now
    for left, n in terms:
        limit = min(limit, left / n)
    return limit


def _slacks(serving: ServingState, slo: SLOBudgets, now: float, terms: list[tuple[float, int]],
            iteration_s: float) -> tuple[float, float]:
    s_dec = math.inf
    if serving.decoding_last_token_s:
        s_dec = min(serving.decoding_last_token_s) + slo.tpot_s - now - iteration_s
    s_prf = min((left - n * iteration_s for left, n in terms), default=math.inf)
    return s_prf, s_dec


def iteration_limit(now: float, serving: ServingState, slo: SLOBudgets, chunk_tokens: int) -> float:
    """The largest iteration time T for which every serving slack stays non-negative:
    min over decoding r of (t_last + B_TPOT - now), and over waiting r of
    (t_arr + B_TTFT - now) / iterations_r. `inf` when no serving request is in flight."""
    return _limit(serving, slo, now, _prefill_terms(now, serving, slo, chunk_tokens))


def slacks(now: float, serving: ServingState, slo: SLOBudgets, chunk_tokens: int,
           iteration_s: float) -> tuple[float, float]:
    """(min S_prf, min S_dec) if the next iteration takes `iteration_s`; inf where none."""
    return _slacks(serving, slo, now, _prefill_terms(now, serving, slo, chunk_tokens), iteration_s)


def _largest(lo: int, hi: int, fits) -> int:
    """Largest k in [lo, hi] with fits(k), given fits is monotone (true then false) and fits(lo).
    Tries hi first: admission usually has room for everything offered."""
    if fits(hi):
        return hi
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def admit(now: float, serving: ServingState, rollout: RolloutDemand, latency: LatencyModel,
          slo: SLOBudgets, chunk_tokens: int = 512, rollout_chunk_tokens: int | None = None,
          max_iteration_s: float = math.inf) -> Admission:
    """How many rollout decode sequences and prefill tokens may join the next iteration.

    Serving always runs (its chunk and all its decodes); rollout tokens are added only while
    both slacks stay positive with them. `rollout_chunk_tokens` (default `chunk_tokens`) caps
    rollout prefill per iteration; `max_iteration_s` caps the iteration whatever the slacks
    (the executor keeps TTFT room for a request that may arrive while it runs)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    base = serving.load(chunk_tokens)
    terms = _prefill_terms(now, serving, slo, chunk_tokens)
    limit = min(_limit(serving, slo, now, terms), max_iteration_s)
    prefix = [0, *itertools.accumulate(rollout.decode_context)]

    def time_with(d: int, p: int) -> float:
        return latency.iteration_time(base, TokenLoad(p, d, prefix[d]))

    t0 = time_with(0, 0)
    d = p = 0
    if t0 < limit:
        d = _largest(0, len(rollout.decode_context), lambda k: time_with(k, 0) < limit)
        max_p = min(rollout.prefill_tokens, rollout_chunk_tokens or chunk_tokens)
        p = _largest(0, max_p, lambda k: time_with(d, k) < limit)
    t = time_with(d, p) if (d or p) else t0
    s_prf, s_dec = _slacks(serving, slo, now, terms, t)
    return Admission(d, p, t, limit, s_prf, s_dec)


def rollout_capacity(now: float, serving: ServingState, rollout: RolloutDemand,
                     latency: LatencyModel, slo: SLOBudgets, typical_context: int,
                     chunk_tokens: int = 512, limit: int = 1024) -> int:
    """How many more rollout sequences of `typical_context` tokens could decode beside the ones
    in `rollout` with every slack still positive (at most `limit`): the executor's capacity
    report to the scheduler, so that turns go where admission will actually run them."""
    base = serving.load(chunk_tokens)
    ceiling = iteration_limit(now, serving, slo, chunk_tokens)
    d0, c0 = len(rollout.decode_context), sum(rollout.decode_context)

    def fits(k: int) -> bool:
        return latency.iteration_time(base, TokenLoad(0, d0 + k, c0 + k * typical_context)) < ceiling

    return _largest(0, limit, fits) if fits(0) else 0


class BurstState(enum.IntEnum):
    """Exported as a metric: 0 NORMAL, 1 BURST, 2 FROZEN."""

    NORMAL = 0
    BURST = 1
    FROZEN = 2


@dataclasses.dataclass(frozen=True)
class MemoryDecision:
    state: BurstState
    rollout_budget: int                  # pages (or bytes: any one unit) rollout may hold
    abort: tuple[Hashable, ...] = ()     # rollout sequences to abort and hand back, newest first
    cut: bool = False                    # an emergency cut happened in this observation


class BurstController:
    """The burst state machine of one device's shared page pool (units: pages or bytes)."""

    def __init__(self, pool: int, headroom: float = 0.2, high_watermark: float = 0.5) -> None:
        if pool <= 0:
            raise ValueError(f"pool must be positive, got {pool}")
        if not 0.0 < headroom < 1.0:
            raise ValueError(f"headroom must be in (0, 1), got {headroom}")
        if not 0.0 < high_watermark <= 1.0:
            raise ValueError(f"high_watermark must be in (0, 1], got {high_watermark}")
        self.pool = pool
        self.headroom = int(pool * headroom)
        # Free pages at or below this means serving has used `high_watermark` of its headroom.
        self.trigger_free = self.headroom * (1.0 - high_watermark)
        self.state = BurstState.NORMAL
        self.budget = pool - self.headroom
        self.bursts = 0           # emergency cuts so far
        self.aborted = 0          # rollout sequences aborted so far

    def observe(self, serving_used: int, rollout: Sequence[tuple[Hashable, int]]) -> MemoryDecision:
        """Update with current usage; `rollout` is (sequence id, units held) oldest first.
        The caller aborts the returned sequences before granting any rollout page again."""
        rollout_used = sum(units for _, units in rollout)
        crossed = self.pool - serving_used - rollout_used <= self.trigger_free
        if crossed and rollout_used > 0:
            return self._cut(rollout, rollout_used)
        if self.state is BurstState.NORMAL:
            self.budget = max(0, self.pool - self.headroom - serving_used)
        elif self.state is BurstState.BURST and not crossed:
            self.state = BurstState.FROZEN
        return MemoryDecision(self.state, self.budget)

    def _cut(self, rollout: Sequence[tuple[Hashable, int]], rollout_used: int) -> MemoryDecision:
        self.budget = min(self.budget, rollout_used) // 2
        self.state = BurstState.BURST
        self.bursts += 1
        victims, held = [], rollout_used
        for seq_id, units in reversed(rollout):
            if held <= self.budget:
                break
            victims.append(seq_id)
            held -= units
        self.aborted += len(victims)
        return MemoryDecision(self.state, self.budget, tuple(victims), cut=True)

    def can_grant(self, rollout_used: int, units: int) -> bool:
        """Whether rollout may take `units` more on top of `rollout_used` now."""
        return rollout_used + units <= self.budget

    def new_rl_step(self) -> None:
        """A new RL step began: the rollout budget may grow again."""
        self.state = BurstState.NORMAL
