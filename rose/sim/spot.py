"""Spot GPU availability, from measured traces.

Source: the public traces of "Can't Be Late: Optimizing Spot Instance Savings under Deadlines"
(Wu et al., NSDI 2024), github.com/skypilot-org/spot-traces. Summary figures only (the traces
carry no licence, so no data is copied); how each was computed is beside it:

- availability/16-node/aws-08-27-2023/{us-east-2b,us-west-2a,us-west-2c}_v100_1.json: how many
  of 16 requested p3.2xlarge (1 x V100) spot instances AWS granted, every 5 minutes for 11-16
  days per zone. Pooled over the three zones (~12,500 samples): none of the 16 in 51% of the
  samples, all 16 in 43%, and k of 16 in the other 6.5%, each k = 1..15 about equally often (their
  mean is 0.51 of the request). A level held for 77 minutes on average (~800 runs of a constant
  count); spells with none available lasted 132 minutes on average (median 40).
- preemption/4-node/aws-08-03-2023/{us-east-1f,us-east-2a,us-west-2c}_v100_1.json: how many of 4
  held V100 spot instances were running every 5 minutes for 13 days (lost ones re-launched).
  ~600 drops in the count over ~3,200 instance-hours: 0.19 preemptions per instance-hour, a mean
  lifetime of 5.3 hours (per zone 2.2, 17.8 and 4.3 h); a loss re-launched within the same
  5 minutes is not seen, so this is a lower bound on the rate (the lifetime is
  `ElasticConfig.spot_mean_lifetime_h`).

These are V100s on AWS in 2023, the only public multi-node GPU spot traces at hand; the H800s of
the paper scenarios are scarcer, if anything.
"""

from __future__ import annotations

import numpy as np

SPOT_NONE_SHARE = 0.51        # share of samples with none of the 16 requested instances granted
SPOT_ALL_SHARE = 0.43         # ... with all 16; otherwise a share uniform in (0, 1)
SPOT_LEVEL_MEAN_S = 77 * 60.0  # mean time availability stays at one level


class SpotMarket:
    """The share of a request the spot market grants at a time: a level drawn from the measured
    distribution, held for an exponential time with the measured mean, then drawn again.
    Deterministic per seed; one market per run, so consecutive steps see correlated levels."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.level = self._draw()
        self.next_change = float(self.rng.exponential(SPOT_LEVEL_MEAN_S))

    def _draw(self) -> float:
        u = self.rng.random()
        if u < SPOT_NONE_SHARE:
            return 0.0
        if u < SPOT_NONE_SHARE + SPOT_ALL_SHARE:
            return 1.0
        return float(self.rng.random())

    def granted(self, requested: int, t: float) -> int:
        """How many of `requested` instances the market grants at time t (t never decreases)."""
        while t >= self.next_change:
            self.level = self._draw()
            self.next_change += float(self.rng.exponential(SPOT_LEVEL_MEAN_S))
        return round(requested * self.level)
