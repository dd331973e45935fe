"""Rollout rounds in batches (`sim.rollout_model=batched`): the cost of a tick grows with the
events in it, not with the sequences running.

The per-turn model (`rollout.Round` through `dispatch.Dispatch`) routes every turn through the
routing table one by one and advances every running sequence every tick; at ten thousand
workers that is a million turns a step. Here:

- every worker has `rl.fixed_concurrency` slots, a trajectory one of them while it runs (and,
  when the cap counts trajectories, between its turns); a turn that takes a slot takes the one
  given up first and starts no earlier than it was given up;
- a worker's sequences share its rates equally (its decode tokens per second over every sequence
  it runs in the tick, its prefill tokens per second over its prompts), and its iterations carry
  them all (`BatchedRound.tick_load`), so each worker keeps two clocks,
  the tokens one of its decoding sequences has decoded so far and the prompt tokens one of its
  prefilling sequences has prefilled; a sequence is a target on its worker's clock, reached at an
  exact time inside a tick, and a tick touches only the sequences that reach theirs;
- the turns due in a tick are routed together by the routing policy's array form
  (`rose.rollout.routing.spread`, `pays`, `rebalance_moves`: the rule `choose_worker` and
  `RoutingTable.rebalance` apply one by one), counts of slots per worker;
- admission, free-slot reports and the burst state machine are the co-serving planner's, as in
  the per-turn model, with each executor's sequences offered at their mean context.

What it gives up (docs/simulator.md measures it): admission's oldest-first order within an
executor (rates are shared equally), a worker over its KV budget slows all its sequences in
proportion instead of stalling its newest, queued turns lose their cache affinity, and turns due
in one tick are routed as a batch (affinity first, then the rest in order of readiness).
"""

from __future__ import annotations

import collections

import numba
import numpy as np

from rose.rollout.routing import RouteReason, pays, rebalance_moves, spread
from rose.sim.coserving import CoServing, ServingTimes
from rose.sim.engine import Simulation
from rose.sim.rates import WorkerLoad, plan_rates
from rose.sim.rollout import DECODE, DONE, ENV, PREFILL, WAIT, TickRates
from rose.sim.scenarios import Scenario
from rose.sim.systems import System
from rose.sim.workers import COSERVE, Workers
from rose.sim.workloads import RoundDemand

SUBPASSES = 4               # further turns of one trajectory within a tick


def _add(to: np.ndarray, at: np.ndarray, values: np.ndarray | float) -> None:
    """`to[at] += values`, repeated indices summed (as np.add.at, by bincount: faster)."""
    if len(at):
        to += np.bincount(at, weights=np.broadcast_to(values, at.shape), minlength=len(to))


@numba.njit(cache=True)
def _evenly(count: np.ndarray, total: np.ndarray) -> np.ndarray:
    """[rows, most count]: each row's `count` entries of `total` / `count` tokens (at least 1).
    (Compiled: numpy's broadcasting over rows this short costs more than filling them.)"""
    n = count.astype(np.int64)
    out = np.zeros((len(n), n.max() if len(n) else 0), np.int64)
    for i in range(len(n)):
        out[i, : n[i]] = int(max(1.0, total[i] / max(n[i], 1)))
    return out


# A worker's sums, compiled: each is asked several times a tick, of every worker.
@numba.njit(cache=True)
def _decode_context(n_dec: np.ndarray, dec_base: np.ndarray, dec_clock: np.ndarray) -> np.ndarray:
    """Context tokens of each worker's decoding sequences."""
    out = np.zeros(len(n_dec))
    for w in range(len(n_dec)):
        if n_dec[w] > 0:
            out[w] = dec_base[w] + n_dec[w] * dec_clock[w]
    return out


@numba.njit(cache=True)
def _kv(n_dec: np.ndarray, dec_base: np.ndarray, dec_clock: np.ndarray, n_pre: np.ndarray,
        pre_kv: np.ndarray) -> np.ndarray:
    """KV tokens of each worker's running sequences: its decoding ones' contexts and its
    prefilling ones'."""
    out = _decode_context(n_dec, dec_base, dec_clock)
    for w in range(len(n_pre)):
        out[w] += pre_kv[w] if n_pre[w] > 0 else 0.0
    return out


