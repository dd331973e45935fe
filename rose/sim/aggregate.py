"""Serving replicas in aggregate: each replica one row, its requests counted, not listed
(`sim.serving_model=aggregate`).

The per-request model (`serving.ServingFleet`) keeps every request a row: exact, and a day of
thousands of replicas is billions of them. Here a replica's traffic is its copy of the trace as a
range of the trace's indices: the requests that arrived, the prefill queue and its progress are
positions in the trace's running sums of requests and prompt tokens, so a tick's arrivals, the
tokens waiting and the prompts prefilled are a few lookups per replica, whatever the load. The
same fluid model as the per-request one runs over them:

- prefill: first come first served at the tick's prefill rate; a tick prefills what waited and
  arrived, at most the rate's worth (the fluid queue with the tick's arrivals spread over it);
- decode: the requests a tick prefilled form a cohort that decodes at the replica's rate per
  request; how many of it still decode after v tokens follows the trace's output lengths (their
  survival function), so the replica's decoding requests and their KV are the cohorts' sums;
- latency: each tick's arrivals see the fluid queue's backlog (at two points of the tick) and
  prefill their own prompt, drawn from the trace's prompt lengths; TTFT = (backlog + prompt) x
  seconds per prefill token, TPOT = the tick's seconds per decoded token, each counted with the
  requests it stands for in per-minute histograms, from which the P99s and the SLO minutes come
  (`LatencyHistogram`).

docs/simulator.md compares it with the per-request model where both run.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from rose.coserve.admission import ServingState
from rose.traces import Diurnal, Trace

# Latency bins: log-spaced from 0.1 ms to 1,000 s, 1% wide (a P99 is read within 1%).
_LO_S, _STEP = 1e-4, 0.01
_BINS = int(math.log(1e3 / _LO_S) / math.log1p(_STEP)) + 1
# Probability levels at which a TTFT distribution is kept, finer in the tail that a P99 comes
# from, and the share of requests each stands for.
_LEVELS = np.r_[np.arange(0.05, 0.9, 0.1), np.arange(0.905, 0.99, 0.01), np.arange(0.9905, 1.0, 0.001)]
_WEIGHTS = np.r_[np.full(9, 0.1), np.full(9, 0.01), np.full(10, 0.001)]
# Prefill speeds (prompt tokens per second of trace time) the trace's own queueing is known at:
# from just above the trace's token arrival rate to 10^4 times it.
_SPEEDS = 64
# The two points of a tick at which its arrivals see the fluid queue's backlog (fractions of it).
_SEEN_AT = (0.25, 0.75)


def _bin(seconds: np.ndarray) -> np.ndarray:
    x = np.log(np.maximum(seconds, _LO_S) / _LO_S) / math.log1p(_STEP)
    return np.minimum(x, _BINS - 1).astype(np.int64)


def _value(i: np.ndarray) -> np.ndarray:
    """A bin's value: its geometric middle (the lowest bin: 0)."""
    return np.where(i == 0, 0.0, _LO_S * (1 + _STEP) ** (i + 0.5))


def _p99(seconds: np.ndarray, weights: np.ndarray) -> float:
    """The P99 of weighted samples, to a bin."""
    if weights.sum() <= 0:
        return 0.0
    c = np.cumsum(np.bincount(_bin(seconds), weights=weights, minlength=_BINS))
    return float(_value(np.array(np.searchsorted(c, 0.99 * c[-1]))))


def queueing_ttft(trace: Trace, speeds: np.ndarray) -> np.ndarray:
    """[speeds, _LEVELS]: the TTFT (trace seconds) of the trace's requests at `_LEVELS` when one
    replica prefills them first come first served at each speed (prompt tokens per trace
    second): the queueing among the trace's own bursts, which a tick's fluid backlog smooths
    away. Over the trace's second pass, so that its first requests queue behind its last."""
    arrival = np.r_[trace.arrival_s, trace.arrival_s + trace.period_s]
    prompt = np.r_[trace.prompt_tokens, trace.prompt_tokens].astype(float)
    out = np.empty((len(speeds), len(_LEVELS)))
    for i, speed in enumerate(speeds.tolist()):
        work = prompt / speed
        s = np.cumsum(work)
        # First come first served: done_i = S_i + max over j <= i of (arrival_j - S_{j-1}).
        done = s + np.maximum.accumulate(arrival - (s - work))
        out[i] = np.quantile((done - arrival)[len(trace):], _LEVELS)
    return out


