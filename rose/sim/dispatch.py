"""Routing glue: a rollout round's turns (`rollout.Round`) through the shared routing policy
(`rose.rollout.routing.RoutingTable`). Workers join and leave the table, turns are routed,
started, completed, moved to dedicated workers, aborted and resumed elsewhere with the tokens
they produced, and the rollout manager shares the round's trajectories out as per-worker
concurrency caps."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

import numpy as np

from rose.contracts import WorkerKind
from rose.rollout.routing import Route, RoutedTurn, RouteReason, RoutingTable, WorkerState, resume
from rose.sim.rollout import DONE, ActiveView, Round, TickRates
from rose.sim.workers import COSERVE, DEDICATED, ELASTIC, Workers


class Dispatch:
    """The routing table of one run and the workers it routes to. `seq_s()` gives each worker's
    time per decode iteration of one typical sequence (the caps' shares follow it);
    `fixed_concurrency`, when set, is every worker's cap instead; `serverless_invoke_s`, when
    set, is the invocation each turn on an elastic worker pays (a serverless function)."""

    def __init__(self, table: RoutingTable, workers: Workers, dt: float, fixed_concurrency: int,
                 seq_s: Callable[[], np.ndarray], serverless_invoke_s: float | None) -> None:
        self.table, self.workers, self.dt = table, workers, dt
        self.fixed_concurrency, self.seq_s = fixed_concurrency, seq_s
        self.serverless_invoke_s = serverless_invoke_s
        self.caps = np.ones(len(workers.kind), int)
        self.round_start = 0.0
        self.aborted = 0              # turns that lost their worker (abort, preemption, release)
        self.paused = False           # the dedicated workers' devices are the trainer's for now

    @property
    def counts(self) -> collections.Counter[RouteReason]:
        return self.table.counts

    def begin_round(self, rnd: Round, t: float) -> None:
        self.round_start = t
        self.set_caps(rnd, t)

    def set_caps(self, rnd: Round, t: float) -> None:
        """The rollout manager's per-worker concurrency caps: the round's unfinished
        trajectories shared over the usable workers (at the round's start, and again whenever
        capacity joins) in proportion to how fast each decodes one sequence (a serving executor
        runs the serving model's forward in every iteration too, so it gets a smaller share).
        With `rl.fixed_concurrency` every worker keeps that cap, as `rose train`'s manager does."""
        w = self.workers
        if self.fixed_concurrency:
            self.caps = np.full(len(w.kind), self.fixed_concurrency)
            return
        usable = ((w.ready_at <= t + self.dt) & (w.gone_at > t)) | w.registered
        speed = np.where(usable, 1.0 / self.seq_s(), 0.0)
        share = int(np.count_nonzero(rnd.phase != DONE)) * speed / max(speed.sum(), 1e-12)
        self.caps = np.maximum(1, np.ceil(share)).astype(int)
        self.caps[~usable] = max(1, math.ceil(rnd.n / max(1, int(usable.sum()))))
        for wid in np.flatnonzero(w.registered).tolist():
            self.table.set_concurrency(wid, int(self.caps[wid]))

    def membership(self, rnd: Round, t: float, version: int) -> None:
        """Workers usable in this tick join the table, those gone leave it (their turns resume
        elsewhere), and the live ones heartbeat."""
        w = self.workers
        join = np.flatnonzero(~w.registered & (w.ready_at <= t + self.dt) & (w.gone_at > t))
        for wid in join.tolist():
            kind = WorkerKind.SERVING if w.kind[wid] == COSERVE else WorkerKind.DEDICATED
            self.table.register(WorkerState(wid, kind, int(self.caps[wid]),
                                            last_heartbeat_s=t, policy_version=version))
            w.registered[wid] = True
        if len(join) and t > self.round_start:
            # Capacity arrived mid-round: the rollout manager re-shares what is left over the
            # workers now usable, so busier workers lose room and later turns move (at turn
            # boundaries) to the new ones.
            self.set_caps(rnd, t)
        leave = np.flatnonzero(w.registered & (w.gone_at <= t + self.dt))
        for wid in leave.tolist():
            self._drop_worker(rnd, wid, t)
        # Live workers heartbeat all through the tick (the stall timeout is shorter than a tick).
        for wid in np.flatnonzero(w.registered).tolist():
            self.table.heartbeat(wid, t + self.dt, policy_version=version)

    def pause_dedicated(self, paused: bool) -> None:
        """The trainer takes the dedicated devices (or gives them back): no turn is routed to
        them meanwhile."""
        if paused == self.paused:
            return
        self.paused = paused
        for wid in np.flatnonzero(self.workers.registered & (self.workers.kind == DEDICATED)).tolist():
            self.table.set_paused(wid, paused)

    def report(self, t: float, free_slots: list[tuple[int, int]]) -> None:
        """Serving executors' capacity reports: (worker, free rollout slots)."""
        for wid, slots in free_slots:
            self.table.heartbeat(wid, t + self.dt, free_slots=slots)

    def unregister(self, wids: np.ndarray) -> None:
        """Workers given back after a round (no turn left on them)."""
        for wid in wids.tolist():
            if self.workers.registered[wid]:
                self.table.remove(wid)
                self.workers.registered[wid] = False

    def rebalance_to_dedicated(self, rnd: Round, t: float) -> None:
        """The scheduler moves turns in flight from serving executors to dedicated workers with
        fewer turns (routing.rebalance), resuming them with the tokens already produced."""
        for turn, src, dst in self.table.rebalance(t):
            row = turn.trajectory_id - rnd.id_base
            produced = rnd.interrupt(row)
            self._place(rnd, row, self.table.move(turn.trajectory_id, src, dst, produced), t)

    def abort(self, rnd: Round, wid: int, row: int, t: float) -> None:
        """An executor aborted the turn of `row` (an emergency cut): it resumes elsewhere."""
        produced = rnd.interrupt(row)
        self._place(rnd, row, self.table.abort(wid, rnd.id_base + row, produced, t), t)
        self.aborted += 1

    def route(self, rnd: Round, t: float, version: int) -> bool:
        """Route queued turns and those ready before the tick ends; whether any was due."""
        drained = self.table.drain(t)
        if drained:
            self._start(rnd, [turn.trajectory_id - rnd.id_base for turn, _ in drained],
                        [route for _, route in drained], [t] * len(drained))
        rows = rnd.due(t + self.dt)
        if not len(rows):
            return False
        nows = np.maximum(t, rnd.ready[rows]).tolist()
        routes = [self.table.route(RoutedTurn(rnd.id_base + row, turn, int(hist), resp,
                                              policy_version=version), now)
                  for row, turn, hist, resp, now in zip(rows.tolist(), rnd.turn[rows].tolist(),
                                                        rnd.hist[rows].tolist(),
                                                        rnd.responses(rows).tolist(), nows, strict=True)]
        self._start(rnd, rows.tolist(), routes, nows)
        return True

    def advance(self, rnd: Round, t: float, view: ActiveView, plan: TickRates,
                credit: bool = True) -> np.ndarray:
        """Progress the sequences of `view` through the tick; finished turns free their slot
        and their environments step. Returns tokens generated per worker."""
        finished, tokens = rnd.advance(t, self.dt, view, plan, credit)
        if finished:
            rows = np.array([f[0] for f in finished])
            for row, wid in zip(rows.tolist(), rnd.worker[rows].tolist(), strict=True):
                self.table.complete(wid, rnd.id_base + row)
            done = rnd.finish_turns(rows, np.array([f[1] for f in finished]))
            for row in rows[done].tolist():
                self.table.finish_trajectory(rnd.id_base + row)
        return tokens

    def measure_rates(self, view: ActiveView, made: np.ndarray) -> None:
        """What the scheduler measures of each worker: tokens/s per sequence it decoded."""
        n_dec = np.bincount(view.worker[view.fits & (view.decode_rank >= 0)], minlength=len(made))
        for wid in np.flatnonzero((n_dec > 0) & self.workers.registered).tolist():
            self.table.measure(wid, float(made[wid]) / self.dt / int(n_dec[wid]))

    def _drop_worker(self, rnd: Round, wid: int, t: float) -> None:
        lost = self.table.remove(wid)
        self.workers.registered[wid] = False
        for turn in lost:
            row = turn.trajectory_id - rnd.id_base
            if 0 <= row < rnd.n and rnd.phase[row] != DONE:
                produced = rnd.interrupt(row)
                self._place(rnd, row, self.table.route(resume(turn, produced), t), t)
        self.aborted += len(lost)

    def _place(self, rnd: Round, row: int, route: Route, now: float) -> None:
        self._start(rnd, [row], [route], [now])

    def _start(self, rnd: Round, rows: list[int], routes: list[Route], nows: list[float]) -> None:
        """Apply routing decisions: placed turns start on their workers, the others queue."""
        placed = [i for i, r in enumerate(routes) if r.worker_id is not None]
        queued = [rows[i] for i, r in enumerate(routes) if r.worker_id is None]
        if queued:
            rnd.queue(np.array(queued))
        if not placed:
            return
        p_rows = np.array([rows[i] for i in placed])
        wids = np.array([routes[i].worker_id for i in placed])
        hits = np.array([routes[i].cache_hit for i in placed])
        # A serverless function keeps no KV between invocations, and each turn is one.
        stateless = (self.workers.kind[wids] == ELASTIC) & (self.serverless_invoke_s is not None)
        rnd.start(p_rows, wids, hits & ~stateless)
        if stateless.any():
            nows_p = np.array([nows[i] for i in placed])
            sel = p_rows[stateless]
            rnd.ready[sel] = np.maximum(rnd.ready[sel], nows_p[stateless]) + self.serverless_invoke_s