@numba.njit(cache=True)
def _prefill_load(placed: np.ndarray, worker: np.ndarray, target: np.ndarray, hist: np.ndarray,
                  n_pre: np.ndarray, pre_targets: np.ndarray,
                  pre_clock: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`BatchedRound.tick_load`'s prefill: the prompt tokens each worker still has to prefill, to a
    millionth, not a sum's rounding (a whole prompt's tokens must not come out a hair over, and
    cost an iteration more), those of the rows `placed` (not started) added; its prompts; and the
    contexts of the rows placed."""
    placed_tokens, placed_prompts = np.zeros(len(n_pre)), np.zeros(len(n_pre), np.int64)
    placed_kv = np.zeros(len(n_pre))
    for r in placed:
        placed_tokens[worker[r]] += target[r]
        placed_prompts[worker[r]] += 1
        placed_kv[worker[r]] += hist[r]
    tokens, prompts = np.empty(len(n_pre)), np.empty(len(n_pre))
    for w in range(len(n_pre)):
        left = 0.0
        if n_pre[w] > 0:
            left = pre_targets[w] - n_pre[w] * pre_clock[w]
            left = left if left > 0.0 else 0.0
        tokens[w] = np.rint(left * 1e6) / 1e6 + placed_tokens[w]      # numpy's round to 6 decimals
        prompts[w] = n_pre[w] + placed_prompts[w]
    return tokens, prompts, placed_kv


@numba.njit(cache=True)
def _reach(t: float, t1: float, pre_at: np.ndarray, dec_at: np.ndarray, pre_soonest: np.ndarray,
           dec_soonest: np.ndarray, cell: np.ndarray, pre_clock: np.ndarray, dec_clock: np.ndarray,
           prate: np.ndarray, drate: np.ndarray, pre1: np.ndarray, dec1: np.ndarray, target: np.ndarray,
           left: np.ndarray, hist: np.ndarray, phase: np.ndarray, n_pre: np.ndarray, n_dec: np.ndarray,
           pre_targets: np.ndarray, pre_kv: np.ndarray, dec_base: np.ndarray, made: np.ndarray,
           rows: np.ndarray, ends: np.ndarray) -> int:
    """The slots whose sequence reaches its target in [t, t1) on its worker's clocks (at `prate`
    and `drate` each from `pre_clock` and `dec_clock` to `pre1` and `dec1`): a prefill that ends
    starts decoding then, with the rest of the tick at the decode rate; a decode that ends is a
    turn done. Updates the rows, the slots' targets and the workers' sums and tokens `made`;
    writes the rows whose turn ended and when into `rows` and `ends` and returns how many.
    (Compiled: a tick scans every slot of the workers whose `pre_soonest` or `dec_soonest`, at
    most their slots' least targets, the tick's clocks reach; it sets them to those targets.)"""
    workers, slots = cell.shape
    done = 0
    for w in range(workers):
        if pre_soonest[w] > pre1[w] and dec_soonest[w] > dec1[w]:
            continue
        pre_least = dec_least = np.inf
        for k in range(slots):
            if pre_at[w, k] <= pre1[w]:
                r = cell[w, k]
                at = t + (target[r] - pre_clock[w]) / prate[w] if prate[w] > 0 else t
                pre_at[w, k] = np.inf
                n_pre[w] -= 1
                pre_targets[w] -= target[r]
                pre_kv[w] -= hist[r]
                v0 = dec_clock[w] + drate[w] * (at - t)
                phase[r] = DECODE
                target[r] = v0 + left[r]
                dec_at[w, k] = target[r]
                n_dec[w] += 1
                dec_base[w] += hist[r] - v0
                made[w] += dec1[w] - v0
            if dec_at[w, k] <= dec1[w]:
                r = cell[w, k]
                at = t + (target[r] - dec_clock[w]) / drate[w] if drate[w] > 0 else t
                made[w] -= dec1[w] - target[r]
                dec_at[w, k] = np.inf
                n_dec[w] -= 1
                dec_base[w] -= hist[r] - (target[r] - left[r])
                rows[done] = r
                ends[done] = min(at, t1)
                done += 1
            pre_least = min(pre_least, pre_at[w, k])
            dec_least = min(dec_least, dec_at[w, k])
        pre_soonest[w], dec_soonest[w] = pre_least, dec_least
    return done


@numba.njit(cache=True)
def _place(rows: np.ndarray, wids: np.ndarray, hits: np.ndarray, begin: np.ndarray, placements: int,
           response: np.ndarray, turn: np.ndarray, worker: np.ndarray, slot: np.ndarray, cell: np.ndarray,
           occ: np.ndarray, free_at: np.ndarray, phase: np.ndarray, target: np.ndarray, hist: np.ndarray,
           cached: np.ndarray, begins: np.ndarray, placed: np.ndarray, order: np.ndarray,
           left: np.ndarray) -> None:
    """`BatchedRound.place`, row by row; a new turn's length from `response` [rows, turns]. A row
    that takes a slot takes the one given up first, and begins no earlier than it was.
    (Compiled: thousands of turns a tick.)"""
    for i in range(len(rows)):
        r, w = rows[i], wids[i]
        start = begin[i]
        if worker[r] != w:
            if slot[r] >= 0:
                cell[worker[r], slot[r]] = -1
                free_at[worker[r], slot[r]] = start
                occ[worker[r]] -= 1
            k = -1
            for j in range(cell.shape[1]):
                if cell[w, j] < 0 and (k < 0 or free_at[w, j] < free_at[w, k]):
                    k = j
            start = max(start, free_at[w, k])
            cell[w, k] = r
            slot[r] = k
            worker[r] = w
            occ[w] += 1
        phase[r] = PREFILL
        target[r] = hist[r] - (cached[r] if hits[i] else 0.0)     # prompt tokens, until it starts
        begins[r] = start
        placed[r] = True
        order[r] = placements + i + 1
        if left[r] <= 0:
            left[r] = response[r, turn[r]]


@numba.njit(cache=True)
def _come_back(p: np.ndarray, ok: np.ndarray, holds: np.ndarray, cap: np.ndarray, occupied: np.ndarray,
               serving: np.ndarray, free: np.ndarray) -> None:
    """`BatchedRound.route`'s affinity room: of the turns `ok` to go back to their previous worker
    `p`, where more come back than it has room for (its own held slots and those nobody holds; an
    executor's also within its free rollout slots), the holders are kept first, then the others,
    each in order; the rest are no longer ok. (Compiled: a pass that counts, one that ranks.)"""
    holders, back = np.zeros(len(cap), np.int64), np.zeros(len(cap), np.int64)
    for i in range(len(p)):
        if ok[i]:
            back[p[i]] += 1
            holders[p[i]] += holds[i]
    ranked_holders, ranked_others = np.zeros(len(cap), np.int64), np.zeros(len(cap), np.int64)
    for i in range(len(p)):
        if not ok[i]:
            continue
        w = p[i]
        allow = holders[w] + max(0, cap[w] - occupied[w])
        if serving[w]:
            allow = min(allow, free[w])
        if back[w] > allow:
            if holds[i]:
                rank = ranked_holders[w]
                ranked_holders[w] += 1
            else:
                rank = holders[w] + ranked_others[w]
                ranked_others[w] += 1
            ok[i] = rank < allow


@numba.njit(cache=True)
def _running(wids: np.ndarray, cell: np.ndarray, phase: np.ndarray, order: np.ndarray) -> np.ndarray:
    """`BatchedRound.running`: [workers, slots], each worker's running rows oldest first (in order
    of placement, ties in slot order), -1 after them. (Compiled: a stable sort of a few slots.)"""
    out = np.full((len(wids), cell.shape[1]), -1)
    for i in range(len(wids)):
        n = 0
        for k in range(cell.shape[1]):
            r = cell[wids[i], k]
            if r < 0 or (phase[r] != PREFILL and phase[r] != DECODE):
                continue
            j = n
            while j > 0 and order[out[i, j - 1]] > order[r]:
                out[i, j] = out[i, j - 1]
                j -= 1
            out[i, j] = r
            n += 1
    return out


@numba.njit(cache=True)
def _release(rows: np.ndarray, at: np.ndarray, worker: np.ndarray, slot: np.ndarray, cell: np.ndarray,
             occ: np.ndarray, free_at: np.ndarray) -> None:
    """`BatchedRound._release`, row by row (compiled: no pass over every worker for a few rows)."""
    for i in range(len(rows)):
        r = rows[i]
        if slot[r] >= 0:
            cell[worker[r], slot[r]] = -1
            free_at[worker[r], slot[r]] = at[i]
            occ[worker[r]] -= 1
            slot[r] = -1
            worker[r] = -1


@numba.njit(cache=True)
def _start_prefill(rows: np.ndarray, t: float, prate: np.ndarray, worker: np.ndarray, slot: np.ndarray,
                   target: np.ndarray, begins: np.ndarray, hist: np.ndarray, placed: np.ndarray,
                   pre_clock: np.ndarray, n_pre: np.ndarray, pre_targets: np.ndarray, pre_kv: np.ndarray,
                   pre_at: np.ndarray, pre_soonest: np.ndarray) -> None:
    """`BatchedRound.start_prefill`, row by row: each target on its worker's prefill clock."""
    for r in rows:
        w = worker[r]
        target[r] = pre_clock[w] + prate[w] * (begins[r] - t) + target[r]
        n_pre[w] += 1
        pre_targets[w] += target[r]
        pre_kv[w] += hist[r]
        pre_at[w, slot[r]] = target[r]
        pre_soonest[w] = min(pre_soonest[w], target[r])
        placed[r] = False


