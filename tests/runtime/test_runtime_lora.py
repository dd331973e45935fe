"""`rose train` with `model.lora`, end to end on Ray: the dedicated worker and the serving device
run every turn on the policy's adapter at the trained version, each sync carries the adapter
alone, checkpoints are PEFT adapters, and a run resumes from one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rose.cli import main
from rose.contracts.adapter import LoRAConfig
from rose.model import ModelConfig
from rose.model.lora import load_adapter

pytest.importorskip("ray")

RUN = ["--mode", "rose", "model.lora.rank=4", "rollout.groups=2", "rollout.group_size=4",
       "rollout.dedicated_concurrency=2",  # the rest spill onto the serving device
       "train.checkpoint_every=1"]


@pytest.mark.slow
def test_a_lora_run_trains_syncs_and_resumes_the_adapter_alone(tmp_path: Path) -> None:
    out, summary = tmp_path / "run", tmp_path / "summary.json"
    assert main(["train", *RUN, "train.steps=2", f"train.out_dir={out}", "--json", str(summary)]) == 0
    steps = json.loads(summary.read_text())["steps"]
    config, tensors, base = load_adapter(out / "step-1")
    assert config == LoRAConfig(rank=4) and Path(base) == (out / "initial").resolve()
    adapter_bytes = sum(t.numel() for t in tensors.values()) * 2  # bf16 on the wire
    model = ModelConfig.from_dir(out / "initial")
    model_bytes = 2 * (model.vocab_size * model.hidden_size)  # the embedding alone, bf16
    for s in steps:
        # Every element of A and B moves each step: the adapter whole, and nothing of the model.
        assert adapter_bytes <= s["sync_bytes"] < min(2 * adapter_bytes, model_bytes)
        # Each turn ran on the adapter of the version being trained: no token lags it.
        assert set(s["staleness"]) == {"0"} and s["lost_trajectories"] == s["failed_trajectories"] == 0
    assert sum(s["serving_turns"] for s in steps) > 0  # the serving device's rollout model ran some
    assert main(["train", *RUN, "train.steps=3", f"train.out_dir={out}", "--resume", str(out),
                 "--json", str(summary)]) == 0
    [resumed] = json.loads(summary.read_text())["steps"]
    assert (resumed["step"], resumed["version"]) == (2, 3)
    assert set(resumed["staleness"]) == {"0"}


@pytest.mark.slow
def test_adapter_mode_runs_the_serving_devices_turns_on_the_serving_model(tmp_path: Path) -> None:
    """serving.rollout=adapter: the policy is a LoRA adapter of the serving model's own checkpoint
    (the serving default's preset and seed), and the serving device runs its turns on the serving
    model with the adapter each sync loads, at the trained version, no rollout model beside it."""
    summary = tmp_path / "summary.json"
    assert main(["train", *RUN, "serving.rollout=adapter", "model.arch=qwen2", "model.seed=1",
                 "train.steps=2", f"train.out_dir={tmp_path / 'run'}", "--json", str(summary)]) == 0
    report = json.loads(summary.read_text())
    steps = report["steps"]
    assert [s["version"] for s in steps] == [steps[0]["version"], steps[0]["version"] + 1]
    for s in steps:
        assert set(s["staleness"]) == {"0"} and s["lost_trajectories"] == s["failed_trajectories"] == 0
    assert sum(s["serving_tokens"] for s in steps) > 0 and report["summary"]["serving_token_share"] > 0
