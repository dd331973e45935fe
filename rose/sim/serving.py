"""Serving replicas under real traffic, advanced one tick at a time.

A fluid model of continuous batching with chunked prefill, vectorised over all replicas: within
a tick a replica's iteration time is constant (set by the engine from the tick's start state
and whatever rollout work shares the replica); every decoding request gains one token per
iteration; prefill runs first-come-first-served at the replica's serving prefill budget per
iteration. Completion times inside a tick are exact for that constant iteration time, so TTFT
and TPOT are per request, not per tick. Each replica replays its own copy of the trace
(started at a random offset into it) at the scenario's rate, shaped by the diurnal curve.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rose.coserve.admission import ServingState
from rose.traces import Diurnal, Trace, day_arrivals

_BLOCK_S = 300.0     # arrivals are generated this far ahead


def _group_starts(groups: np.ndarray) -> np.ndarray:
    """For each element of a sorted group array, the index of its group's first element."""
    first = np.r_[True, groups[1:] != groups[:-1]]
    return np.maximum.accumulate(np.where(first, np.arange(len(groups)), 0))


@dataclasses.dataclass
class ServingLog:
    """One row per finished request."""

    arrival: list[np.ndarray] = dataclasses.field(default_factory=list)
    ttft: list[np.ndarray] = dataclasses.field(default_factory=list)
    tpot: list[np.ndarray] = dataclasses.field(default_factory=list)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.arrival:
            return np.zeros(0), np.zeros(0), np.zeros(0)
        return np.concatenate(self.arrival), np.concatenate(self.ttft), np.concatenate(self.tpot)

    def p99_tpot_s(self, until_s: float) -> float:
        """P99 TPOT of the requests that arrived before `until_s`."""
        arrival, _, tpot = self.arrays()
        return float(np.nanpercentile(tpot[arrival < until_s], 99))


