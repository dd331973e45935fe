"""What the OpenAI and lease routers share: the server's state (on `app.state`, handed to the
routes as the `Served` dependency, or the lease API's part of it as `Leased`), each model's
queue of requests waiting for their first token, the serving requests still on their way to the
engine, the shutdown drain, and SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from rose.contracts import TurnHost
from rose.coserve.api_errors import APIError, ClientGone, busy
from rose.coserve.executor import ROLLOUT, SERVING, CoServingExecutor
from rose.coserve.settings import ChatOptions, ServerLimits
from rose.engine import RequestOutput
from rose.model import Tokenizer
from rose.steploop import LoopDeadError, StepLoop

T = TypeVar("T")


class Arrivals:
    """Serving requests received but not yet queued on the engine: their bodies are still read,
    parsed and tokenized. The executor gives up its rollout iteration for them as soon as they
    arrive, not only once they are queued, so that the rollout work neither delays them by what
    is left of its iteration nor competes with their parsing for the CPU meanwhile."""

    def __init__(self) -> None:
        self._pending = 0
        self._lock = threading.Lock()  # released on the engine thread, held on the event loop's

    def pending(self) -> bool:
        return self._pending > 0

    def arrive(self) -> Callable[[], None]:
        """Count one arrival; the returned function (idempotent, any thread) ends it."""
        with self._lock:
            self._pending += 1
        done = False

        def release() -> None:
            nonlocal done
            with self._lock:
                if not done:
                    done = True
                    self._pending -= 1

        return release


def engine_dead(why: str) -> APIError:
    return APIError(503, f"the engine loop is down: {why}", kind="server_error", code="engine_dead")


class Drain:
    """The shutdown drain (`rose.coserve.drain`): once it starts, new requests are refused and
    the open serving requests (the OpenAI API's) are waited for, up to its deadline. The event
    loop's thread alone counts them."""

    def __init__(self) -> None:
        self.deadline: float | None = None  # monotonic; None: not draining
        self.open = 0  # serving requests in progress

    @property
    def started(self) -> bool:
        return self.deadline is not None

    def start(self, timeout_s: float) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + timeout_s

    def done(self) -> bool:
        """Whether the drain has nothing left to wait for: no open serving request, or its time is up."""
        return self.deadline is not None and (self.open == 0 or time.monotonic() >= self.deadline)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """One serving request in progress, until its response is sent."""
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


class WaitingQueue:
    """One model's requests waiting for their first token (the event loop's thread alone
    counts them); beyond `limit` new ones are refused with a 429."""

    def __init__(self, model: str, limit: int) -> None:
        self.model, self.limit, self.waiting = model, limit, 0

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        if self.waiting >= self.limit:
            raise busy(429, f"{self.waiting} {self.model} requests already wait for their first token "
                            f"(max_waiting_per_model {self.limit}); retry later", "queue_full")
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, unless the client disconnects first: then cancel it (closing a request's
    output stream aborts the request in the engine) and raise ClientGone."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        task.cancel()  # a no-op once done
    if task in done:
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # its cleanup (the abort) runs before we answer
    raise ClientGone


@dataclasses.dataclass
class LeaseState:
    """What the lease API's turn endpoints need: the engine loop, the host of the turns on it (a
    co-serving executor, a dedicated worker's engine), the limits, each model's waiting queue."""

    loop: StepLoop[RequestOutput]
    host: TurnHost
    limits: ServerLimits
    queues: dict[str, WaitingQueue] = dataclasses.field(init=False)
    drain: Drain = dataclasses.field(default_factory=Drain, kw_only=True)

    def __post_init__(self) -> None:
        self.queues = {m: WaitingQueue(m, self.limits.max_waiting_per_model) for m in (SERVING, ROLLOUT)}

    async def first(self, request: Request, outputs: AsyncIterator[T], model: str) -> T:
        """A request's first output (its first token): the request counts as waiting until
        then, is dropped at `queue_timeout_s`, and aborted if its client leaves."""
        timeout_s = self.limits.queue_timeout_s
        with self.queues[model].slot():
            try:
                return await unless_gone(request, asyncio.wait_for(anext(outputs), timeout_s))
            except TimeoutError:
                raise busy(503, f"no first token within queue_timeout_s ({timeout_s} s): "
                                f"the executor is overloaded; the request was dropped",
                           "queue_timeout") from None

    async def alive(self) -> None:
        """Raise a 503 if the engine loop's thread has ended, or has made no progress for
        `health_timeout_s` (`StepLoop.check`). Answered here, on the event loop: a weight push
        that holds the engine thread for long, progressing, never fails it."""
        try:
            self.loop.check(self.limits.health_timeout_s)
        except LoopDeadError as exc:
            raise engine_dead(str(exc)) from None

    async def answered(self, work: Awaitable[T]) -> T:
        """`work` (a call on the engine loop), unless the loop takes over `health_timeout_s` to
        answer: then a 503, so that a stuck loop fails a probe that needs its answer instead of
        hanging it."""
        timeout_s = self.limits.health_timeout_s
        try:
            return await asyncio.wait_for(work, timeout_s)
        except TimeoutError:
            raise engine_dead(f"no answer within {timeout_s} s; an iteration or a command is stuck") from None


@dataclasses.dataclass
class ServerState(LeaseState):
    """One `rose serve` app's state: the lease API's, its host the co-serving executor, and the
    served model's tokenizer and name."""

    executor: CoServingExecutor = dataclasses.field(kw_only=True)
    tokenizer: Tokenizer = dataclasses.field(kw_only=True)
    model_name: str = dataclasses.field(kw_only=True)
    chat: ChatOptions = dataclasses.field(kw_only=True)
    # What a request that does not set them samples with (`rose serve --generation-config`).
    sampling_defaults: Mapping[str, float | int] = dataclasses.field(kw_only=True, default_factory=dict)
    arrivals: Arrivals = dataclasses.field(default_factory=Arrivals)

    @functools.cached_property
    def eos_stops(self) -> frozenset[int]:
        """The end-of-sequence ids a reply names as its stop reason, as vLLM does: the
        checkpoint's, but the tokenizer's own."""
        return self.executor.serving_eos - {self.tokenizer.eos_token_id}


async def _server_state(request: Request) -> ServerState:
    return request.app.state.server  # async: FastAPI would run a plain function on a thread pool


async def _lease_state(request: Request) -> LeaseState:
    return request.app.state.server


Served = Annotated[ServerState, Depends(_server_state)]
Leased = Annotated[LeaseState, Depends(_lease_state)]


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
