"""The turn stream end to end: `LeaseStream` (the driver's side) against real lease servers
(`build_lease_app` over a `PacedEngine`, and `build_app` over a tiny co-serving executor) on
loopback: many turns multiplexed on one WebSocket, keys, refusals, aborts, a connection that
drops mid-turn, the rollout manager resuming a dropped device's turns elsewhere, liveness under a
stalled driver, and a device that sends malformed frames."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.websockets import WebSocketDisconnect
from servers import running

from rose.bench.fake_devices import PacedEngine
from rose.contracts import RequestOutput, SamplingParams, Turn, TurnOutput, WorkerKind
from rose.coserve import lease_stream
from rose.coserve.executor import CoServingExecutor
from rose.coserve.lease_client import ExecutorBusy, LeaseClient, LeaseError, TurnRejected
from rose.coserve.lease_stream import LeaseStream
from rose.coserve.server import build_app, build_lease_app
from rose.coserve.settings import ExecutorConfig, ServerLimits
from rose.coserve.turn_stream import (
    DEVICE_FRAME,
    DRIVER_FRAME,
    ENCODER,
    STREAM_PATH,
    DeviceFrame,
    EngineHost,
)
from rose.model import load_tokenizer
from rose.rl import Trajectory
from rose.rl.trajectory import TurnRecord
from rose.rollout.agent import TurnHandle
from rose.rollout.manager import Placement, RolloutManager
from rose.rollout.registry import WorkerRegistry
from rose.steploop import StepLoop

pytestmark = pytest.mark.timeout(120)  # a transport that hangs fails its test, not the run

KEY = "lease-secret"
TOKEN = PacedEngine.TOKEN


class RecordingEngine(PacedEngine):
    """A `PacedEngine` that remembers how many tokens each aborted request had made."""

    def __init__(self, iteration_s: float) -> None:
        super().__init__(iteration_s)
        self.aborted: dict[str, int] = {}

    def abort(self, request_id: str) -> RequestOutput | None:
        if (state := self._requests.get(request_id)) is not None:
            self.aborted[request_id] = state[1]
        return super().abort(request_id)


@contextlib.contextmanager
def device(engine: PacedEngine, max_turns: int = 64) -> Iterator[str]:
    """A dedicated worker's lease server (the turn stream behind `KEY`) over `engine`; its URL."""
    app = build_lease_app(StepLoop(engine, name="paced"), EngineHost(engine, max_turns),
                          ServerLimits(lease_key=KEY))
    with running(app) as url:
        yield url


def turn(turn_id: str, max_tokens: int, prompt: list[int] | None = None, **params: object) -> Turn:
    return Turn(turn_id, "traj", prompt or [1, 2, 3], SamplingParams(max_tokens=max_tokens, **params))


