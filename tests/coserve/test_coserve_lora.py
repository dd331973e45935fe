"""The rollout model's LoRA adapters behind the lease API, over real HTTP: pushed with
`LeaseClient.load_adapter` (whole, then a new version of the tensors that changed), turns that
name one run as a local engine with the same adapter does and carry its version (on a dedicated
worker's engine too), a turn naming no loaded adapter and a bad push are refused by name while
the server keeps serving, and `rose serve --rollout-adapter` loads a PEFT directory at start."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save
from servers import running

from rose.contracts import Turn, TurnOutput
from rose.contracts.adapter import LoRAConfig
from rose.coserve.cli import serve_process
from rose.coserve.executor import CoServingExecutor
from rose.coserve.lease_client import LeaseClient, TurnRejected
from rose.coserve.serve_config import load_serve_config
from rose.coserve.server import build_app, build_lease_app
from rose.coserve.settings import ExecutorConfig, ServerLimits
from rose.coserve.turn_stream import EngineHost
from rose.engine import LLMEngine, RequestOutput, SamplingParams
from rose.model import ModelConfig, load_tokenizer
from rose.model.lora import save_adapter
from rose.steploop import StepLoop

KEY = "lease-secret"
CONFIG = LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
PROMPT = [5, 9, 14, 3, 27, 8]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
MAX_WEIGHTS = 256 * 1024


def adapter_tensors(model: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """An adapter whose B is not zero (a freshly initialised one changes nothing)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.3 for name, shape in CONFIG.shapes(model).items()}


def local_run(checkpoint: Path, loads: list[tuple[Mapping[str, torch.Tensor], int]],
              adapter: str | None = "policy") -> RequestOutput:
    """The greedy turn on a local engine of the rollout checkpoint, its adapter given `loads`
    (tensors, version) in order."""
    engine = LLMEngine.from_pretrained(checkpoint)
    for tensors, version in loads:
        engine.load_adapter("policy", CONFIG, tensors.items(), version)
    engine.add_request(PROMPT, GREEDY, "local", adapter=adapter)
    merged: RequestOutput | None = None
    while engine.has_unfinished():
        for out in engine.step():
            if merged is None:
                merged = out
            else:
                merged.merge(out)
    assert merged is not None and merged.finished
    return merged


def turn(turn_id: str, adapter: str | None, policy_version: int | None = None) -> Turn:
    return Turn(turn_id, "traj", PROMPT, GREEDY, policy_version, adapter)


def same(got: TurnOutput, want: RequestOutput) -> bool:
    return got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


@pytest.fixture(scope="module")
def checkpoints(tiny_qwen2: Path, tiny_qwen3: Path) -> tuple[Path, Path]:
    """The serving model and the rollout model, the adapters' base."""
    return tiny_qwen2, tiny_qwen3


@pytest.fixture(scope="module")
def rollout_config(checkpoints: tuple[Path, Path]) -> ModelConfig:
    return ModelConfig.from_dir(checkpoints[1])


@pytest.fixture(scope="module")
def server(checkpoints: tuple[Path, Path]) -> Iterator[tuple[str, CoServingExecutor]]:
    executor = CoServingExecutor.from_pretrained(*checkpoints, ExecutorConfig(pool_mb=8))
    executor.profile()
    limits = ServerLimits(lease_key=KEY, max_weights_bytes=MAX_WEIGHTS)
    app = build_app(StepLoop(executor), executor, load_tokenizer(checkpoints[0]), "tiny-serving", limits)
    with running(app) as url:
        yield url, executor


async def _with_client(url: str, work: Any, key: str | None = KEY) -> Any:
    client = LeaseClient(url, key=key)
    try:
        return await work(client)
    finally:
        await client.close()


