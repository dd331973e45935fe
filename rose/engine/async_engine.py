"""An asyncio front for `LLMEngine`: iterations run on a background thread, callers stream.

Everything that touches the engine (adding, aborting, loading weights) is queued and run by
that thread between two iterations, so a weight swap or an abort never lands mid-iteration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TypeVar

import torch

from rose.engine.llm_engine import InFlight, LLMEngine
from rose.engine.sampling import SamplingParams
from rose.engine.sequence import RequestOutput

T = TypeVar("T")


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future]] = (
            queue.SimpleQueue())
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="rose-engine", daemon=True)
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

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs, one per iteration that advanced it; the last is finished.
        Bad input raises ValueError before anything is queued. Leaving the loop early (a client
        that went away) aborts the request."""
        rid = request_id or f"async-{next(self._ids)}"
        stream = (asyncio.get_running_loop(), asyncio.Queue())

        def add() -> None:
            self.engine.add_request(prompt_token_ids, params, rid, priority)
            self._streams[rid] = stream  # only once accepted, before any step can answer

        await self.call(add)
        try:
            while True:
                out = await stream[1].get()
                yield out
                if out.finished:
                    return
        finally:
            if self._streams.pop(rid, None) is not None:
                self.submit(lambda: self.engine.abort(rid))

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request; its stream ends with the partial output (finish_reason 'abort')."""
        out = await self.call(lambda: self.engine.abort(request_id))
        if out is not None:
            self._deliver([out])
        return out

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                           in_flight: InFlight = InFlight.CONTINUE) -> None:
        await self.call(lambda: self.engine.load_weights(named_tensors, version, in_flight))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
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
            if self.engine.has_unfinished():
                self._deliver(self.engine.step())
            else:
                self._wake.wait(timeout=0.1)
                self._wake.clear()
