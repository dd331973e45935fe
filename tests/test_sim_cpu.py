"""The `cpu` device against this machine: `cpu-bench-train` mirrors `rose bench train --quick` and
predicts its `speedup_rose_vs_fixed` within 20% (issue 7)."""

from __future__ import annotations

from rose.sim.calibrate import bench_config
from rose.sim.report import run_scenario
from rose.sim.scenarios import load_scenario

# `rose bench train --quick` on this machine (docs/benchmarks.md, Training): 1.315 measured on a
# quiet machine (fixed 14.28 s a step, rose 10.86 s), 1.31 on one loaded by other jobs.
MEASURED_SPEEDUP_ROSE_VS_FIXED = 1.315


def test_cpu_bench_train_mirrors_the_benchmark_config():
    sc, config = load_scenario("cpu-bench-train"), bench_config()
    r, s, d = config.rollout, config.serving, config.devices
    env = sc.rl.env_profile()
    assert sc.rl.trajectories == r.groups * r.group_size and sc.rl.group == r.group_size
    assert sc.rl.algorithm == config.train.objective
    assert env.max_response == r.max_tokens and env.max_turns == config.env.options["max_turns"]
    assert sc.rl.fixed_concurrency == r.dedicated_concurrency == r.serving_concurrency
    assert (sc.cluster.train_gpus, sc.cluster.serving_gpus) == (len(d.dedicated), len(d.serving))
    assert d.trainer == d.dedicated[0]            # trainer and rollout worker share core 0: colocated
    assert (sc.serving.load, sc.serving.token_scale) == (s.load, s.prompt_scale) == (s.load, s.output_scale)
    assert (sc.serving.max_context, sc.serving.max_output) == (s.max_context, s.max_output)
    assert (sc.serving.slo_ttft_ms, sc.serving.slo_tpot_ms) == (s.slo_ttft_ms, s.slo_tpot_ms)
    assert (sc.models.policy, sc.models.serving) == (f"tiny-{config.model.arch}", f"tiny-{s.arch}")
    assert config.model.preset == s.preset == "tiny"


def test_cpu_bench_train_predicts_the_measured_speedup_within_20_percent():
    summary = run_scenario(load_scenario("cpu-bench-train")).summary()
    predicted = summary["throughput_vs_fixed_sync"]
    assert abs(predicted - MEASURED_SPEEDUP_ROSE_VS_FIXED) / MEASURED_SPEEDUP_ROSE_VS_FIXED < 0.2
    assert summary["slo_violations"] == 0