def test_turns_run_the_pushed_adapter_and_its_new_versions(server: tuple[str, CoServingExecutor],
                                                           checkpoints: tuple[Path, Path],
                                                           rollout_config: ModelConfig) -> None:
    url, _ = server
    first = adapter_tensors(rollout_config, seed=3)
    # The next version: only layer 0's q_proj changed, and only that is pushed.
    changed = {n: -2 * t for n, t in first.items() if n.startswith("model.layers.0.self_attn.q_proj")}

    async def work(client: LeaseClient) -> list[Any]:
        base = await client.run_turn(turn("base-0", None))
        pushed = await client.load_adapter("policy", CONFIG, first.items(), 1)
        v1 = await client.run_turn(turn("v1", "policy", policy_version=1))
        partial = await client.load_adapter("policy", CONFIG, changed.items(), 2)
        v2 = await client.run_turn(turn("v2", "policy", policy_version=2))
        base_after = await client.run_turn(turn("base-1", None))
        with pytest.raises(TurnRejected, match="expects policy version 3 or later, this executor has 2"):
            await client.run_turn(turn("v3", "policy", policy_version=3))
        return [base, pushed, v1, partial, v2, base_after, await client.heartbeat()]

    base, pushed, v1, partial, v2, base_after, beat = asyncio.run(_with_client(url, work))
    assert pushed == {"policy_version": 1, "tensors": len(first), "adapter": "policy"}
    assert partial == {"policy_version": 2, "tensors": 2, "adapter": "policy"}
    assert same(base, local_run(checkpoints[1], [], adapter=None))
    assert same(v1, local_run(checkpoints[1], [(first, 1)]))
    assert same(v2, local_run(checkpoints[1], [(first, 1), (changed, 2)]))
    assert (v1.versions, v2.versions) == ([1] * 8, [2] * 8)
    # Each version changes the turn; turns on the base model stay as they were.
    assert max(abs(a - b) for a, b in zip(base.logprobs, v1.logprobs, strict=True)) > 1e-2
    assert max(abs(a - b) for a, b in zip(v1.logprobs, v2.logprobs, strict=True)) > 1e-2
    assert same(base_after, local_run(checkpoints[1], [], adapter=None)) and base_after.versions == [0] * 8
    assert beat.policy_version == 2  # the newest a turn runs on here: the adapter's


def test_a_turn_naming_no_loaded_adapter_is_refused_by_name(server: tuple[str, CoServingExecutor]) -> None:
    url, _ = server

    async def work(client: LeaseClient) -> TurnOutput:
        with pytest.raises(TurnRejected, match="is not loaded on this executor") as refused:
            await client.run_turn(turn("unknown", "nope"))
        assert refused.value.status == 400
        return await client.run_turn(turn("after", None))

    assert len(asyncio.run(_with_client(url, work)).token_ids) == 8
    lease = {"Authorization": f"Bearer {KEY}"}
    body = {"turn_id": "unknown", "trajectory_id": "t", "token_ids": [1], "adapter": "nope"}
    r = httpx.post(f"{url}/v1/lease/turns", json=body, headers=lease)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("turn 'unknown': adapter 'nope' is not loaded on this")
    r = httpx.post(f"{url}/v1/lease/turns", json={**body, "adapter": ""}, headers=lease)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("adapter: expected null or a name")


def test_a_dedicated_worker_runs_turns_on_its_engine_s_adapter(checkpoints: tuple[Path, Path],
                                                              rollout_config: ModelConfig) -> None:
    tensors = adapter_tensors(rollout_config, seed=11)
    engine = LLMEngine.from_pretrained(checkpoints[1])
    engine.load_adapter("policy", CONFIG, tensors.items(), 3)
    loop = StepLoop(engine)
    with running(build_lease_app(loop, EngineHost(engine, 4), ServerLimits())) as url:
        async def work(client: LeaseClient) -> TurnOutput:
            with pytest.raises(TurnRejected, match="is not loaded") as refused:
                await client.run_turn(turn("unknown", "nope"))
            assert refused.value.status == 400
            return await client.run_turn(turn("dedicated", "policy", policy_version=3))

        got = asyncio.run(_with_client(url, work, key=None))
    assert same(got, local_run(checkpoints[1], [(tensors, 3)])) and got.versions == [3] * 8


def _push(url: str, tensors: Mapping[str, torch.Tensor], key: str | None = KEY, **params: Any
          ) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/lease/weights", params=params, headers=headers,
                      content=save({n: t.contiguous() for n, t in tensors.items()}))


