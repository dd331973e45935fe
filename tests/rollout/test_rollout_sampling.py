"""A turn samples the same wherever it runs: on a dedicated worker (an `EngineWorker` over an
`AsyncLLMEngine`) and on a serving device (a real `rose serve` process, through its lease API
with the `LeaseClient`), with every field of its `SamplingParams` carried to the engine; and a
rollout runs on both, the lease client as the serving device's `Worker`."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from rose.contracts import SamplingParams, StructuredKind, StructuredOutput, Turn, TurnOutput, WorkerKind
from rose.coserve.cli import serve_process
from rose.coserve.lease_client import LeaseClient, TurnRejected
from rose.coserve.protocol import TURN
from rose.engine import LLMEngine
from rose.engine.async_engine import AsyncLLMEngine
from rose.model import load_tokenizer
from rose.rl import Episode, make_env
from rose.rollout.manager import RolloutManager, RolloutReport
from rose.rollout.registry import WorkerRegistry
from rose.rollout.workers import EngineWorker

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
# Every field away from its default (the test below checks that none is left at it).
SHAPED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, top_k=200, seed=1234,
                        stop_token_ids=(3, 4), ignore_eos=True, logprobs_at_temperature=True,
                        presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_p=0.01,
                        min_tokens=4, logit_bias=((5, 2.0), (7, -3.0)), top_logprobs=3,
                        structured=StructuredOutput(StructuredKind.REGEX, "[a-z ]+"))


def test_every_sampling_field_is_set_away_from_its_default() -> None:
    default = SamplingParams()
    assert [f.name for f in dataclasses.fields(SamplingParams)
            if getattr(SHAPED, f.name) == getattr(default, f.name)] == []


def test_the_lease_wire_form_carries_every_sampling_field_with_its_default() -> None:
    """A leased turn is the contract's `Turn` on the wire, every field of its sampling carried."""
    turn = Turn("t0:0:0", "t0", PROMPT, SHAPED, policy_version=2)
    assert TURN.validate_json(TURN.dump_json(turn)) == turn
    bare = {"turn_id": "t", "trajectory_id": "t", "token_ids": PROMPT}
    assert TURN.validate_python(bare).params == SamplingParams()


@pytest.fixture(scope="module")
def serving(tiny_qwen2: Path, tiny_qwen3: Path) -> Iterator[str]:
    """A serving device whose rollout model is the dedicated worker's: its URL."""
    argv = ["--model", str(tiny_qwen2), "--rollout-model", str(tiny_qwen3), "--device", "cpu",
            "--no-profile", "--pool-mb", "16"]
    with serve_process(argv, startup_s=120) as (url, _):
        yield url


@pytest.fixture(scope="module")
def dedicated(tiny_qwen3: Path) -> Iterator[EngineWorker]:
    engine = LLMEngine.from_pretrained(tiny_qwen3, device="cpu")
    worker = EngineWorker("dedicated-0", AsyncLLMEngine(engine), max_concurrency=1)
    yield worker
    asyncio.run(worker.close())


def _run(worker: EngineWorker | str, turn: Turn) -> TurnOutput:
    """The turn on `worker`, a dedicated one or a serving device's URL (its lease API's client
    made on this call's event loop)."""
    async def run() -> TurnOutput:
        if isinstance(worker, EngineWorker):
            return await worker.run_turn(turn, TurnOutput())
        client = LeaseClient(worker, worker_id="serving-0")
        try:
            return await client.run_turn(turn, TurnOutput())
        finally:
            await client.close()
    return asyncio.run(run())


@pytest.mark.parametrize("params", [SHAPED, dataclasses.replace(SHAPED, logprobs_at_temperature=False),
                                    dataclasses.replace(SHAPED, temperature=0.0, top_logprobs=0)],
                         ids=["shaped", "raw-logprobs", "greedy"])
def test_a_turn_samples_the_same_on_a_dedicated_worker_and_a_serving_device(
        dedicated: EngineWorker, serving: str, params: SamplingParams, tiny_qwen3: Path) -> None:
    turn = Turn(f"t:{params.temperature}:{params.logprobs_at_temperature}", "t", PROMPT, params)
    here = _run(dedicated, turn)
    there = _run(serving, turn)
    assert here.finish_reason == there.finish_reason is not None
    assert there.token_ids == here.token_ids and len(here.token_ids) >= params.min_tokens
    # The structured output held on both (a stop token may end it).
    text = load_tokenizer(tiny_qwen3).decode([t for t in here.token_ids if t not in params.stop_token_ids])
    assert re.fullmatch("[a-z ]+", text), text
    # Same numbers, up to a different reduction order (the server process's own thread count).
    assert there.logprobs == pytest.approx(here.logprobs, abs=1e-5)
    assert there.versions == here.versions
    asked = len(here.token_ids) if params.top_logprobs else 0
    assert len(there.top_logprobs) == len(here.top_logprobs) == asked
    for mine, theirs in zip(here.top_logprobs, there.top_logprobs, strict=True):
        assert [t for t, _ in theirs] == [t for t, _ in mine]
        assert [lp for _, lp in theirs] == pytest.approx([lp for _, lp in mine], abs=1e-5)


def test_a_turn_refused_is_refused_on_either(dedicated: EngineWorker, serving: str) -> None:
    """A sampling value the engine cannot take is the turn's failure on both kinds of worker."""
    turn = Turn("bad", "t", PROMPT, dataclasses.replace(SHAPED, logit_bias=((10**6, 1.0),)))
    with pytest.raises(ValueError, match="logit_bias token id 1000000 is outside the vocabulary"):
        _run(dedicated, turn)
    with pytest.raises(TurnRejected, match="logit_bias token id 1000000 is outside the vocabulary"):
        _run(serving, turn)


def test_a_rollout_spills_onto_a_serving_device_through_its_lease_client(
        dedicated: EngineWorker, serving: str, tiny_qwen3: Path) -> None:
    """The lease client is the serving device's `Worker`: registered, heartbeated and routed to
    beside a dedicated worker, which the turns fill first."""
    tokenizer = load_tokenizer(tiny_qwen3)
    eps = [Episode(make_env("frozenlake", max_turns=2), tokenizer, seed=i) for i in range(4)]

    async def rollout() -> RolloutReport:
        registry = WorkerRegistry()
        client = LeaseClient(serving, worker_id="serving-0", max_concurrency=4)
        registry.add(dedicated)
        registry.add(client)
        try:
            manager = RolloutManager(registry, SamplingParams(max_tokens=8, logprobs_at_temperature=True),
                                     tick_s=0.05, rebalance=False)
            return await manager.run(eps, policy_version=0, timeout_s=120)
        finally:
            await client.close()

    report = asyncio.run(rollout())
    assert len(report.trajectories) == len(eps) and not report.failed and not report.lost
    assert report.turns_on(WorkerKind.SERVING) > 0 and report.turns_on(WorkerKind.DEDICATED) > 0
