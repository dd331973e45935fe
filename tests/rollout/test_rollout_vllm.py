"""The vLLM rollout backend (`rollout.backend=vllm`, docs/vllm.md) against the native engine on
the same weights: greedy turns token for token (up to a near-tie), sampled tokens' logprobs within
1e-3 in fp32, multi-turn prompts as token ids, abort with the partial tokens, weights from the
relay through the replica's apply hook, a failed engine failing the heartbeat.

vLLM is not in the default venv: `make test-vllm` runs this file from `.venv-vllm` (made
first if need be). vLLM keeps process-wide state
(its parallel groups, torn down when an engine is freed): one engine at a time per process, so
the tests that start an engine of their own come after those of the module's shared one."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this file")

from vllm_checkpoints import tiny_qwen3_for_vllm

from rose.cli import main
from rose.contracts import SamplingParams, Turn, TurnOutput
from rose.engine import LLMEngine
from rose.engine.async_engine import AsyncLLMEngine
from rose.engine.vllm_engine import VllmEngine
from rose.model import load_model, load_tokenizer
from rose.rollout.workers import EngineWorker, Failure, classify
from rose.runtime.actors import on_loop
from rose.runtime.config import load_config
from rose.steploop import RequestFailed
from rose.transfer import LocalRelay, Receiver, ReceiverSpec, Sender, model_spec

pytestmark = pytest.mark.vllm

KV_BYTES = 64 << 20
TIE = 1e-4  # a greedy mismatch is excused only where the native model's top two logits are this close
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs_at_temperature=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3_for_vllm(tmp_path_factory.mktemp("qwen3"), seed=11)


@pytest.fixture(scope="module")
def ckpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shape, other weights: what the relay pushes."""
    return tiny_qwen3_for_vllm(tmp_path_factory.mktemp("qwen3b"), seed=12)


def _worker(path: Path, name: str) -> EngineWorker:
    return EngineWorker(name, AsyncLLMEngine(VllmEngine.from_pretrained(path, kv_cache_bytes=KV_BYTES)), 16)


@pytest.fixture(scope="module")
def worker(ckpt: Path) -> Iterator[EngineWorker]:
    w = _worker(ckpt, "vllm-0")
    yield w
    w.engine.shutdown()


def _prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 512, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def _turns(worker: EngineWorker, prompts: list[list[int]], params: SamplingParams,
           prefix: str = "t") -> list[TurnOutput]:
    """The prompts as concurrent turns on `worker` (one batch in vLLM)."""
    async def run() -> list[TurnOutput]:
        return list(await asyncio.gather(*(
            worker.run_turn(Turn(f"{prefix}{i}", f"{prefix}{i}", p, params), TurnOutput())
            for i, p in enumerate(prompts))))

    return asyncio.run(run())


def _logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The native model's logits before each of `tokens`, teacher-forced."""
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1]


def _assert_matches(model: torch.nn.Module, prompt: list[int], got: TurnOutput, want: list[int],
                    want_logprobs: list[float]) -> int:
    """`got` (vLLM) equals the native greedy `want` token for token up to a near-tie under the
    native model, with logprobs within 1e-3 on the common tokens; how many tokens are common."""
    shorter = min(len(got.token_ids), len(want))
    common = next((i for i, (a, b) in enumerate(zip(got.token_ids, want, strict=False)) if a != b),
                  shorter)
    assert common < shorter or len(got.token_ids) == len(want), (got.token_ids, want)
    if common < shorter:
        top2 = _logits(model, prompt, want[:common + 1])[common].topk(2).values
        assert float(top2[0] - top2[1]) < TIE, f"token {common}: {got.token_ids[common]} != {want[common]}"
    assert torch.allclose(torch.tensor(got.logprobs[:common]), torch.tensor(want_logprobs[:common]),
                          atol=1e-3, rtol=0), (got.logprobs, want_logprobs)
    return common


