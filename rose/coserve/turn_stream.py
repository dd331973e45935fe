"""The turn stream: one WebSocket per device carries every rollout turn the driver leases it
(`GET /v1/lease/stream`, upgraded; the lease key on the upgrade), both ways at once.

The driver sends turns (each the contract's `Turn` as it is, validated here alone: one bad turn
is refused, not the message) and aborts; the device sends frames: every turn's new tokens of
the last `FRAME_S` in one message, at once when a turn ends (the trajectory's next turn waits
for it), and its capacity every `HEARTBEAT_S`, read on the engine's thread, which is its
heartbeat: a frame proves the device alive, and no heartbeat queues behind token traffic. A
driver that leaves, or stops reading for `SEND_TIMEOUT_S`, has its turns aborted here: nothing
it leased runs on.

Why a WebSocket: the lease API's own server, port and key, through whatever proxy passes HTTP;
framed messages, many turns on one connection, each direction independent of the other. Per
message it costs what one HTTP request's body costs, and a message carries a device's whole
interval. (HTTP/2 streams in Python cost about what HTTP/1.1 requests do, per turn; a framed TCP
stream of our own would need a second port and its own keys.)

`EngineHost` runs leased turns on a dedicated worker's engine, so that dedicated workers speak the
same stream as serving executors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from rose.contracts import Capacity, GenerationEngine, RequestOutput, Turn, TurnHost
from rose.coserve.executor import TurnSlotsFull, check_version, newest_version
from rose.coserve.protocol import TURN, check_turn
from rose.steploop import Sink, StepLoop

log = logging.getLogger(__name__)
STREAM_PATH = "/v1/lease/stream"
FRAME_S = 0.05  # a device's tokens go out in one frame per this interval
HEARTBEAT_S = 0.5  # its capacity, read on the engine's thread, this often (4 a stall timeout)
SEND_TIMEOUT_S = 10.0  # a driver that takes no frame for this long is gone
MAX_MESSAGE_BYTES = 64 * 1024**2  # a message of turns (their prompts), or of one interval's tokens

# One turn's new tokens in a frame: (turn id, token ids, logprobs, versions, finish reason or
# None while it runs, top logprobs per token).
Chunk = tuple[str, list[int], list[float], list[int], str | None, list[list[tuple[int, float]]]]


class DeviceFrame(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """What a device sends: new tokens, turns it refused (turn id, HTTP-like status: 429 no room,
    400 the turn's own fault, 500 the device's, and why), and its capacity."""

    out: list[Chunk] = msgspec.field(default_factory=list)
    refused: list[tuple[str, int, str]] = msgspec.field(default_factory=list)
    capacity: Capacity | None = None


class DriverFrame(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """What the driver sends: turns to run (the contract's `Turn`, each validated on its own
    where it lands) and turn ids to abort."""

    turns: list[Any] = msgspec.field(default_factory=list)
    abort: list[str] = msgspec.field(default_factory=list)


# Frames are MessagePack (msgspec, as vLLM's engine core speaks to its clients): typed and
# validated as they are decoded, floats exact, a frame of a device's turns in a few
# microseconds of the driver's one core.
ENCODER = msgspec.msgpack.Encoder()
DEVICE_FRAME = msgspec.msgpack.Decoder(DeviceFrame)
DRIVER_FRAME = msgspec.msgpack.Decoder(DriverFrame)


def chunk(out: RequestOutput) -> Chunk:
    return (out.request_id, out.token_ids, out.logprobs, out.versions,
            out.finish_reason if out.finished else None, out.top_logprobs)


def refusal(exc: BaseException) -> tuple[int, str]:
    """The status a turn's refusal stands for: no room, the turn's own fault, or the device's."""
    if isinstance(exc, TurnSlotsFull):
        return 429, str(exc)
    if isinstance(exc, ValueError):
        return 400, str(exc)
    return 500, f"{type(exc).__name__}: {exc}"


