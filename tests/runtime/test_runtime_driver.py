"""The training loop (rose.runtime.driver) through `rose train`: the held-out evaluation runs
every eval.every steps and at the last, and the per-step records and the summary carry its
success beside the training success."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rose.cli import main

pytest.importorskip("ray")


@pytest.mark.slow
def test_rose_train_reports_heldout_success(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    assert main(["train", "--mode", "fixed", "train.steps=4", "eval.every=2", "eval.episodes=6",
                 "rollout.groups=2", "rollout.group_size=4", "env.options.random_map=true",
                 f"train.out_dir={tmp_path / 'run'}", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    steps, summary = report["steps"], report["summary"]
    evaluated = [s["step"] for s in steps if s["heldout_success"] is not None]
    assert evaluated == [0, 2, 3]
    assert all(0 <= s["heldout_success"] <= 1 and s["eval_s"] > 0 for s in steps if s["step"] in evaluated)
    assert all(s["eval_s"] == pytest.approx(0, abs=1e-3) for s in steps if s["step"] not in evaluated)
    assert summary["initial_heldout_success"] == steps[0]["heldout_success"]
    assert summary["final_heldout_success"] == steps[-1]["heldout_success"]
    assert summary["initial_success_rate"] == steps[0]["success_rate"]