def test_greedy_turns_equal_the_native_engines(worker: EngineWorker, ckpt: Path) -> None:
    prompts = _prompts(6, [1, 5, 17, 33, 70, 120])
    got = _turns(worker, prompts, GREEDY)
    native = LLMEngine.from_pretrained(ckpt).generate(prompts, GREEDY)
    model = load_model(ckpt)
    exact = 0
    for prompt, out, ref in zip(prompts, got, native, strict=True):
        assert len(out.token_ids) == 24 and out.finish_reason == "length"
        assert len(out.logprobs) == 24 and out.versions == [0] * 24
        assert all(isinstance(lp, float) and lp <= 0 for lp in out.logprobs)
        exact += _assert_matches(model, prompt, out, ref.token_ids, ref.logprobs) == 24
    assert exact >= 5  # a near-tie is rare: most turns match to the end


def test_sampled_tokens_logprobs_equal_the_native_models(worker: EngineWorker, ckpt: Path) -> None:
    """Sampled (temperature 0.7, as RL records it: at the temperature), the draws differ from the
    native engine's (other random streams); each drawn token's logprob is the native model's."""
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=3, ignore_eos=True,
                            logprobs_at_temperature=True)
    prompts = _prompts(4, [9, 40], seed=1)
    model = load_model(ckpt)
    for prompt, out in zip(prompts, _turns(worker, prompts, params, "s"), strict=True):
        ref = (_logits(model, prompt, out.token_ids) / 0.7).log_softmax(-1)
        ref = ref.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-3, rtol=0), (out.logprobs, ref)


def test_a_second_turn_extends_the_first_as_token_ids(worker: EngineWorker, ckpt: Path) -> None:
    """Turn 2's prompt is turn 1's prompt, its tokens and an observation, all ids: the tokens come
    back as given (nothing re-tokenised) and vLLM's prefix cache serves the shared part."""
    native, model = LLMEngine.from_pretrained(ckpt), load_model(ckpt)
    prompt = _prompts(1, [40], seed=2)[0]
    first = _turns(worker, [prompt], GREEDY, "m1-")[0]
    _assert_matches(model, prompt, first, *_native(native, prompt))
    second_prompt = prompt + first.token_ids + [7, 8, 9, 300, 301]
    second = _turns(worker, [second_prompt], GREEDY, "m2-")[0]
    _assert_matches(model, second_prompt, second, *_native(native, second_prompt))
    assert worker.engine.engine.llm.get_num_unfinished_requests() == 0


def _native(engine: LLMEngine, prompt: list[int],
            params: SamplingParams = GREEDY) -> tuple[list[int], list[float]]:
    out = engine.generate([prompt], params)[0]
    return out.token_ids, out.logprobs


def test_the_prefix_cache_serves_a_repeated_prompt(worker: EngineWorker) -> None:
    prompt = _prompts(1, [80], seed=4)[0]

    async def cached(request_id: str) -> int:
        return [out async for out in worker.engine.generate(prompt, GREEDY, request_id)][-1].num_cached_tokens

    assert asyncio.run(cached("c1")) == 0 and asyncio.run(cached("c2")) >= 64


def test_an_abort_midway_returns_the_partial_tokens(worker: EngineWorker, ckpt: Path) -> None:
    prompt = _prompts(1, [12], seed=5)[0]
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    output = TurnOutput()

    async def run() -> None:
        task = asyncio.create_task(worker.run_turn(Turn("a0", "a0", prompt, long), output))
        while len(output.token_ids) < 5:
            await asyncio.sleep(0.01)
        await worker.abort("a0")
        assert await task is output

    asyncio.run(run())
    assert output.finish_reason == "abort" and 5 <= len(output.token_ids) < 400
    assert len(output.logprobs) == len(output.versions) == len(output.token_ids)
    want, logprobs = _native(LLMEngine.from_pretrained(ckpt), prompt, long)
    n = len(output.token_ids)
    _assert_matches(load_model(ckpt), prompt, output, want[:n], logprobs[:n])
    # A caller cancelled midway keeps what had arrived, and the engine drops the request.
    kept = TurnOutput()

    async def cancel() -> None:
        task = asyncio.create_task(worker.run_turn(Turn("a1", "a1", prompt, long), kept))
        while len(kept.token_ids) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await worker.heartbeat()  # after the loop has run the abort

    asyncio.run(cancel())
    assert len(kept.token_ids) >= 3 and kept.token_ids == want[:len(kept.token_ids)]
    assert not worker.engine.engine.has_unfinished()


