"""Co-serving policies: dual-SLO compute admission and the burst state machine for memory.

Pure decisions over plain numbers (no I/O, no tensors, no clock): the co-serving executor calls
them once per iteration with what it measured, and the cluster simulator calls the very same
code with what it simulated. Every decision also takes numpy arrays in place of its numbers, one
entry per device (`ServingState`, `RolloutDemand`, `BurstController`: "Arrays"), so that a
simulator of thousands of devices decides for all of them in one call; the branches are
elementwise selects (`_where`), the searches bisect every device at once (`_largest`).

Compute (`admit`): for each serving request r the design defines
    prefill slack  S_prf = (t_arr + B_TTFT) - t_now - T_prf(L_r)
    decode slack   S_dec = (t_last + B_TPOT) - t_now - T_dec(b)
where T_prf(L_r) is the predicted time to prefill r's remaining prompt (with the chunks queued
ahead of it, FIFO, `chunk_tokens` of serving prefill per iteration) and T_dec(b) the predicted
time of the next iteration. Both are multiples of the predicted iteration time T, so every slack
is positive exactly while T stays under one ceiling (`iteration_limit`); rollout tokens join the
iteration while T with them added stays under it. Rollout decode sequences are admitted before
rollout prefill tokens: they already hold KV pages, and finishing them frees pages.

Two refinements make the ceiling the SLO as it is measured (docs/coserve.md, "Admission"):
- banked slack: TPOT is measured per request, (last - first token) / (tokens - 1), so a request
  that has run ahead of B_TPOT may spend what it banked, minus a reserve of one full serving
  iteration that later serving work may still need;
- inflation budgets: rollouts may add at most `tpot_inflation` (`ttft_inflation`) of what each
  request spent on serving work itself to its decode time (its time to first token), so that
  serving barely notices them even where the SLOs would allow more.
The latency model is read at a quantile of its error (`LatencyModel`), and `share` (from the
feedback guard `SlackGuard`) scales the rollout part of the ceiling down after an overrun.

One step for every caller (`admission_step`: the native executor, the vLLM scheduler and the
simulator): serving state in, admitted rollout work out, with one cap on the rollout part of an
iteration, decodes before prefill and one idle minimum. The mechanisms build the state from
their requests (`serving_state`) and charge each request the rollout time it waited for
(`RolloutWait`). The free slots a device reports (`rollout_capacity`) follow one memory rule
(`memory_room`): none in a burst, else as many typical turns as the free rollout budget holds.

Priority (`priority_tokens`, `priority_pages`): the `priority` policy, vLLM's priority
scheduling (serving at a higher priority than rollouts) carried over to two models on one
device, for the benchmark: serving goes first every iteration and never waits on rollout
memory, rollouts fill whatever it leaves of the iteration's token budget and of the pool, with
no SLO in the decision: it orders a batch, it does not bound its size.

Memory (`BurstController`): one page pool, serving keeps a reserved headroom H. NORMAL: the
rollout budget follows serving usage (pool - H - serving). Burst trigger: serving usage crosses
the high-watermark inside H (free pages fall to (1 - high_watermark) * H). Emergency cut: the
rollout budget is halved and the newest rollout sequences that no longer fit are aborted (the
executor hands them back with their partial tokens). BURST lasts while free pages stay under
the watermark (each further crossing halves again); after it, FROZEN keeps the budget where it
is until an RL step has begun (`new_rl_step()`) and serving's usage has receded
(`BurstController.thaw_below`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from rose.contracts import TokenLoad
from rose.coserve.settings import (
    ARRIVAL_RESERVE_TOKENS,
    CHUNK_TOKENS,
    HEADROOM,
    HIGH_WATERMARK,
    IDLE_MIN_ROLLOUT_TOKENS,
    ExecutorConfig,
)

# -- one decision for a device or for many ------------------------------------------------------
# A number, or a numpy array of them with one entry per device.
Num = Any


def _is_array(*xs: Num) -> bool:
    return any(isinstance(x, np.ndarray) for x in xs)


def _min(a: Num, b: Num) -> Num:
    return np.minimum(a, b) if _is_array(a, b) else min(a, b)


def _max(a: Num, b: Num) -> Num:
    return np.maximum(a, b) if _is_array(a, b) else max(a, b)


def _where(cond: Num, a: Num, b: Num) -> Num:
    """`a` where `cond` holds, else `b`: the branch of one device, or of each device."""
    return np.where(cond, a, b) if _is_array(cond, a, b) else (a if cond else b)


def _ceil(x: Num) -> Num:
    return np.ceil(x) if isinstance(x, np.ndarray) else math.ceil(x)


def _present(x: Num) -> Num:
    """Whether an entry is there: arrays pad the devices that have fewer entries with inf."""
    return np.isfinite(x) if isinstance(x, np.ndarray) else True


def _count(times: Sequence[Num]) -> Num:
    """Entries there (per device, for arrays) of a sequence of times."""
    if times and isinstance(times[0], np.ndarray):
        return sum(np.isfinite(x) for x in times)
    return len(times)


def _all(x: Num) -> bool:
    return bool(np.all(x)) if isinstance(x, np.ndarray) else bool(x)


def _any(x: Num) -> bool:
    return bool(np.any(x)) if isinstance(x, np.ndarray) else bool(x)


class LatencyModel(Protocol):
    """Predicted wall time of one iteration that runs `serving` and `rollout` together.

    Must be non-decreasing in every field of either load (admission searches over it).
    The executor profiles one at start-up and refits it online; the simulator uses a roofline."""

    def iteration_time(self, serving: TokenLoad, rollout: TokenLoad) -> float: ...


@dataclasses.dataclass(frozen=True)
class SLOBudgets:
    ttft_s: float    # B_TTFT: arrival to first token
    tpot_s: float    # B_TPOT: between consecutive tokens of one request
    # The share of a request's own serving time that rollouts may add to its time to first
    # token / its decode time (inf: only B_TTFT and B_TPOT bound them).
    ttft_inflation: float = math.inf
    tpot_inflation: float = math.inf

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO budgets must be positive, got ttft_s={self.ttft_s}, "
                             f"tpot_s={self.tpot_s}")
        if not (self.ttft_inflation >= 0 and self.tpot_inflation >= 0):
            raise ValueError(f"inflation budgets must be >= 0, got ttft_inflation={self.ttft_inflation}, "
                             f"tpot_inflation={self.tpot_inflation}")

    @classmethod
    def of(cls, config: ExecutorConfig) -> SLOBudgets:
        """The budgets an executor's settings state (milliseconds there, seconds here)."""
        return cls(config.slo_ttft_ms / 1e3, config.slo_tpot_ms / 1e3, config.ttft_inflation,
                   config.tpot_inflation)

    @functools.cached_property
    def without_inflation(self) -> SLOBudgets:
        """B_TTFT and B_TPOT alone, for bounds that leave the inflation budgets to be kept over
        time (asked in hot loops: made once)."""
        return SLOBudgets(self.ttft_s, self.tpot_s)


