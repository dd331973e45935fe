"""The step loop (rose.steploop), here around an engine, outlives its callers: cancelled calls,
failing iterations, readers that stop reading, a dead or stuck thread, shutdown from any state."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from rose.engine import LLMEngine, SamplingParams
from rose.engine.async_engine import AsyncLLMEngine
from rose.engine.scheduler import Batch
from rose.rollout.workers import EngineWorker
from rose.steploop import LoopDeadError, RequestFailed, StepLoop

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _tokens(stream: object) -> list[int]:
    return [t async for out in stream for t in out.token_ids]  # type: ignore[attr-defined]


async def _until(predicate: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_a_storm_of_cancelled_calls_leaves_the_engine_serving(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    free_at_start = engine.pool.num_free
    expected = engine.generate([_prompt(9, 1)], GREEDY)[0].token_ids
    engine.blocks.reset_prefix_cache()
    front = AsyncLLMEngine(engine)
    rng = random.Random(0)

    async def one(i: int) -> None:
        kind = rng.choice(["call", "stream", "stream-closing", "abort"])
        if kind == "call":
            await front.call(lambda: time.sleep(0.001))
        elif kind == "abort":
            await front.abort(f"s{i - 1}")
        else:
            stream = front.generate(_prompt(rng.randint(1, 40), i),
                                    SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True),
                                    request_id=f"s{i}")
            if kind == "stream":  # left to the garbage collector when cancelled
                async for _ in stream:
                    pass
            else:
                async with contextlib.aclosing(stream):
                    async for _ in stream:
                        pass

    async def cancelled(i: int) -> None:
        task = asyncio.ensure_future(one(i))
        if rng.random() < 0.5:
            await asyncio.sleep(rng.random() * 0.05)
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(task, rng.random() * 0.1)

    async def main() -> None:
        await asyncio.gather(*(cancelled(i) for i in range(300)))
        await asyncio.sleep(0)  # let finalizers of abandoned streams schedule their aborts

        async def idle() -> bool:
            return await front.call(lambda: not engine.has_unfinished())

        await _until(idle)
        assert await asyncio.wait_for(_tokens(front.generate(_prompt(9, 1), GREEDY)), 30) == expected
        await front.call(engine.blocks.reset_prefix_cache)
        assert engine.pool.num_free == free_at_start  # no page leaked
        await front.ping(30)

    try:
        asyncio.run(main())
    finally:
        front.shutdown()


def _raise_for(engine: LLMEngine, bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the model runner raise whenever request `bad` is in its batch."""
    run = engine.runner.run

    def failing(batch: Batch, interrupt: object = None) -> tuple:
        if any(s.request_id == bad for s in batch.seqs):
            raise RuntimeError("injected fault")
        return run(batch, interrupt)

    monkeypatch.setattr(engine.runner, "run", failing)


def test_an_iteration_that_raises_fails_only_its_request(ckpt: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    prompts = [_prompt(9, 1), _prompt(20, 2), _prompt(5, 3)]
    clean = engine.generate(prompts, GREEDY)
    _raise_for(engine, "bad", monkeypatch)
    ids = [engine.add_request(p, GREEDY, rid) for p, rid in zip(prompts, ["a", "bad", "c"], strict=True)]
    done: dict[str, list[int]] = {i: [] for i in ids}
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] += out.token_ids
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].finish_reason == "error" and "injected fault" in finished["bad"].error
    assert done["a"] == clean[0].token_ids and done["c"] == clean[2].token_ids
    assert engine.blocks.num_active_pages == 0

    # Through the loop: the failed request's stream raises, the others complete.
    front = AsyncLLMEngine(engine)

    async def main() -> None:
        with pytest.raises(RequestFailed, match="injected fault"):
            await _tokens(front.generate(prompts[1], GREEDY, request_id="bad"))
        got = await asyncio.gather(*(_tokens(front.generate(p, GREEDY)) for p in prompts[::2]))
        assert got == [clean[0].token_ids, clean[2].token_ids]

    try:
        asyncio.run(main())
    finally:
        front.shutdown()


