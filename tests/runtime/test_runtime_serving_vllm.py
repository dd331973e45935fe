"""`rose train`'s serving devices on vLLM (`serving.engine=vllm`, docs/vllm.md): each serving
device's executor serves its trace replay on vLLM's engine, the policy's rollout turns on ROSE's
engine beside it, as `rose serve --engine vllm` does; the config refuses a serving model vLLM
cannot run before anything starts.

vLLM is not in the default venv: `make test-vllm` runs this file from `.venv-vllm` (the refusals
without vLLM are in tests/runtime/test_runtime_config.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this file")

from rose.cli import main
from rose.coserve.settings import Engine
from rose.model import init_model
from rose.runtime.config import load_config

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def serving_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 vLLM's CPU attention runs: head_dim 32, which is hidden_size 64 over 2 heads
    (vLLM's Qwen2 takes that quotient, whatever config.json's head_dim says)."""
    return init_model("qwen2", "tiny", tmp_path_factory.mktemp("serving"), seed=1, num_attention_heads=2,
                      head_dim=32)


def test_the_config_refuses_a_serving_model_vllm_cannot_run(serving_ckpt: Path, tmp_path: Path) -> None:
    """The default serving model (the tiny Qwen2, head_dim 16) has no kernel in vLLM's CPU
    attention; a Qwen2 whose head_dim is not hidden_size / heads would run at another head size
    in vLLM than in its checkpoint. Both refused naming the keys; a model vLLM runs is taken, with
    its share of the pool."""
    no_kernel = (r"^config: serving\.engine=vllm: the model's head_dim is 16; vLLM's CPU attention takes 32, "
                 r"64.* \(serving\.model, serving\.device\)$")
    with pytest.raises(ValueError, match=no_kernel):
        load_config(None, ["serving.engine=vllm"])
    odd = init_model("qwen2", "tiny", tmp_path / "odd", head_dim=32)  # 4 heads of 32 over a hidden size of 64
    other_size = (r"^config: serving\.engine=vllm: the model is a Qwen2 with head_dim 32, but vLLM's Qwen2 "
                  r"runs at hidden_size / num_attention_heads \(16\)")
    with pytest.raises(ValueError, match=other_size):
        load_config(None, ["serving.engine=vllm", f"serving.model.path={odd}"])
    config = load_config(None, ["serving.engine=vllm", f"serving.model.path={serving_ckpt}",
                                "serving.executor.serving_pool_share=0.25"])
    assert (config.serving.engine, config.serving.executor.serving_pool_share) == (Engine.VLLM, 0.25)


def test_rose_train_serves_on_vllm_beside_its_rollouts(serving_ckpt: Path, tmp_path: Path,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    """A short run in rose mode with the serving device on vLLM: turns spill onto it (the
    dedicated worker's slots are fewer than the episodes), train on policy, none is lost, and
    the trace replay's requests are served by vLLM within their SLOs."""
    out = tmp_path / "summary.json"
    assert main(["train", "--mode", "rose", "train.steps=3", "serving.engine=vllm",
                 f"serving.model.path={serving_ckpt}", "rollout.groups=4", "rollout.group_size=4",
                 "rollout.dedicated_concurrency=4", f"train.out_dir={tmp_path / 'run'}",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    steps, summary, serving = report["steps"], report["summary"], report["serving"]
    assert [s["version"] for s in steps] == [1, 2, 3]
    assert sum(s["serving_turns"] for s in steps) > 0 and sum(s["serving_tokens"] for s in steps) > 0
    assert summary["serving_token_share"] > 0
    # The serving device's rollout model took every sync: its turns were sampled by the trained version.
    assert all(s["trainer"]["version_lag"] == 0 for s in steps)
    assert summary["lost_trajectories"] == summary["failed_trajectories"] == summary["restarts"] == 0
    assert serving["requests"] > 0 and serving["completed"] == serving["requests"] and serving["errors"] == 0
    assert summary["serving_slo_attainment"] is not None
    # The serving device's actor (its lines forwarded by Ray) ran vLLM on the serving model.
    captured = capfd.readouterr()
    assert "(vllm engine) at http://" in captured.err
    assert "Resolved architecture: Qwen2ForCausalLM" in captured.out  # vLLM's own log: the policy is a Qwen3
