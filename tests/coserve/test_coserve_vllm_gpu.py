"""`--engine vllm` on a GPU (`make test-gpu`, scripts/gpu_checks.sh): vLLM's CUDA build in this
process serving beside the rollout model on ROSE's engine, both within one share of the GPU's
memory (`rose.coserve.device_memory`). Skipped without a CUDA device or without vLLM's CUDA build
in this Python; tests/coserve/test_coserve_gpu_sizing.py checks the sizing where neither is."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM is not installed here: its CUDA build runs these tests")
from vllm.platforms import current_platform

if not current_platform.is_cuda():
    pytest.skip("this vLLM is not its CUDA build", allow_module_level=True)

from vllm_checkpoints import tiny_qwen3_for_vllm

from rose.contracts import SamplingParams, Turn
from rose.coserve.cli import serve_process
from rose.coserve.device_memory import GiB
from rose.coserve.executor import CoServingExecutor
from rose.coserve.settings import Engine, ExecutorConfig
from rose.engine.vllm_engine import BLOCK_SIZE
from rose.model import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

# What both models may take of the GPU: a few GiB, whatever its size, so that the tiny models'
# caches hold tens of thousands of blocks, not millions (vLLM keeps an object per block).
BUDGET = 4 * GiB
SHARE = 0.5
# SLOs of 100 s and no inflation budgets: admission holds no rollout back.
LOOSE = dict(slo_ttft_ms=1e5, slo_tpot_ms=1e5, tpot_inflation=math.inf, ttft_inflation=math.inf)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

# vLLM alone (its `LLM`, as a user runs it) in a process of its own: one prompt at a time, with the
# block size and batch limits the executor gives it (they pick its kernels and graph sizes).
ALONE = """
import json, sys, vllm
args = json.loads(sys.argv[1])
llm = vllm.LLM(**args["engine"])
greedy = vllm.SamplingParams(max_tokens=args["max_tokens"], temperature=0, ignore_eos=True)
outs = [llm.generate([vllm.TokensPrompt(prompt_token_ids=p)], greedy, use_tqdm=False)[0].outputs[0]
        for p in args["prompts"]]
