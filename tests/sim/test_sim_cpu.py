"""The `cpu` device against this machine: `cpu-bench-train` reads `rose bench train`'s workload and
predicts its `speedup_rose_vs_fixed` within 20%."""

from __future__ import annotations

import numpy as np
import pytest

from rose.bench.train import bench_config
from rose.sim import scenarios
from rose.sim.costs import HTTP_PER_TURN, STREAM
from rose.sim.engine import Simulation
from rose.sim.rollout import TickRates
from rose.sim.runner import run_scenario
from rose.sim.scenarios import load_scenario
from rose.sim.systems import SYSTEMS
from rose.sim.workers import COSERVE, DEDICATED

# `rose bench train --json OUT` on this machine, 2026-12-05 (6 steps a mode, quiet machine, rollout
# turns streamed in 50 ms chunks). Before the chunks, four runs on 2026-11-30: 1.449, 1.496,
# 1.740, 1.270 (the fixed mode alone varied 13.3-16.8 s a step across them).
MEASURED_SPEEDUP_ROSE_VS_FIXED = 1.096


def test_cpu_bench_train_is_derived_from_the_bench_train_workload(monkeypatch: pytest.MonkeyPatch):
    # The scenario reads the named config `rose bench train` loads: a change there moves it.
    workload = scenarios.read_named_config("bench-train")
    workload["rollout"]["groups"], workload["serving"]["executor"]["slo_ttft_ms"] = 4, 500.0
    workload["env"]["options"]["max_turns"] = 6
    monkeypatch.setattr(scenarios, "read_named_config", lambda name: workload)
    sc = load_scenario("cpu-bench-train")
    assert (sc.rl.trajectories, sc.serving.executor.slo_ttft_ms, sc.rl.env_profile().max_turns) == (
        32, 500.0, 6)


def test_cpu_bench_train_agrees_where_the_workload_has_no_figure_for_it():
    sc, config = load_scenario("cpu-bench-train"), bench_config()
    r, s, d = config.rollout, config.serving, config.devices
    # The scenario has one turn cap for both kinds of worker and colocates the trainer with the
    # first dedicated worker.
    assert r.serving_concurrency == r.dedicated_concurrency
    assert d.trainer == d.dedicated[0]
    assert (sc.serving.prompt_scale, sc.serving.output_scale) == (s.prompt_scale, s.output_scale)
    # The executor's settings the simulator models, whether the workload states them or not.
    assert all(getattr(sc.serving.executor, k) == getattr(s.executor, k)
               for k in scenarios.SIMULATED_SETTINGS)


def test_cpu_bench_train_predicts_the_measured_speedup_within_20_percent():
    summary = run_scenario(load_scenario("cpu-bench-train")).summary()
    predicted = summary["throughput_vs_fixed_sync"]
    assert abs(predicted - MEASURED_SPEEDUP_ROSE_VS_FIXED) / MEASURED_SPEEDUP_ROSE_VS_FIXED < 0.2
    assert summary["slo_violations"] == 0


def test_the_manager_charges_the_dedicated_device_for_every_worker_s_tokens():
    # rose train pins its driver to the trainer's cores in every mode: fixed pays for its own
    # tokens, rose's dedicated device also for the serving device's, which pays none. Each turn
    # streams its own chunks, at the manager's measured cost.
    fixed = Simulation(load_scenario("cpu-bench-train"), SYSTEMS["fixed-sync"]).control
    assert fixed.on_dedicated and fixed.cost == HTTP_PER_TURN and fixed.cores == 0
    sim = Simulation(load_scenario("cpu-bench-train"), SYSTEMS["rose"])
    assert sim.workers.kind.tolist() == [DEDICATED, COSERVE]
    iter_s, dec = np.array([0.010, 0.008]), np.array([16.0, 8.0])
    plan = TickRates(prefill_rate=np.array([1e4, 5e3]), rate0=np.array([0.0, 5.0]),
                     cap1=np.array([np.inf, 6.0]), rate1=1.0 / iter_s,
                     cap2=np.array([0.0, 4.0]), rate2=np.array([0.0, 20.0]))
    sim.control.tick(plan, iter_s, dec, sim.workers.kind == DEDICATED, placements=3)
    # Chunks of TURN_CHUNK_S (50 ms): the serving device's first 6 sequences stream 20 a second
    # each, its other 2 (rate0 only) 5 a second; the dedicated one's 16, one chunk per 5
    # iterations each.
    serving_chunks_per_s = 6 * 20.0 + 2 * 5.0
    chunk_s = HTTP_PER_TURN.chunk_s
    rate = (1.0 - chunk_s * serving_chunks_per_s) / (0.010 + 16 * 0.2 * chunk_s)
    assert plan.rate1.tolist() == pytest.approx([rate, 125.0])
    assert plan.prefill_rate.tolist() == pytest.approx([1e4 * 0.010 * rate, 5e3])
    assert plan.rate2.tolist() == [0.0, 20.0]


def test_gpu_scenarios_give_the_manager_cpus_of_its_own():
    control = Simulation(load_scenario("paper-8b", ["rl.steps=1"]), SYSTEMS["rose"]).control
    # One core for the whole cluster: the simulated slice (a quarter) has a quarter of it.
    assert not control.on_dedicated and control.cost == STREAM and control.cores == 0.25