def test_a_bad_push_is_refused_by_name_and_changes_nothing(server: tuple[str, CoServingExecutor],
                                                          rollout_config: ModelConfig) -> None:
    url, _ = server
    tensors = adapter_tensors(rollout_config, seed=5)
    lora = {"rank": CONFIG.rank, "alpha": CONFIG.alpha, "targets": list(CONFIG.targets)}
    assert _push(url, tensors, adapter="fixed", version=5, **lora).status_code == 200

    async def run(turn_id: str, adapter: str = "fixed") -> TurnOutput:
        return await _with_client(url, lambda client: client.run_turn(turn(turn_id, adapter)))

    before = asyncio.run(run("before"))
    q0 = "model.layers.0.self_attn.q_proj.lora_A.weight"
    wider = LoRAConfig(rank=8, alpha=8.0, targets=CONFIG.targets).shapes(rollout_config)
    refusals = [  # (the push, its status, what its message names)
        # A good tensor beside one of another rank: neither is taken.
        (_push(url, {q0: -tensors[q0], "model.layers.1.mlp.down_proj.lora_B.weight": torch.zeros(64, 8)},
               adapter="fixed", version=6, **lora), 400, "has shape (64, 8), expected (64, 4)"),
        (_push(url, {**tensors, "model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)},
               adapter="fixed", version=6, **lora), 400, "is not one of this adapter's"),
        (_push(url, {n: torch.zeros(s) for n, s in wider.items()}, adapter="fresh", version=1, **lora),
         400, "expected"),
        (_push(url, tensors, adapter="fixed", version=6, **{**lora, "rank": 0}), 400, "rank must be"),
        (_push(url, tensors, adapter="fixed", version=6, rank=4, alpha=8.0), 400, "targets is missing"),
        (_push(url, tensors, version=6, **lora), 400, "given with no adapter"),
        (_push(url, tensors, adapter="fixed", version=6, in_flight="finish_old", **lora), 400, "in_flight"),
        (_push(url, tensors, adapter="fixed", version=4, **lora), 409, "only move forward"),
        (_push(url, tensors, key=None, adapter="fixed", version=6, **lora), 401, "lease key"),
        (httpx.post(f"{url}/v1/lease/weights", params={"adapter": "fixed", "version": 6, **lora},
                    headers={"Authorization": f"Bearer {KEY}"}, content=b"z" * (MAX_WEIGHTS + 1)),
         413, "at most"),
    ]
    for r, status, named in refusals:
        assert (r.status_code, named in r.json()["error"]["message"]) == (status, True), r.text
    # Still serving, the adapter as it was, and nothing loaded under the refused name.
    assert asyncio.run(run("after")) == before
    with pytest.raises(TurnRejected, match="is not loaded on this executor"):
        asyncio.run(run("fresh", "fresh"))
    ok = httpx.post(f"{url}/v1/completions",
                    json={"model": "tiny-serving", "prompt": [5, 6], "max_tokens": 2})
    assert ok.status_code == 200


def test_rose_serve_loads_a_rollout_adapter_at_start(checkpoints: tuple[Path, Path],
                                                     rollout_config: ModelConfig, tmp_path: Path) -> None:
    tensors = adapter_tensors(rollout_config, seed=7)
    directory = save_adapter(tmp_path / "my-adapter", CONFIG, tensors, str(checkpoints[1]))
    argv = ["--model", str(checkpoints[0]), "--rollout-model", str(checkpoints[1]), "--rollout-adapter",
            str(directory), "--device", "cpu", "--no-profile", "--threads", "1", "--pool-mb", "8"]
    with serve_process(argv, startup_s=120) as (url, _):
        got = asyncio.run(_with_client(url, lambda c: c.run_turn(turn("start", "my-adapter", 0)), key=None))
    assert same(got, local_run(checkpoints[1], [(tensors, 0)])) and got.versions == [0] * 8


def test_rollout_adapter_settings_are_checked_before_any_model_loads(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has no adapter_config\.json; expected a PEFT adapter directory"):
        load_serve_config(flags={"model": "m", "rollout_model": "r", "rollout_adapter": str(tmp_path)})
    (tmp_path / "adapter_config.json").write_text('{"base_model_name_or_path": "/elsewhere/base"}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    # Adapter mode (no rollout model): the adapter must be the serving model's.
    with pytest.raises(ValueError, match=r"rollout_adapter \(adapter mode: no rollout model\): the "
                                         r"adapter's base is '/elsewhere/base'"):
        load_serve_config(flags={"model": "/models/served", "rollout_adapter": str(tmp_path)})
    assert load_serve_config(flags={"model": "/models/base", "rollout_adapter": str(tmp_path)}).adapter_mode
    config = load_serve_config(flags={"model": "m", "rollout_model": "r", "rollout_adapter": str(tmp_path)})
    assert config.adapter_name() == tmp_path.name
    named = load_serve_config(flags={"model": "m", "rollout_model": "r", "rollout_adapter": str(tmp_path),
                                     "rollout_adapter_name": "policy"})
    assert named.adapter_name() == "policy"