class ServingFleet:
    """`n` serving replicas. Time is simulation time; day time is `day_start_s` later. Each
    replica starts its replay at a random point of the trace, or all of them at `start_s` (trace
    time; on a flat day)."""

    def __init__(self, n: int, trace: Trace, rate_per_replica: float, diurnal: Diurnal,
                 day_start_s: float, chunk_tokens: int, seed: int, start_s: float | None = None) -> None:
        self.n, self.trace, self.rate, self.diurnal = n, trace, rate_per_replica, diurnal
        self.day_start_s, self.chunk = day_start_s, chunk_tokens
        if start_s is None:
            self.phase = np.random.default_rng(seed).uniform(0, trace.period_s, size=n)
        else:  # `day_arrivals` maps trace time a to day time (a - phase) x mean rate / rate
            self.phase = np.full(n, start_s - day_start_s * rate_per_replica / trace.mean_rate)
        self._generated_to = 0.0
        z = np.zeros(0)
        zi = np.zeros(0, np.int64)
        self._pending = (z, zi, zi, zi)                     # arrival, prompt, output, replica
        # waiting for (or in) prefill, sorted by (replica, arrival)
        self.w_arr, self.w_rep, self.w_left, self.w_prompt, self.w_out = z, zi, zi.astype(float), zi, zi
        # decoding
        self.d_rep, self.d_left, self.d_ctx = zi, z, z
        self.d_first, self.d_arr, self.d_out, self.d_start = z, z, zi, z
        self.log = ServingLog()

    # -- arrivals -----------------------------------------------------------------------------
    def _generate(self, until: float) -> None:
        while self._generated_to < until:
            t0, t1 = self._generated_to, self._generated_to + _BLOCK_S
            parts = [day_arrivals(self.trace, self.rate, self.diurnal, self.day_start_s + t0,
                                  self.day_start_s + t1, phase_s=float(self.phase[r]))
                     for r in range(self.n)]
            arr = np.concatenate([p[0] for p in parts]) - self.day_start_s
            rep = np.concatenate([np.full(len(p[0]), r) for r, p in enumerate(parts)])
            order = np.argsort(arr, kind="stable")
            old = self._pending
            self._pending = (np.r_[old[0], arr[order]],
                             np.r_[old[1], np.concatenate([p[1] for p in parts])[order]],
                             np.r_[old[2], np.concatenate([p[2] for p in parts])[order]],
                             np.r_[old[3], rep[order]])
            self._generated_to = t1

    def _take_arrivals(self, t1: float) -> None:
        self._generate(t1)
        a, p, o, r = self._pending
        k = int(np.searchsorted(a, t1))
        self._pending = (a[k:], p[k:], o[k:], r[k:])
        if k:
            arr = np.r_[self.w_arr, a[:k]]
            rep = np.r_[self.w_rep, r[:k]]
            order = np.lexsort((arr, rep))
            self.w_arr, self.w_rep = arr[order], rep[order]
            self.w_left = np.r_[self.w_left, p[:k].astype(float)][order]
            self.w_prompt = np.r_[self.w_prompt, p[:k]][order]
            self.w_out = np.r_[self.w_out, o[:k]][order]

    # -- state seen by the engine ---------------------------------------------------------------
    def decode_seqs(self) -> np.ndarray:
        return np.bincount(self.d_rep, minlength=self.n)

    def decode_context(self) -> np.ndarray:
        return np.bincount(self.d_rep, weights=self.d_ctx, minlength=self.n)

    def prefill_backlog(self) -> np.ndarray:
        return np.bincount(self.w_rep, weights=self.w_left, minlength=self.n)

    def kv_tokens(self) -> np.ndarray:
        """KV tokens held per replica: decoding contexts plus prompts already prefilled."""
        return self.decode_context() + np.bincount(self.w_rep, weights=self.w_prompt - self.w_left,
                                                   minlength=self.n)

    def allocated_tokens(self) -> np.ndarray:
        """KV tokens whose pages each replica has allocated: `kv_tokens` and its prefill chunk in
        progress, whose pages an engine takes before computing it (counted whole: the fluid
        prefill does not say how much of the chunk is done)."""
        return self.kv_tokens() + np.minimum(self.prefill_backlog(), float(self.chunk))

    def first_waiting_prompt(self) -> np.ndarray:
        """Prompt tokens of each replica's head-of-line waiting request (0 if none)."""
        out = np.zeros(self.n)
        if len(self.w_rep):
            first = np.r_[True, self.w_rep[1:] != self.w_rep[:-1]]
            out[self.w_rep[first]] = self.w_left[first]
        return out

    def admission_state(self, now: float, replicas: np.ndarray) -> ServingState:
        """The admission controller's view of the replicas in `replicas` (sorted), in arrays over
        them (`ServingState`'s arrays: waiting requests in columns, FIFO). Every decoding request
        emitted a token in the iteration that just ended, so their last-token time is `now`: they
        are one entry with their count, as serving's share of an iteration counts its decodes
        (`ServingState.load`)."""
        lo, hi = np.searchsorted(self.w_rep, replicas, "left"), np.searchsorted(self.w_rep, replicas, "right")
        count = hi - lo
        k = int(count.max()) if len(count) else 0
        arrival, left = np.full((len(replicas), k), np.inf), np.zeros((len(replicas), k))
        row = np.repeat(np.arange(len(replicas)), count)
        col = np.arange(len(row)) - np.repeat(np.cumsum(count) - count, count)
        at = np.repeat(lo, count) + col
        # A request keeps its arrival time, so the TTFT it has already spent waiting counts, as the
        # executor's `arrival_time` does. One that arrives during the tick is judged as arriving
        # now (with its full budget ahead and the whole queue before it): the slack the executor
        # would compute at its arrival, or less, as the tick's iteration time is fixed from now.
        arrival[row, col], left[row, col] = np.minimum(self.w_arr[at], now), self.w_left[at]
        dec = self.decode_seqs()[replicas]
        return ServingState(list(zip(arrival.T, left.T, strict=True)), [np.where(dec > 0, now, np.inf)],
                            self.decode_context()[replicas].astype(np.int64), [dec])

    # -- one tick ---------------------------------------------------------------------------------
    def advance(self, t: float, dt: float, prefill_iter_s: np.ndarray, decode_iter_s: np.ndarray,
                prefill_per_iter: np.ndarray) -> None:
        """Run [t, t + dt). Per replica: the iteration time with a serving prefill chunk in it
        and without, and the serving prefill tokens per prefill iteration (0: none may start,
        for example for want of pages). Iterations with a chunk run while prompts wait; every
        iteration gives each decoding request one token."""
        t1 = t + dt
        self._take_arrivals(t1)
        busy = self._prefill(t, t1, prefill_iter_s, prefill_per_iter)
        frac = np.minimum(1.0, busy / dt)
        rate = frac / prefill_iter_s + (1.0 - frac) / decode_iter_s       # tokens/s per request
        self._decode(t, t1, 1.0 / rate)

    def arrivals_until(self, t1: float) -> None:
        """Move requests arriving before `t1` into the queue (the engine looks before a tick)."""
        self._take_arrivals(t1)

    def _prefill(self, t: float, t1: float, iter_s: np.ndarray, per_iter: np.ndarray) -> np.ndarray:
        """FIFO prefill; returns each replica's time spent in prefill iterations."""
        if not len(self.w_rep):
            return np.zeros(self.n)
        rate = per_iter[self.w_rep] / iter_s[self.w_rep]          # prompt tokens/s on its replica
        ok = rate > 0                                             # a blocked replica: whole queue
        work = np.where(ok, self.w_left / np.where(ok, rate, 1.0), 0.0)
        s = np.cumsum(work)
        s_group = s - (s - work)[_group_starts(self.w_rep)]       # work up to and including i
        # FIFO: done_i = S_i + max over j <= i of (start_j - S_{j-1}), per replica.
        key = np.maximum(t, self.w_arr) - (s_group - work)
        span = (t1 - t) + s[-1] + 1.0                             # separates replicas for cummax
        offset = self.w_rep * span
        done_at = np.where(ok, s_group + np.maximum.accumulate(key + offset) - offset, np.inf)
        done = done_at <= t1
        still = ~done
        after = np.where(ok, np.maximum(0.0, (np.where(ok, done_at, t1) - t1) * rate), self.w_left)
        new_left = np.where(done, 0.0, np.minimum(self.w_left, after))
        spent = work - np.where(ok, new_left / np.where(ok, rate, 1.0), 0.0)
        busy = np.bincount(self.w_rep, weights=spent, minlength=self.n)
        self.w_left = new_left
        if done.any():
            first_tok = done_at[done]
            self.d_rep = np.r_[self.d_rep, self.w_rep[done]]
            self.d_left = np.r_[self.d_left, self.w_out[done] - 1.0]
            self.d_ctx = np.r_[self.d_ctx, self.w_prompt[done] + 1.0]
            self.d_first = np.r_[self.d_first, first_tok]
            self.d_arr = np.r_[self.d_arr, self.w_arr[done]]
            self.d_out = np.r_[self.d_out, self.w_out[done]]
            self.d_start = np.r_[self.d_start, first_tok]
            self.w_arr, self.w_rep, self.w_left = self.w_arr[still], self.w_rep[still], self.w_left[still]
            self.w_prompt, self.w_out = self.w_prompt[still], self.w_out[still]
        return busy

    def _decode(self, t: float, t1: float, iter_s: np.ndarray) -> None:
        if not len(self.d_rep):
            return
        it = iter_s[self.d_rep]
        begin = np.maximum(t, self.d_start)
        tokens = np.maximum(0.0, t1 - begin) / it
        fin = self.d_left <= tokens
        if fin.any():
            end = begin[fin] + self.d_left[fin] * it[fin]
            out = self.d_out[fin]
            tpot = np.where(out > 1, (end - self.d_first[fin]) / np.maximum(out - 1, 1), np.nan)
            self.log.arrival.append(self.d_arr[fin])
            self.log.ttft.append(self.d_first[fin] - self.d_arr[fin])
            self.log.tpot.append(tpot)
        keep = ~fin
        self.d_left = (self.d_left - tokens)[keep]
        self.d_ctx = (self.d_ctx + tokens)[keep]
        self.d_rep, self.d_first, self.d_arr = self.d_rep[keep], self.d_first[keep], self.d_arr[keep]
        self.d_out, self.d_start = self.d_out[keep], self.d_start[keep]