@pytest.mark.parametrize("params, refused", [
    (SamplingParams(temperature=1.0, top_p=0.9), "top_p"),
    (SamplingParams(temperature=1.0, top_k=20), "top_k"),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), "presence_penalty"),
    (SamplingParams(temperature=0.0, logit_bias=((5, 1.0),)), "logit_bias"),
    (SamplingParams(temperature=0.5), "logprobs_at_temperature"),
    (SamplingParams(temperature=-1.0), "temperature must be >= 0"),
])
def test_sampling_it_cannot_map_is_the_turns_failure(worker: EngineWorker, params: SamplingParams,
                                                      refused: str) -> None:
    with pytest.raises(ValueError, match=refused) as info:
        _turns(worker, [[1, 2, 3]], params, "r")
    assert classify(info.value) is Failure.REJECTED
    assert asyncio.run(worker.heartbeat()).policy_version == 0  # the worker is fine


def test_a_prompt_past_the_context_is_the_turns_failure(worker: EngineWorker) -> None:
    with pytest.raises(ValueError, match="request 'r0'"):
        _turns(worker, [[5] * 3000], GREEDY, "r")


def test_smollm2_greedy_turns_equal_the_native_engines(smollm2: Path) -> None:
    """A real pretrained model (SmolLM2-135M-Instruct, `rose init-model --preset
    smollm2-135m-instruct`), chat prompts, a turn that stops at its end of turn."""
    tokenizer = load_tokenizer(smollm2)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("What is the capital of France?", "Name three colours.", "Count from 1 to 5.")]
    params = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=tuple(tokenizer.stop_token_ids))
    worker = _worker(smollm2, "vllm-smol")
    try:
        got = _turns(worker, prompts, params, "smol")
    finally:
        worker.engine.shutdown()
    model = load_model(smollm2)
    for prompt, out, ref in zip(prompts, got, LLMEngine.from_pretrained(smollm2).generate(prompts, params),
                                strict=True):
        assert out.finish_reason in ("stop", "length") and out.versions == [0] * len(out.token_ids)
        if _assert_matches(model, prompt, out, ref.token_ids, ref.logprobs) == len(ref.token_ids):
            assert out.finish_reason == ref.finish_reason
    assert "Paris" in tokenizer.decode(got[0].token_ids)