@numba.njit(cache=True)
def _finish(rows: np.ndarray, ends: np.ndarray, turns: np.ndarray, serving: np.ndarray, hold: bool,
            obs: float, env_step: float, left: np.ndarray, hist: np.ndarray, cached: np.ndarray,
            produced: np.ndarray, turn: np.ndarray, previous: np.ndarray, worker: np.ndarray,
            slot: np.ndarray, cell: np.ndarray, occ: np.ndarray, free_at: np.ndarray, free: np.ndarray,
            phase: np.ndarray, finished: np.ndarray, ready: np.ndarray) -> np.ndarray:
    """`BatchedRound._finish_turns`, row by row; returns the rows whose trajectory goes on."""
    more = np.empty(len(rows), np.int64)
    going = 0
    for i in range(len(rows)):
        r = rows[i]
        w = worker[r]
        hist[r] += left[r]
        cached[r] = hist[r]
        produced[r] = 0.0
        left[r] = 0.0
        turn[r] += 1
        previous[r] = w
        if serving[w]:
            free[w] += 1
        done = turn[r] >= turns[r]
        if done or not hold:
            cell[w, slot[r]] = -1
            free_at[w, slot[r]] = ends[i]
            occ[w] -= 1
            slot[r] = -1
            worker[r] = -1
        if done:
            phase[r] = DONE
            finished[r] = ends[i]
        else:
            phase[r] = ENV
            hist[r] += obs
            ready[r] = ends[i] + env_step
            more[going] = r
            going += 1
    return more[:going]


