"""Extra rollout capacity, asked for at each RL step's start and given back at its rollout's end:
spot instances (prepared, preempted, rented again as the market grants more), serverless
functions (cold starts, a time limit per function), or serving GPUs (usable once the step's
weights reach them); how long the step waited for it, and what giving it back costs."""

from __future__ import annotations

import numpy as np

from rose.sim.scenarios import Scenario
from rose.sim.spot import SpotMarket
from rose.sim.systems import Extra, System
from rose.sim.workers import COSERVE, ELASTIC, Workers


class Provisioning:
    """The extra capacity of `workers` (elastic or co-serving) for `system`; `weight_bytes`: the
    policy's weights, which every cold start loads."""

    def __init__(self, sc: Scenario, system: System, workers: Workers, weight_bytes: float) -> None:
        self.workers, self.extra, self.elastic = workers, system.extra, sc.elastic
        self.rollout_tp, self.weight_bytes = sc.cluster.rollout_tp, weight_bytes
        self.rng = np.random.default_rng(sc.sim.seed)
        # Spot availability as measured (rose.sim.spot); None: every requested GPU, every step.
        measured = system.extra is Extra.SPOT and sc.elastic.availability == "measured"
        self.market = SpotMarket(sc.sim.seed + 13) if measured else None
        self.prep: list[tuple[float, float]] = []    # this step's (asked, usable) extra capacity

    def acquire(self, t: float, coserve_ready: float) -> None:
        """Ask for the step's extra capacity at t (serving GPUs: usable from `coserve_ready`);
        each piece's wait is recorded for `waited`."""
        self.prep = []
        w = self.workers
        sel = np.flatnonzero(w.kind == (COSERVE if self.extra is Extra.COSERVE else ELASTIC))
        if not len(sel):
            return
        if self.extra is Extra.COSERVE:
            w.ready_at[sel] = coserve_ready
            self.prep.append((t, coserve_ready))
        elif self.extra is Extra.SPOT:
            self.rent(sel[: self.market.granted(len(sel), t)] if self.market else sel, t)
        else:
            self.invoke(sel, t)

    def tick(self, t: float) -> None:
        """Within a rollout: replace lost spot instances as the market allows, restart serverless
        functions that hit their time limit."""
        if self.market:
            self.rent_more(t)
        elif self.extra is Extra.SERVERLESS:
            self.reinvoke(t)

    def invoke(self, wids: np.ndarray, t: float) -> None:
        """Serverless functions for `wids` from t: a cold start (container, engine, the weights
        from object storage), then at most `serverless_max_run_s` of running."""
        w, e = self.workers, self.elastic
        load_s = self.weight_bytes / self.rollout_tp / (e.serverless_storage_gbps / 8 * 1e9)
        cold = e.serverless_container_s + e.serverless_engine_init_s + load_s
        w.ready_at[wids], w.gone_at[wids] = t + cold, t + cold + e.serverless_max_run_s
        self.prep.append((t, t + cold))

    def reinvoke(self, t: float) -> None:
        """Functions that hit their time limit mid-rollout (their turns already resumed
        elsewhere, with their tokens) start cold again."""
        w = self.workers
        el = np.flatnonzero(w.kind == ELASTIC)
        ended = el[(w.gone_at[el] <= t) & ~w.registered[el]]
        if len(ended):
            self.invoke(ended, t)

    def rent(self, wids: np.ndarray, t: float) -> None:
        """Spot instances for `wids` from t: each prepares (instance, container, engine, weights),
        then lives an exponential lifetime."""
        w, e = self.workers, self.elastic
        ready = t + self.rng.uniform(e.spot_prepare_min_s, e.spot_prepare_max_s, len(wids))
        w.gone_at[wids] = ready + self.rng.exponential(e.spot_mean_lifetime_h * 3600.0, len(wids))
        w.ready_at[wids] = ready
        self.prep += [(t, r) for r in ready.tolist()]

    def rent_more(self, t: float) -> None:
        """Measured availability: instances preempted or not granted are asked for again as soon
        as the market grants more than the run holds, each paying the preparation again."""
        w = self.workers
        el = np.flatnonzero(w.kind == ELASTIC)
        held = (w.ready_at[el] < np.inf) & (w.gone_at[el] > t)
        want = self.market.granted(len(el), t) - int(held.sum())
        if want > 0:
            self.rent(el[~held & ~w.registered[el]][:want], t)

    def waited(self, start: float, end: float) -> float:
        """Time in [start, end] during which extra capacity asked for was not usable yet (the
        union of the step's preparation intervals)."""
        total, reach = 0.0, start
        for a, b in sorted(self.prep):
            a, b = max(a, reach), min(b, end)
            if b > a:
                total, reach = total + b - a, b
        return total

    def release(self) -> float:
        """Give the elastic capacity back after a step's rollout (the caller has taken it out of
        the routing table); returns the finalisation time (spot: of the instances obtained this
        step)."""
        w, e = self.workers, self.elastic
        sel = np.flatnonzero(w.kind == ELASTIC)
        if not len(sel):
            return 0.0
        obtained = int(np.count_nonzero(w.ready_at[sel] < np.inf))
        w.ready_at[sel], w.gone_at[sel] = np.inf, np.inf
        if self.extra is Extra.SPOT:
            if not obtained:
                return 0.0
            return float(self.rng.uniform(e.spot_finalize_min_s, e.spot_finalize_max_s, obtained).max())
        return e.serverless_finalize_s