async def until(condition: Callable[[], object], timeout_s: float = 10.0) -> None:
    """Wait (without blocking the event loop) until `condition()` holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still not true after {timeout_s} s"
        await asyncio.sleep(0.01)


def whole(out: TurnOutput, n: int) -> bool:
    """`out` is a finished turn of exactly `n` tokens, one logprob and one version each."""
    return (out.token_ids == [TOKEN] * n and len(out.logprobs) == n and out.versions == [0] * n
            and out.finish_reason == "length")


def test_many_turns_share_one_stream() -> None:
    """Turns of different lengths multiplexed on one WebSocket each get exactly their tokens, and
    the device batches: one frame carries every running turn's tokens (far fewer frames than
    tokens); its capacity frames are the heartbeats."""
    engine = PacedEngine(0.005)

    async def body(url: str) -> None:
        client = LeaseStream(url, key=KEY, worker_id="dev", kind=WorkerKind.DEDICATED)
        frames: list[DeviceFrame] = []
        read = client._frame

        def spy(message: bytes) -> None:  # what the socket's callback hands the client
            frames.append(DEVICE_FRAME.decode(message))
            read(message)

        client._frame = spy  # type: ignore[method-assign]
        try:
            lengths = [20 + i for i in range(24)]
            outs = await asyncio.gather(*(client.run_turn(turn(f"m{i}", n)) for i, n in enumerate(lengths)))
            for out, n in zip(outs, lengths, strict=True):
                assert whole(out, n), out
            tokens = sum(lengths)
            assert client.frames == len(frames) and 0 < len(frames) < tokens // 10, (len(frames), tokens)
            # The turns went out in one message, so they step together: a frame has all 24, and
            # gathers several iterations' tokens of each.
            assert max(len(f.out) for f in frames) == 24
            assert max(len(chunk[1]) for f in frames for chunk in f.out) > 1
            beat = await client.heartbeat()
            assert beat.free_slots == 64 and beat.policy_version == 0
        finally:
            await client.close()
        assert not engine.has_unfinished()

    with device(engine) as url:
        asyncio.run(body(url))


def test_stream_matches_the_sse_endpoint_on_the_real_executor(tiny_qwen2: Path, tiny_qwen3: Path) -> None:
    """On a tiny co-serving executor (`build_app`), greedy turns over the stream give exactly the
    tokens, logprobs (bit for bit), versions and top logprobs of the same turns over
    `POST /v1/lease/turns`. Turns run one at a time on both, so that batches are alike."""
    executor = CoServingExecutor.from_pretrained(tiny_qwen2, tiny_qwen3, ExecutorConfig(pool_mb=8))
    app = build_app(StepLoop(executor), executor, load_tokenizer(tiny_qwen2), "tiny-serving",
                    ServerLimits(lease_key=KEY))
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9], [11]]

    def turns(prefix: str) -> list[Turn]:
        return [turn(f"{prefix}{i}", 8, p, temperature=0.0, ignore_eos=True, top_logprobs=3)
                for i, p in enumerate(prompts)]

    async def body(url: str) -> tuple[list[TurnOutput], list[TurnOutput]]:
        stream, sse = LeaseStream(url, key=KEY), LeaseClient(url, key=KEY)
        try:
            return ([await stream.run_turn(t) for t in turns("ws")],
                    [await sse.run_turn(t) for t in turns("sse")])
        finally:
            await stream.close()
            await sse.close()

    with running(app) as url:
        streamed, served = asyncio.run(body(url))
    for a, b in zip(streamed, served, strict=True):
        assert len(a.token_ids) == 8 and a.finish_reason == b.finish_reason == "length"
        assert a.token_ids == b.token_ids and a.versions == b.versions
        assert a.logprobs == b.logprobs  # floats compared exactly
        assert [[tuple(p) for p in top] for top in a.top_logprobs] == \
            [[tuple(p) for p in top] for top in b.top_logprobs] and len(a.top_logprobs) == 8
    assert streamed[0].token_ids != streamed[1].token_ids or streamed[0].logprobs != streamed[1].logprobs


def test_the_lease_key_guards_the_upgrade(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong or missing lease key is refused at the upgrade: the turn fails with a LeaseError
    (the worker's failure, not the turn's) naming the refusal; the right key works."""
    monkeypatch.setattr(lease_stream, "CONNECT_TIMEOUT_S", 1.5)  # how long a turn waits to connect

    async def refused(url: str, key: str | None) -> LeaseError:
        client = LeaseStream(url, key=key, worker_id="dev")
        try:
            with pytest.raises(LeaseError) as caught:
                await client.run_turn(turn(f"k-{key}", 3))
            return caught.value
        finally:
            await client.close()

    async def body(url: str) -> None:
        for exc in await asyncio.gather(refused(url, "wrong"), refused(url, None)):
            assert not isinstance(exc, TurnRejected | ExecutorBusy)
            assert "not connected" in str(exc) and "the upgrade was refused" in str(exc) and "403" in str(exc)
        client = LeaseStream(url, key=KEY)
        try:
            assert whole(await client.run_turn(turn("keyed", 3)), 3)
        finally:
            await client.close()

    with device(PacedEngine(0.005)) as url:
        asyncio.run(body(url))