print("TOKENS " + json.dumps([list(out.token_ids) for out in outs]))
"""


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (5, 40, 300)]


def _utilization() -> float:
    return BUDGET / torch.cuda.mem_get_info()[1]


@pytest.fixture(scope="module")
def serving_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3_for_vllm(tmp_path_factory.mktemp("serving"), seed=11)


@pytest.fixture(scope="module")
def executor(serving_ckpt: Path, tiny_qwen3: Path) -> Iterator[tuple[CoServingExecutor, int]]:
    """The executor on cuda, and what was free on the device before it started."""
    free = torch.cuda.mem_get_info()[0]
    config = ExecutorConfig(gpu_memory_utilization=_utilization(), serving_pool_share=SHARE, **LOOSE)
    ex = CoServingExecutor.from_pretrained(serving_ckpt, tiny_qwen3, config, device="cuda",
                                           engine=Engine.VLLM)
    ex.profile()
    yield ex, free
    del ex
    gc.collect()  # vLLM tears its process-wide state down when the engine is freed
    torch.cuda.empty_cache()


def _until_done(ex: CoServingExecutor) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while ex.has_unfinished():
        for out in ex.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def test_serving_on_the_gpu_gives_vllm_s_own_greedy_tokens(executor: tuple[CoServingExecutor, int],
                                                            serving_ckpt: Path) -> None:
    """Compiled, with CUDA graphs (vLLM's defaults on cuda), one iteration per step; each
    prompt's greedy tokens are those of vLLM's `LLM` alone on the same checkpoint."""
    ex, _ = executor
    vllm_config = ex.serving.llm.vllm_config
    assert not vllm_config.model_config.enforce_eager
    assert not vllm_config.scheduler_config.async_scheduling
    assert vllm_config.model_config.dtype == torch.bfloat16  # the cuda default
    served = []
    for i, prompt in enumerate(_prompts()):
        ex.add_serving(prompt, GREEDY, f"s{i}")
        served.append(_until_done(ex)[f"s{i}"])
    engine = dict(model=str(serving_ckpt), dtype="bfloat16", seed=0, block_size=BLOCK_SIZE,
                  max_num_seqs=ex.config.max_num_seqs,
                  max_num_batched_tokens=ex.config.chunk_tokens + ex.config.max_num_seqs,
                  gpu_memory_utilization=_utilization() * SHARE)
    args = json.dumps({"engine": engine, "prompts": _prompts(), "max_tokens": GREEDY.max_tokens})
    run = subprocess.run([sys.executable, "-c", ALONE, args], capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    alone = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("TOKENS "))[7:])
    assert served == alone


def test_rollout_turns_run_beside_vllm_on_the_gpu(executor: tuple[CoServingExecutor, int],
                                                  tiny_qwen3: Path) -> None:
    """Turns decode on the rollout engine (its decode CUDA graphs too) while vLLM serves, without
    changing serving's tokens; weights pushed from the CPU reach the rollout model on the device."""
    ex, _ = executor
    assert ex.pool.device.type == "cuda"
    prompt = _prompts()[1]
    ex.add_serving(prompt, GREEDY, "alone")
    alone = _until_done(ex)["alone"]
    ex.add_serving(prompt, GREEDY, "beside")
    turn_prompts = [torch.randint(1, 512, (50,), generator=torch.Generator().manual_seed(i)).tolist()
                    for i in range(4)]
    for i, turn_prompt in enumerate(turn_prompts):
        ex.submit_turn(Turn(f"t{i}", f"traj{i}", turn_prompt, SamplingParams(max_tokens=32, ignore_eos=True)))
    tokens = _until_done(ex)
    assert tokens["beside"] == alone
    assert all(len(tokens[f"t{i}"]) == 32 for i in range(4))
    assert ex.rollout is not None and ex.rollout.runner.graphs is not None and ex.rollout.runner.graphs.graphs
    ex.load_weights(load_model(tiny_qwen3, device="cpu").named_parameters(), version=1)
    ex.submit_turn(Turn("t-v1", "traj-v1", turn_prompts[0], GREEDY, policy_version=1))
    after = _until_done(ex)
    assert len(after["t-v1"]) == GREEDY.max_tokens


def test_both_models_stay_within_their_share_of_the_gpu(executor: tuple[CoServingExecutor, int]) -> None:
    """vLLM was given SHARE of the budget as its own gpu_memory_utilization, the rollout pool the
    rest less its weights and activations; after the heaviest iterations the executor runs
    (chunks of serving prompt, every lease slot's turn prefilled at the rollout engine's batch
    limit) the process holds no more than the budget."""
    ex, free_before = executor
    utilization = ex.config.gpu_memory_utilization
    cache_config = ex.serving.llm.vllm_config.cache_config
    assert cache_config.gpu_memory_utilization == pytest.approx(utilization * SHARE)
    kv = ex.serving.kv_pages()
    vllm_kv, rollout_pool = kv.total * kv.page_bytes, ex.pool.num_pages * ex.pool.page_bytes
    assert 0 < vllm_kv < BUDGET * SHARE and 0 < rollout_pool < BUDGET * (1 - SHARE)
    assert vllm_kv + rollout_pool <= ex.config.pool_bytes <= BUDGET
    for i in range(4):
        ex.add_serving(torch.randint(1, 512, (ex.config.chunk_tokens,)).tolist(), GREEDY, f"heavy{i}")
    for i in range(ex.config.max_rollout_turns):
        ex.submit_turn(Turn(f"h{i}", f"heavy{i}", torch.randint(1, 512, (200,)).tolist(),
                            SamplingParams(max_tokens=8, ignore_eos=True)))
    _until_done(ex)
    held = free_before - torch.cuda.mem_get_info()[0]
    assert held <= BUDGET, f"{held / GiB:.2f} GiB held, budget {BUDGET / GiB:.2f}"


def test_rose_serve_engine_vllm_on_cuda(serving_ckpt: Path, tiny_qwen3: Path) -> None:
    """The command on cuda: `--gpu-memory-utilization` in place of `--pool-mb`, a completion
    answered by vLLM, /metrics."""
    argv = ["--engine", "vllm", "--model", str(serving_ckpt), "--rollout-model", str(tiny_qwen3),
            "--device", "cuda", "--no-profile", "--gpu-memory-utilization", f"{_utilization():.6f}"]
    with serve_process(argv, startup_s=400) as (url, _):
        completion = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": serving_ckpt.name, "prompt": _prompts()[0], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}).json()
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert completion["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    assert f'vllm:num_requests_running{{model_name="{serving_ckpt.name}"}} 0.0' in metrics
