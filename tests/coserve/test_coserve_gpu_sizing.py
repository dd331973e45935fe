"""How `rose serve --engine vllm --device cuda` sizes the GPU's memory (`rose.coserve.device_memory`)
and what it refuses, checked where no GPU is: the split's arithmetic, vLLM's arguments on cuda,
and each refusal's one line. tests/coserve/test_coserve_vllm_gpu.py runs it on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rose.cli import main
from rose.coserve.device_memory import GiB, GpuBudget, check_memory_settings, rollout_pool_bytes
from rose.coserve.executor import CoServingExecutor
from rose.coserve.settings import Engine, ExecutorConfig
from rose.engine.vllm_engine import engine_args


def test_the_rollout_pool_is_what_the_budget_leaves() -> None:
    assert rollout_pool_bytes(72 * GiB, 36 * GiB, 16 * GiB, GiB) == 19 * GiB
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: its 72.00 GiB leave the rollout model no "
                                         r"KV pool once vLLM's 40.00 GiB .* weights \(31.00 GiB\) and one "
                                         r"iteration's activations \(1.00 GiB\) .*lower serving_pool_share$"):
        rollout_pool_bytes(72 * GiB, 40 * GiB, 31 * GiB, GiB)


def test_a_budget_larger_than_the_free_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (50 * GiB, 80 * GiB))
    budget = GpuBudget.take(torch.device("cuda"), 0.5)
    assert (budget.bytes, budget.free_at_start) == (40 * GiB, 50 * GiB)
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: 0.9 of cuda's 80.00 GiB is 72.00 GiB, "
                                         r"but only 50.00 GiB is free \(other processes hold the rest\); "
                                         r"lower it$"):
        GpuBudget.take(torch.device("cuda"), 0.9)


def test_each_device_takes_its_own_memory_setting_only(tiny_qwen3: Path) -> None:
    check_memory_settings(ExecutorConfig(gpu_memory_utilization=0.5), gpu_vllm=True)
    check_memory_settings(ExecutorConfig(pool_mb=64), gpu_vllm=False)
    with pytest.raises(ValueError, match=r"^pool_mb: with --engine vllm on cuda .* leave pool_mb out$"):
        check_memory_settings(ExecutorConfig(pool_mb=64), gpu_vllm=True)
    # Refused before any model loads (vLLM is not even installed in this venv).
    half = ExecutorConfig(gpu_memory_utilization=0.5)
    for engine in Engine:
        with pytest.raises(ValueError, match=r"^gpu_memory_utilization: sizes the memory of --engine vllm on "
                                             r"cuda; here the KV pool is pool_mb$"):
            CoServingExecutor.from_pretrained(tiny_qwen3, tiny_qwen3, half, device="cpu", engine=engine)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        ExecutorConfig(gpu_memory_utilization=1.5)


def test_vllm_on_cuda_runs_compiled_one_iteration_a_step_within_its_share() -> None:
    """On cuda vLLM keeps its defaults (torch.compile, CUDA graphs) but synchronous scheduling,
    and takes its share of the GPU as its gpu_memory_utilization; the CPU's arguments stay."""
    cuda = engine_args("ckpt", "bfloat16", device="cuda", memory_share=0.45)
    assert cuda == {"model": "ckpt", "dtype": "bfloat16", "seed": 0, "async_scheduling": False,
                    "gpu_memory_utilization": 0.45}
    assert engine_args("ckpt", kv_cache_bytes=1 << 20) == {
        "model": "ckpt", "dtype": "float32", "seed": 0, "enforce_eager": True, "gpu_memory_utilization": 0.1,
        "kv_cache_memory_bytes": 1 << 20}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_serve_on_cuda_without_a_gpu_is_one_line(tiny_qwen3: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tiny_qwen3), "--rollout-model", str(tiny_qwen3), "--engine", "vllm",
                 "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("rose serve: error: config: device 'cuda': no CUDA device")


@pytest.mark.vllm
def test_vllm_refuses_what_it_cannot_run_on_cuda(tiny_qwen3: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this test")
    from rose.coserve.vllm_serving import VllmServing
    from rose.engine.vllm_engine import VllmEngine, check_model
    from rose.model import ModelConfig

    config = ModelConfig.from_dir(tiny_qwen3)
    with pytest.raises(ValueError, match=r"^vLLM runs on cpu here, not 'cuda' \(cuda: `rose serve --engine "
                                         r"vllm` only\)$"):
        check_model(config, "cuda", VllmEngine.devices)
    with pytest.raises(ValueError, match=r"^vLLM runs on the first visible GPU, not 'cuda:1': choose the GPU "
                                         r"with CUDA_VISIBLE_DEVICES=1 and --device cuda$"):
        check_model(config, "cuda:1", VllmServing.devices)
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        with pytest.raises(ValueError, match=r"^device 'cuda': this vLLM is its cpu build; cuda needs vLLM's "
                                             r"CUDA build"):
            check_model(config, "cuda", VllmServing.devices)
