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

from rose.bench.coserve import _measure, _server

pytestmark = pytest.mark.vllm


def test_measure_on_vllm_serving_beside_native_rollouts(tmp_path: Path, tiny_qwen3: Path) -> None:
    serving = tiny_qwen3_for_vllm(tmp_path / "serving", seed=11)
    # The trace at 2 requests/s for 6 s from the benchmark's offset, two rollout trajectories.
    args = argparse.Namespace(trajectories=2, rate=2.0, start=600.0)
    slo = {"ttft_ms": 5000.0, "tpot_ms": 1000.0}
    flags = ("--engine", "vllm", "--serving-pool-share", "0.25", "--dtype", "float32")
    with _server(serving, tiny_qwen3, "rose", slo, None, flags) as url:
        result, requests = asyncio.run(_measure(url, "rose", 6.0, args, slo))
    assert len(requests) == result["requests"] >= 5
    assert result["errors"] == 0 and result["completed"] == len(requests)
    assert result["slo_attainment"] == 1.0  # budgets far above what a tiny model takes
    assert result["rollout_tokens_per_s"] > 0 and result["rollout"]["turns"] >= 1
    assert result["serving_busy_fraction"] > 0 and result["serving_iteration_ms"] > 0