class EngineHost:
    """A dedicated worker's engine as a `TurnHost`: the rollout model alone on its device, at
    most `max_turns` turns running (more are refused as busy)."""

    def __init__(self, engine: GenerationEngine, max_turns: int) -> None:
        self.engine, self.max_turns = engine, max_turns
        self._turns: set[str] = set()

    def _running(self) -> int:
        self._turns = {t for t in self._turns if self.engine.has_request(t)}
        return len(self._turns)

    def submit_turn(self, turn: Turn) -> str:
        if len(self._turns) >= self.max_turns and self._running() >= self.max_turns:
            raise TurnSlotsFull(f"turn {turn.turn_id!r}: all {self.max_turns} turn slots hold running turns")
        check_version(turn, self.engine.policy_version, self.engine.adapter_versions(), "worker")
        self.engine.add_request(turn.token_ids, turn.params, turn.turn_id, adapter=turn.adapter)
        self._turns.add(turn.turn_id)
        return turn.turn_id

    def abort_turn(self, turn_id: str) -> RequestOutput | None:
        if turn_id not in self._turns:
            return None
        self._turns.discard(turn_id)
        return self.engine.abort(turn_id)

    def capacity(self) -> Capacity:
        running = self._running()
        return Capacity(self.max_turns - running, float("inf"), "dedicated", newest_version(self.engine),
                        0, 0, running)


async def serve_turns(ws: WebSocket, loop: StepLoop[RequestOutput], host: TurnHost) -> None:
    """Serve one driver's turn stream until it leaves; then abort whatever of its turns still run."""
    await ws.accept()
    session = _Session(ws, loop, host)
    tasks = [asyncio.create_task(session.read()), asyncio.create_task(session.write()),
             asyncio.create_task(session.beat())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, Exception) and not isinstance(result, WebSocketDisconnect | TimeoutError):
                log.error("turn stream: %s", result, exc_info=result)
        await loop.detach(session.sink, host.abort_turn)
        with contextlib.suppress(Exception):  # already closed by the driver
            await ws.close()


class _Session:
    """One driver's connection: its reader takes turns and aborts, its writer sends frames."""

    def __init__(self, ws: WebSocket, loop: StepLoop[RequestOutput], host: TurnHost) -> None:
        self.ws, self.loop, self.host = ws, loop, host
        self.wake = asyncio.Event()  # something to send: outputs, refusals, a heartbeat due
        self.sink: Sink[RequestOutput] = Sink(self.wake)
        self.refused: list[tuple[str, int, str]] = []
        self.capacity: Capacity | None = None
        self.sent = 0.0  # when the last frame went

    async def read(self) -> None:
        while True:
            received = await self.ws.receive()
            if received["type"] == "websocket.disconnect":
                return
            try:
                message = DRIVER_FRAME.decode(received.get("bytes") or b"")
            except msgspec.MsgspecError as exc:  # not a frame at all: the driver's bug, said once
                await self.ws.close(1003, f"expected a MessagePack frame of turns and aborts: {exc}"[:120])
                return
            if message.turns:
                await self._submit(message.turns)
            if message.abort:
                await self.loop.abort_many(message.abort, self.host.abort_turn)

    async def _submit(self, raw: list[Any]) -> None:
        turns: list[Turn] = []
        for item in raw:
            try:
                turns.append(check_turn(TURN.validate_python(item)))
            except (ValidationError, ValueError) as exc:
                turn_id = str(item.get("turn_id", "")) if isinstance(item, dict) else ""
                self.refused.append((turn_id, 400, str(exc)))
        adds = [(turn.turn_id, lambda turn=turn: self.host.submit_turn(turn)) for turn in turns]
        for turn, exc in zip(turns, await self.loop.submit_to(self.sink, adds), strict=True):
            if exc is not None:
                self.refused.append((turn.turn_id, *refusal(exc)))
        if self.refused:
            self.wake.set()

    async def beat(self) -> None:
        """The device's capacity every HEARTBEAT_S, read between two iterations (a stuck engine
        sends none): it rides the next frame, or goes alone if no frame went for HEARTBEAT_S."""
        while True:
            self.capacity = await self.loop.call(self.host.capacity)
            if time.monotonic() - self.sent >= HEARTBEAT_S:
                self.wake.set()
            await asyncio.sleep(HEARTBEAT_S)

    async def write(self) -> None:
        sink = self.sink
        while True:
            await self.wake.wait()
            if sink and not (sink.urgent.is_set() or self.refused):
                # Tokens alone: gather the rest of the interval, unless a turn ends meanwhile.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(sink.urgent.wait(), self.sent + FRAME_S - time.monotonic())
            self.wake.clear()
            outputs, errors = sink.take()
            refused = self.refused + [(rid, *refusal(exc)) for rid, exc in errors.items()]
            frame = DeviceFrame([chunk(out) for out in outputs.values()], refused, self.capacity)
            self.refused, self.capacity = [], None
            if frame.out or frame.refused or frame.capacity:
                try:
                    await asyncio.wait_for(self.ws.send_bytes(ENCODER.encode(frame)), SEND_TIMEOUT_S)
                except (WebSocketDisconnect, RuntimeError):  # the driver left (the server says so by either)
                    return
                self.sent = time.monotonic()
