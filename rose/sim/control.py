"""The rollout control plane: the driver's rollout manager, which every turn and every streamed
chunk of tokens passes through, and its CPU tick by tick (`costs.ControlPlaneCost`).

A tick's demand is the turns placed since the last tick's plan, x `turn_s`, and what the workers
stream at the tick's planned rates: a decoding sequence delivers a chunk per `interval_s` (or per
token, if slower), x `chunk_s`, and a device with sequences decoding a frame per `interval_s` (or
per iteration, if slower), x `frame_s`. Where that needs more than the driver's cores give in the
tick, every rollout rate of the tick (prompts prefilled, which is how a turn starts, and tokens
decoded) scales by what they give over what it needs: the driver falls behind and delivers
everything late. Where the driver runs on the dedicated devices' cores
(`cluster.manager_on_dedicated`), what the workers stream comes out of those devices' time instead
(`charge_manager`)."""

from __future__ import annotations

import numba
import numpy as np

from rose.sim.costs import ControlPlaneCost
from rose.sim.rollout import TickRates


def deliveries(plan: TickRates, dec: np.ndarray, interval_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Per worker, the chunks and frames a second its `dec` decoding sequences send at `plan`'s
    rates (a sequence's tokens/s by its rank's tiers): a chunk per `interval_s` from each sequence,
    or one per token if slower; a frame per `interval_s` from a worker with sequences decoding, or
    one per iteration (its fastest sequence's tokens/s) if slower."""
    return _deliveries(dec.astype(np.float64, copy=False), plan.rate0, plan.cap1, plan.rate1, plan.cap2,
                       plan.rate2, 1.0 / interval_s)


@numba.njit(cache=True)
def _deliveries(dec: np.ndarray, rate0: np.ndarray, cap1: np.ndarray, rate1: np.ndarray, cap2: np.ndarray,
                rate2: np.ndarray, most: float) -> tuple[np.ndarray, np.ndarray]:
    """`deliveries`, worker by worker (compiled: numpy's dozen passes over ten thousand workers
    cost half a millisecond a tick)."""
    chunks, frames = np.zeros(len(dec)), np.zeros(len(dec))
    for w in range(len(dec)):
        if dec[w] <= 0:
            continue
        n1, n2 = min(dec[w], cap1[w]), min(dec[w], cap2[w])     # sequences at each tier
        one_rate = rate1[w] if n1 > n2 else rate2[w]
        chunks[w] = (min(n1, n2) * min(rate0[w] + rate1[w] + rate2[w], most)
                     + abs(n1 - n2) * min(rate0[w] + one_rate, most)
                     + (dec[w] - max(n1, n2)) * min(rate0[w], most))
        frames[w] = min(rate0[w] + (rate1[w] if n1 > 0 else 0.0) + (rate2[w] if n2 > 0 else 0.0), most)
    return chunks, frames


def charge_manager(plan: TickRates, iter_s: np.ndarray, driver: np.ndarray, dedicated: np.ndarray) -> None:
    """The rollout manager runs on the dedicated devices' cores (`cluster.manager_on_dedicated`,
    as `rose train` pins its driver to the trainer's), `driver` its CPU seconds a second for what
    each worker streams. A dedicated worker's own lengthen its iterations; the other workers', at
    this tick's planned rates, take a share of the tick from the dedicated workers alike (none left
    when the manager would need more than all of it)."""
    others = float(driver[~dedicated].sum()) / max(1, int(dedicated.sum()))
    own_s = iter_s[dedicated] * (1.0 + driver[dedicated])
    scale = max(0.0, 1.0 - others) * iter_s[dedicated] / np.maximum(own_s, 1e-12)
    plan.prefill_rate[dedicated] *= scale
    plan.rate1[dedicated] *= scale


class ControlPlane:
    """The driver through a run (`cost` its transport's, `cores` its CPU, 0: unlimited; `on_dedicated`:
    it runs on the dedicated devices' cores): every rollout tick's demand, and the tick's rates as it
    keeps up with them."""

    def __init__(self, cost: ControlPlaneCost, cores: float, dt: float, on_dedicated: bool) -> None:
        self.cost, self.cores, self.dt, self.on_dedicated = cost, cores, dt, on_dedicated
        self.demand_s: list[float] = []      # the driver's CPU seconds each rollout tick needs
        self.saturated: list[bool] = []      # whether its cores fell short in the tick
        self._placed = 0                     # the round's turns placed by the last tick's plan

    def begin_round(self) -> None:
        self._placed = 0

    def tick(self, plan: TickRates, iter_s: np.ndarray, dec: np.ndarray, dedicated: np.ndarray,
             placements: int) -> None:
        """Record the tick's demand, `placements` the round's turns placed so far (every attempt:
        moved and resumed turns too) and `dec` the sequences each worker decodes; scale `plan` where
        the driver's cores fall short, or charge the dedicated devices where it runs on them (for
        what is streamed only: the `cpu` device's measured constants leave the per-turn work out,
        docs/simulator.md)."""
        chunks, frames = deliveries(plan, dec, self.cost.interval_s)
        attempts, self._placed = placements - self._placed, placements
        demand = float(self.cost.demand_s(attempts, chunks.sum() * self.dt, frames.sum() * self.dt))
        capacity = self.cores * self.dt
        self.demand_s.append(demand)
        self.saturated.append(0 < capacity < demand)
        if self.on_dedicated:
            charge_manager(plan, iter_s, self.cost.demand_s(0.0, chunks, frames), dedicated)
        elif self.saturated[-1]:
            for rates in (plan.prefill_rate, plan.rate0, plan.rate1, plan.rate2):
                rates *= capacity / demand
