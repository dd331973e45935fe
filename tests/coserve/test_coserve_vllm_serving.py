"""The co-serving executor with vLLM serving (`rose.coserve.vllm_serving`): production requests
on vLLM's engine, a different rollout model on the native engine beside it, under admission and
the burst state machine.

vLLM is not in the default venv: `make test-vllm` runs this file from `.venv-vllm`."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this file")

from vllm_checkpoints import tiny_qwen3_for_vllm

from rose.contracts import SamplingParams, StructuredKind, StructuredOutput, TokenLoad, Turn
from rose.coserve.cli import serve_process
from rose.coserve.executor import CoServingExecutor
from rose.coserve.lease_client import LeaseClient
from rose.coserve.settings import MB, Engine, ExecutorConfig
from rose.coserve.vllm_serving import VllmServing
from rose.engine import RequestOutput
from rose.engine.kv_pool import KVSpec
from rose.engine.vllm_engine import BLOCK_SIZE
from rose.model import ModelConfig, preset_config, random_model, save_model

pytestmark = pytest.mark.vllm

VLLM_BLOCKS = 24  # vLLM's KV cache, in its blocks of BLOCK_SIZE tokens
# Memory alone decides the burst: SLOs of 100 s and no inflation budgets; a headroom of half the
# device's KV, a burst once serving has eaten half of it.
CONFIG = dict(slo_ttft_ms=1e5, slo_tpot_ms=1e5, tpot_inflation=math.inf, ttft_inflation=math.inf,
              headroom=0.5, high_watermark=0.5, serving_pool_share=0.5)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoServingExecutor]:
    serving = tiny_qwen3_for_vllm(tmp_path_factory.mktemp("serving"), seed=11)
    rollout = tmp_path_factory.mktemp("rollout")  # another model: another KV shape
    save_model(random_model(preset_config("qwen3", "tiny", num_hidden_layers=3, head_dim=8), seed=2), rollout)
    block = KVSpec.of(ModelConfig.from_dir(serving), torch.float32, BLOCK_SIZE).block_bytes
    cache = (VLLM_BLOCKS + 1) * block  # vLLM keeps one block back
    config = ExecutorConfig(pool_mb=2 * cache / MB, **CONFIG)
    ex = CoServingExecutor.from_pretrained(serving, rollout, config, device="cpu", dtype="float32",
                                           engine=Engine.VLLM)
    ex.profile()
    yield ex
    del ex
    gc.collect()  # vLLM tears its process-wide state down when the engine is freed


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _until_done(ex: CoServingExecutor) -> list[list[RequestOutput]]:
    steps = []
    while ex.has_unfinished():
        steps.append(ex.step())
    return steps


def _tokens(steps: list[list[RequestOutput]], request_id: str) -> list[int]:
    return [t for outs in steps for o in outs if o.request_id == request_id for t in o.token_ids]


def test_serving_hands_vllm_every_sampling_field_with_raw_logprobs(executor: CoServingExecutor) -> None:
    """As vLLM's server: every field (a field added to SamplingParams must reach vLLM too), vLLM's
    default raw logprobs; only tempered logprobs are refused, which raw ones are not."""
    serving = executor.serving
    assert serving.llm.vllm_config.model_config.logprobs_mode == "raw_logprobs"
    params = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.8, top_k=5, seed=7, stop_token_ids=(3,),
                            ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5,
                            repetition_penalty=1.2, min_p=0.1, min_tokens=2, logit_bias=((4, 2.0),),
                            top_logprobs=3, structured=StructuredOutput(StructuredKind.REGEX, "[a-z]+"))
    got = serving.sampling_params(params)
    carried = {"max_tokens": got.max_tokens, "temperature": got.temperature, "top_p": got.top_p,
               "top_k": got.top_k, "seed": got.seed, "stop_token_ids": tuple(got.stop_token_ids),
               "ignore_eos": got.ignore_eos, "presence_penalty": got.presence_penalty,
               "frequency_penalty": got.frequency_penalty, "repetition_penalty": got.repetition_penalty,
               "min_p": got.min_p, "min_tokens": got.min_tokens, "logit_bias": tuple(got.logit_bias.items()),
               "top_logprobs": got.logprobs,
               "structured": StructuredOutput(StructuredKind.REGEX, got.structured_outputs.regex)}
    assert carried == {k: getattr(params, k) for k in carried}
    assert set(carried) | {"logprobs_at_temperature"} == {f.name for f in dataclasses.fields(SamplingParams)}
    whole_vocabulary = dataclasses.replace(params, top_k=10**12)
    assert serving.sampling_params(whole_vocabulary).top_k == 0
    with pytest.raises(ValueError, match="raw logprobs"):
        serving.sampling_params(dataclasses.replace(params, logprobs_at_temperature=True))


def test_vllm_serves_beside_a_native_rollout_model_in_two_bounded_pools(executor: CoServingExecutor) -> None:
    ex = executor
    assert isinstance(ex.serving, VllmServing)
    kv = ex.serving.kv_pages()
    assert (kv.active, kv.total) == (0, VLLM_BLOCKS)
    # The rollout pool is the rest of pool_mb; both count as the device's KV.
    assert ex.pool.num_pages * ex.pool.page_bytes <= ex.config.pool_bytes - VLLM_BLOCKS * kv.page_bytes
    assert ex.device_pages == ex.pool.num_pages + ex.own_pages > ex.pool.num_pages
    prompt = _ids(40, 0)
    ex.add_serving(prompt, GREEDY, "alone")
    alone = _tokens(_until_done(ex), "alone")
    ex.add_serving(prompt, GREEDY, "beside")
    for i in range(3):
        ex.submit_turn(Turn(f"t{i}", f"traj{i}", _ids(50, i + 1), SamplingParams(max_tokens=10)))
    steps = _until_done(ex)
    assert _tokens(steps, "beside") == alone  # rollouts beside it do not change serving's tokens
    for i in range(3):
        assert len(_tokens(steps, f"t{i}")) == 10
    finished = {o.request_id: o.finish_reason for outs in steps for o in outs if o.finished}
    assert finished == {"beside": "length", "t0": "length", "t1": "length", "t2": "length"}
    assert ex.served == 2 and not ex._turns
    cached = ex.serving.cached_pages()
    assert ex.serving.kv_pages().active == 0 and cached > 0  # all done; vLLM's prefix cache keeps theirs
    # vLLM's blocks in the gauges, in the rollout pool's pages.
    assert ex.metrics.pool_pages.labels("serving")._value.get() == ex._pages(cached) > 0
    assert ex.metrics.running.labels(ex.metrics.model_name)._value.get() == 0


def test_a_tight_tpot_slo_holds_rollouts_while_vllm_decodes(executor: CoServingExecutor) -> None:
    ex = executor
    loose, ex.slo = ex.slo, dataclasses.replace(ex.slo, tpot_s=1e-5)  # 10 us per token: never
    try:
        ex.add_serving(_ids(20, 50), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), "s")
        for i in range(3):
            ex.submit_turn(Turn(f"u{i}", f"traj{i}", _ids(30, i + 5), SamplingParams(max_tokens=6)))
        steps, loads = [], []
        while ex.has_unfinished():
            steps.append(ex.step())
            loads.append(ex.serving.last_step.load)
    finally:
        ex.slo = loose
    serving = [i for i, outs in enumerate(steps) if any(o.request_id == "s" and o.token_ids for o in outs)]
    first, last = serving[0], serving[-1]
    assert last - first == 7  # vLLM decodes it every iteration
    # What the latency model learns: vLLM's iterations' serving load.
    assert loads[first] == TokenLoad(20) and loads[first + 1] == TokenLoad(0, 1, 21)
    # Once it decodes, no rollout token fits its TPOT budget until it is done.
    assert not [o for outs in steps[first + 1:last + 1] for o in outs if o.request_id.startswith("u")]
    for i in range(3):  # then the rollouts run on the idle device
        assert len(_tokens(steps, f"u{i}")) == 6
    assert ex.metrics.admissions.labels("held")._value.get() > 0


def test_a_serving_arrival_interrupts_the_rollout_iteration_beside_vllm(executor: CoServingExecutor) -> None:
    # The server's arrivals (`rose.coserve.api_state.Arrivals`) know nothing of the engine: a
    # request on its way to vLLM cuts the native rollout forward between two layers.
    ex = executor
    turn = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(2):
        ex.submit_turn(Turn(f"a{i}", f"traj{i}", _ids(30, 60 + i), turn))
    made = sum(len(o.token_ids) for _ in range(3) for o in ex.step())
    assert made > 0
    interrupted = ex.metrics.rollout_interrupted._value.get()
    ex.serving_arrived = lambda: True  # a request is being parsed
    try:
        assert not [o for o in ex.step() if o.token_ids]
        assert ex.rollout.last_step.interrupted and ex.serving.last_step.load == TokenLoad()
    finally:
        ex.serving_arrived = None
    assert ex.metrics.rollout_interrupted._value.get() == interrupted + 1
    ex.add_serving(_ids(24, 70), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "due")
    first = ex.step()  # queued: vLLM prefills it first, in the next iteration
    assert ex.serving.last_step.load.prefill_tokens == 24
    assert [o.request_id for o in first if o.request_id == "due" and o.token_ids] == ["due"]
    _until_done(ex)
    assert not ex._turns


def test_a_burst_on_vllm_cuts_rollout_turns_with_their_partial_tokens(executor: CoServingExecutor) -> None:
    ex = executor
    page_tokens = ex.rollout.blocks.block_size
    # Rollout turns that hold 70% of the rollout pool, each with some tokens out.
    prompt = int(0.7 * ex.pool.num_pages * page_tokens / 4) - page_tokens
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    for i in range(4):
        ex.submit_turn(Turn(f"b{i}", f"traj{i}", _ids(prompt, 20 + i), long))
    streamed = {f"b{i}": 0 for i in range(4)}
    while min(streamed.values()) == 0:
        for out in ex.step():
            streamed[out.request_id] += len(out.token_ids)
    assert ex.burst.state.name == "NORMAL"
    # A serving burst: prompts that take most of vLLM's cache.
    for i in range(2):
        ex.add_serving(_ids(VLLM_BLOCKS * BLOCK_SIZE * 2 // 5, 30 + i), SamplingParams(max_tokens=4), f"s{i}")
    aborted: list[RequestOutput] = []
    for _ in range(40):
        for out in ex.step():
            if out.request_id in streamed:
                streamed[out.request_id] += len(out.token_ids)
                if out.finish_reason == "abort":
                    aborted.append(out)
        if aborted:
            break
    assert aborted and ex.burst.state.name == "BURST" and ex.burst.bursts == 1
    for out in aborted:  # handed back with the tokens it had streamed
        assert out.num_output_tokens == streamed[out.request_id] > 0 and out.token_ids == []
        assert out.request_id not in ex._turns
    for turn in list(ex._turns):
        ex.abort_turn(turn)
    _until_done(ex)
    ex.step()
    assert ex.burst.state.name == "FROZEN"
    ex.new_rl_step()
    ex.step()
    assert ex.burst.state.name == "NORMAL"
    metrics = ex.metrics.expose().decode()
    assert 'rose:burst_transitions_total{from_state="normal",to_state="burst"} 1.0' in metrics


def _preemptions_metric(ex: CoServingExecutor) -> float:
    return next(float(line.split()[-1]) for line in ex.metrics.expose().decode().splitlines()
                if line.startswith("vllm:num_preemptions_total"))


def test_vllms_own_preemptions_are_counted(executor: CoServingExecutor) -> None:
    """Prompts that together outgrow vLLM's cache as they decode: vLLM preempts (frees a request's
    KV, recomputes it later), and `vllm:num_preemptions_total` counts it as vLLM's server does."""
    engine, metric = executor.serving.num_preemptions, _preemptions_metric(executor)
    for i in range(3):
        executor.add_serving(_ids(VLLM_BLOCKS * BLOCK_SIZE * 3 // 10, 50 + i), SamplingParams(
            max_tokens=VLLM_BLOCKS * BLOCK_SIZE // 5, ignore_eos=True), f"p{i}")
    done = {out.request_id for step in _until_done(executor) for out in step if out.finished}
    assert done == {"p0", "p1", "p2"}
    preempted = executor.serving.num_preemptions - engine
    assert preempted > 0 and _preemptions_metric(executor) - metric == preempted


def test_a_serving_engine_with_its_own_cache_needs_a_rollout_model(executor: CoServingExecutor) -> None:
    with pytest.raises(ValueError, match="beside a rollout model"):
        CoServingExecutor(executor.serving, None)
    with pytest.raises(ValueError, match="leaves nothing"):
        CoServingExecutor(executor.serving, executor.rollout.model, ExecutorConfig(pool_mb=0.01))


def test_rose_serve_engine_vllm_serves_and_leases_its_device(tmp_path: Path) -> None:
    """The command: the OpenAI API answered by vLLM, a leased turn, pushed weights, /metrics."""
    serving = tiny_qwen3_for_vllm(tmp_path / "serving", seed=11)
    rollout_model = random_model(preset_config("qwen3", "tiny", head_dim=8), seed=3)
    save_model(rollout_model, tmp_path / "rollout")
    argv = ["--engine", "vllm", "--model", str(serving), "--rollout-model", str(tmp_path / "rollout"),
            "--device", "cpu", "--no-profile", "--pool-mb", "4"]
    turn = Turn("t", "traj", _ids(30, 1), SamplingParams(max_tokens=6, ignore_eos=True))

    async def lease(url: str) -> tuple[list[int], int]:
        client = LeaseClient(url)
        try:
            output = await client.run_turn(turn)
            await client.load_weights(rollout_model.named_parameters(), version=1)
            return output.token_ids, (await client.heartbeat()).policy_version
        finally:
            await client.close()

    with serve_process(argv, startup_s=300) as (url, _):
        completion = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "serving", "prompt": _ids(12, 2), "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}).json()
        tokens, version = asyncio.run(lease(url))
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert completion["usage"] == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    assert completion["choices"][0]["finish_reason"] == "length"
    assert len(tokens) == 6 and version == 1
    assert 'vllm:num_requests_running{model_name="serving"} 0.0' in metrics
