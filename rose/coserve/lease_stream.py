"""The driver's end of a device's turn stream (`rose.coserve.turn_stream`): a `Worker` whose
turns, aborts and heartbeats travel on one WebSocket, many turns at once.

Turns submitted in one pass of the event loop go out in one message; each frame that comes
back extends every turn it carries and ends those that finished. The device's capacity frames
are its heartbeats (`take_heartbeat`: the registry reads them, nothing is asked). A connection
that breaks ends every turn on it as the worker's failure, each keeping the tokens it had (the
rollout manager resumes them elsewhere: the device aborted them as the connection closed); the
stream connects again by itself, and the registry takes the device back at its next heartbeat.
The HTTP calls of the lease API that are not turns (new RL steps, weights) are `LeaseClient`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from rose.contracts import Heartbeat, Turn, TurnOutput, WorkerKind
from rose.coserve.lease_client import LeaseClient, LeaseError, error_for
from rose.coserve.protocol import TURN
from rose.coserve.turn_stream import DEVICE_FRAME, MAX_MESSAGE_BYTES, STREAM_PATH, DeviceFrame

CONNECT_TIMEOUT_S = 5.0  # a turn waits this long for the stream to (re)connect, then fails
RECONNECT_S = (0.05, 2.0)  # wait between attempts to connect: from the first, doubling to the second


class LeaseStream(LeaseClient):
    """A device's turns over its turn stream: a serving executor's lease API, or a dedicated
    worker's (`kind`)."""

    def __init__(self, url: str, client: httpx.AsyncClient | None = None, key: str | None = None, *,
                 worker_id: str | None = None, max_concurrency: int = 1,
                 kind: WorkerKind = WorkerKind.SERVING) -> None:
        super().__init__(url, client, key, worker_id=worker_id, max_concurrency=max_concurrency)
        self.kind = kind
        self._headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        self._pending: dict[str, tuple[TurnOutput, asyncio.Future[TurnOutput]]] = {}
        self._turns: list[bytes] = []  # encoded, to send
        self._aborts: list[str] = []
        self._wake = asyncio.Event()  # something to send
        self._up = asyncio.Event()  # connected
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
        """Connect, read frames until the connection ends, connect again, until closed."""
        ws_url = "ws" + self.url.removeprefix("http") + STREAM_PATH
        wait = RECONNECT_S[0]
        while True:
            try:
                async with connect(ws_url, additional_headers=self._headers, max_size=MAX_MESSAGE_BYTES,
                                   compression=None, open_timeout=CONNECT_TIMEOUT_S) as ws:
                    self._up.set()
                    wait = RECONNECT_S[0]
                    writer = asyncio.create_task(self._write(ws))
                    try:
                        async for message in ws:
                            self._frame(message)
                    finally:
                        writer.cancel()
                    self.error = f"the device closed the stream ({ws.close_code}: {ws.close_reason})"
            except (OSError, TimeoutError, WebSocketException, LeaseError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
            finally:
                self._up.clear()
                self._fail_all(LeaseError(f"{self.worker_id}: the turn stream broke off: {self.error}"))
            await asyncio.sleep(wait)
            wait = min(2 * wait, RECONNECT_S[1])

    async def _write(self, ws: ClientConnection) -> None:
        self._wake.set()  # turns queued while it was down
        while True:
            await self._wake.wait()
            self._wake.clear()
            turns, aborts = self._turns, self._aborts
            if not turns and not aborts:
                continue
            self._turns, self._aborts = [], []
            aborted = json.dumps(aborts).encode()
            await ws.send(b'{"turns":[' + b",".join(turns) + b'],"abort":' + aborted + b"}")

    def _frame(self, message: str | bytes) -> None:
        try:
            frame: DeviceFrame = DEVICE_FRAME.validate_json(message)
        except ValidationError as exc:  # the device's fault: the connection ends, its turns resume elsewhere
            raise LeaseError(f"{self.worker_id}: malformed frame: {exc}") from None
        self.frames += 1
        for turn_id, ids, logprobs, versions, finish, top in frame.get("out", ()):
            held = self._pending.get(turn_id)
            if held is None:  # cancelled here: its abort is on its way
                continue
            if not len(ids) == len(logprobs) == len(versions):
                raise LeaseError(f"{self.worker_id}: turn {turn_id!r}: expected one logprob and one version "
                                 f"per token, got {len(ids)}, {len(logprobs)}, {len(versions)}")
            output, done = held
            output.extend(TurnOutput(ids, logprobs, versions, finish, top))
            if finish is not None:
                del self._pending[turn_id]
                done.set_result(output)
        for turn_id, status, why in frame.get("refused", ()):
            held = self._pending.pop(turn_id, None)
            if held is not None:
                held[1].set_exception(error_for(f"turn {turn_id!r} on {self.worker_id}: {status}: {why}",
                                                status))
        if (capacity := frame.get("capacity")) is not None:
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
        self._turns.append(TURN.dump_json(turn))
        self._wake.set()
        try:
            return await done
        except asyncio.CancelledError:
            if self._pending.pop(turn.turn_id, None) is not None:
                self._aborts.append(turn.turn_id)
                self._wake.set()
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
            self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_all(LeaseError(f"{self.worker_id}: closed"))
        await super().close()