@dataclasses.dataclass(frozen=True)
class ServingState:
    """The serving side of the device at the start of an iteration.

    waiting: (arrival time, prompt tokens still to prefill) of each request not yet past its
        prefill, in FIFO order.
    decoding_last_token_s: time each decoding request emitted its last token.
    decode_context_tokens: KV tokens of the decoding requests (attention reads them).
    decoding_counts: the decoding requests each entry of `decoding_last_token_s` stands for
        (requests that emitted their last token together, counted instead of listed: the
        simulator's form); empty means one each.
    The rest are per-request accounts, parallel to `waiting` / `decoding_last_token_s`; empty
    means none kept (no banked slack; rollouts have taken none of the request's time):
    waiting_rollout_s: time each waiting request has spent waiting for rollout work.
    decoding_first_token_s, decoding_output_tokens: when each decoding request emitted its first
        token and how many it has emitted (for banked slack).
    decoding_rollout_s: time each decoding request has spent waiting for rollout work since its
        first token.

    Arrays: for many devices at once, every per-request entry is an array over the devices (a
    column), padded with an arrival / last-token time of inf (and 0 tokens) for devices with
    fewer requests; `decode_context_tokens` is an array over the devices.
    """

    waiting: Sequence[tuple[float, int]] = ()
    decoding_last_token_s: Sequence[float] = ()
    decode_context_tokens: int = 0
    decoding_counts: Sequence[Num] = ()
    waiting_rollout_s: Sequence[float] = ()
    decoding_first_token_s: Sequence[float] = ()
    decoding_output_tokens: Sequence[int] = ()
    decoding_rollout_s: Sequence[float] = ()

    @property
    def waiting_requests(self) -> Num:
        return _count([arrival for arrival, _ in self.waiting])

    @property
    def decoding_requests(self) -> Num:
        if not self.decoding_counts:
            return _count(self.decoding_last_token_s)
        return sum(_where(_present(last), n, 0)
                   for last, n in zip(self.decoding_last_token_s, self.decoding_counts, strict=True))

    def load(self, chunk_tokens: int) -> TokenLoad:
        """Serving's own share of the next iteration: one prefill chunk plus every decode."""
        pending = sum(tokens for _, tokens in self.waiting)
        return TokenLoad(_min(chunk_tokens, pending), self.decoding_requests, self.decode_context_tokens)


