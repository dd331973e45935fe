"""Scenario configs: named scenarios, dotted overrides, clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rose.sim.scenarios import SCENARIOS, SWEEPS, list_scenarios, load_scenario


def test_named_scenarios_load_and_validate():
    for name in SCENARIOS:
        sc = load_scenario(name)
        assert sc.name == name and sc.description
    names = [n for n, _ in list_scenarios()]
    assert set(SCENARIOS) | set(SWEEPS) == set(names)


def test_paper_scenarios_follow_the_papers_set_up():
    s8, s32 = load_scenario("paper-8b"), load_scenario("paper-32b")
    assert (s8.models.policy, s8.models.serving, s8.rl.env, s8.rl.algorithm) == (
        "qwen3-8b", "qwen2.5-7b", "frozenlake", "grpo")
    assert s8.rl.group == 16 and s8.rl.trajectories == 256 * 16
    assert (s8.cluster.device, s8.cluster.train_gpus, s8.cluster.serving_gpus) == ("H800", 48, 64)
    assert (s32.models.policy, s32.models.serving, s32.rl.algorithm) == ("qwen3-32b", "qwen2.5-32b", "dapo")
    assert s32.rl.trajectories == 1024 * 16
    # The paper's evaluation: 16 trajectories per rollout GPU, its serving SLOs (TTFT, TPOT).
    assert (s8.rl.fixed_concurrency, s32.rl.fixed_concurrency) == (16, 16 * s32.cluster.rollout_tp)
    assert s8.rl.cap_counts == s32.rl.cap_counts == "trajectories"
    e8, e32 = s8.serving.executor, s32.serving.executor
    assert (e8.slo_ttft_ms, e8.slo_tpot_ms, e32.slo_ttft_ms, e32.slo_tpot_ms) == (500, 150, 1000, 450)
    # Its serving fleet as its Table 1 states it, serving alone's P99 TPOT, at the trace's own rate,
    # in iterations of vLLM's default token budget.
    assert (s8.serving.target_p99_tpot_ms, s32.serving.target_p99_tpot_ms) == (117.8, 312.8)
    assert s8.serving.load == s32.serving.load == 1.0
    assert e8.chunk_tokens == e32.chunk_tokens == 8192


def test_overrides_apply_with_types():
    sc = load_scenario("paper-8b", ["cluster.serving_gpus=32", "serving.load=2.5", "rl.max_turns=4",
                                    "sim.systems=[fixed-sync,rose]"])
    assert sc.cluster.serving_gpus == 32 and sc.serving.load == 2.5
    assert sc.rl.env_profile().max_turns == 4
    assert sc.sim.systems == ["fixed-sync", "rose"]


@pytest.mark.parametrize(("override", "message"), [
    ("rl.nope=1", "Key 'nope' not in 'RLConfig'"),
    ("rl.steps=abc", "rl.steps"),
    ("rl.steps=0", "rl.steps must be >= 1"),
    ("cluster.device=TPU", "cluster.device must be one of"),
    ("cluster.serving_tp=5", "multiple of its tp"),
    ("paper-32b", "not key=value"),
    ("serving.executor.headroom=1.5", "scenario paper-8b: serving.executor.headroom must be in (0, 1)"),
    ("serving.headroom=0.3", "serving.headroom: Key 'headroom' not in 'ServingFleetConfig' (did you mean "
                             "serving.executor.headroom"),
    ("serving.executor.policy=naive", "serving.executor.policy is not simulated (only pool_mb, slo_ttft_ms"),
    ("serving.executor.policy=priority", "serving.executor.policy is not simulated (only pool_mb"),
    ("sim.systems=[rose,bogus]", "sim.systems must be"),
    ("rl.trajectories=100", "multiple of rl.group"),
    ("elastic.availability=some", "elastic.availability must be measured or full"),
    ("serving.spike_at_s=-1", "serving.spike_at_s must be >= 0 or null"),
    ("serving.prompt_scale=0", "serving.prompt_scale must be positive"),
    ("sim.duration_s=-5", "sim.duration_s must be >= 0"),
    ("serving.spike_at_s=20", "serving.minute_peak_to_mean must be 1.0 with serving.spike_at_s"),
    ("serving.replay_start_s=600", "serving.minute_peak_to_mean must be 1.0 with serving.replay_start_s"),
    ("serving.engine_overhead_ms=50", "serving.engine_overhead_ms must be 0 with serving.target_p99_tpot_ms"),
    ("serving.target_p99_tpot_ms=-1", "serving.target_p99_tpot_ms must be >= 0"),
    ("cluster.trainer_rolls_out=false", "cluster.trainer_rolls_out must be true where a system has no other "
                                        "rollout GPUs (cluster.rollout_gpus 0; fixed-sync"),
    ("control_plane.transport=grpc", "control_plane.transport must be stream or http, got 'grpc'"),
    ("control_plane.driver_cores=-1", "control_plane.driver_cores must be >= 0 (0: unlimited), got -1.0"),
    ("control_plane.cores=2", "Key 'cores' not in 'ControlPlaneConfig'"),
    ("cluster.manager_on_dedicated=true",
     "control_plane.driver_cores must be 0 with cluster.manager_on_dedicated (the driver has the "
     "dedicated devices' cores)"),
])
def test_bad_overrides_are_one_line_errors(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_scenario("paper-8b", [override])
    assert "\n" not in str(err.value)


def test_unknown_scenario():
    with pytest.raises(ValueError, match="unknown scenario 'x'; expected one of paper-8b"):
        load_scenario("x")


def test_the_simulator_runs_without_torch():
    # The executor's settings are plain data (rose.coserve.settings): the simulator stays free of
    # torch's seconds of start-up.
    code = "import sys, rose.sim.runner, rose.sim.cli; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_simulated_replica_is_configured_as_an_executor_with_its_defaults():
    # The scenarios state every setting in which they differ from the executor's defaults.
    s8, bench = load_scenario("paper-8b").serving.executor, load_scenario("cpu-bench-train").serving.executor
    assert s8.changed() == ["slo_ttft_ms", "slo_tpot_ms", "chunk_tokens"]
    assert bench.changed() == ["pool_mb"]  # bench-train's SLOs, 1,000 / 200 ms, are the defaults
