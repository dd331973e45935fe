"""Co-serving memory: on each serving replica's page pool (bytes, both models' KV) the burst
state machine (`rose.coserve.admission.BurstController`, the executor's own) sets the rollout KV
budget from serving's usage every tick and names the rollout sequences an emergency cut aborts.
Under naive sharing rollouts take whatever serving leaves of the pool; under a static split, their
fixed share of it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from rose.coserve.admission import BurstController, BurstState
from rose.sim.systems import Sharing


@dataclasses.dataclass(frozen=True)
class Cut:
    """One emergency cut on a replica: at the start of the tick whose state crossed the
    watermark, so within one tick of the crossing."""

    t: float
    replica: int
    trigger: bool       # the burst's first cut (from the normal state), not a later crossing
    turns: int
    rollout_bytes: float


class BurstMemory:
    """`n` replicas' pools of `pool` bytes, shared as `sharing` says (`static_share`: the
    rollouts' share under a static split); KV bytes per token of the rollout and serving models;
    `step_after_burst_s` > 0: the next RL step (which lets a burst's freeze end) begins that long
    after each burst's trigger, else when the run begins it (`new_rl_step`). One state machine
    per replica, all of them in the controller's arrays."""

    def __init__(self, n: int, pool: int, headroom: float, high_watermark: float, sharing: Sharing,
                 static_share: float, rollout_kv: float, serving_kv: float,
                 step_after_burst_s: float = 0.0) -> None:
        self.pool, self.sharing, self.rollout_kv, self.serving_kv = pool, sharing, rollout_kv, serving_kv
        self.static_bytes = static_share * pool
        self.controller = BurstController(pool, headroom, high_watermark, devices=n)
        self.step_after_burst_s = step_after_burst_s
        self.step_at = np.full(n, math.inf)
        self.cuts: list[Cut] = []

    @property
    def initial_budget(self) -> float:
        """A replica's rollout budget before serving uses anything, in rollout KV tokens."""
        fixed = self.static_bytes if self.sharing is Sharing.STATIC else self.pool - self.controller.headroom
        return fixed / self.rollout_kv

    @property
    def bursts(self) -> int:
        return int(self.controller.bursts.sum())

    def state(self, replicas: np.ndarray) -> np.ndarray:
        if self.sharing is Sharing.ROSE:
            return self.controller.state[replicas]
        return np.full(len(replicas), BurstState.NORMAL, np.int64)

    def new_rl_step(self) -> None:
        self.controller.new_rl_step()

    def observe(self, t: float, serving_tokens: np.ndarray, rollout_bytes: np.ndarray,
                sequences: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
                ) -> tuple[np.ndarray, np.ndarray]:
        """Each replica's rollout budget (KV tokens) at `t` given serving's KV tokens and the
        rollout KV bytes held on it, and the rows of the sequences an emergency cut aborts, newest
        first per replica. `sequences(replicas)`: the rows and KV bytes of each rollout sequence
        holding pages on those replicas, oldest first ([replicas, sequences], rows -1 after them),
        asked only of the replicas whose pages crossed the watermark (where a cut may fall)."""
        serving_bytes = (serving_tokens * self.serving_kv).astype(np.int64)
        if self.sharing is Sharing.NAIVE:
            return np.maximum(0.0, (self.pool - serving_bytes) / self.rollout_kv), np.zeros(0, np.int64)
        if self.sharing is Sharing.STATIC:
            return np.full(len(serving_bytes), self.static_bytes / self.rollout_kv), np.zeros(0, np.int64)
        c = self.controller
        step = t >= self.step_at
        if step.any():
            c.new_rl_step(step)
            self.step_at[step] = math.inf
        crossing = np.flatnonzero(c.crossed(serving_bytes, rollout_bytes) & (rollout_bytes > 0))
        before = c.state
        if not len(crossing):  # (the common case) each replica's rollout bytes, one column
            decision = c.observe(serving_bytes, [(np.full(len(serving_bytes), -1), rollout_bytes)])
            return decision.rollout_budget / self.rollout_kv, np.zeros(0, np.int64)
        ids, units = sequences(crossing)
        columns = np.full((len(serving_bytes), max(1, ids.shape[1])), -1)
        held = np.zeros(columns.shape, np.int64)
        held[:, 0] = rollout_bytes
        held[crossing] = 0
        columns[crossing, : ids.shape[1]], held[crossing, : ids.shape[1]] = ids, units
        decision = c.observe(serving_bytes, list(zip(columns.T, held.T, strict=True)))
        aborts = []
        for i, r in enumerate(crossing.tolist()):
            if not decision.cut[r]:
                continue
            mine = set(ids[i].tolist())
            victims = [int(v) for col in decision.abort for v in col.tolist() if v in mine]
            by_row = dict(zip(ids[i].tolist(), units[i].tolist(), strict=True))
            trigger = before[r] == BurstState.NORMAL
            self.cuts.append(Cut(t, r, trigger, len(victims), float(sum(by_row[v] for v in victims))))
            if trigger and self.step_after_burst_s and self.step_at[r] == math.inf:
                self.step_at[r] = t + self.step_after_burst_s
            aborts += victims
        return decision.rollout_budget / self.rollout_kv, np.array(aborts, np.int64)