def test_refused_turns_fail_alone() -> None:
    """A turn out of bounds is refused alone (TurnRejected, 400, naming its field) while the turns
    beside it on the same stream finish; a device whose turn slots are full answers ExecutorBusy (429)."""
    engine = PacedEngine(0.005)

    async def body(url: str) -> None:
        client = LeaseStream(url, key=KEY, worker_id="dev")
        try:
            got = await asyncio.wait_for(asyncio.gather(
                client.run_turn(turn("ok0", 10)), client.run_turn(turn("neg", 5, [-1])),
                client.run_turn(turn("top", 5, top_logprobs=21)), client.run_turn(turn("ok1", 12)),
                return_exceptions=True), 20)
            assert whole(got[0], 10) and whole(got[3], 12)  # type: ignore[arg-type]
            for exc, field in ((got[1], "token_ids"), (got[2], "top_logprobs")):
                assert isinstance(exc, TurnRejected) and exc.status == 400 and field in str(exc), exc
            # Two slots, both held by long turns: a third is turned away, then fits once one ends.
            long = [asyncio.create_task(client.run_turn(turn(f"long{i}", 100_000))) for i in range(2)]
            await until(lambda: engine.has_request("long0") and engine.has_request("long1"))
            with pytest.raises(ExecutorBusy) as busy:
                await asyncio.wait_for(client.run_turn(turn("third", 3)), 20)
            assert busy.value.status == 429 and "turn slots" in str(busy.value)
            long[0].cancel()
            await until(lambda: not engine.has_request("long0"))
            assert whole(await client.run_turn(turn("fits", 3)), 3)
            long[1].cancel()
            await asyncio.gather(*long, return_exceptions=True)
        finally:
            await client.close()

    with device(engine, max_turns=2) as url:
        asyncio.run(body(url))


def test_abort_and_cancel_stop_the_turn_on_the_device() -> None:
    """`abort` ends a running turn with finish reason 'abort' and every token it made; cancelling
    `run_turn` aborts the turn on the device too. The stream goes on serving turns."""
    engine = RecordingEngine(0.005)

    async def body(url: str) -> None:
        client = LeaseStream(url, key=KEY, worker_id="dev")
        try:
            out = TurnOutput()
            task = asyncio.create_task(client.run_turn(turn("a", 100_000), out))
            await until(lambda: len(out.token_ids) >= 3)
            await client.abort("a")
            done = await asyncio.wait_for(task, 10)
            assert done is out and done.finish_reason == "abort"
            assert len(done.token_ids) == len(done.logprobs) == len(done.versions) == engine.aborted["a"] >= 3
            assert not engine.has_request("a")

            kept = TurnOutput()
            task = asyncio.create_task(client.run_turn(turn("c", 100_000), kept))
            await until(lambda: kept.token_ids)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: not engine.has_request("c"), timeout_s=5)
            assert "c" in engine.aborted and kept.finish_reason is None
            assert whole(await client.run_turn(turn("after", 4)), 4)
        finally:
            await client.close()

    with device(engine) as url:
        asyncio.run(body(url))


