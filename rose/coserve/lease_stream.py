"""The driver's end of a device's turn stream (`rose.coserve.turn_stream`): a `Worker` whose
turns, aborts and heartbeats travel on one WebSocket, many turns at once.

Turns submitted in one pass of the event loop go out in one message; each frame that comes
back extends every turn it carries and ends those that finished, right in the socket's read
callback: websockets' sans-I/O protocol on asyncio's callbacks, so that a frame wakes no task
of its own (the asyncio client's per-message machinery cost the driver more than the frame's
tokens). The device's capacity frames are its heartbeats (`take_heartbeat`: the registry reads
them, nothing is asked). A connection that breaks ends every turn on it as the worker's failure,
each keeping the tokens it had (the rollout manager resumes them elsewhere: the device aborted
them as the connection closed); the stream connects again by itself, and the registry takes the
device back at its next heartbeat. The HTTP calls of the lease API that are not turns (new RL
steps, weights) are `LeaseClient`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from typing import cast

import httpx
import msgspec
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.http11 import Response
from websockets.uri import WebSocketURI, parse_uri

from rose.contracts import Heartbeat, Turn, TurnOutput, WorkerKind
from rose.coserve.lease_client import LeaseClient, LeaseError, error_for
from rose.coserve.turn_stream import DEVICE_FRAME, ENCODER, MAX_MESSAGE_BYTES, STREAM_PATH, DriverFrame

CONNECT_TIMEOUT_S = 5.0  # a turn waits this long for the stream to (re)connect, then fails
RECONNECT_S = (0.05, 2.0)  # wait between attempts to connect: from the first, doubling to the second
_DATA = (Opcode.BINARY, Opcode.TEXT, Opcode.CONT)


class _Wire(asyncio.Protocol):
    """One connection of the stream: websockets' sans-I/O client on asyncio's transport. Each
    message goes to `on_message` as it is read; one that raises ends the connection."""

    def __init__(self, uri: WebSocketURI, headers: dict[str, str],
                 on_message: Callable[[bytes], None]) -> None:
        self.protocol = ClientProtocol(uri, max_size=MAX_MESSAGE_BYTES)
        self.headers, self.on_message = headers, on_message
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future[None] = loop.create_future()  # the upgrade answered
        self.closed: asyncio.Future[str] = loop.create_future()  # why the connection ended
        self.transport: asyncio.Transport | None = None
        self._parts: list[bytes] = []  # a fragmented message's

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's (a Ray async actor's loop) is no asyncio.Transport subclass, but is one.
        self.transport = cast(asyncio.Transport, transport)
        request = self.protocol.connect()
        for name, value in self.headers.items():
            request.headers[name] = value
        self.protocol.send_request(request)
        self._flush()

    def data_received(self, data: bytes) -> None:
        self.protocol.receive_data(data)
        try:
            for event in self.protocol.events_received():
                if isinstance(event, Response):
                    if self.protocol.handshake_exc is not None:
                        self.end(f"the upgrade was refused: {self.protocol.handshake_exc}")
                    elif not self.opened.done():
                        self.opened.set_result(None)
                elif event.opcode in _DATA:
                    self._parts.append(event.data)
                    if event.fin:
                        message = b"".join(self._parts)
                        self._parts.clear()
                        self.on_message(message)
        except LeaseError as exc:
            self.end(str(exc))
        self._flush()
        if self.protocol.close_expected():
            p = self.protocol
            self.end(f"the device closed the stream ({p.close_code}: {p.close_reason})")

    def eof_received(self) -> bool:
        self.protocol.receive_eof()
        self._flush()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.end(f"the connection was lost: {exc}" if exc else "the device closed the connection")

    def send(self, message: bytes) -> None:
        assert self.transport is not None
        self.protocol.send_binary(message)
        self._flush()
        if self.transport.get_write_buffer_size() > MAX_MESSAGE_BYTES:
            self.end("the device reads nothing: its send buffer is full")

    def _flush(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        for data in self.protocol.data_to_send():
            if data:
                self.transport.write(data)
            elif self.transport.can_write_eof():
                self.transport.write_eof()

    def end(self, why: str) -> None:
        if not self.closed.done():
            self.closed.set_result(why)
        if self.transport is not None:
            self.transport.close()


class LeaseStream(LeaseClient):
    """A device's turns over its turn stream: a serving executor's lease API, or a dedicated
    worker's (`kind`)."""

    def __init__(self, url: str, client: httpx.AsyncClient | None = None, key: str | None = None, *,
                 worker_id: str | None = None, max_concurrency: int = 1,
                 kind: WorkerKind = WorkerKind.SERVING) -> None:
        super().__init__(url, client, key, worker_id=worker_id, max_concurrency=max_concurrency)
        self.kind = kind
        self._headers = {"Authorization": f"Bearer {key}"} if key is not None else {}  # the upgrade's
        self._pending: dict[str, tuple[TurnOutput, asyncio.Future[TurnOutput]]] = {}
        self._turns: list[Turn] = []  # to send
        self._aborts: list[str] = []
        self._sending = False  # a send is scheduled
        self._wire: _Wire | None = None  # while connected
        self._up = asyncio.Event()
        self._beat: Heartbeat | None = None  # the latest capacity report
        self._fresh = False  # ... not yet taken
        self._new_beat = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.error = "not connected yet"  # why the last connection ended
        self.frames = 0  # received, for the curious (a benchmark)

    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._connection())

    async def _connection(self) -> None:
        """Connect, serve the connection until it ends, connect again, until closed."""
        uri = parse_uri("ws" + self.url.removeprefix("http") + STREAM_PATH)
        loop = asyncio.get_running_loop()
        wait = RECONNECT_S[0]
        while True:
            wire = _Wire(uri, self._headers, self._frame)
            try:
                await asyncio.wait_for(loop.create_connection(
                    lambda wire=wire: wire, uri.host, uri.port, ssl=ssl.create_default_context() if uri.secure
                    else None), CONNECT_TIMEOUT_S)
                await asyncio.wait([wire.opened, wire.closed], timeout=CONNECT_TIMEOUT_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                if not wire.opened.done() or wire.closed.done():
                    wire.end("no answer to the upgrade" if not wire.closed.done() else wire.closed.result())
                else:
                    self._wire, wait = wire, RECONNECT_S[0]
                    self._up.set()
                    self._send()  # what was queued while it was down
                self.error = await wire.closed
            except (OSError, TimeoutError) as exc:
                wire.end(f"{type(exc).__name__}: {exc}")
                self.error = await wire.closed
            finally:
                self._wire = None
                self._up.clear()
                self._fresh = False  # a report from a connection that ended says nothing of the device now
                wire.end("closed")
                self._fail_all(LeaseError(f"{self.worker_id}: the turn stream broke off: {self.error}"))
            await asyncio.sleep(wait)
            wait = min(2 * wait, RECONNECT_S[1])

    def _queue(self) -> None:
        """Send what is queued once this pass of the event loop is over (with whatever else it queues)."""
        if not self._sending:
            self._sending = True
            asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        self._sending = False
        if self._wire is None or not (self._turns or self._aborts):
            return
        turns, aborts, self._turns, self._aborts = self._turns, self._aborts, [], []
        self._wire.send(ENCODER.encode(DriverFrame(turns, aborts)))

    def _frame(self, message: bytes) -> None:
        try:
            frame = DEVICE_FRAME.decode(message)
        except msgspec.MsgspecError as exc:  # the device's fault: the stream ends, its turns resume elsewhere
            raise LeaseError(f"{self.worker_id}: malformed frame: {exc}") from None
        self.frames += 1
        pending = self._pending
        for turn_id, ids, logprobs, versions, finish, top in frame.out:
            held = pending.get(turn_id)
            if held is None:  # cancelled here: its abort is on its way
                continue
            if not len(ids) == len(logprobs) == len(versions):
                raise LeaseError(f"{self.worker_id}: turn {turn_id!r}: expected one logprob and one version "
                                 f"per token, got {len(ids)}, {len(logprobs)}, {len(versions)}")
            output, done = held
            output.add(ids, logprobs, versions, finish, top)
            if finish is not None:
                del pending[turn_id]
                done.set_result(output)
        for turn_id, status, why in frame.refused:
            held = pending.pop(turn_id, None)
            if held is not None:
                held[1].set_exception(error_for(f"turn {turn_id!r} on {self.worker_id}: {status}: {why}",
                                                status))
        if (capacity := frame.capacity) is not None:
            self._beat, self._fresh = Heartbeat(capacity.policy_version, capacity.free_slots), True
            self._new_beat.set()

    def _fail_all(self, exc: LeaseError) -> None:
        pending, self._pending, self._turns = self._pending, {}, []
        for _, done in pending.values():
            if not done.done():
                done.set_exception(exc)

    async def run_turn(self, turn: Turn, output: TurnOutput | None = None) -> TurnOutput:
        """Run the turn on the device; its tokens land in `output` frame by frame. Cancelled, the
        turn is aborted there."""
        output = output if output is not None else TurnOutput()
        self._start()
        if not self._up.is_set():
            try:
                await asyncio.wait_for(self._up.wait(), CONNECT_TIMEOUT_S)
            except TimeoutError:
                raise LeaseError(f"turn {turn.turn_id!r}: {self.worker_id} is not connected: "
                                 f"{self.error}") from None
        done: asyncio.Future[TurnOutput] = asyncio.get_running_loop().create_future()
        self._pending[turn.turn_id] = (output, done)
        self._turns.append(turn)
        self._queue()
        try:
            return await done
        except asyncio.CancelledError:
            if self._pending.pop(turn.turn_id, None) is not None:
                self._aborts.append(turn.turn_id)
                self._queue()
            raise

    def take_heartbeat(self) -> Heartbeat | None:
        self._start()
        fresh, self._fresh = self._fresh, False
        return self._beat if fresh else None

    async def heartbeat(self) -> Heartbeat:
        """The device's next capacity report."""
        self._start()
        self._new_beat.clear()
        await self._new_beat.wait()
        assert self._beat is not None
        return self._beat

    async def abort(self, turn_id: str) -> None:
        """Hand the turn back now: it ends with what it produced (`run_turn` returns)."""
        if turn_id in self._pending:
            self._aborts.append(turn_id)
            self._queue()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_all(LeaseError(f"{self.worker_id}: closed"))
        await super().close()