@dataclasses.dataclass
class RolloutWait:
    """The seconds one serving request has waited for rollout work: in all, and up to its first
    token (what admission's inflation budgets and banked slack read)."""

    total_s: float = 0.0
    before_first_s: float = 0.0

    def charge(self, seconds: float, age_s: float, first_token: bool) -> None:
        """Rollout work of `seconds` ran while the request was in flight, `age_s` after it arrived
        (it waited for no more of the work than that); `first_token`: whether its first token
        came before the work ran."""
        self.total_s += min(seconds, age_s)
        if not first_token:
            self.before_first_s = self.total_s

    @property
    def since_first_s(self) -> float:
        return self.total_s - self.before_first_s


class ServingRequest(NamedTuple):
    """One serving request in flight on a device, as a mechanism reads it for `serving_state`."""

    arrival_s: float
    prompt_left: int                 # prompt tokens still to prefill (before the first token)
    context_tokens: int              # KV tokens its decode reads (after the first token)
    first_token_s: float | None
    last_token_s: float | None
    output_tokens: int
    wait: RolloutWait


def serving_state(requests: Iterable[ServingRequest]) -> ServingState:
    """The `ServingState` of a device's serving requests, given in arrival order: those without a
    first token wait (FIFO), the others decode, each with its accounts."""
    waiting, decoding = [], []
    for r in requests:
        (waiting if r.first_token_s is None else decoding).append(r)
    return ServingState(
        waiting=[(r.arrival_s, r.prompt_left) for r in waiting],
        decoding_last_token_s=[r.last_token_s for r in decoding],
        decode_context_tokens=sum(r.context_tokens for r in decoding),
        waiting_rollout_s=[r.wait.total_s for r in waiting],
        decoding_first_token_s=[r.first_token_s for r in decoding],
        decoding_output_tokens=[r.output_tokens for r in decoding],
        decoding_rollout_s=[r.wait.since_first_s for r in decoding])


@dataclasses.dataclass(frozen=True)
class RolloutDemand:
    """Rollout work ready on this device: the context length of each sequence ready to decode,
    in the order they should be admitted (oldest first), and prompt tokens awaiting prefill.
    Arrays: `decode_context` is [devices, sequences], each row's sequences first and 0 after
    them (a sequence holds at least one token); `prefill_tokens` an array over the devices."""

    decode_context: Sequence[int] | np.ndarray = ()
    prefill_tokens: Num = 0

    # Arrays: summed along their rows by einsum, several times faster than numpy's reductions
    # along rows this short (and exact: the entries are integers).
    @property
    def decodes(self) -> Num:
        c = self.decode_context
        return np.einsum("ij->i", (c != 0).astype(np.intp)) if isinstance(c, np.ndarray) else len(c)

    @property
    def context_tokens(self) -> Num:
        c = self.decode_context
        return np.einsum("ij->i", c) if isinstance(c, np.ndarray) else sum(c)


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
                   chunk_tokens: int) -> list[tuple[Num, Num]]:
    """Per waiting request: (time left to its TTFT deadline, iterations until its prefill
    completes), FIFO at `chunk_tokens` of serving prefill per iteration."""
    out, ahead = [], 0
    for arrival, tokens in serving.waiting:
        ahead = ahead + tokens      # not in place: a column must not change
        out.append((arrival + slo.ttft_s - now, _max(1, _ceil(ahead / chunk_tokens))))
    return out


