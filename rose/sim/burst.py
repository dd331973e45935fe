"""Co-serving memory: on each serving replica's page pool (bytes, both models' KV) the burst
state machine (`rose.coserve.admission.BurstController`, the executor's own) sets the rollout KV
budget from serving's usage every tick and names the rollout sequences an emergency cut aborts.
Under naive sharing rollouts take whatever serving leaves of the pool."""

from __future__ import annotations

import numpy as np

from rose.coserve.admission import BurstController, BurstState
from rose.sim.rollout import DECODE, PREFILL, Round


class BurstMemory:
    """`n` replicas' pools of `pool` bytes; KV bytes per token of the rollout and serving models."""

    def __init__(self, n: int, pool: int, headroom: float, high_watermark: float, naive: bool,
                 rollout_kv: float, serving_kv: float) -> None:
        self.pool, self.naive, self.rollout_kv, self.serving_kv = pool, naive, rollout_kv, serving_kv
        self.controllers = [BurstController(pool, headroom, high_watermark) for _ in range(n)]

    @property
    def initial_budget(self) -> float:
        """A replica's rollout budget before serving uses anything, in rollout KV tokens."""
        return self.controllers[0].budget / self.rollout_kv

    @property
    def bursts(self) -> int:
        return sum(b.bursts for b in self.controllers)

    def state(self, r: int) -> BurstState:
        return BurstState.NORMAL if self.naive else self.controllers[r].state

    def new_rl_step(self) -> None:
        for b in self.controllers:
            b.new_rl_step()

    def observe(self, rnd: Round, held: dict[int, list[tuple[int, float]]], first_wid: int,
                serving_tokens: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Each replica's rollout budget (KV tokens) given serving's KV tokens and the rollout
        sequences `held` on its worker (from `first_wid` on; `ActiveView.held`), and the
        (worker, row) of each sequence an emergency cut aborts, newest first per replica."""
        serving_bytes = (serving_tokens * self.serving_kv).tolist()
        caps = np.empty(len(self.controllers))
        aborts: list[tuple[int, int]] = []
        for r, controller in enumerate(self.controllers):
            if self.naive:
                caps[r] = max(0.0, (self.pool - serving_bytes[r]) / self.rollout_kv)
                continue
            wid = first_wid + r
            # Sequences of the tick's view still running on this worker (sub-passes end some).
            seqs = [(row, int(k * self.rollout_kv)) for row, k in held.get(wid, [])
                    if rnd.worker[row] == wid and rnd.phase[row] in (PREFILL, DECODE)]
            decision = controller.observe(int(serving_bytes[r]), seqs)
            aborts += [(wid, row) for row in decision.abort]
            caps[r] = decision.rollout_budget / self.rollout_kv
        return caps, aborts
