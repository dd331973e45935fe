"""`rose train`'s plain-words lines (rose.runtime.report: `describe`, `outcome`): what the run
trains, on which devices, what a step's success means and where the results go, then how it
went. The slow test runs `make demo`'s command and reads its whole output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rose.rollout.manager import Placement
from rose.runtime.config import Mode, load_config
from rose.runtime.report import TrainStep, burst_spans, describe, outcome, write_plot

CPU = ["train.device=cpu", "rollout.device=cpu", "serving.device=cpu"]


def step(n: int, success: float, dedicated: int = 10, serving: int = 5) -> TrainStep:
    return TrainStep(step=n, version=n + 1, wall_start_s=3.0 * n, step_s=3.0, rollout_s=2.0, train_s=1.0,
                     sync_s=0.0, sync_bytes=0, success_rate=success, heldout_success=None, eval_s=0.0,
                     serving_token_share=0.3, serving_tokens=serving, dedicated_tokens=dedicated,
                     serving_turns=serving, dedicated_turns=dedicated, resumed_turns=0, handed_back_turns=0,
                     bursts=0, lost_trajectories=0,
                     failed_trajectories=0, placements=[], serving={}, trainer={}, elastic_devices=0)


def test_the_embedded_default_is_described_in_plain_words() -> None:
    config = load_config(None, [*CPU, "train.out_dir=/tmp/rose-demo", "train.steps=60"])
    what, devices, each_step, results = describe(config, Mode.ROSE)
    assert what == ("training: a random-initialised qwen3 tiny (seed 0) policy, from scratch, with grpo on "
                    "frozenlake (size 4, slippery False, progress_reward 0.5, max_turns 8): 8 groups of 8 "
                    "episodes a step, 60 steps")
    assert devices == ("devices: the trainer on core 0 (cpu); turns run on dedicated rollout worker "
                       "dedicated-0 on core 0 (cpu); serving device serving-0 on core 1 (cpu) when it has "
                       "room: it serves a random-initialised qwen2 tiny (seed 1) to a replay of the "
                       "azure-conv trace within SLOs of 1000 ms TTFT and 200 ms TPOT")
    assert "success = the share of its 64 episodes that reach the goal" in each_step
    assert results.startswith("results in /tmp/rose-demo: metrics.jsonl (every step, as it ends), report.png")


def test_each_mode_names_its_own_devices(tiny_qwen3: Path) -> None:
    config = load_config(None, [*CPU, f"model.path={tiny_qwen3}"])
    fixed, elastic = describe(config, Mode.FIXED), describe(config, Mode.ELASTIC)
    assert fixed[0].startswith(f"training: the checkpoint {tiny_qwen3}, with grpo")
    assert "scratch" not in fixed[0] and "serving device" not in fixed[1] and "elastic" not in fixed[1]
    assert "elastic device elastic-0 on core 1 (cpu), started for each step's rollouts" in elastic[1]


def test_the_outcome_says_how_success_moved_and_where_turns_ran() -> None:
    records = [step(0, 0.0), step(1, 0.5, serving=7), step(2, 0.25)]
    serving = {"slo_attainment": 1.0, "p99_ttft_ms": 66.0, "p99_tpot_ms": 3.5}
    assert outcome(records, serving) == [
        "success rate 0.00 at step 0 -> 0.25 at step 2 (best 0.50, step 1)",
        "turns: 30 on dedicated workers, 17 on serving devices; the serving devices' own requests met their "
        "SLOs 100.0% of the time (p99 TTFT 66.0 ms, TPOT 3.5 ms)"]
    assert outcome(records, {})[1] == "turns: 30 on dedicated workers, 17 on serving devices"
    assert outcome([], {}) == []
    records[1].bursts, records[1].handed_back_turns = 2, 5
    assert outcome(records, serving)[2] == ("bursts: serving took its KV pages back 2 times; 5 turns handed "
                                            "back with their tokens and resumed elsewhere")


def _pool(states: list[int]) -> list[tuple[float, dict[str, float]]]:
    return [(0.25 * i, {"serving_pages": 10.0 * state, "cached_serving_pages": 0.0, "rollout_pages": 50.0,
                        "cached_rollout_pages": 5.0, "rollout_budget": 60.0, "state": float(state)})
            for i, state in enumerate(states)]


def test_the_report_shades_each_burst_and_freeze_of_a_serving_device(tmp_path: Path) -> None:
    """The pool panel's spans: a burst (state 1) from its first sample to the freeze's, the
    freeze (2) until the next RL step's sample; normal runs are not shaded."""
    timeline = _pool([0, 0, 1, 1, 2, 2, 2, 0, 0, 1])
    assert burst_spans(timeline) == [(0.5, 1.0, 1), (1.0, 1.75, 2), (2.25, 2.25, 1)]
    assert burst_spans(_pool([0, 0])) == [] and burst_spans([]) == []
    records = [step(0, 0.0), step(1, 0.5)]
    for r in records:
        r.trainer = {"reward_mean": r.success_rate}
    records[1].placements = [Placement("t0", 0, 0, "serving-0", "serving", 0.5, 0.75, 3, "abort"),
                             Placement("t0", 0, 1, "dedicated-0", "dedicated", 0.75, 2.0, 5, "done")]
    serving = load_config(None, CPU).serving
    path = write_plot(tmp_path / "report.png", records, [], {"serving-0": timeline}, serving, Mode.ROSE)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_make_demos_command_prints_no_warning(tmp_path: Path) -> None:
    """The Makefile's demo target, shortened: its whole output (the driver's and every actor's
    lines, which Ray forwards) carries no warning, and it says what it runs and how it went."""
    pytest.importorskip("ray")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # as a user has it: unset
    summary = tmp_path / "summary.json"
    command = [sys.executable, "-m", "rose.cli", "train", "train.steps=2", f"train.out_dir={tmp_path}",
               "--json", str(summary)]
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    # Every line is a step's, the summary's or an INFO line of rose's, the driver's or an actor's
    # (prefixed by Ray): a warning of any origin (Ray, torch, Python) is none of these.
    info = r"\d\d:\d\d:\d\d INFO \[[\w-]+\] rose\."
    actor = r"(\x1b\[36m)?\(\w[\w-]* pid=\d+\)(\x1b\[0m)? "
    ours = re.compile(rf"step \d+ reward |\{{\"steps\": |{info}|{actor}{info}")
    assert [line for line in output.splitlines() if not ours.match(line)] == [], output
    assert "training: a random-initialised qwen3 tiny" in output
    assert re.search(r"success rate \d\.\d\d at step 0 -> \d\.\d\d at step 1 ", output), output
    steps = json.loads(summary.read_text())["steps"]
    assert [s["step"] for s in steps] == [0, 1] and steps[0]["serving_turns"] > 0
