"""The RL workload model: the paper's 5.7x step-to-step spread, and DAPO's resampling."""

from __future__ import annotations

import numpy as np
import pytest

from rose.sim.workloads import (
    DEMAND_SIGMA,
    ENVS,
    MAX_OF_20,
    RoundDemand,
    dapo_resampling,
    groups_sampled,
    step_multipliers,
)


def test_demand_spreads_5_7x_over_20_steps_and_dapo_never_samples_less_than_the_batch():
    runs = np.log(step_multipliers(20 * 2000, DEMAND_SIGMA, seed=0).reshape(-1, 20))
    spread = np.exp((runs.max(axis=1) - runs.min(axis=1)).mean())
    assert spread == pytest.approx(5.7, rel=0.05)
    # Scaled so that a run's lightest step (geometric mean over runs) generates just the batch.
    lightest = np.exp(runs.min(axis=1).mean() + DEMAND_SIGMA * MAX_OF_20)
    assert lightest == pytest.approx(1.0, abs=0.05)
    r = dapo_resampling(np.exp(runs.ravel()), DEMAND_SIGMA)
    assert r.min() == 1.0 and 2.0 < np.median(r) < 3.0
    flat = step_multipliers(20, 0.0, seed=0)
    assert np.all(dapo_resampling(flat, 0.0) == 1.0)                   # no spread, no resampling


def test_dapo_samples_groups_until_the_batch_has_enough_valid_ones():
    rng = np.random.default_rng(0)
    for fraction in (1.0, 0.9, 0.4, 0.175):
        sampled = [groups_sampled(1024, fraction, rng) for _ in range(200)]
        assert min(sampled) >= 1024
        assert np.mean(sampled) == pytest.approx(1024 / fraction, rel=0.02)
    assert groups_sampled(1024, 1.0, rng) == 1024


def test_every_turn_prompts_its_whole_context():
    # ALFWorld: a 1,500-token first prompt, 120-token observations. Two turns of 10 and 20 tokens:
    # prompts 1,500 and 1,500 + 10 + 120; one turn of 30: 1,500.
    env = ENVS["alfworld"]
    response = np.zeros((2, env.max_turns), np.int64)
    response[0, :2], response[1, 0] = (10, 20), 30
    demand = RoundDemand(env, response, np.array([2, 1]), 1)
    assert demand.prompt_tokens == 1500 + (1500 + 10 + 120) + 1500
    assert demand.generated_tokens == 60