class _Flaky:
    """A target whose next iteration raises outside any engine (e.g. the executor's own code)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.fail = engine, False

    def step(self) -> list:
        if self.fail:
            self.fail = False
            raise RuntimeError("executor fault")
        return self.engine.step()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def abort(self, request_id: str) -> object:
        return self.engine.abort(request_id)


def test_a_failed_iteration_of_the_target_ends_its_streams_and_the_loop_goes_on(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    target = _Flaky(engine)
    loop = StepLoop(target)
    long = SamplingParams(max_tokens=1000, ignore_eos=True)

    async def main() -> None:
        stream = loop.stream("x", lambda: engine.add_request(_prompt(8), long, "x"))
        await anext(stream)
        target.fail = True
        with pytest.raises(RequestFailed, match="executor fault"):
            async for _ in stream:
                pass
        assert not await loop.call(engine.has_unfinished)  # aborted: its pages went back
        tokens = await _tokens(loop.stream("y", lambda: engine.add_request(_prompt(8), GREEDY, "y")))
        assert len(tokens) == 6
        await loop.ping(30)

    try:
        asyncio.run(main())
    finally:
        loop.shutdown()


def test_a_reader_that_stops_reading_gets_its_request_aborted(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    loop = StepLoop(engine, max_queued_outputs=8)

    async def main() -> None:
        stream = loop.stream("slow", lambda: engine.add_request(
            _prompt(8), SamplingParams(max_tokens=1000, ignore_eos=True), "slow"))
        await anext(stream)  # then stop reading

        async def aborted() -> bool:
            return not await loop.call(lambda: engine.has_request("slow"))

        await _until(aborted)
        got = 0
        with pytest.raises(RequestFailed, match="fell 8 outputs behind"):
            async for _ in stream:
                got += 1
        assert got <= 8
        assert await loop.call(lambda: engine.blocks.num_active_pages) == 0

    try:
        asyncio.run(main())
    finally:
        loop.shutdown()


def test_ping_and_heartbeats_go_through_the_engine_thread(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    front = AsyncLLMEngine(engine)
    worker = EngineWorker("w", front, max_concurrency=1, ping_timeout_s=0.5)
    release = threading.Event()

    async def main() -> None:
        await front.ping(30)
        assert (await worker.heartbeat()).policy_version == 0
        front.submit(lambda: release.wait(30))  # a stuck command (or iteration)
        with pytest.raises(LoopDeadError, match=r"no answer within 0\.5 s"):
            await front.ping(0.5)
        with pytest.raises(LoopDeadError):
            await worker.heartbeat()
        release.set()
        await front.ping(30)
        # The thread dies (a broken invariant outside any request): pings, heartbeats and
        # every waiting caller fail instead of hanging.
        stream = front.generate(_prompt(8), SamplingParams(max_tokens=1000, ignore_eos=True))
        await anext(stream)

        def broken() -> bool:
            raise SystemError("engine state corrupted")

        engine.has_unfinished = broken  # type: ignore[method-assign]
        with pytest.raises(LoopDeadError, match="corrupted"):
            async for _ in stream:
                pass
        with pytest.raises(LoopDeadError, match="corrupted"):
            await front.ping(30)
        with pytest.raises(LoopDeadError):
            await worker.heartbeat()
        with pytest.raises(LoopDeadError):
            await front.call(lambda: None)

    try:
        asyncio.run(main())
    finally:
        release.set()
        front.shutdown()


def test_a_paused_worker_generates_nothing_yet_answers_and_then_finishes_its_turns(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    expected = engine.generate([_prompt(8)], GREEDY)[0].token_ids
    engine.blocks.reset_prefix_cache()
    front = AsyncLLMEngine(engine)
    worker = EngineWorker("w", front, max_concurrency=1, ping_timeout_s=5)

    async def main() -> None:
        stream = front.generate(_prompt(8), GREEDY)
        first = await anext(stream)
        await worker.pause()
        made = await front.call(lambda: engine.scheduler.running[0].num_output_tokens)
        await asyncio.sleep(0.3)  # many iterations' time: none runs
        assert (await worker.heartbeat()).policy_version == 0  # commands still run
        assert await front.call(lambda: engine.scheduler.running[0].num_output_tokens) == made
        await worker.resume()
        assert first.token_ids + await _tokens(stream) == expected

    try:
        asyncio.run(main())
    finally:
        front.shutdown()


def test_a_gathering_reader_gets_fewer_larger_outputs_and_the_last_at_once(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = engine.generate([_prompt(8)], params)[0].token_ids
    front = AsyncLLMEngine(engine)

    async def outputs(gather_s: float) -> list:
        engine.blocks.reset_prefix_cache()
        return [out async for out in front.generate(_prompt(8), params, gather_s=gather_s)]

    async def main() -> None:
        each = await outputs(0.0)
        assert len(each) == 24 and [t for o in each for t in o.token_ids] == expected
        start = time.monotonic()
        gathered = await outputs(30.0)  # far longer than the request: it ends when the request does
        assert time.monotonic() - start < 20
        assert len(gathered) == 2 and [t for o in gathered for t in o.token_ids] == expected
        assert gathered[-1].finished and gathered[-1].num_output_tokens == 24

    try:
        asyncio.run(main())
    finally:
        front.shutdown()


def test_shutdown_ends_everything_even_while_an_iteration_is_stuck(ckpt: Path) -> None:
    engine = LLMEngine.from_pretrained(ckpt)
    loop = StepLoop(engine)
    stuck, release = threading.Event(), threading.Event()
    step = engine.step

    def stuck_step() -> list:
        if engine.has_request("stuck"):
            stuck.set()
            release.wait(60)
        return step()

    engine.step = stuck_step  # type: ignore[method-assign]

    async def main() -> None:
        stream = loop.stream("stuck", lambda: engine.add_request(_prompt(8), GREEDY, "stuck"))
        reader = asyncio.ensure_future(_tokens(stream))
        await asyncio.to_thread(stuck.wait, 30)
        pending = asyncio.ensure_future(loop.call(lambda: 1))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        loop.shutdown(timeout_s=0.5)
        assert time.monotonic() - start < 10
        with pytest.raises(LoopDeadError, match="shut down while an iteration was still running"):
            await asyncio.wait_for(pending, 10)
        with pytest.raises(LoopDeadError):
            await asyncio.wait_for(reader, 10)
        with pytest.raises(LoopDeadError):
            await loop.ping(1)

    try:
        asyncio.run(main())
    finally:
        release.set()
        loop.shutdown()