def test_a_dropped_connection_fails_its_turns_and_reconnects() -> None:
    """When the connection breaks mid-turn, every pending turn fails with LeaseError keeping the
    tokens it received, no capacity report from before the break is handed out as a heartbeat,
    the device aborts all of that session's turns, and the stream connects again by itself: new
    turns work and heartbeats resume."""
    engine = RecordingEngine(0.005)

    async def body(url: str) -> None:
        client = LeaseStream(url, key=KEY, worker_id="dev")
        try:
            outs = [TurnOutput() for _ in range(4)]
            tasks = [asyncio.create_task(client.run_turn(turn(f"d{i}", 100_000), out))
                     for i, out in enumerate(outs)]
            await until(lambda: all(len(out.token_ids) >= 3 for out in outs))
            await client.heartbeat()  # a capacity report came, not yet taken by any registry
            wire = client._wire
            assert wire is not None and wire.transport is not None
            wire.transport.abort()  # the TCP connection cut, as by a network failure
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            for result, out in zip(results, outs, strict=True):
                assert type(result) is LeaseError and "broke off" in str(result), result
                assert out.token_ids and out.finish_reason is None
                assert len(out.token_ids) == len(out.logprobs) == len(out.versions)
            # The report from before the break does not revive the device in a registry.
            assert client.take_heartbeat() is None
            await until(lambda: not engine.has_unfinished(), timeout_s=5)
            assert set(engine.aborted) == {f"d{i}" for i in range(4)}
            assert all(engine.aborted[f"d{i}"] >= len(out.token_ids) for i, out in enumerate(outs))
            assert whole(await client.run_turn(turn("again", 5)), 5)
            await asyncio.wait_for(client.heartbeat(), 5)  # the new connection's reports come
            assert client.take_heartbeat() is not None
        finally:
            await client.close()

    with device(engine) as url:
        asyncio.run(body(url))


async def turns_agent(handle: TurnHandle, turns: int) -> Trajectory:
    """An agent that generates `turns` turns, each continuing the last (a fixed observation between)."""
    trajectory, prompt = Trajectory(group_id=0), [1, 2, 3]
    for _ in range(turns):
        out = await handle.generate(prompt)
        trajectory.turns.append(TurnRecord(prompt, out.token_ids, out.logprobs, out.versions))
        prompt = prompt + out.token_ids + [7]
    return trajectory


def test_the_manager_resumes_a_dropped_devices_turns_elsewhere() -> None:
    """Two devices behind `LeaseStream`s in one registry; one server is stopped mid-turn: no
    trajectory is lost, each turn has exactly its budget of tokens across its attempts (those
    received before the drop kept, the rest made on the other device, in order), and the
    placements show the 'lost' attempts on the dropped device and their resumptions."""
    budget, engines = 60, {"a": PacedEngine(0.01), "b": PacedEngine(0.01)}

    async def body(urls: dict[str, str], stop_a: Callable[[], None]) -> None:
        registry = WorkerRegistry(stall_timeout_s=2.0)
        streams = {w: LeaseStream(url, key=KEY, worker_id=w, max_concurrency=16, kind=WorkerKind.DEDICATED)
                   for w, url in urls.items()}
        for stream in streams.values():
            registry.add(stream)
        manager = RolloutManager(registry, SamplingParams(max_tokens=budget), tick_s=0.05, rebalance=False)

        async def kill() -> None:
            await until(lambda: engines["a"].has_unfinished())
            await asyncio.sleep(0.25)  # a's turns are well under way
            await asyncio.to_thread(stop_a)

        try:
            report, _ = await asyncio.gather(manager.run([2] * 8, 0, timeout_s=30, agent=turns_agent), kill())
        finally:
            for stream in streams.values():
                await stream.close()
        assert not report.lost and not report.failed and len(report.trajectories) == 8
        for trajectory in report.trajectories:
            assert len(trajectory.turns) == 2
            for record in trajectory.turns:
                assert record.output_ids == [TOKEN] * budget and record.versions == [0] * budget
                # logprob = -(when the token was made): the resumed tokens come after the kept ones.
                assert all(x >= y for x, y in itertools.pairwise(record.logprobs))
        by_turn: dict[tuple[str, int], list[Placement]] = {}
        for p in report.placements:
            by_turn.setdefault((p.trajectory_id, p.turn), []).append(p)
        assert len(by_turn) == 16
        assert all(sum(p.tokens for p in attempts) == budget for attempts in by_turn.values())
        lost = [p for p in report.placements if p.outcome == "lost"]
        assert lost and all(p.worker_id == "a" for p in lost) and any(p.tokens > 0 for p in lost)
        for p in lost:
            after = [q for q in by_turn[(p.trajectory_id, p.turn)] if q.attempt > p.attempt]
            assert after and after[-1].outcome == "done" and after[-1].worker_id == "b"
        assert registry.alive() == ["b"]

    with contextlib.ExitStack() as a_server, device(engines["b"]) as url_b:
        url_a = a_server.enter_context(device(engines["a"]))
        asyncio.run(body({"a": url_a, "b": url_b}, a_server.close))