class LatencyHistogram:
    """Requests' TTFT and TPOT, counted per minute (of arrival for TTFT, of completion for TPOT).
    A TTFT is kept as (fluid backlog delay bin, prefill speed index) and read as that delay plus
    the trace's own queueing at the speed (`queueing`, [speeds, _LEVELS], trace seconds) in the
    minute's real time per trace second; a TPOT as its bin."""

    def __init__(self, queueing: np.ndarray) -> None:
        self.queueing = queueing
        self._open: dict[int, np.ndarray] = {}       # minutes still filled: dense TTFT cells
        self.ttft: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # minute -> (cells, requests)
        self.scale: dict[int, list[float]] = {}      # minute -> [real s per trace s x requests, requests]
        self.tpot: dict[int, np.ndarray] = {}

    def ttft_cells(self, minute: int) -> np.ndarray:
        """The TTFT cells [wait bin x speed index] of `minute`, to add requests to (the minutes
        before the last are kept as their nonzero cells only)."""
        for m in [m for m in self._open if m < minute - 1]:
            h = self._open.pop(m)
            nz = np.flatnonzero(h != 0)   # faster than on the floats themselves
            self.ttft[m] = nz, h[nz]
        if minute not in self._open:
            self._open[minute] = np.zeros(_BINS * _SPEEDS)
        return self._open[minute]

    def arrived(self, minute: int, requests: float, scale: float) -> None:
        """`requests` arrived in `minute` at `scale` real seconds per trace second."""
        acc = self.scale.setdefault(minute, [0.0, 0.0])
        acc[0] += scale * requests
        acc[1] += requests

    def tpot_cells(self, minute: int) -> np.ndarray:
        """The TPOT bins of `minute` (of completion), to add requests to."""
        return self.tpot.setdefault(minute, np.zeros(_BINS))

    def minutes(self) -> list[int]:
        return sorted(set(self.ttft) | set(self._open) | set(self.tpot))

    def ttft_samples(self, minutes: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """TTFTs (s) and the requests each stands for, over `minutes`."""
        values, weights = [], []
        for m in minutes:
            if m in self._open:
                cell = np.flatnonzero(self._open[m])
                count = self._open[m][cell]
            elif m in self.ttft:
                cell, count = self.ttft[m]
            else:
                continue
            scale = self.scale[m][0] / max(self.scale[m][1], 1e-12)
            wait = _value(cell // _SPEEDS)
            values.append((wait[:, None] + self.queueing[cell % _SPEEDS] * scale).ravel())
            weights.append((count[:, None] * _WEIGHTS[None, :]).ravel())
        if not values:
            return np.zeros(0), np.zeros(0)
        return np.concatenate(values), np.concatenate(weights)

    def tpot_samples(self, minutes: list[int]) -> tuple[np.ndarray, np.ndarray]:
        h = sum((self.tpot[m] for m in minutes if m in self.tpot), np.zeros(_BINS))
        nz = np.flatnonzero(h != 0)   # faster than on the floats themselves
        return _value(nz), h[nz]

    def p99(self, minutes: list[int]) -> tuple[float, float]:
        """P99 TTFT and P99 TPOT (s) of the requests of `minutes`."""
        return _p99(*self.ttft_samples(minutes)), _p99(*self.tpot_samples(minutes))

    def p99_tpot_s(self, until_s: float) -> float:
        """P99 TPOT of the requests of the minutes that began before `until_s`."""
        return _p99(*self.tpot_samples([m for m in self.minutes() if m * 60 < until_s]))

    def within(self, ttft_s: float, tpot_s: float, minutes: list[int]) -> float:
        """The share of requests within both SLOs, taking TTFT and TPOT as independent."""
        t, tw = self.ttft_samples(minutes)
        o, ow = self.tpot_samples(minutes)
        share_t = float(tw[t <= ttft_s].sum() / tw.sum()) if tw.sum() else 1.0
        share_o = float(ow[o <= tpot_s].sum() / ow.sum()) if ow.sum() else 1.0
        return share_t * share_o


class _Sorted:
    """`np.searchsorted(values, y, side)` for y in [0, span) by a grid of starting points, a few
    steps from the answer (a binary search per replica per tick costs more than the rest): the
    tables `_find` searches."""

    def __init__(self, values: np.ndarray, span: float, side: str) -> None:
        self.cells = 4 * len(values)
        self.per_cell = self.cells / span
        self.values = np.r_[values, np.inf]
        self.start = np.searchsorted(values, np.arange(self.cells) / self.per_cell, side)


@numba.njit(cache=True)
def _find(values: np.ndarray, start: np.ndarray, per_cell: float, right: bool, y: float) -> int:
    """`_Sorted`'s search of y: from one cell back (the grid's float rounding may not put y past its
    cell's start), step to the first value above y (at or above: not `right`)."""
    j = start[min(max(int(y * per_cell) - 1, 0), len(start) - 1)]
    while values[j] < y or (right and values[j] == y):
        j += 1
    return j


class AggregateServing:
    """`n` serving replicas in aggregate, the interface of `serving.ServingFleet` (the engine and
    the co-serving planner use either): the same trace, rate, day, chunk and replay offsets
    (`phase`, drawn alike from `seed`)."""

    def __init__(self, n: int, trace: Trace, rate_per_replica: float, diurnal: Diurnal,
                 day_start_s: float, chunk_tokens: int, seed: int, start_s: float | None = None,
                 decode_floor_s: float = 0.0) -> None:
        self.n, self.trace, self.rate, self.diurnal = n, trace, rate_per_replica, diurnal
        self.day_start_s, self.chunk = day_start_s, chunk_tokens
        if start_s is None:
            self.phase = np.random.default_rng(seed).uniform(0, trace.period_s, size=n)
        else:
            self.phase = np.full(n, start_s - day_start_s * rate_per_replica / trace.mean_rate)
        self.scale = trace.mean_rate / rate_per_replica   # trace time = phase + day-unit time / scale
        self.count = len(trace)
        self.prompt_sum = np.r_[0, np.cumsum(trace.prompt_tokens)].astype(float)
        self.tokens = float(self.prompt_sum[-1])
        self._arrival_index = _Sorted(trace.arrival_s, trace.period_s, "left")
        self._prompt_index = _Sorted(self.prompt_sum, self.tokens, "right")
        # Decode survival: the share of requests still decoding v tokens after their first.
        out = np.sort(trace.output_tokens)
        v = np.arange(int(out[-1]) + 1)
        self.survival = 1.0 - np.searchsorted(out - 1, v, "right") / len(out)
        # The trace's own queueing at prefill speeds around its token arrival rate.
        self.speeds = self.tokens / trace.period_s * np.geomspace(1.02, 1e4, _SPEEDS)
        self.log = LatencyHistogram(queueing_ttft(trace, self.speeds))
        # A decode iteration takes at least one request's: a tick that begins with none decoding
        # gives the requests it starts that, not an idle replica's time.
        self.decode_floor_s = decode_floor_s
        # Cohorts of requests prefilled in one tick, ring-buffered over enough ticks for the
        # longest output at 30 ms a token (an older one is dropped). Per replica: requests, prompt
        # tokens, decode clock at their first token, share still decoding.
        self.longest_s = 0.03 * float(out[-1])
        self.c_n = self.c_prompt = self.c_v0 = self.c_alive = np.zeros((n, 0))
        self._slot = 0
        self.clock = np.zeros(n)                   # tokens decoded per request so far (decode clock)
        self._until = 0.0
        # Running indices into the tiled trace, and the prompt tokens before them: the next request
        # to arrive, the same as the tick began, the first not whole prefilled; and the prompt
        # tokens prefilled so far.
        self.arrived, self.arrived_tokens = self._arrivals(self._trace_time(0.0))
        self.at_tick, self.at_tick_tokens = self.arrived.copy(), self.arrived_tokens.copy()
        self.head, self.head_tokens = self.arrived.copy(), self.arrived_tokens.copy()
        self.prefilled = self.arrived_tokens.copy()
        self._dec = np.zeros(n)
        self._ctx = np.zeros(n)

    # -- the tiled trace ----------------------------------------------------------------------
    def _trace_time(self, t: float) -> np.ndarray:
        return self.phase + self._day_units(t)

    def _day_units(self, t: float) -> float:
        """Trace time passed from the replicas' `phase` by t."""
        return float(self.diurnal.cumulative(np.array(self.day_start_s + t))) / self.scale

    def _arrivals(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Running index of the first request at or after trace time x (the trace tiled), and the
        prompt tokens of the requests before it."""
        a = self._arrival_index
        return _arrivals(x, self.trace.period_s, self.count, self.tokens, a.values, a.start, a.per_cell,
                         self.prompt_sum)

    def _prompt_at(self, g: np.ndarray) -> np.ndarray:
        """Prompt tokens of the requests before running index g."""
        k, j = np.divmod(g, self.count)
        return k * self.tokens + self.prompt_sum[j]

    # -- state seen by the engine ---------------------------------------------------------------
    def arrivals_until(self, t1: float) -> None:
        if t1 != self._until:
            self._until = t1
            self.arrived, self.arrived_tokens = self._arrivals(self._trace_time(t1))

    def decode_seqs(self) -> np.ndarray:
        return self._dec

    def decode_context(self) -> np.ndarray:
        return self._ctx

    def prefill_backlog(self) -> np.ndarray:
        return self.arrived_tokens - self.prefilled

    def kv_tokens(self) -> np.ndarray:
        """Decoding contexts plus the prefilled part of the prompt in prefill."""
        return self._ctx + self.prefilled - self.head_tokens

    def allocated_tokens(self) -> np.ndarray:
        return self.kv_tokens() + np.minimum(self.prefill_backlog(), float(self.chunk))

    def first_waiting_prompt(self) -> np.ndarray:
        left = self._prompt_at(self.head + 1) - self.prefilled
        return np.where(self.head < self.arrived, left, 0.0)

    def admission_state(self, now: float, replicas: np.ndarray) -> ServingState:
        """The admission controller's view of `replicas`: what waited from before the tick as
        one entry at the oldest waiting request's arrival (conservative: each of those requests
        has as much time left and fewer tokens ahead), what arrives in the tick as one arriving
        now (as the per-request model judges it), the decoding requests as one entry with their
        count (the fluid count rounded) and context, all of them emitting a token now."""
        # Back from trace time to simulated time, at the current rate (the head is recent).
        rate = float(self.diurnal.multiplier(self.day_start_s + now)) / self.scale
        waited_at, carried, new_at, new, last, ctx, dec = _admission_view(
            now, replicas, self._day_units(now), rate, self.trace.period_s, self.trace.arrival_s, self.count,
            self.phase, self.head, self.at_tick, self.at_tick_tokens, self.arrived_tokens, self.prefilled,
            self._dec, self._ctx)
        return ServingState([(waited_at, carried), (new_at, new)], [last], ctx, [dec])

    # -- one tick ---------------------------------------------------------------------------------
    def advance(self, t: float, dt: float, prefill_iter_s: np.ndarray, decode_iter_s: np.ndarray,
                prefill_per_iter: np.ndarray) -> None:
        """Run [t, t + dt), as `ServingFleet.advance`: the fluid prefill of what waited and
        arrived (first come first served), the requests it completes a new decode cohort, the
        cohorts' decoding at the tick's pace; the tick's arrivals counted in the TTFT histogram
        (`_SEEN_AT`), its finished requests in the TPOT one."""
        self.arrivals_until(t + dt)
        if not self.c_n.shape[1]:
            k = min(512, max(3, math.ceil(self.longest_s / dt) + 2))
            self.c_n, self.c_prompt, self.c_v0, self.c_alive = (np.zeros((self.n, k)) for _ in range(4))
        # Real seconds per trace second now: arrivals see the trace's own queueing at their speed.
        scale = self.scale / float(self.diurnal.multiplier(self.day_start_s + t + dt / 2))
        seen = [self.log.ttft_cells(int((t + at * dt) // 60)) for at in _SEEN_AT]
        tpot = self.log.tpot_cells(int((t + dt) // 60))
        index = self._prompt_index
        speed_step = math.log(self.speeds[1] / self.speeds[0])
        arrivals = _tick(dt, prefill_per_iter / prefill_iter_s, prefill_iter_s, decode_iter_s,
                         self.decode_floor_s, scale, self.speeds[0], speed_step, np.array(_SEEN_AT),
                         seen[0], seen[1], tpot, (self.arrived - self.at_tick).astype(float),
                         self.arrived_tokens, self.at_tick_tokens, self.prefilled, self.head,
                         self.head_tokens,
                         self.prompt_sum, index.values, index.start, index.per_cell, self.count, self._slot,
                         self.clock, self.c_n, self.c_prompt, self.c_v0, self.c_alive, self.survival,
                         self._dec, self._ctx)
        for at in _SEEN_AT:
            self.log.arrived(int((t + at * dt) // 60), arrivals / len(_SEEN_AT), scale)
        self._slot = (self._slot + 1) % self.c_n.shape[1]
        self.at_tick, self.at_tick_tokens = self.arrived, self.arrived_tokens


@numba.njit(cache=True)
def _tick(dt: float, rate: np.ndarray, prefill_iter_s: np.ndarray, decode_iter_s: np.ndarray,
          floor_s: float, scale: float, speed0: float, speed_step: float, seen_at: np.ndarray,
          cells0: np.ndarray, cells1: np.ndarray, tpot: np.ndarray, count: np.ndarray,
          arrived_tokens: np.ndarray, at_tick_tokens: np.ndarray,
          prefilled: np.ndarray, head: np.ndarray, head_tokens: np.ndarray, prompt_sum: np.ndarray,
          index_values: np.ndarray, index_start: np.ndarray, per_cell: float, requests: int, slot: int,
          clock: np.ndarray, c_n: np.ndarray, c_prompt: np.ndarray, c_v0: np.ndarray, c_alive: np.ndarray,
          survival: np.ndarray, decoding: np.ndarray, context: np.ndarray) -> float:
    """`AggregateServing.advance` for every replica (compiled: every replica, every tick):
    updates the running sums and cohorts in place, adds to the histograms' cells; returns the
    requests that arrived."""
    total = prompt_sum[-1]
    arrivals = 0.0
    for r in range(len(rate)):
        arrived = arrived_tokens[r] - at_tick_tokens[r]
        before = at_tick_tokens[r] - prefilled[r]
        if count[r] > 0:
            arrivals += count[r]
            speed = min(math.log(max(rate[r] * scale, speed0) / speed0) / speed_step, _SPEEDS - 1.0)
            gain = (arrived / dt - rate[r]) * dt
            _count_ttft(cells0, count[r] / 2, max(0.0, before + gain * seen_at[0]), rate[r], speed)
            _count_ttft(cells1, count[r] / 2, max(0.0, before + gain * seen_at[1]), rate[r], speed)
        # Prefill: what waits, at most the rate's worth; decodes at the iterations' mixed pace.
        done = min(rate[r] * dt, before + arrived)
        frac = min(1.0, done / rate[r] / dt) if rate[r] > 0 else 0.0
        prefilled[r] += done
        per_token = 1.0 / (frac / max(prefill_iter_s[r], floor_s)
                           + (1.0 - frac) / max(decode_iter_s[r], floor_s))
        # The requests whole prefilled: a new cohort, each with its first token.
        k = math.floor(prefilled[r] / total)
        y = prefilled[r] - k * total
        j = index_start[min(max(int(y * per_cell) - 1, 0), len(index_start) - 1)]
        while index_values[j] <= y:
            j += 1
        new_head = k * requests + j - 1
        new_tokens = _prompt_before(new_head, requests, total, prompt_sum)
        speed_tokens = dt / per_token
        clock[r] += speed_tokens
        c_n[r, slot] = new_head - head[r]
        c_prompt[r, slot] = new_tokens - head_tokens[r]
        c_v0[r, slot] = clock[r] - speed_tokens / 2        # half-way through the tick, on average
        c_alive[r, slot] = survival[0]                     # those of one token are done at their first
        head[r], head_tokens[r] = new_head, new_tokens
        dec = ctx = finished = 0.0
        for c in range(c_n.shape[1]):
            if c_n[r, c] == 0.0:
                continue
            v = max(0.0, clock[r] - c_v0[r, c])
            now = survival[min(int(v), len(survival) - 1)]
            finished += c_n[r, c] * (c_alive[r, c] - now)
            c_alive[r, c] = now
            dec += c_n[r, c] * now
            ctx += now * c_prompt[r, c] + c_n[r, c] * now * (1.0 + v)
        decoding[r], context[r] = dec, ctx
        if finished > 0:
            tpot[_bin_of(per_token)] += finished
    return arrivals


@numba.njit(cache=True)
def _admission_view(now: float, replicas: np.ndarray, units: float, rate: float, period_s: float,
                    arrival_s: np.ndarray, count: int, phase: np.ndarray, head: np.ndarray,
                    at_tick: np.ndarray, at_tick_tokens: np.ndarray, arrived_tokens: np.ndarray,
                    prefilled: np.ndarray, decoding: np.ndarray,
                    context: np.ndarray) -> tuple[np.ndarray, ...]:
    """`AggregateServing.admission_state`'s arrays for `replicas`: what waited (at the head's
    arrival, back at `rate` from the replica's trace time now, `phase` + `units`), what arrives,
    the decoding requests and their context. (Compiled: every replica, twice a tick.)"""
    n = len(replicas)
    waited_at, carried, new_at, new, last = np.empty(n), np.empty(n), np.empty(n), np.empty(n), np.empty(n)
    ctx, dec = np.empty(n, np.int64), np.empty(n, np.int64)
    for i in range(n):
        r = replicas[i]
        h = head[r]
        waited_at[i], carried[i] = np.inf, 0.0
        if h < at_tick[r]:
            k = h // count
            x = k * period_s + arrival_s[min(h - k * count, count - 1)]
            back = now - (phase[r] + units - x) / rate
            waited_at[i] = now if now <= back else back
            carried[i] = at_tick_tokens[r] - prefilled[r]
        new[i] = arrived_tokens[r] - at_tick_tokens[r]
        new_at[i] = now if new[i] > 0 else np.inf
        dec[i] = int(np.rint(decoding[r]))
        last[i] = now if dec[i] > 0 else np.inf
        ctx[i] = int(context[r])
    return waited_at, carried, new_at, new, last, ctx, dec


@numba.njit(cache=True)
def _arrivals(x: np.ndarray, period_s: float, count: int, tokens: float, values: np.ndarray,
              start: np.ndarray, per_cell: float, prompt_sum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`AggregateServing._arrivals` for every replica (compiled: every replica, every tick)."""
    index, before = np.empty(len(x), np.int64), np.empty(len(x))
    for i in range(len(x)):
        k = math.floor(x[i] / period_s)
        j = _find(values, start, per_cell, False, x[i] - k * period_s)
        index[i] = k * count + j
        # `_prompt_before(index[i])`, the division by `count` known (j == count: the next pass's first)
        before[i] = k * tokens + prompt_sum[j] if j < count else (k + 1) * tokens + prompt_sum[j - count]
    return index, before


@numba.njit(cache=True)
def _prompt_before(g: int, requests: int, total: float, prompt_sum: np.ndarray) -> float:
    """Prompt tokens of the requests before running index g (the trace tiled)."""
    k = g // requests
    return k * total + prompt_sum[g - k * requests]


@numba.njit(cache=True)
def _bin_of(seconds: float) -> int:
    if seconds <= _LO_S:     # the lowest bin, without a log (most arrivals meet no backlog)
        return 0
    if seconds >= 1e300:
        return _BINS - 1
    return min(_BINS - 1, int(math.log(max(seconds, _LO_S) / _LO_S) / math.log1p(_STEP)))


@numba.njit(cache=True)
def _count_ttft(cells: np.ndarray, count: float, backlog: float, rate: float, speed: float) -> None:
    """Add `count` requests to `cells` [wait bin x _SPEEDS]: their wait `backlog` / `rate` (beyond
    the last bin when blocked), their speed split between the two nearest indices."""
    b = _bin_of(backlog / rate if rate > 0 else math.inf)
    lo = int(speed)
    up = speed - lo
    cells[b * _SPEEDS + lo] += count * (1.0 - up)
    cells[b * _SPEEDS + min(lo + 1, _SPEEDS - 1)] += count * up


