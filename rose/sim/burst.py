"""Co-serving memory: on each serving replica's page pool (bytes, both models' KV) the burst
state machine (`rose.coserve.admission.BurstController`, the executor's own) sets the rollout KV
budget from serving's usage every tick and names the rollout sequences an emergency cut aborts.
Under naive sharing rollouts take whatever serving leaves of the pool; under a static split, their
fixed share of it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from rose.coserve.admission import BurstController, BurstState
from rose.sim.rollout import DECODE, PREFILL, Round
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
    `step_after_burst_s` > 0: the next RL step (which ends a burst's freeze) begins that long
    after each burst's trigger, else when the run begins it (`new_rl_step`)."""

    def __init__(self, n: int, pool: int, headroom: float, high_watermark: float, sharing: Sharing,
                 static_share: float, rollout_kv: float, serving_kv: float,
                 step_after_burst_s: float = 0.0) -> None:
        self.pool, self.sharing, self.rollout_kv, self.serving_kv = pool, sharing, rollout_kv, serving_kv
        self.static_bytes = static_share * pool
        self.controllers = [BurstController(pool, headroom, high_watermark) for _ in range(n)]
        self.step_after_burst_s = step_after_burst_s
        self.step_at = [math.inf] * n
        self.cuts: list[Cut] = []

    @property
    def initial_budget(self) -> float:
        """A replica's rollout budget before serving uses anything, in rollout KV tokens."""
        fixed = self.static_bytes if self.sharing is Sharing.STATIC else self.controllers[0].budget
        return fixed / self.rollout_kv

    @property
    def bursts(self) -> int:
        return sum(b.bursts for b in self.controllers)

    def state(self, r: int) -> BurstState:
        return self.controllers[r].state if self.sharing is Sharing.ROSE else BurstState.NORMAL

    def new_rl_step(self) -> None:
        for b in self.controllers:
            b.new_rl_step()

    def observe(self, t: float, rnd: Round, held: dict[int, list[tuple[int, float]]], first_wid: int,
                serving_tokens: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Each replica's rollout budget (KV tokens) at `t` given serving's KV tokens and the
        rollout sequences `held` on its worker (from `first_wid` on; `ActiveView.held`), and the
        (worker, row) of each sequence an emergency cut aborts, newest first per replica."""
        serving_bytes = (serving_tokens * self.serving_kv).tolist()
        caps = np.empty(len(self.controllers))
        aborts: list[tuple[int, int]] = []
        for r, controller in enumerate(self.controllers):
            if self.sharing is Sharing.NAIVE:
                caps[r] = max(0.0, (self.pool - serving_bytes[r]) / self.rollout_kv)
                continue
            if self.sharing is Sharing.STATIC:
                caps[r] = self.static_bytes / self.rollout_kv
                continue
            wid = first_wid + r
            # Sequences of the tick's view still running on this worker (sub-passes end some).
            seqs = [(row, int(k * self.rollout_kv)) for row, k in held.get(wid, [])
                    if rnd.worker[row] == wid and rnd.phase[row] in (PREFILL, DECODE)]
            if t >= self.step_at[r]:
                controller.new_rl_step()
                self.step_at[r] = math.inf
            before = controller.state
            decision = controller.observe(int(serving_bytes[r]), seqs)
            if decision.cut:
                trigger = before is BurstState.NORMAL
                cut = dict(seqs)
                self.cuts.append(Cut(t, r, trigger, len(decision.abort),
                                     float(sum(cut[row] for row in decision.abort))))
                if trigger and self.step_after_burst_s and self.step_at[r] == math.inf:
                    self.step_at[r] = t + self.step_after_burst_s
            aborts += [(wid, row) for row in decision.abort]
            caps[r] = decision.rollout_budget / self.rollout_kv
        return caps, aborts