@numba.njit(cache=True)
def _measure(rate: np.ndarray, made: np.ndarray, running: np.ndarray, registered: np.ndarray,
             dt: float) -> None:
    """`BatchedRouter.measure`, worker by worker."""
    for w in range(len(rate)):
        if running[w] > 0 and registered[w]:
            now = made[w] / dt / running[w]
            rate[w] = 0.5 * now + 0.5 * rate[w] if rate[w] > 0 else now


class BatchedRouter:
    """What the rollout scheduler keeps across rounds: which workers are in the table, each
    one's measured decode rate per sequence, the route counts."""

    def __init__(self, workers: Workers, slots: int, affinity: bool, hold_slots: bool) -> None:
        self.workers, self.slots, self.affinity, self.hold_slots = workers, slots, affinity, hold_slots
        self.serving = workers.kind == COSERVE            # the executors (kinds do not change)
        self.cap = np.full(len(workers.kind), slots)      # every worker's slots
        self.rate = np.zeros(len(workers.kind))          # measured tokens/s of one sequence
        self.free = np.zeros(len(workers.kind))          # an executor's last free-slot report
        self.counts: collections.Counter[RouteReason] = collections.Counter()
        self.aborted = 0

    def unregister(self, wids: np.ndarray) -> None:
        self.workers.registered[wids] = False

    def membership(self, t: float, dt: float) -> None:
        w = self.workers
        w.registered |= (w.ready_at <= t + dt) & (w.gone_at > t)

    def measure(self, made: np.ndarray, running: np.ndarray, dt: float) -> None:
        """Smoothed as `RoutingTable.measure` smooths (half the newest measurement)."""
        _measure(self.rate, made, running, self.workers.registered, dt)


