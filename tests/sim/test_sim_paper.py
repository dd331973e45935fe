"""The paper scenarios against the paper's figures (reproducing-the-paper.md): serving alone
calibrated to Table 1's P99s, then what ROSE does beside it: faster than fixed-sync, under 1%
allocation overhead, within the SLOs over the run and in no more minutes over them than serving
alone, while naive sharing breaks them more often. (Its rollout against elastic-spot depends on
the spot market's luck and is not asserted; the docs give ten seeds.) And where the job's own
GPUs are enough, or barely short, lending it serving GPUs costs it nothing."""

from __future__ import annotations

import pytest

from rose.sim.engine import CALIBRATION_S, serving_alone, with_serving_engine
from rose.sim.runner import run_scenario, serving_stats
from rose.sim.scenarios import load_scenario

# Table 1 of the paper, serving alone (ServerlessLLM): P99 TTFT and TPOT, ms.
TABLE_1_ALONE = {"paper-8b": (314.8, 117.8), "paper-32b": (716.1, 312.8)}
# ROSE over fixed-sync at least: the paper's 1.31x for 8B; for 32B (the paper: 1.46x over
# ROLL-GRPO, 3.31x over ROLL-DAPO) what the simulator reaches, short of it (seeds 0-9: 1.20-1.37x).
GAIN = {"paper-8b": 1.31, "paper-32b": 1.2}


def _check(name: str) -> None:
    sc = load_scenario(name, ["sim.systems=[fixed-sync,rose,naive-share]"])
    summary = run_scenario(sc).summary()
    ttft, tpot = TABLE_1_ALONE[name]
    assert summary["serving_alone_p99_ttft_ms"] == pytest.approx(ttft, rel=0.2)
    assert summary["serving_alone_p99_tpot_ms"] == pytest.approx(tpot, rel=0.2)
    assert summary["throughput_vs_fixed_sync"] >= GAIN[name]
    assert summary["allocation_overhead"]["rose"] < 0.01
    slo = sc.serving.executor   # the paper's "no SLO violation", over the run
    assert summary["serving_p99_ttft_ms"] <= slo.slo_ttft_ms
    assert summary["serving_p99_tpot_ms"] <= slo.slo_tpot_ms
    assert summary["slo_violations"] <= summary["serving_alone_slo_violations"]
    assert summary["naive_share_slo_violations"] > summary["slo_violations"]


def test_paper_8b_serves_as_table_1_and_rose_gains_within_the_slos():
    _check("paper-8b")


@pytest.mark.slow
def test_paper_32b_serves_as_table_1_and_rose_gains_within_the_slos():
    _check("paper-32b")


def test_a_fleet_stated_by_its_p99_tpot_gets_the_engine_that_serves_it():
    sc = load_scenario("paper-8b", ["cluster.serving_gpus=8", "sim.slice=1", "serving.target_p99_tpot_ms=80"])
    solved = with_serving_engine(sc)
    assert solved.serving.engine_overhead_ms > 0
    p99 = serving_stats(serving_alone(solved, CALIBRATION_S), solved, CALIBRATION_S).p99_tpot_ms
    assert p99 == pytest.approx(80.0, rel=0.005)
    # Below what the roofline alone gives, no overhead is added.
    fast = with_serving_engine(load_scenario("paper-8b", ["cluster.serving_gpus=8", "sim.slice=1",
                                                          "serving.target_p99_tpot_ms=1"]))
    assert fast.serving.engine_overhead_ms == 0.0


@pytest.mark.parametrize("name, overrides", [
    ("paper-8b", ["rl.trajectories=256", "rl.steps=2"]),       # 256 trajectories, 768 slots
    # 1,024 trajectories, 768 slots (GRPO: DAPO's resampling would make it contended)
    ("paper-32b", ["rl.trajectories=1024", "rl.steps=1", "rl.algorithm=grpo"]),
])
def test_rose_costs_nothing_when_dedicated_capacity_nearly_suffices(name, overrides):
    """Rollouts start on dedicated GPUs and spill to (slower) serving executors only when those
    are full, and move back where they decode faster: serving-first placement lost 13% and 22%."""
    sc = load_scenario(name, [*overrides, "sim.slice=1", "sim.systems=[fixed-sync,rose]"])
    assert run_scenario(sc).summary()["throughput_vs_fixed_sync"] >= 0.97
