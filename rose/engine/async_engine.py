"""An asyncio front for an engine: iterations run on a background thread, callers stream.

Everything that touches the engine (adding, aborting, loading weights) is queued and run by
that thread between two iterations, so a weight swap or an abort never lands mid-iteration.
`EngineLoop` drives anything with `step`, `has_unfinished` and `abort` (an `LLMEngine`, or the
co-serving executor that steps two of them); `AsyncLLMEngine` adds `LLMEngine`'s calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Protocol, TypeVar

import torch

from rose.engine.llm_engine import InFlight, LLMEngine
from rose.engine.sampling import SamplingParams
from rose.engine.sequence import RequestOutput

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop's thread is dead or does not answer."""


class Steppable(Protocol):
    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def abort(self, request_id: str) -> RequestOutput | None: ...


class EngineLoop:
    def __init__(self, target: Steppable, name: str = "rose-engine") -> None:
        self.target = target
        self._commands: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future]] = (
            queue.SimpleQueue())
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue `fn` to run on the engine thread between two iterations."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, future))
        self._wake.set()
        return future

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between two iterations and return its result."""
        return await asyncio.wrap_future(self.submit(fn))

    async def ping(self, timeout_s: float) -> None:
        """Raise EngineDeadError unless the engine thread runs a no-op within `timeout_s`.
        (Temporary version from the server branch; the engine helper's replaces it.)"""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread has died")
        try:
            await asyncio.wait_for(asyncio.shield(self.call(lambda: None)), timeout_s)
        except TimeoutError:
            raise EngineDeadError(f"the engine thread did not answer within {timeout_s} s") from None

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def stream(self, request_id: str, add: Callable[[], object]) -> AsyncIterator[RequestOutput]:
        """Run `add` (which queues `request_id`) on the engine thread, then yield the request's
        outputs, one per iteration that advanced it; the last is finished. Whatever `add` raises
        (bad input) is raised here before anything is queued. Leaving early (a client that went
        away) aborts the request."""
        stream = (asyncio.get_running_loop(), asyncio.Queue())

        def register() -> None:
            add()
            self._streams[request_id] = stream  # only once accepted, before any step can answer

        await self.call(register)
        try:
            while True:
                out = await stream[1].get()
                yield out
                if out.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None:
                self.submit(lambda: self.target.abort(request_id))

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request; its stream ends with the partial output (finish_reason 'abort')."""
        out = await self.call(lambda: self.target.abort(request_id))
        if out is not None:
            self.deliver([out])
        return out

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                loop, q = stream
                loop.call_soon_threadsafe(q.put_nowait, out)
                if out.finished:
                    self._streams.pop(out.request_id, None)

    def _run(self) -> None:
        while not self._stop:
            while not self._commands.empty():
                fn, future = self._commands.get()
                try:
                    future.set_result(fn())
                except Exception as exc:  # handed to the awaiting caller
                    future.set_exception(exc)
            if self.target.has_unfinished():
                self.deliver(self.target.step())
            else:
                self._wake.wait(timeout=0.1)
                self._wake.clear()


class AsyncLLMEngine(EngineLoop):
    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine)
        self.engine = engine

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (see `EngineLoop.stream`)."""
        rid = request_id or self.new_id("async")
        return self.stream(rid, lambda: self.engine.add_request(prompt_token_ids, params, rid, priority))

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                           in_flight: InFlight = InFlight.CONTINUE) -> None:
        await self.call(lambda: self.engine.load_weights(named_tensors, version, in_flight))
