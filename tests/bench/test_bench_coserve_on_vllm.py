"""`rose bench coserve --engine vllm`'s measurement end to end, for a few seconds: a `rose serve
--engine vllm` process (a tiny Qwen3 on vLLM, a tiny rollout model on the native engine), the
Azure trace replayed over HTTP and the rollout backlog on the lease API (the benchmark itself runs
for over an hour; docs/benchmarks.md has its figures).

vLLM is not in the default venv: `make test-vllm` runs this file from `.venv-vllm`."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this file")

from vllm_checkpoints import tiny_qwen3_for_vllm

from rose.bench import burst
from rose.bench.coserve import _measure, bench_server
from rose.cli import main

pytestmark = pytest.mark.vllm


def test_measure_on_vllm_serving_beside_native_rollouts(tmp_path: Path, tiny_qwen3: Path) -> None:
    serving = tiny_qwen3_for_vllm(tmp_path / "serving", seed=11)
    # The trace at 2 requests/s for 6 s from the benchmark's offset, two rollout trajectories.
    args = argparse.Namespace(trajectories=2, rate=2.0, start=600.0)
    slo = {"ttft_ms": 5000.0, "tpot_ms": 1000.0}
    flags = ("--engine", "vllm", "--serving-pool-share", "0.25", "--dtype", "float32")
    with bench_server(serving, tiny_qwen3, "rose", slo, None, flags) as url:
        result, requests = asyncio.run(_measure(url, "rose", 6.0, args, slo))
    assert len(requests) == result["requests"] >= 5
    assert result["errors"] == 0 and result["completed"] == len(requests)
    assert result["slo_attainment"] == 1.0  # budgets far above what a tiny model takes
    assert result["rollout_tokens_per_s"] > 0 and result["rollout"]["turns"] >= 1
    assert result["serving_busy_fraction"] > 0 and result["serving_iteration_ms"] > 0


def test_the_burst_window_is_measured_on_vllm(tmp_path: Path, tiny_qwen3: Path) -> None:
    """`--burst --engine vllm`'s measurement end to end, for a 24 s window: the pool timeline
    samples vLLM's own cache as serving's pages, the backlog's turns run beside it and none is
    lost, every serving request is answered (the burst itself on vLLM's cache:
    tests/coserve/test_coserve_vllm_serving.py)."""
    serving = tiny_qwen3_for_vllm(tmp_path / "serving", seed=11)
    scale = burst.Scale(load=0.5, prompt_scale=0.25, max_output=200, max_context=512)
    window = burst.burst_window(scale, duration_s=24.0, spike_s=4.0, lead_s=8.0)
    args = argparse.Namespace(trajectories=8, next_step_s=6.0, engine="vllm")
    slo = {"ttft_ms": 1e6, "tpot_ms": 1e6}
    flags = ("--pool-mb", "4", "--engine", "vllm", "--serving-pool-share", "0.6", "--dtype", "float32")
    with bench_server(serving, tiny_qwen3, "rose", slo, None, flags) as url:
        result, requests = asyncio.run(burst._measure(url, "rose", window, args, slo))
    samples = result["timeline"]["samples"]
    assert max(s["serving_pages"] for s in samples) > 0 and result["pool_pages"] > 0
    assert result["hand_back"]["tokens"] > 0 and result["hand_back"]["lost"] == 0
    assert result["errors"] == 0 and result["completed"] == len(requests) == result["requests"]


def test_burst_on_vllm_refuses_a_cache_smaller_than_one_request(tmp_path: Path, tiny_qwen3: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    serving = tiny_qwen3_for_vllm(tmp_path / "serving", seed=11)  # 1 KiB of KV a token
    models = ["--serving-model", str(serving), "--rollout-model", str(tiny_qwen3)]
    assert main(["bench", "coserve", "--burst", "--engine", "vllm", "--serving-pool-share", "0.01", *models,
                 "--json", "/dev/null"]) == 2
    assert ("--serving-pool-share 0.01 of --burst-pool-mb 48 is vLLM's KV cache, less than one request of "
            "1024 tokens needs (1 MiB)") in capsys.readouterr().err
