"""Multi-turn trajectories on rollout workers, advanced one tick at a time (vectorised).

Every trajectory of a round is one row. A turn is routed (by the shared routing policy, through
the engine), prefilled (only the new observation on a cache-affinity hit, else the whole
context), decoded, then the environment steps and the next turn becomes ready. Inside a tick a
worker's iteration times are constant; each sequence's own clock (when it became ready, when
its prefill ended) is kept exactly, so turn completions are not rounded to ticks.

Per worker the engine supplies a *plan* for the tick: prefill tokens/s, and two decode tiers
(rank < cap -> tokens/s) because a co-serving replica runs some iterations with a serving
prefill chunk and some without, and admission lets a different number of rollout sequences
into each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from rose.sim.workloads import RoundDemand

WAIT, PREFILL, DECODE, ENV, DONE = range(5)


@dataclasses.dataclass
class TickRates:
    """Per-worker rates for one tick (arrays indexed by worker)."""

    prefill_rate: np.ndarray     # prompt tokens/s, shared by the worker's prefilling sequences
    rate0: np.ndarray            # every decode gets rate0 tokens/s, ...
    cap1: np.ndarray             # ... those ranked below cap1 also rate1 ...
    rate1: np.ndarray
    cap2: np.ndarray             # ... and those below cap2 also rate2
    rate2: np.ndarray


@dataclasses.dataclass
class ActiveView:
    """The sequences on workers this tick, sorted by (worker, age), and what fits in memory."""

    idx: np.ndarray              # trajectory rows
    worker: np.ndarray
    fits: np.ndarray             # within the worker's KV capacity and sequence cap
    decode_rank: np.ndarray      # rank among the worker's fitting decode sequences (-1: none)
    kv: np.ndarray               # KV tokens each holds now

    def held_kv(self, workers: np.ndarray) -> np.ndarray:
        """[workers, sequences]: the KV tokens of each sequence holding pages on `workers`."""
        return self.matrix(self.fits, workers, self.kv.astype(np.int64))

    def decode_contexts(self, rnd: Round) -> Callable[[np.ndarray], np.ndarray]:
        """The contexts of the fitting decodes of given workers, in rank order (what admission is
        offered), [workers, sequences]."""
        decoding = self.fits & (self.decode_rank >= 0)
        ctx = rnd.ctx[self.idx].astype(np.int64)
        return lambda workers: self.matrix(decoding, workers, ctx)

    def matrix(self, sel: np.ndarray, workers: np.ndarray, values: np.ndarray) -> np.ndarray:
        """[workers, sequences]: per worker of `workers` (sorted ids) the `values` (one per
        sequence of the view) of its sequences selected by `sel`, in view order, then zeros; for
        example the contexts of its fitting decodes, what admission is offered."""
        w, v = self.worker[sel], values[sel]
        pos = np.minimum(np.searchsorted(workers, w), max(0, len(workers) - 1))
        mine = (workers[pos] == w) if len(workers) else np.zeros(len(w), bool)
        w, v, pos = w[mine], v[mine], pos[mine]
        first = np.r_[True, w[1:] != w[:-1]] if len(w) else np.zeros(0, bool)
        rank = np.arange(len(w)) - np.maximum.accumulate(np.where(first, np.arange(len(w)), 0))
        out = np.zeros((len(workers), int(rank.max()) + 1 if len(rank) else 0), values.dtype)
        out[pos, rank] = v
        return out


class Round:
    """One rollout round's trajectories (`n` rows) from `start`, numbered from `id_base`."""

    def __init__(self, demand: RoundDemand, start: float, id_base: int) -> None:
        n = demand.trajectories
        self.demand, self.env, self.id_base = demand, demand.env, id_base
        self.phase = np.full(n, ENV)
        self.ready = np.full(n, float(start))        # when the current turn may start
        self.turn = np.zeros(n, np.int64)
        self.worker = np.full(n, -1)
        self.prefill_left = np.zeros(n)
        self.decode_left = np.zeros(n)
        self.ctx = np.zeros(n)                       # KV tokens on the worker for this turn
        self.hist = np.full(n, float(self.env.prompt_tokens))   # context before generation
        self.cached = np.zeros(n)                    # KV the last worker kept after the turn
        self.turn_produced = np.zeros(n)             # tokens of this turn already in `hist`
        self.fresh = np.zeros(n, bool)               # placed this tick: may start before it
        self.holding = np.zeros(n, bool)             # ran last tick, so holds KV pages
        self.age = np.zeros(n)
        self.finished = np.full(n, np.nan)
        self.placements = 0                          # turns placed on a worker (every attempt)

    @property
    def n(self) -> int:
        return len(self.phase)

    def all_done(self) -> bool:
        return bool(np.all(self.phase == DONE))

    def due(self, t1: float) -> np.ndarray:
        """Rows whose next turn becomes ready before t1, earliest first."""
        rows = np.flatnonzero((self.phase == ENV) & (self.ready < t1))
        return rows[np.argsort(self.ready[rows], kind="stable")]

    def response_tokens(self, row: int) -> int:
        return int(self.demand.response[row, self.turn[row]])

    def responses(self, rows: np.ndarray) -> np.ndarray:
        return self.demand.response[rows, self.turn[rows]]

    def start(self, rows: np.ndarray, workers: np.ndarray, cache_hit: np.ndarray) -> None:
        """The current turns of `rows` were placed on `workers`; with a cache hit only the tokens
        since the previous turn need a prefill."""
        self.ctx[rows] = np.where(cache_hit, self.cached[rows], 0.0)
        self.prefill_left[rows] = self.hist[rows] - self.ctx[rows]
        fresh = self.decode_left[rows] <= 0
        self.decode_left[rows[fresh]] = self.responses(rows[fresh])
        self.worker[rows] = workers
        self.phase[rows] = PREFILL
        self.fresh[rows] = True
        self.holding[rows] = False
        self.age[rows] = self.placements + np.arange(1, len(rows) + 1)
        self.placements += len(rows)

    def queue(self, rows: np.ndarray) -> None:
        self.phase[rows] = WAIT
        self.worker[rows] = -1

    def interrupt(self, row: int) -> int:
        """The turn lost its worker (abort, preemption): the tokens produced so far join the
        context (resume, not restart). Returns the tokens produced in this attempt."""
        produced = int(self.response_tokens(row) - np.ceil(self.decode_left[row]) - self.turn_produced[row])
        self.hist[row] += produced
        self.turn_produced[row] += produced
        self.worker[row] = -1
        self.phase[row] = WAIT
        self.cached[row] = 0.0
        self.holding[row] = False
        return produced

    def active_view(self, kv_cap: np.ndarray, max_seqs: np.ndarray, only_fresh: bool = False) -> ActiveView:
        """Sequences on workers, per worker those already holding pages first, then by age;
        those that fit run, the others wait for pages (as an engine's scheduler keeps them: it
        preempts the latest running sequence when the pages within its budget run out, so a
        co-serving executor's rollouts shrink to a budget cut by serving's growth by the next
        tick, and the burst state machine, observing first, sees what they held).
        `only_fresh`: the view of the turns placed since the tick's main pass (which fit
        beside the ones already running), for a sub-pass of the same tick."""
        idx = np.flatnonzero((self.phase == PREFILL) | (self.phase == DECODE))
        if not len(idx):
            e = np.zeros(0, np.int64)
            return ActiveView(e, e, np.zeros(0, bool), e, np.zeros(0))
        w = self.worker[idx]
        order = np.lexsort((self.age[idx], ~self.holding[idx], w))
        idx, w = idx[order], w[order]
        kv = self.ctx[idx] + np.where(self.phase[idx] == PREFILL, self.prefill_left[idx], 0.0)
        first = np.r_[True, w[1:] != w[:-1]]
        start = np.maximum.accumulate(np.where(first, np.arange(len(idx)), 0))
        ckv = np.cumsum(kv)
        kv_in_group = ckv - (ckv - kv)[start]
        rank = np.arange(len(idx)) - start
        fits = (kv_in_group <= kv_cap[w]) & (rank < max_seqs[w])
        fits[first & (kv <= kv_cap[w])] = True         # a lone sequence always fits if it can
        if only_fresh:
            fits &= self.fresh[idx]
        else:
            self.holding[:] = False
        self.holding[idx[fits]] = True
        is_dec = fits & (self.phase[idx] == DECODE)
        cdec = np.cumsum(is_dec)
        dec_rank = np.where(is_dec, cdec - 1 - (cdec - is_dec)[start], -1)
        return ActiveView(idx, w, fits, dec_rank, kv)

    def advance(self, t: float, dt: float, view: ActiveView, plan: TickRates,
                credit: bool = True) -> tuple[list[tuple[int, float]], np.ndarray]:
        """Run [t, t + dt). Returns (row, end time) of each turn that finished generating, and
        the tokens each worker generated."""
        t1 = t + dt
        run = view.fits
        idx, w = view.idx[run], view.worker[run]
        n_workers = len(plan.prefill_rate)
        if not len(idx):
            return [], np.zeros(n_workers)
        # A turn placed at this tick's start that became ready during the previous tick is run
        # from its ready time (at most one tick back), so routing at tick boundaries adds no
        # latency on average.
        back = t - dt if credit else t
        begin = np.where(self.fresh[idx], np.maximum(back, self.ready[idx]), np.maximum(t, self.ready[idx]))
        avail = np.maximum(0.0, t1 - begin)
        # Prefill: the worker's prefill rate shared equally by its fitting prefilling sequences.
        pre = self.phase[idx] == PREFILL
        n_pre = np.bincount(w[pre], minlength=len(plan.prefill_rate))
        prate = np.where(pre, plan.prefill_rate[w] / np.maximum(n_pre[w], 1), 0.0)
        need = np.where(pre, self.prefill_left[idx] / np.where(prate > 0, prate, 1.0), 0.0)
        need = np.where(pre & (prate <= 0), np.inf, need)
        # A turn placed in a sub-pass on a worker whose tick plan has no prefill budget (none was
        # pending at the tick's start) starts next tick, from its ready time, not from the tick.
        self.fresh[idx[~(pre & (prate <= 0))]] = False
        pre_done = pre & (need <= avail)
        still_pre = pre & ~pre_done
        self.prefill_left[idx[still_pre]] -= prate[still_pre] * avail[still_pre]
        # Decode: tier rates by rank; sequences that just finished prefill decode with what is
        # left of the tick at the worker's top tier.
        rank = view.decode_rank[run]
        drate = (np.where(rank >= 0, plan.rate0[w], 0.0)
                 + np.where((rank >= 0) & (rank < plan.cap1[w]), plan.rate1[w], 0.0)
                 + np.where((rank >= 0) & (rank < plan.cap2[w]), plan.rate2[w], 0.0))
        drate = np.where(pre_done, plan.rate0[w] + plan.rate1[w] + plan.rate2[w], drate)
        dbegin = np.where(pre_done, begin + np.where(pre_done, need, 0.0), begin)
        decoding = (self.phase[idx] == DECODE) | pre_done
        left = self.decode_left[idx]
        dtime = np.maximum(0.0, t1 - dbegin)
        tokens = np.where(decoding, drate * dtime, 0.0)
        fin = decoding & (tokens >= left) & (drate > 0)
        end = dbegin + left / np.where(drate > 0, drate, 1.0)
        rows_pd = idx[pre_done]
        self.ctx[rows_pd] = self.hist[rows_pd]
        self.prefill_left[rows_pd] = 0.0
        self.phase[rows_pd] = DECODE
        going = decoding & ~fin
        self.decode_left[idx[going]] = left[going] - tokens[going]
        self.ctx[idx[going]] += tokens[going]
        made = np.bincount(w, weights=np.minimum(tokens, left), minlength=n_workers)
        return list(zip(idx[fin].tolist(), end[fin].tolist(), strict=True)), made

    def finish_turns(self, rows: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Generation of the current turns of `rows` ended at `ends`; the environment steps.
        Returns which trajectories are now complete."""
        self.hist[rows] += self.responses(rows) - self.turn_produced[rows]
        self.cached[rows] = self.hist[rows]
        self.turn_produced[rows] = 0.0
        self.decode_left[rows] = 0.0
        self.turn[rows] += 1
        self.worker[rows] = -1
        done = self.turn[rows] >= self.demand.turns[rows]
        self.phase[rows] = np.where(done, DONE, ENV)
        self.finished[rows[done]] = ends[done]
        more = rows[~done]
        self.hist[more] += self.env.obs_tokens
        self.ready[more] = ends[~done] + self.env.env_step_s
        return done
