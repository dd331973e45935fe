"""On a CUDA device (`make test-gpu`; skipped without one): the engine against transformers in
fp32 and bf16, seeded sampling, a trainer step against the CPU's, the co-serving executor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from attention_cases import BATCHES, check_backend
from hf_parity import assert_matches_hf, chosen_logprobs, hf_logits
from rl_batches import random_batch

from rose.contracts import Turn
from rose.coserve.executor import CoServingExecutor
from rose.coserve.settings import ExecutorConfig
from rose.engine import LLMEngine, SamplingParams
from rose.model import load_model
from rose.rl import Objective, Trainer, TrainerConfig

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g, device="cpu").tolist() for n in lengths]


def _hf(path: Path, dtype: torch.dtype) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


@pytest.mark.parametrize("engine_config", [
    {},
    {"chunk_size": 8, "max_num_batched_tokens": 20},  # chunked prefills over cached pages
    {"kv_cache_bytes": 12 * 2 * 2 * 2 * 16 * 4 * 16},  # 12 pages of the tiny qwen3: preemptions
], ids=["batch", "chunked", "preempted"])
def test_fp32_engine_matches_transformers(ckpt: Path, engine_config: dict[str, int]) -> None:
    engine = LLMEngine.from_pretrained(ckpt, dtype="float32", device="cuda", **engine_config)
    assert engine.device.type == engine.pool.device.type == "cuda"
    assert engine.runner.attention.backend == "triton"  # the paged kernel, no gather
    prompts = _prompts([1, 5, 17, 33, 70, 2, 16])
    outs = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    hf = _hf(ckpt, torch.float32)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_hf(hf, prompt, out.token_ids, out.logprobs)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_attention_compiled_matches_the_math(batch: str, block_size: int, dtype: torch.dtype,
                                                    tolerance: float) -> None:
    """The compiled kernel: decodes and prefill chunks over scattered pages, blocks below and at
    tl.dot's 16 rows, float32 kept IEEE (no TF32)."""
    check_backend("triton", batch, "cuda", dtype, block_size, tolerance)


def test_cuda_graphs_give_the_eager_tokens(ckpt: Path) -> None:
    """Decode iterations replayed as CUDA graphs (padded batch sizes, captured on first use)
    give the eager engine's tokens and logprobs."""
    prompts = _prompts([3, 17, 40, 64, 5], seed=2)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        engine = LLMEngine.from_pretrained(ckpt, dtype="float32", device="cuda", cuda_graphs=graphs)
        outs[graphs] = engine.generate(prompts, params)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # captured
    for eager, replayed in zip(outs[False], outs[True], strict=True):
        assert eager.token_ids == replayed.token_ids
        torch.testing.assert_close(torch.tensor(eager.logprobs), torch.tensor(replayed.logprobs),
                                   rtol=1e-5, atol=1e-5)


def test_bf16_engine_is_as_close_to_fp32_as_transformers_bf16(ckpt: Path) -> None:
    """bf16 is the default on CUDA. Its logprobs stray from the fp32 truth by about as much as
    HF's own bf16 run does (with slack for a different order of the same roundings)."""
    engine = LLMEngine.from_pretrained(ckpt, device="cuda")
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    prompts = _prompts([3, 17, 40, 64], seed=1)
    outs = engine.generate(prompts, GREEDY)
    truth, ref = _hf(ckpt, torch.float32), _hf(ckpt, torch.bfloat16)
    ours_err = ref_err = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        exact = chosen_logprobs(hf_logits(truth, prompt, out.token_ids), out.token_ids)
        theirs = chosen_logprobs(hf_logits(ref, prompt, out.token_ids), out.token_ids)
        ours_err = max(ours_err, (torch.tensor(out.logprobs) - exact).abs().max().item())
        ref_err = max(ref_err, (theirs - exact).abs().max().item())
    assert ours_err <= 1.5 * ref_err + 5e-3, (ours_err, ref_err)


def test_seeds_reproduce_on_the_device_whatever_the_batch(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt, dtype="float32", device="cuda")
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    prompt, *others = _prompts([9, 30, 4], seed=2)
    alone = engine.generate([prompt], sampled)[0].token_ids
    crowd = engine.generate([others[0], prompt, others[1]],
                            [SamplingParams(max_tokens=5, temperature=0.7, seed=1), sampled, GREEDY])
    assert crowd[1].token_ids == alone
    assert engine.generate([prompt], sampled)[0].token_ids == alone


@pytest.mark.parametrize(("dtype", "rel"), [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_a_trainer_step_on_the_device_matches_the_cpu(tiny_qwen3: Path, tmp_path: Path, dtype: str,
                                                     rel: float) -> None:
    """fp32 master weights on the device, compute in `dtype`, log-probabilities in chunks of 16
    tokens; the step's figures are the CPU trainer's. Its weights feed an engine on the device,
    and its checkpoint resumes on the CPU."""
    objective = Objective.grpo(kl_coef=0.1)
    cpu = Trainer(tiny_qwen3, objective, TrainerConfig(lr=1e-3, device="cpu"))
    gpu = Trainer(tiny_qwen3, objective, TrainerConfig(lr=1e-3, device="cuda", dtype=dtype,
                                                       logprob_chunk_tokens=16))
    assert {(p.device.type, p.dtype) for p in gpu.model.parameters()} == {("cuda", torch.float32)}
    batch = random_batch()
    expected, got = cpu.step(batch), gpu.step(batch)
    assert got["tokens"] == expected["tokens"] and got["updates"] == expected["updates"] == 1
    for key in ("loss", "entropy", "kl", "grad_norm"):
        assert got[key] == pytest.approx(expected[key], rel=rel, abs=rel), key

    engine = LLMEngine.from_pretrained(tiny_qwen3, device="cuda", kv_cache_bytes=4 << 20)
    engine.load_weights(gpu.export_weights(), gpu.version)
    assert engine.generate([[1, 2, 3]], GREEDY)[0].versions == [1] * 24

    gpu.save(tmp_path / "ckpt")
    resumed = Trainer(tmp_path / "ckpt", objective, TrainerConfig(lr=1e-3, device="cpu"))
    resumed.load_state(tmp_path / "ckpt")
    assert resumed.version == 1 and resumed.step(random_batch(seed=1))["updates"] == 1


def test_the_coserving_executor_on_the_device(tiny_qwen2: Path, tiny_qwen3: Path) -> None:
    """Both models and their one page pool on the device; serving gets the tokens it gets alone,
    a rollout turn runs beside it, and CPU weights load onto the device."""
    executor = CoServingExecutor.from_pretrained(tiny_qwen2, tiny_qwen3, ExecutorConfig(pool_mb=8), "cuda")
    assert executor.pool.device.type == "cuda"
    executor.profile()
    serving_prompt, turn_prompt = _prompts([40, 70], seed=3)
    executor.add_serving(serving_prompt, GREEDY, "s")
    executor.submit_turn(Turn("t", "trajectory", turn_prompt, GREEDY))
    outs = {}
    while executor.has_unfinished():
        for out in executor.step():
            outs.setdefault(out.request_id, []).extend(out.token_ids)
    alone = LLMEngine.from_pretrained(tiny_qwen2, device="cuda").generate([serving_prompt], GREEDY)[0]
    assert outs["s"] == alone.token_ids and len(outs["t"]) == 24
    executor.load_weights(load_model(tiny_qwen3, device="cpu").named_parameters(), version=1)
    executor.submit_turn(Turn("t2", "trajectory", turn_prompt, GREEDY, policy_version=1))
    while executor.has_unfinished():
        executor.step()