def test_liveness_does_not_queue_behind_tokens() -> None:
    """The driver's event loop blocked for 2.5 s (past the 2 s stall timeout) while a device
    streams tokens: the device's capacity, riding its frames, is heard as soon as the loop runs
    again, the manager's reaper (its grace the loop's lateness) keeps the device, and every turn
    finishes there with no resumed attempt."""
    engine, budget = PacedEngine(0.01), 330

    async def body(url: str) -> None:
        registry = WorkerRegistry(stall_timeout_s=2.0)
        stream = LeaseStream(url, key=KEY, worker_id="dev", max_concurrency=16, kind=WorkerKind.DEDICATED)
        registry.add(stream)
        manager = RolloutManager(registry, SamplingParams(max_tokens=budget), tick_s=0.05, rebalance=False)

        async def stall() -> None:
            await until(engine.has_unfinished)
            await asyncio.sleep(0.2)
            time.sleep(2.5)  # the point: the whole driver stops reading
            last = registry.table.workers["dev"].last_heartbeat_s
            assert registry.clock() - last > registry.stall_timeout_s  # as heard so far: silent too long
            await asyncio.sleep(0.05)  # what came meanwhile is read
            assert registry.table.in_flight["dev"], "the turns must outlast the stall"
            await registry.poll()
            assert registry.clock() - registry.table.workers["dev"].last_heartbeat_s < 0.5

        try:
            report, _ = await asyncio.gather(manager.run([1] * 8, 0, timeout_s=30, agent=turns_agent),
                                             stall())
        finally:
            await stream.close()
        assert not report.lost and not report.failed and len(report.trajectories) == 8
        assert all(t.turns[0].output_ids == [TOKEN] * budget for t in report.trajectories)
        assert report.resumed_turns == 0 and {p.outcome for p in report.placements} == {"done"}
        assert registry.alive() == ["dev"]

    with device(engine) as url:
        asyncio.run(body(url))


def misbehaving_device() -> FastAPI:
    """A turn stream that answers turn 'short' with more tokens than logprobs, turn 'junk' with a
    frame that is not MessagePack, and any other turn with one token, finished."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.websocket(STREAM_PATH)
    async def stream(ws: WebSocket) -> None:
        await ws.accept()
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                for item in DRIVER_FRAME.decode(await ws.receive_bytes()).turns:
                    tid = item["turn_id"]
                    if tid == "junk":
                        await ws.send_bytes(b"\xc1")  # a byte MessagePack never uses
                        continue
                    short = (tid, [TOKEN] * 2, [-1.0], [0, 0], None, [])
                    fine = (tid, [TOKEN], [-1.0], [0], "length", [])
                    await ws.send_bytes(ENCODER.encode(DeviceFrame([short if tid == "short" else fine])))

    return app


def test_a_malformed_frame_ends_the_connection_not_the_driver() -> None:
    """A device frame with a token list longer than its logprobs, or one that is not a frame at
    all, ends that connection: its turns fail with a LeaseError naming what was wrong; the driver
    goes on, connects again and runs the next turn."""

    async def body(url: str) -> None:
        client = LeaseStream(url, worker_id="odd")
        try:
            with pytest.raises(LeaseError, match=r"'short': expected one logprob and one version per token"):
                await asyncio.wait_for(client.run_turn(turn("short", 5)), 20)
            with pytest.raises(LeaseError, match=r"odd: malformed frame"):
                await asyncio.wait_for(client.run_turn(turn("junk", 5)), 20)
            done = await asyncio.wait_for(client.run_turn(turn("fine", 5)), 20)
            assert done.token_ids == [TOKEN] and done.finish_reason == "length"
        finally:
            await client.close()

    with running(misbehaving_device()) as url:
        asyncio.run(body(url))