class BatchedRound:
    """One rollout round's trajectories (rows) on `router`'s workers from `start`."""

    def __init__(self, demand: RoundDemand, start: float, id_base: int, router: BatchedRouter) -> None:
        n, w, k = demand.trajectories, len(router.workers.kind), router.slots
        self.demand, self.env, self.id_base, self.router = demand, demand.env, id_base, router
        self.phase = np.full(n, ENV)
        self.ready = np.full(n, float(start))
        self.turn = np.zeros(n, np.int64)
        self.hist = np.full(n, float(self.env.prompt_tokens))   # context before generation
        self.cached = np.zeros(n)                    # KV the last worker kept after the turn
        self.produced = np.zeros(n)                  # tokens of this turn already in `hist`
        self.left = np.zeros(n)                      # tokens of this turn still to generate
        self.worker = np.full(n, -1)
        self.slot = np.full(n, -1)
        self.previous = np.full(n, -1)               # worker of the previous turn (affinity)
        self.target = np.zeros(n)                    # on the worker's clock of the current phase
        self.begin = np.zeros(n)                     # placed this tick: when it may start
        self.placed = np.zeros(n, bool)
        self.order = np.zeros(n)                     # placement order (the oldest first)
        self.finished = np.full(n, np.nan)
        self.queue = np.zeros(0, np.int64)           # queued rows, FIFO
        self._env = np.arange(n)                     # rows in their environment, not yet routed
        self._done = 0                               # rows DONE
        self.placements = 0                          # turns placed on a worker (every attempt)
        # Per worker: its slots' rows, the two clocks, and running sums.
        self.cell = np.full((w, k), -1)
        self.occ = np.zeros(w, np.int64)            # slots taken
        self.free_at = np.full((w, k), -np.inf)     # when each slot was given up (none starts before)
        self.pre_clock, self.dec_clock = np.zeros(w), np.zeros(w)
        self.n_pre, self.n_dec = np.zeros(w), np.zeros(w)
        self.pre_targets = np.zeros(w)               # sum of prefilling sequences' targets
        self.pre_kv = np.zeros(w)                    # their KV (their whole contexts)
        self.dec_base = np.zeros(w)                  # sum of (context - clock) of decoding ones
        # Targets per slot, inf where none: what a tick compares its clocks with.
        self.pre_at = np.full((w, k), np.inf)
        self.dec_at = np.full((w, k), np.inf)
        # Per worker, at most its least target of each kind (taking one off leaves it): a tick's
        # scan skips the workers whose clocks reach neither.
        self.pre_soonest, self.dec_soonest = np.full(w, np.inf), np.full(w, np.inf)
        self._rows, self._ends = np.empty(w * k, np.int64), np.empty(w * k)   # turns ending in a pass

    def all_done(self) -> bool:
        return self._done == len(self.phase)

    # -- per worker -----------------------------------------------------------------------------
    def occupied(self) -> np.ndarray:
        return self.occ

    def active(self) -> np.ndarray:
        return self.n_pre + self.n_dec

    def kv(self) -> np.ndarray:
        """KV tokens of each worker's running sequences."""
        return _kv(self.n_dec, self.dec_base, self.dec_clock, self.n_pre, self.pre_kv)

    def held_contexts(self, wids: np.ndarray) -> np.ndarray:
        """[workers, sequences]: each running sequence of `wids` at their mean KV (what holds
        pages, for the free-slot reports)."""
        return _evenly(self.active()[wids], self.kv()[wids])

    def running(self, wids: np.ndarray) -> np.ndarray:
        """[workers, sequences]: the rows of each running sequence of `wids`, oldest first (-1 after
        them)."""
        return _running(wids, self.cell, self.phase, self.order)

    def running_kv(self, wids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`running(wids)`, and the KV tokens of each (0 after them)."""
        rows = self.running(wids)
        r = np.maximum(rows, 0)
        decoded = self.dec_clock[wids][:, None] - self._v0(r)
        kv = np.where(self.phase[r] == PREFILL, self.hist[r], self.hist[r] + decoded)
        return rows, np.where(rows >= 0, kv, 0.0)

    def tick_load(self) -> WorkerLoad:
        """Per worker, what its iterations carry through a tick: every sequence on it (decoding,
        prefilling, or placed to start: a turn's prompt is short beside its decode, so each
        decodes for most of a tick) and their contexts, the prompt tokens to prefill (those placed
        included) and prompts. (Counting the decoding ones alone, iterations of a tick that begins
        between turns come out short, and coarse ticks fast: the turns joining during it ride
        free.)"""
        pending, prompts, placed_kv = _prefill_load(np.flatnonzero(self.placed), self.worker, self.target,
                                                    self.hist, self.n_pre, self.pre_targets, self.pre_clock)
        return self.n_dec + prompts, self.kv() + placed_kv, pending, prompts

    # -- moving sequences -------------------------------------------------------------------------
    def place(self, rows: np.ndarray, wids: np.ndarray, hits: np.ndarray, begin: np.ndarray) -> None:
        """The current turns of `rows` start on `wids` (a cache hit prefills only what is new),
        each at `begin` (its clock target is set with the tick's rates, `start_prefill`); a row
        keeps the slot it holds there, else takes a free one (routing gave it room)."""
        if not len(rows):
            return
        _place(rows, wids, hits, begin, self.placements, self.demand.response, self.turn, self.worker,
               self.slot, self.cell, self.occ, self.free_at, self.phase, self.target, self.hist, self.cached,
               self.begin, self.placed, self.order, self.left)
        self.placements += len(rows)

    def start_prefill(self, rows: np.ndarray, t: float, prate: np.ndarray) -> None:
        """Placed rows join their worker's prefill from `begin` at the tick's per-prompt rate."""
        _start_prefill(rows, t, prate, self.worker, self.slot, self.target, self.begin, self.hist,
                       self.placed, self.pre_clock, self.n_pre, self.pre_targets, self.pre_kv, self.pre_at,
                       self.pre_soonest)

    def _release(self, rows: np.ndarray, at: np.ndarray | float) -> None:
        """Free the slots `rows` hold (between turns, or before a move) at `at`."""
        _release(rows, np.broadcast_to(np.asarray(at, float), rows.shape), self.worker, self.slot, self.cell,
                 self.occ, self.free_at)

    def _leave_phase(self, rows: np.ndarray) -> None:
        """Take running `rows` out of their worker's sums."""
        w = self.worker[rows]
        pre = self.phase[rows] == PREFILL
        _add(self.n_pre, w[pre], -1)
        _add(self.pre_targets, w[pre], -self.target[rows[pre]])
        _add(self.pre_kv, w[pre], -self.hist[rows[pre]])
        dec = ~pre
        _add(self.n_dec, w[dec], -1)
        _add(self.dec_base, w[dec], -(self.hist[rows[dec]] - self._v0(rows[dec])))
        self.pre_at[w, self.slot[rows]] = np.inf
        self.dec_at[w, self.slot[rows]] = np.inf

    def _v0(self, rows: np.ndarray) -> np.ndarray:
        """The decode clock of each decoding row's worker when it began decoding."""
        return self.target[rows] - self.left[rows]

    def interrupt(self, rows: np.ndarray, t: float) -> np.ndarray:
        """The turns of running `rows` stop where they are at t (abort, move): the tokens produced
        join the context, to be resumed; they lose their slot and cached prefix. Returns the tokens
        each had produced in this attempt."""
        produced = np.zeros(len(rows))
        # Placed this tick: not in the worker's sums yet.
        run = ((self.phase[rows] == PREFILL) | (self.phase[rows] == DECODE)) & ~self.placed[rows]
        r = rows[run]
        if len(r):
            dec = self.phase[r] == DECODE
            done = np.where(dec, np.floor(self.dec_clock[self.worker[r]] - self._v0(r)), 0.0)
            done = np.minimum(done, self.left[r])
            self._leave_phase(r)
            self.hist[r] += done
            self.produced[r] += done
            self.left[r] -= done
            produced[run] = done
        self.placed[rows] = False
        self._release(rows, t)
        self.phase[rows] = WAIT
        self.cached[rows] = 0.0
        self.previous[rows] = -1
        return produced

    # -- one tick ---------------------------------------------------------------------------------
    def advance(self, t: float, dt: float, plan: TickRates, load: WorkerLoad) -> np.ndarray:
        """Run [t, t + dt) at `plan`'s rates: prefills and decodes reach their targets at exact
        times, environments step, and turns ready within the tick are routed and run in it too, up
        to SUBPASSES times. Returns the tokens each worker generated."""
        t1 = t + dt
        dec0 = self.n_dec.copy()
        running, _, _, prompts = load            # `tick_load` as the tick's plan was made
        # Fair share of the decode tiers: the worker's tokens/s over the sequences it runs in the
        # tick.
        n = np.maximum(running, 1)
        drate = plan.rate0 + (np.minimum(n, plan.cap1) * plan.rate1
                              + np.minimum(n, plan.cap2) * plan.rate2) / n
        prate = plan.prefill_rate / np.maximum(prompts, 1)
        # What does not fit in a worker's KV budget waits: its rates shrink in proportion.
        kv = self.kv()
        fit = np.where(kv > self.router.workers.kv_cap, self.router.workers.kv_cap / np.maximum(kv, 1), 1.0)
        drate, prate = drate * fit, prate * fit
        self.start_prefill(np.flatnonzero(self.placed), t, prate)
        pre1, dec1 = self.pre_clock + prate * dt, self.dec_clock + drate * dt
        made = dec0 * (dec1 - self.dec_clock)
        for sub in range(SUBPASSES + 1):
            made += self._events(t, t1, prate, drate, pre1, dec1)
            if sub == SUBPASSES:
                break
            if not self._routable(t1):
                break
            rows = self.route(t, t1, credit=False)
            if not len(rows):
                break
            # Placed within the tick, from their ready time, at the tick's rates; on a worker the
            # tick gave no prefill (none was pending as it began), from their ready time next tick
            # (as the per-turn model has them).
            self.start_prefill(rows[prate[self.worker[rows]] > 0], t, prate)
        self.pre_clock, self.dec_clock = pre1, dec1
        return made

    def _events(self, t: float, t1: float, prate: np.ndarray, drate: np.ndarray, pre1: np.ndarray,
                dec1: np.ndarray) -> np.ndarray:
        """Prefills and decodes that reach their targets by the tick's end; returns the decode
        tokens to correct the tick's count by (joining and leaving within it)."""
        made = np.zeros(len(drate))
        done = _reach(t, t1, self.pre_at, self.dec_at, self.pre_soonest, self.dec_soonest, self.cell,
                      self.pre_clock, self.dec_clock, prate, drate, pre1, dec1, self.target, self.left,
                      self.hist, self.phase, self.n_pre, self.n_dec, self.pre_targets, self.pre_kv,
                      self.dec_base, made, self._rows, self._ends)
        if done:
            self._finish_turns(self._rows[:done].copy(), self._ends[:done].copy())
        return made

    def _finish_turns(self, rows: np.ndarray, ends: np.ndarray) -> None:
        """Generation of the current turns of `rows` ended at `ends`; the environment steps. The
        executor's free slots grow back at once, as `RoutingTable.complete` has them; a
        trajectory keeps its slot between turns where the cap counts trajectories."""
        more = _finish(rows, ends, self.demand.turns, self.router.serving, self.router.hold_slots,
                       float(self.env.obs_tokens), self.env.env_step_s, self.left, self.hist, self.cached,
                       self.produced, self.turn, self.previous, self.worker, self.slot, self.cell, self.occ,
                       self.free_at, self.router.free, self.phase, self.finished, self.ready)
        self._done += len(rows) - len(more)
        self._env = np.concatenate((self._env, more))

    # -- routing ------------------------------------------------------------------------------------
    def _routable(self, t1: float) -> bool:
        """Whether a turn is due before t1, or one queued could find a slot."""
        if (self.ready[self._env] < t1).any():
            return True
        if not len(self.queue):
            return False
        r, w = self.router, self.router.workers
        room = np.where(r.serving, np.minimum(r.slots - self.occ, r.free), r.slots - self.occ)
        return bool((w.registered & (room > 0)).any())

    def _due(self, t1: float) -> np.ndarray:
        """Rows in their environment whose next turn is ready before t1 (in no order)."""
        ready = self.ready[self._env] < t1
        rows, self._env = self._env[ready], self._env[~ready]
        return rows

    def _by_ready(self, rows: np.ndarray) -> np.ndarray:
        return rows[np.argsort(self.ready[rows], kind="stable")]

    def route(self, t: float, t1: float, credit: bool) -> np.ndarray:
        """Route the queue (FIFO) and then the turns due before t1 (in order of readiness) as
        `choose_worker` would one by one, in batches: the queue by `spread`; a due turn to its
        previous worker (cache affinity: a dedicated worker where it holds its slot or that has
        room; a serving executor with room unless moving to a dedicated one pays: then there, as
        many as the dedicated room left), the others by `spread`; the rest queue. A turn placed
        starts at its ready time, at most a tick back with `credit` (the tick's first pass: it
        became ready during the previous tick). Returns the rows placed."""
        r = self.router
        cap, serving, eligible = r.cap, r.serving, r.workers.registered
        back = t - (t1 - t) if credit else t
        placed = [self._spread(self.queue, back, queue_rest=False)]
        due = self._due(t1)
        if not len(due):
            return placed[0]
        occupied = self.occupied()
        prev = self.previous[due] if r.affinity else np.full(len(due), -1)
        p = np.maximum(prev, 0)
        holds = self.worker[due] == prev
        load = occupied[p] - holds          # as a turn sees it, its own slot given back first
        ok = (prev >= 0) & eligible[p]
        # Each goes back to its previous worker while that has room: its own held slot, or one
        # nobody holds; an executor also only within its free rollout slots.
        _come_back(p, ok, holds, cap, occupied, serving, r.free)
        # An executor keeps its turns unless the least-loaded dedicated workers with room pay
        # (weighed in order of readiness; the rest go back unordered: each to its own worker).
        stay = np.flatnonzero(ok & serving[p])
        movers = dst = stay[:0]
        if len(stay):
            dst = spread(len(stay), np.where(eligible, occupied, cap), cap, np.zeros(len(cap)), serving)
        if len(dst):  # (usually the dedicated workers have no room: nothing to weigh)
            stay = stay[np.argsort(self.ready[due[stay]], kind="stable")][: len(dst)]
            move = pays(r.rate[dst], occupied[dst], occupied[dst], r.rate[p[stay]], load[stay])
            movers, dst = stay[move], dst[move]
            ok[movers] = False
        kept = due[ok]
        self.place(kept, p[ok], np.ones(len(kept), bool), np.maximum(back, self.ready[kept]))
        r.counts[RouteReason.AFFINITY] += len(kept)
        moved = due[movers]
        self._release(moved, np.maximum(back, self.ready[moved]))
        self.place(moved, dst, np.zeros(len(moved), bool), np.maximum(back, self.ready[moved]))
        r.counts[RouteReason.LEAST_LOADED] += len(moved)
        rest = np.ones(len(due), bool)
        rest[ok] = False
        rest[movers] = False
        placed += [kept, moved, self._spread(self._by_ready(due[rest]), back, queue_rest=True)]
        return np.concatenate(placed)

    def _spread(self, rows: np.ndarray, back: float, queue_rest: bool) -> np.ndarray:
        """Place `rows` in order by `spread` (no cache hit), from their ready time (at most `back`
        ago); those that find no room queue (`queue_rest`: behind the queue; else they are the
        queue, already waiting). Returns the rows placed."""
        if not len(rows):
            return rows
        r = self.router
        if queue_rest:
            held = rows[self.worker[rows] >= 0]
            self._release(held, np.maximum(back, self.ready[held]))
        cap, serving = r.cap, r.serving
        occupied = np.where(r.workers.registered, self.occupied(), cap)
        wids = spread(len(rows), occupied, cap, np.where(serving, r.free, 0), serving)
        placed, queued = rows[: len(wids)], rows[len(wids):]
        if len(placed):
            on_serving = serving[wids]
            _add(r.free, wids[on_serving], -1)
            r.counts[RouteReason.SERVING] += int(on_serving.sum())
            r.counts[RouteReason.LEAST_LOADED] += int((~on_serving).sum())
            self.place(placed, wids, np.zeros(len(placed), bool), np.maximum(back, self.ready[placed]))
        if queue_rest:
            r.counts[RouteReason.QUEUED] += len(queued)
            self.phase[queued] = WAIT
            self.queue = np.r_[self.queue, queued]
        else:
            self.queue = queued
        return placed

    def requeue(self, rows: np.ndarray, t: float) -> None:
        """Turns cut by a burst at t go to the front of the queue, with the tokens they produced."""
        self.interrupt(rows, t)
        self.queue = np.r_[rows, self.queue]
        self.router.aborted += len(rows)

    def rebalance(self, t: float) -> np.ndarray:
        """`RoutingTable.rebalance`'s moves: the oldest turns of the busiest executors to the
        least-loaded dedicated workers, resumed there with their tokens. Returns the rows moved."""
        r, w = self.router, self.router.workers
        serving = r.serving
        dedicated = ~serving & w.registered
        if not (self.occ[dedicated] < r.slots).any():    # no dedicated room: no move (the common case)
            return np.zeros(0, np.int64)
        active = self.active().astype(np.int64)
        take = dedicated | (serving & (active > 0))
        idx = np.flatnonzero(take)
        dst, src = rebalance_moves(self.occupied()[idx], np.full(len(idx), r.slots), r.rate[idx], active[idx],
                                   serving[idx])
        if not len(dst):
            return np.zeros(0, np.int64)
        dst, src = idx[dst], idx[src]
        # Each executor gives up its oldest running turns, one per move from it.
        order = np.argsort(src, kind="stable")
        dst, src = dst[order], src[order]
        first_of = np.r_[True, src[1:] != src[:-1]]
        rank = np.arange(len(src)) - np.maximum.accumulate(np.where(first_of, np.arange(len(src)), 0))
        moved = self.running(src)[np.arange(len(src)), rank]
        self.interrupt(moved, t)
        self.place(moved, dst, np.zeros(len(moved), bool), np.full(len(moved), t))
        r.counts[RouteReason.LEAST_LOADED] += len(moved)
        return moved


class BatchedSimulation(Simulation):
    """`Simulation` with its rollout rounds in batches (`BatchedRound`, `BatchedRouter`): the
    same step loop, provisioning, co-serving planner, burst memory and serving fleet."""

    def __init__(self, sc: Scenario, system: System, serving_alone: bool = False) -> None:
        super().__init__(sc, system, serving_alone)
        rl = self.sc.rl
        self.dispatch = BatchedRouter(self.workers, rl.fixed_concurrency, system.affinity,
                                      rl.cap_counts == "trajectories")

    def new_round(self, demand: RoundDemand, start: float, id_base: int) -> BatchedRound:
        return BatchedRound(demand, start, id_base, self.dispatch)

    def run_round(self, rnd: BatchedRound, t: float, version: int) -> float:
        """Ticks from t until every trajectory of the round is done; returns the end time."""
        cs, router, dt = self.coserving, self.dispatch, self.dt
        while not rnd.all_done() and not self._over(t):
            if cs:
                cs.fleet.arrivals_until(t + dt)
                self._batched_memory(cs, rnd, t)
            self.provisioning.tick(t)
            router.membership(t, dt)
            if cs:
                wids, slots = cs.free_slots(t, self.workers, rnd.held_contexts)
                router.free[wids] = slots
            rnd.route(t, t + dt, credit=True)
            if cs:
                rnd.rebalance(t)
            plan, serving_times, load = self._batched_plan(rnd, t)
            made = rnd.advance(t, dt, plan, load)
            self.ticks.append((t, np.bincount(self.workers.kind, weights=made, minlength=3)))
            router.measure(made, load[0], dt)
            if cs:
                cs.advance(t, serving_times)
            t += dt
            if t > 1e6:
                raise RuntimeError(f"{self.system.name}: a rollout round did not finish (stuck turns)")
        return float(np.nanmax(rnd.finished)) if rnd.all_done() else t

    def _batched_memory(self, cs: CoServing, rnd: BatchedRound, t: float) -> None:
        """The burst state machines over what each executor's sequences hold; a cut's sequences
        go back to the queue's front with the tokens they produced."""
        first = self.first_cs
        kv = np.minimum(rnd.kv()[first:], self.workers.kv_cap[first:])
        rollout_kv = cs.memory.rollout_kv

        def sequences(replicas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            rows, tokens = rnd.running_kv(first + replicas)
            return rows, (tokens * rollout_kv).astype(np.int64)

        caps, aborts = cs.memory.observe(t, cs.fleet.allocated_tokens(), (kv * rollout_kv).astype(np.int64),
                                         sequences)
        self.workers.kv_cap[first:] = caps
        if len(aborts):
            rnd.requeue(aborts, t)

    def _batched_plan(self, rnd: BatchedRound, t: float) -> tuple[TickRates, ServingTimes | None, WorkerLoad]:
        """Every worker's rates for the tick from its sums, the serving fleet's times, and the load
        they were planned for (`tick_load`)."""
        load = rnd.tick_load()
        plan, iter_s = plan_rates(*load, self.ded_cost, self.dt, float(self.sc.rl.rollout_batched_tokens))

        def mean_contexts(wids: np.ndarray) -> np.ndarray:
            """[workers, sequences]: each sequence of `wids` at their mean context (what admission
            is offered)."""
            return _evenly(load[0][wids], load[1][wids])

        serving_times = self.coserving.plan(plan, t, load, mean_contexts) if self.coserving else None
        self._share_and_control(plan, iter_s, load[0], t, rnd.placements)
        return plan, serving_times, load
