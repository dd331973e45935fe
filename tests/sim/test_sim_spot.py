"""Elastic-spot availability and preemption from the measured traces (rose.sim.spot)."""

from __future__ import annotations

import pytest

from rose.sim.engine import Simulation
from rose.sim.scenarios import load_scenario
from rose.sim.spot import SPOT_ALL_SHARE, SPOT_NONE_SHARE, SpotMarket
from rose.sim.systems import SYSTEMS

# Rollouts of ~5 minutes on 4 dedicated GPUs, so rented GPUs matter.
SPOT = ["cluster.train_gpus=4", "cluster.serving_gpus=8", "rl.trajectories=256", "rl.steps=2",
        "rl.response_median=1500", "rl.max_response=4096", "sim.tick_s=2", "sim.slice=1",
        "sim.systems=[elastic-spot]"]


def _grants(seed: int, requested: int = 16) -> list[int]:
    market = SpotMarket(seed)
    return [market.granted(requested, 600.0 * i) for i in range(2000)]


def test_availability_is_deterministic_per_seed_and_within_the_request():
    a = _grants(3)
    assert a == _grants(3) and a != _grants(4)
    assert all(0 <= k <= 16 for k in a)
    # Over many levels the shares are the measured ones.
    assert a.count(0) / len(a) == pytest.approx(SPOT_NONE_SHARE, abs=0.08)
    assert a.count(16) / len(a) == pytest.approx(SPOT_ALL_SHARE, abs=0.08)


def test_preempted_spot_turns_resume_and_no_trajectory_is_lost():
    sc = load_scenario("paper-8b", [*SPOT, "elastic.spot_mean_lifetime_h=0.05"])
    r = Simulation(sc, SYSTEMS["elastic-spot"]).run()
    assert r.aborted_turns > 0                           # turns were on preempted instances
    assert [s.trajectories for s in r.steps] == [256, 256]
    # Every token of the workload was generated once: resumed turns keep what they produced.
    fixed = Simulation(sc, SYSTEMS["fixed-sync"]).run()
    assert r.tick_tokens.sum() == pytest.approx(fixed.tick_tokens.sum(), rel=1e-6)


def test_full_availability_rents_every_gpu_each_step_and_never_replaces_one():
    sc = load_scenario("paper-8b", [*SPOT, "elastic.availability=full", "elastic.spot_mean_lifetime_h=0.1"])
    sim = Simulation(sc, SYSTEMS["elastic-spot"])
    rented, rent = [], sim.provisioning.rent

    def counted_rent(wids, t):
        rented.append(len(wids))
        rent(wids, t)

    sim.provisioning.rent = counted_rent
    r = sim.run()
    assert rented == [8, 8]                   # all 8 requested, at each step's allocation only
    assert r.aborted_turns > 0                # though instances were preempted mid-rollout


def test_measured_availability_rents_what_the_market_grants():
    rented = []
    for seed in range(6):
        sim = Simulation(load_scenario("paper-8b", [*SPOT, f"sim.seed={seed}"]), SYSTEMS["elastic-spot"])
        sim.provisioning.acquire(0.0, 0.0)
        rented.append(int((sim.workers.ready_at < float("inf")).sum()) - 4)   # less the 4 dedicated
        assert rented[-1] == SpotMarket(seed + 13).granted(8, 0.0)
    assert {0, 8} <= set(rented)                     # some runs find none, some all