def _ceiling(now: float, serving: ServingState, slo: SLOBudgets, terms: list[tuple[Num, Num]],
             serving_s: Num, reserve_s: Num) -> Num:
    """The largest iteration time T (serving's own `serving_s` plus rollout work) that keeps
    every serving request within B_TPOT (per token, or within what it banked beyond
    `reserve_s`), within B_TTFT, and within its inflation budgets. (A padded entry's terms are
    inf: its times are.)"""
    limit = math.inf
    acc = bool(serving.decoding_first_token_s)
    for i, last in enumerate(serving.decoding_last_token_s):
        room = last + slo.tpot_s - now
        own, taken = serving_s, 0.0
        if acc:
            first, n = serving.decoding_first_token_s[i], serving.decoding_output_tokens[i]
            # Token n + 1 keeps (last - first) / n <= B_TPOT while it comes by first + n B_TPOT.
            room = _max(room, first + n * slo.tpot_s - now - reserve_s)
            taken = serving.decoding_rollout_s[i]
            own = own + now - first - taken
        limit = _min(limit, room)
        if math.isfinite(slo.tpot_inflation):
            spent = serving_s + slo.tpot_inflation * own - taken
            limit = _min(limit, _where(_present(last), spent, math.inf))
    taken_w = serving.waiting_rollout_s or [0.0] * len(terms)
    for (arrival, _), (left, n), taken in zip(serving.waiting, terms, taken_w, strict=True):
        limit = _min(limit, left / n)
        if math.isfinite(slo.ttft_inflation):
            own = now - arrival - taken + n * serving_s
            limit = _min(limit, _where(_present(arrival), serving_s + (slo.ttft_inflation * own - taken) / n,
                                       math.inf))
    return limit


def _slacks(serving: ServingState, slo: SLOBudgets, now: float, terms: list[tuple[Num, Num]],
            iteration_s: Num) -> tuple[Num, Num]:
    s_dec = math.inf
    if serving.decoding_last_token_s:
        s_dec = functools.reduce(_min, serving.decoding_last_token_s) + slo.tpot_s - now - iteration_s
    s_prf = functools.reduce(_min, (left - n * iteration_s for left, n in terms), math.inf)
    return s_prf, s_dec