def _sync(sender: Sender, receiver: Receiver, version: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pulled = pool.submit(receiver.sync, 60)
        sender.publish(version)
        assert pulled.result() == version


def test_weights_from_the_relay_reach_the_running_model(ckpt: Path, ckpt2: Path) -> None:
    """The dedicated worker's apply hook (`on_loop`, as `DedicatedWorkerActor` sets it for this
    backend: the receiver's whole copy loaded on the engine's loop, between iterations): a full
    sync of other weights, then a delta of one tensor (k_proj, which vLLM holds fused in
    qkv_proj). After each, the vLLM worker's greedy turns are those of a native engine given the
    same tensors, at the new version."""
    worker = _worker(ckpt, "vllm-w")
    native, model = LLMEngine.from_pretrained(ckpt), load_model(ckpt)
    policy = {n: p.detach().to(torch.bfloat16) for n, p in load_model(ckpt2).named_parameters()}
    relay, spec = LocalRelay(), model_spec(load_model(ckpt2))
    sender = Sender(relay, spec, policy)
    receiver = Receiver(relay, spec, ReceiverSpec("vllm-w"))
    receiver.on_apply = on_loop(worker.engine, worker.engine.engine.load_weights, receiver.tensors)
    receiver.join()
    prompts = _prompts(4, [6, 30], seed=6)
    try:
        before = _turns(worker, prompts, GREEDY, "w0-")
        for version, change in ((1, None), (2, "model.layers.1.self_attn.k_proj.weight")):
            if change is not None:
                policy[change].mul_(-1)
            _sync(sender, receiver, version)
            assert receiver.last.kind == ("full" if version == 1 else "delta")
            if change is not None:  # elements: only that tensor's came
                assert receiver.last.changed == policy[change].numel()
            native.load_weights(receiver.tensors.items(), version)
            model.load_state_dict({n: t.float() for n, t in receiver.tensors.items()}, strict=False)
            got = _turns(worker, prompts, GREEDY, f"w{version}-")
            assert asyncio.run(worker.heartbeat()).policy_version == version
            for prompt, out, ref in zip(prompts, got, native.generate(prompts, GREEDY), strict=True):
                assert out.versions == [version] * len(out.token_ids)
                _assert_matches(model, prompt, out, ref.token_ids, ref.logprobs)
            assert [o.token_ids for o in got] != [o.token_ids for o in before]
            before = got
        with pytest.raises(ValueError, match="takes every weight at once; missing"):
            worker.engine.engine.load_weights([(change, policy[change])], 3)
    finally:
        worker.engine.shutdown()


def test_a_failed_engine_fails_its_heartbeat(ckpt: Path) -> None:
    worker = _worker(ckpt, "vllm-dead")
    try:
        assert asyncio.run(worker.heartbeat()).policy_version == 0

        def broken() -> list[object]:
            raise RuntimeError("engine core died")

        worker.engine.engine.llm.step = broken
        with pytest.raises(RequestFailed, match="engine core died"):
            _turns(worker, [[1, 2, 3]], GREEDY, "d")
        with pytest.raises(RuntimeError, match="a vLLM iteration failed"):
            asyncio.run(worker.heartbeat())
        with pytest.raises(RuntimeError, match="a vLLM iteration failed") as info:
            _turns(worker, [[1, 2, 3]], GREEDY, "e")
        assert classify(info.value) is Failure.WORKER  # not the turn's fault: routed elsewhere
    finally:
        worker.engine.shutdown()


def test_the_config_refuses_a_model_vllm_cannot_run(ckpt: Path) -> None:
    """The tiny preset's head_dim (16) has no kernel in vLLM's CPU attention: refused before
    anything starts, as a checkpoint with head_dim 32 is taken."""
    with pytest.raises(ValueError, match=r"^config: rollout\.backend=vllm: the model's head_dim is 16; "
                                         r"vLLM's CPU attention takes 32, 64"):
        load_config(None, ["rollout.backend=vllm"])
    assert load_config(None, ["rollout.backend=vllm", f"model.path={ckpt}"]).rollout.backend == "vllm"


def test_rose_train_runs_its_rollouts_on_vllm(ckpt: Path, tmp_path: Path) -> None:
    """`rose train rollout.backend=vllm`: the dedicated worker's actor hosts vLLM, takes each
    step's weights from the relay (a full copy, then deltas), its turns train on policy and none
    is resumed elsewhere."""
    out = tmp_path / "summary.json"
    assert main(["train", "--mode", "fixed", "train.steps=3", f"model.path={ckpt}", "rollout.backend=vllm",
                 "rollout.groups=2", "rollout.group_size=4", f"train.out_dir={tmp_path / 'run'}",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    steps, summary = report["steps"], report["summary"]
    assert [s["version"] for s in steps] == [1, 2, 3]
    assert all(s["dedicated_tokens"] > 0 and s["trainer"]["version_lag"] == 0 for s in steps)
    # No turn handed elsewhere: the engine's first iteration (its one-time costs) ran at start,
    # not under the first turns, whose heartbeats it would stall past the registry's 2 s.
    assert [s["resumed_turns"] for s in steps] == [0, 0, 0]
    assert summary["lost_trajectories"] == summary["failed_trajectories"] == summary["restarts"] == 0
