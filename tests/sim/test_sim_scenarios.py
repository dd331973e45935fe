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


def test_paper_scenarios_follow_the_issue():
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
    assert (s8.serving.slo_ttft_ms, s8.serving.slo_tpot_ms, s32.serving.slo_ttft_ms,
            s32.serving.slo_tpot_ms) == (500, 150, 1000, 450)


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
    ("serving.headroom=1.5", "serving.headroom must be in (0, 1)"),
    ("sim.systems=[rose,bogus]", "sim.systems must be"),
    ("rl.trajectories=100", "multiple of rl.group"),
    ("elastic.availability=some", "elastic.availability must be measured or full"),
])
def test_bad_overrides_are_one_line_errors(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_scenario("paper-8b", [override])
    assert "\n" not in str(err.value)


def test_unknown_scenario():
    with pytest.raises(ValueError, match="unknown scenario 'x'; expected one of paper-8b"):
        load_scenario("x")


def test_admission_defaults_are_the_executors_and_need_no_torch():
    # One source (rose.coserve.admission) for both; the simulator stays free of torch's start-up.
    code = ("import dataclasses, sys, rose.sim.runner; from rose.sim.scenarios import ServingFleetConfig; "
            "assert 'torch' not in sys.modules; "
            "from rose.coserve.executor import ExecutorConfig; "
            "s, e = ServingFleetConfig(), ExecutorConfig(); "
            "shared = {f.name for f in dataclasses.fields(s)} & {f.name for f in dataclasses.fields(e)}; "
            "print(*sorted(k for k in shared if getattr(s, k) != getattr(e, k)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["slo_tpot_ms", "slo_ttft_ms"]  # the simulator's own SLOs (MLPerf's)