def _limit(now: float, serving: ServingState, slo: SLOBudgets, latency: LatencyModel, chunk_tokens: int,
           share: float, max_rollout_s: float) -> tuple[Num, list[tuple[Num, Num]], TokenLoad]:
    """`iteration_limit`, with the prefill terms and serving's own load it was found from."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    base = serving.load(chunk_tokens)
    serving_s = latency.iteration_time(base, TokenLoad())
    # One full serving iteration, kept back from banked slack (only requests with accounts bank).
    reserve_s = latency.iteration_time(
        TokenLoad(chunk_tokens, base.decode_seqs, serving.decode_context_tokens),
        TokenLoad()) if serving.decoding_first_token_s else 0.0
    terms = _prefill_terms(now, serving, slo, chunk_tokens)
    limit = _ceiling(now, serving, slo, terms, serving_s, reserve_s)
    limit = _where(limit > serving_s, serving_s + _min(share * (limit - serving_s), max_rollout_s), limit)
    return limit, terms, base


def iteration_limit(now: float, serving: ServingState, slo: SLOBudgets, latency: LatencyModel,
                    chunk_tokens: int = CHUNK_TOKENS, share: float = 1.0,
                    max_rollout_s: float = math.inf) -> Num:
    """The largest iteration time T that keeps every serving request within its SLOs and
    inflation budgets (module docstring), with the rollout part of it (T minus serving's own
    predicted time) scaled by `share` and capped at `max_rollout_s`. `inf` when no serving
    request is in flight and no cap is set."""
    return _limit(now, serving, slo, latency, chunk_tokens, share, max_rollout_s)[0]


def _take(x: Num, rows: np.ndarray | None) -> Num:
    """The entries of `rows` of an array over the devices (all of them, or a number, as it is)."""
    return x[rows] if rows is not None and isinstance(x, np.ndarray) else x


def _largest(lo: Num, hi: Num, fits: Callable[[Num, np.ndarray | None], Num]) -> Num:
    """Largest k in [lo, hi] with fits(k), given fits is monotone (true then false) and fits(lo).
    Tries hi first: admission usually has room for everything offered. Arrays: every device's
    search at once, bisecting only the devices where hi does not fit (`fits(k, rows)` judges
    those rows; a device where fits(lo) fails gets lo)."""
    top = fits(hi, None)
    if _all(top):
        return hi
    rows = np.flatnonzero(~top) if isinstance(top, np.ndarray) else None
    lo, below = _take(lo, rows), _take(hi, rows) - 1
    for _ in range(int(np.max(_max(0, below - lo))).bit_length()):
        mid = (lo + below + 1) // 2
        ok = fits(mid, rows)
        lo, below = _where(ok, mid, lo), _where(ok, below, mid - 1)
    if rows is None:
        return lo
    out = np.broadcast_to(hi, top.shape).copy()
    out[rows] = lo
    return out


class _Offer:
    """Predicted times of the next iteration with serving's `base` load and the first `d` rollout
    decodes of `decode_context` plus `p` rollout prefill tokens (a device's, each predicted once:
    the searches come back to some; or every device's at once)."""

    def __init__(self, latency: LatencyModel, base: TokenLoad,
                 decode_context: Sequence[int] | np.ndarray) -> None:
        self.latency, self.base = latency, base
        if isinstance(decode_context, np.ndarray):
            # Summed into a zero column's right: numpy's cumsum along short rows is several times
            # slower into an array of its own making than into one given (`out`).
            c = decode_context
            self.prefix: Any = np.zeros((len(c), c.shape[1] + 1), np.cumsum(c[:0]).dtype)
            np.cumsum(c, axis=1, out=self.prefix[:, 1:])
            # Looked up flat (row offset + d): numpy's one-index gather is the faster.
            self.flat = self.prefix.ravel()
            self._of: tuple[Any, ...] = (None, base, np.arange(len(c)) * self.prefix.shape[1])
        else:
            self.prefix = [0, *itertools.accumulate(decode_context)]
        self.times: dict[tuple[int, int], float] = {}

    def _on(self, rows: np.ndarray | None) -> tuple[TokenLoad, np.ndarray]:
        """Serving's load and the offsets into `flat` of the devices `rows` (all: None), taken
        once for the rows asked of last: a search asks of the same ones step after step."""
        if self._of[0] is not rows:
            b, width = self.base, self.prefix.shape[1]
            self._of = ((None, b, np.arange(len(self.prefix)) * width) if rows is None else
                        (rows, TokenLoad(_take(b.prefill_tokens, rows), _take(b.decode_seqs, rows),
                                         _take(b.context_tokens, rows)), rows * width))
        return self._of[1], self._of[2]

    def time(self, d: Num, p: Num, rows: np.ndarray | None = None) -> Num:
        """The iteration's predicted time (arrays: of the devices `rows`, or all)."""
        if _is_array(self.prefix):
            base, offset = self._on(rows)
            return self.latency.iteration_time(base, TokenLoad(p, d, self.flat[offset + d]))
        t = self.times.get((d, p))
        if t is None:
            t = self.times[d, p] = self.latency.iteration_time(self.base, TokenLoad(p, d, self.prefix[d]))
        return t

    def fill(self, limit: Num, decodes: Num, max_prefill: Num,
             decodes_first: bool = False) -> tuple[Num, Num]:
        """The most decodes (of the first `decodes`), then the most prefill tokens (up to
        `max_prefill`; with `decodes_first`, none beside fewer than all `decodes`), under `limit`."""
        none = self.time(0, 0) >= limit
        if _all(none):
            return 0, 0
        d = _largest(0, decodes, lambda k, rows: self.time(k, 0, rows) < _take(limit, rows))
        if decodes_first:  # (and no search for it there)
            max_prefill = _where(d < decodes, 0, max_prefill)
        p = _largest(0, max_prefill, lambda k, rows: self.time(_take(d, rows), k, rows) < _take(limit, rows))
        return _where(none, 0, d), _where(none, 0, p)

    def admission(self, now: float, serving: ServingState, slo: SLOBudgets, terms: list[tuple[Num, Num]],
                  d: Num, p: Num, limit: Num) -> Admission:
        t = self.time(d, p)
        s_prf, s_dec = _slacks(serving, slo, now, terms, t)
        return Admission(d, p, t, limit, s_prf, s_dec)


def admit(now: float, serving: ServingState, rollout: RolloutDemand, latency: LatencyModel,
          slo: SLOBudgets, chunk_tokens: int = CHUNK_TOKENS, rollout_chunk_tokens: int | None = None,
          share: float = 1.0, max_rollout_s: float = math.inf) -> Admission:
    """How many rollout decode sequences and prefill tokens may join the next iteration.

    Serving always runs (its chunk and all its decodes); rollout tokens are added only while
    the iteration stays under `iteration_limit` with them. `rollout_chunk_tokens` (default
    `chunk_tokens`) caps rollout prefill per iteration; `share` and `max_rollout_s` scale and
    cap the rollout part of the ceiling (the feedback guard; `rollout_time_cap`)."""
    limit, terms, base = _limit(now, serving, slo, latency, chunk_tokens, share, max_rollout_s)
    offer = _Offer(latency, base, rollout.decode_context)
    max_prefill = _min(rollout.prefill_tokens, rollout_chunk_tokens or chunk_tokens)
    d, p = offer.fill(limit, rollout.decodes, max_prefill)
    return offer.admission(now, serving, slo, terms, d, p, limit)


def admission_step(now: float, serving: ServingState, rollout: RolloutDemand, latency: LatencyModel,
                   slo: SLOBudgets, chunk_tokens: int = CHUNK_TOKENS, share: float = 1.0,
                   arrival_reserve_tokens: int = ARRIVAL_RESERVE_TOKENS,
                   idle_min_tokens: int = IDLE_MIN_ROLLOUT_TOKENS, banked: bool = True) -> Admission:
    """The rollout work that joins one iteration of a co-serving device: the one step the native
    executor, the vLLM scheduler and the simulator run.

    1. cap: the rollout part of the iteration stays under `rollout_time_cap`, for a serving
       request that may arrive while it runs (a prompt of `arrival_reserve_tokens`);
    2. `admit`, under the SLOs and, with `banked`, the inflation budgets of each request's
       accounts in `serving`; without it the caller keeps the inflation budgets on average over
       iterations (`rollout_duty`: the simulator's fluid model) and the SLOs alone bound this one;
    3. decodes first: rollout prefill joins only beside every ready rollout decode (an engine
       spends a token budget on ready decodes first, so prefill tokens admitted beside only some
       would run as more, costlier, decodes);
    4. idle minimum: with no serving request in flight, at least `idle_min_tokens` of rollout
       work (decodes first), so that a latency model that overestimates cannot starve rollouts:
       each such iteration is also a measurement that corrects it. `limit_s` is then inf: there
       is no serving slack for the feedback guard to measure."""
    reserve_s = latency.iteration_time(TokenLoad(arrival_reserve_tokens), TokenLoad())
    bound = slo if banked else slo.without_inflation
    limit, terms, base = _limit(now, serving, bound, latency, chunk_tokens, share,
                                rollout_time_cap(slo, reserve_s))
    offer = _Offer(latency, base, rollout.decode_context)
    decodes = rollout.decodes
    d, p = offer.fill(limit, decodes, _min(rollout.prefill_tokens, chunk_tokens), decodes_first=True)
    idle = (serving.waiting_requests == 0) & (serving.decoding_requests == 0)
    if _any(idle):
        lift = idle & (d + p < idle_min_tokens)
        d_min = _min(decodes, idle_min_tokens)
        d, p = _where(lift, d_min, d), _where(lift, _min(rollout.prefill_tokens, idle_min_tokens - d_min), p)
        limit = _where(idle, math.inf, limit)
    return offer.admission(now, serving, bound, terms, d, p, limit)


def rollout_time_cap(slo: SLOBudgets, reserve_prefill_s: float) -> float:
    """The most rollout work one iteration may carry however idle serving is: a serving request
    arriving while it runs waits for it, then prefills (`reserve_prefill_s`, the predicted time of
    a typical prompt), within B_TTFT, and waits at most `ttft_inflation` of B_TTFT for it."""
    return min(slo.ttft_s * slo.ttft_inflation, slo.ttft_s - reserve_prefill_s)


def rollout_capacity(now: float, serving: ServingState, running: RolloutDemand, latency: LatencyModel,
                     slo: SLOBudgets, typical_context: int, chunk_tokens: int = CHUNK_TOKENS,
                     limit: Num = 1024, share: float = 1.0) -> Num:
    """The free rollout slots a serving device reports to the rollout scheduler, so that turns go
    where admission will run them: how many more sequences of `typical_context` tokens could
    decode beside the `running` ones, at most `limit` (what `memory_room` and the lease slots
    leave). Under the SLOs alone, beside serving's decodes: a waiting prompt passes, and the
    inflation budgets are kept over time; admission enforces both per iteration, so neither is
    held against a turn that will run over many."""
    if not _any(limit > 0):
        return 0
    decoding = dataclasses.replace(serving, waiting=(), waiting_rollout_s=())
    base = decoding.load(chunk_tokens)
    ceiling = iteration_limit(now, decoding, slo.without_inflation, latency, chunk_tokens, share)
    d0, c0 = running.decodes, running.context_tokens

    def fits(k: Num, rows: np.ndarray | None = None) -> Num:
        b = base if rows is None else TokenLoad(0, _take(base.decode_seqs, rows),
                                                _take(base.context_tokens, rows))
        rollout = TokenLoad(0, _take(d0, rows) + k, _take(c0, rows) + k * typical_context)
        return latency.iteration_time(b, rollout) < _take(ceiling, rows)

    room = fits(0) & (limit > 0)
    if not _any(room):
        return 0
    return _where(room, _largest(0, _max(limit, 0), fits), 0)


def rollout_duty(serving_s: Num, with_rollout_s: Num, inflation: float) -> Num:
    """The share of serving iterations that may carry rollout work (making them `with_rollout_s`
    long instead of `serving_s`) so that rollouts add at most `inflation` of serving's own time:
    the steady state the banked inflation budgets of `iteration_limit` reach, in closed form,
    for the simulator's fluid model. 1.0 where serving has no work or no budget is set."""
    if math.isinf(inflation):
        return 1.0
    extra = with_rollout_s - serving_s
    bounded = (serving_s > 0) & (extra > 0)
    return _where(bounded, _min(1.0, inflation * serving_s / _where(bounded, extra, 1.0)), 1.0)


def priority_tokens(serving_tokens: int, max_batched_tokens: int) -> int:
    """The rollout tokens of one iteration under the `priority` policy: what serving's own tokens
    in it (prefill and decodes, scheduled first) leave of the iteration's token budget, as vLLM's
    priority scheduling lets lower-priority requests fill the rest of `max_num_batched_tokens`."""
    if max_batched_tokens < 1 or serving_tokens < 0:
        raise ValueError(f"priority_tokens needs max_batched_tokens >= 1 and serving_tokens >= 0, got "
                         f"{max_batched_tokens}, {serving_tokens}")
    return max(0, max_batched_tokens - serving_tokens)


def priority_pages(pool: int, serving_used: int, serving_next: int) -> int:
    """The rollout page budget under the `priority` policy: the pool less what serving holds and
    what its next iteration may take (`serving_next`), so that serving never waits on rollout
    memory. The rollout sequences beyond the budget are preempted, newest first, and recomputed
    later, as vLLM preempts its lowest-priority requests (not handed back: no burst control)."""
    return max(0, pool - serving_used - serving_next)


class SlackGuard:
    """Feedback on measured serving slack, against what the latency model cannot see coming:
    `share` scales the rollout part of the admission ceiling. An iteration that ran past the
    ceiling it was admitted under, or within `low_s` of it, halves the share at once; each one
    with room regrows it by `regrow`, up to 1 (additive increase, multiplicative decrease)."""

    def __init__(self, floor: float = 0.05, regrow: float = 0.02, low_s: float = 0.0) -> None:
        if not (0.0 < floor <= 1.0 and regrow > 0 and low_s >= 0):
            raise ValueError(f"SlackGuard needs 0 < floor <= 1, regrow > 0, low_s >= 0; got "
                             f"floor={floor}, regrow={regrow}, low_s={low_s}")
        self.floor, self.regrow, self.low_s = floor, regrow, low_s
        self.share = 1.0
        self.overruns = 0     # iterations that ran past their ceiling
        self.observed = 0     # iterations with a finite ceiling

    def observe(self, measured_s: float, limit_s: float) -> float:
        """An iteration admitted under `limit_s` took `measured_s`; returns the new share."""
        if math.isinf(limit_s):
            return self.share  # no serving request in flight: no slack to measure
        self.observed += 1
        if measured_s > limit_s - self.low_s:
            self.overruns += measured_s > limit_s
            self.share = max(self.floor, self.share / 2)
        else:
            self.share = min(1.0, self.share + self.regrow)
        return self.share


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
    """The burst state machine of one device's shared page pool (units: pages or bytes).

    Arrays: `devices` > 0 makes one machine per device, all in arrays (`state`, `budget`,
    `bursts`, `aborted`), each observation deciding for every device at once."""

    def __init__(self, pool: int, headroom: float = HEADROOM, high_watermark: float = HIGH_WATERMARK,
                 devices: int = 0) -> None:
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
        self.state: Any = np.full(devices, BurstState.NORMAL) if devices else BurstState.NORMAL
        self.budget: Any = np.full(devices, pool - self.headroom) if devices else pool - self.headroom
        self.bursts: Any = np.zeros(devices, np.int64) if devices else 0     # emergency cuts so far
        self.aborted: Any = np.zeros(devices, np.int64) if devices else 0    # rollout sequences aborted
        # The freeze ends at an RL step once serving's usage is `thaw_below` or less: the level
        # that fired the burst less the watermark's share of the headroom, so that the regrown
        # budget lets serving climb back to that level before it fires again (a step inside
        # the spike waits for it to recede; `step_begun` holds such a step). At least that share
        # itself: a device using no more is quiet by the trigger's own measure (a burst fired by
        # one prompt on an idle device would otherwise wait for serving to go idle).
        self.thaw_below: Any = np.zeros(devices) if devices else 0.0
        self.step_begun: Any = np.zeros(devices, bool) if devices else False
        self.serving_used: Any = np.zeros(devices) if devices else 0.0  # at the last observation

    def crossed(self, serving_used: Num, rollout_used: Num) -> Num:
        """Whether free pages are at or below the trigger: the watermark inside the headroom."""
        return self.pool - serving_used - rollout_used <= self.trigger_free

    def observe(self, serving_used: Num, rollout: Sequence[tuple[Hashable, Num]]) -> MemoryDecision:
        """Update with current usage; `rollout` is (sequence id, units held) oldest first.
        The caller aborts the returned sequences before granting any rollout page again.
        Arrays: `serving_used` per device, `rollout` columns of (ids, units) over the devices,
        padded with id -1 and 0 units; `abort` then holds, column by column from the newest, the
        ids of the sequences the cut devices abort."""
        rollout_used = sum(units for _, units in rollout)
        crossed = self.crossed(serving_used, rollout_used)
        cut = crossed & (rollout_used > 0)
        normal, burst = self.state == BurstState.NORMAL, self.state == BurstState.BURST
        calm = self.pool - serving_used - rollout_used > self.trigger_free
        self.serving_used = serving_used
        thaw = _where(cut, False, self._thaws())
        onset = cut & normal
        margin = self.headroom - self.trigger_free
        self.thaw_below = _where(onset, _max(serving_used - margin, margin), self.thaw_below)
        self.step_begun = _where(thaw | onset, False, self.step_begun)
        regrown = _max(0, self.pool - self.headroom - serving_used)
        self.budget = _where(cut, _min(self.budget, rollout_used) // 2,
                             _where(normal | thaw, regrown, self.budget))
        self.state = _where(cut, BurstState.BURST, _where(burst & calm, BurstState.FROZEN,
                                                          _where(thaw, BurstState.NORMAL, self.state)))
        victims: list[Hashable] = []
        if _any(cut):
            self.bursts += cut
            held = rollout_used
            for seq_id, units in reversed(rollout):
                take = cut & (held > self.budget)
                if isinstance(take, np.ndarray):
                    take &= seq_id >= 0
                    held = held - np.where(take, units, 0)
                    victims.append(seq_id[take])
                    self.aborted += take
                    continue
                held -= units if take else 0
                if take:
                    victims.append(seq_id)
                    self.aborted += 1
        return MemoryDecision(self.state, self.budget, tuple(victims), cut)

    def new_rl_step(self, devices: Num = True) -> None:
        """A new RL step began (on `devices`, arrays: a mask): the rollout budget may grow again,
        at once where the freeze may end (`thaw_below`), else at the first observation where it may."""
        self.step_begun = self.step_begun | (devices & (self.state != BurstState.NORMAL))
        thaw = devices & self._thaws()
        self.state = _where(thaw, BurstState.NORMAL, self.state)
        self.step_begun = _where(thaw, False, self.step_begun)

    def _thaws(self) -> Num:
        """Whether the freeze ends now: a step has begun and serving has receded."""
        return (self.state == BurstState.FROZEN) & self.step_begun & (self.serving_used <= self.thaw_below)


def memory_room(state: Num, free: Num, per_turn: float) -> Num:
    """The memory rule of a device's free-slot count: how many rollout turns of `per_turn` (the
    typical turn's pages, bytes or tokens) the free part `free` of the rollout budget holds;
    none in a burst, while the burst state machine takes pages back."""
    room = _max(0, free // per_turn)
    room = room.astype(np.int64) if isinstance(room, np.ndarray) else int(room)
    return _where(state == BurstState.BURST, 0, room)
