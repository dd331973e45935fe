"""A loop on a background thread around anything with `step()`, for asyncio callers to stream.

It drives a `GenerationEngine` (rose.contracts; `rose.engine.async_engine.AsyncLLMEngine`) and
the co-serving executor, which steps two of them. Everything that touches the target (adding,
aborting, loading weights) is queued and run by that thread between two iterations, so a weight
swap or an abort never lands mid-iteration. It knows nothing of engines beyond the `Steppable`
protocol, the part of an engine's contract that every target has (as asyncio knows nothing of
what it runs), so it imports nothing of any layer, rose.contracts included: a turn's path counts
the layers whose code does the work, not the loop that calls into them (docs/architecture.md).

The thread outlives its callers: a caller cancelled while its command waits is skipped, an
iteration that raises fails the requests it was running and the loop goes on, and a reader
that stops reading has its request aborted. `ping` goes through the thread, so a dead or stuck
loop is seen; `check` sees the same from outside it, by the progress the thread records (each
pass of the loop, each command, each item of a long command's `progressing` input), so that a
health probe never waits behind a long command such as a weight push. `shutdown` ends every
pending call and stream from any state.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

# Outputs a stream may hold unread before its request is aborted: a stalled reader must not
# grow memory without bound (one output per iteration, so this is some seconds of decoding).
MAX_QUEUED_OUTPUTS = 512
IDLE_WAIT_S = 0.1  # nothing to run: wait this long for a command (a command wakes it at once)
STALLED_WAIT_S = (0.001, 0.05)  # work that cannot run now: back off from the first to the second


class LoopDeadError(RuntimeError):
    """The loop's thread has ended (shut down or crashed) or does not answer (stuck)."""


class RequestFailed(RuntimeError):
    """A request's stream ended in error: the target failed it, or its reader fell behind."""


class Output(Protocol):
    """One request's progress as a target reports it (an engine's `RequestOutput`)."""

    request_id: str
    finished: bool
    finish_reason: str | None  # 'error': the request failed, `error` says why
    error: str | None

    def merge(self, later: Any) -> None: ...  # append a later output of the same request


Out = TypeVar("Out", bound=Output)
Out_co = TypeVar("Out_co", bound=Output, covariant=True)


class Steppable(Protocol[Out_co]):
    def step(self) -> list[Out_co]: ...

    def has_unfinished(self) -> bool: ...

    def abort(self, request_id: str) -> Out_co | None: ...


class _Stream(Generic[Out]):
    """One request's outputs, from the loop's thread to the asyncio reader. Items are outputs,
    or an exception that ends the stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self._loop, self._limit = loop, limit
        self._items: collections.deque[Out | BaseException] = collections.deque()
        self._ready = asyncio.Event()
        self._ended = asyncio.Event()  # the last item is queued

    def put(self, item: Out | BaseException, force: bool = False) -> bool:
        """Any thread. False (nothing queued) when full, unless `force`, or when the reader's
        event loop has closed."""
        if not force and len(self._items) >= self._limit:
            return False
        self._items.append(item)
        last = isinstance(item, BaseException) or item.finished
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
            if last:
                self._loop.call_soon_threadsafe(self._ended.set)
        except RuntimeError:  # the reader's event loop is closed: nobody will read
            return False
        return True

    async def get(self, gather_s: float = 0.0) -> Out:
        """The next output; with `gather_s`, merged with those of the next `gather_s` seconds
        (less if the request ends sooner)."""
        while not self._items:
            self._ready.clear()  # before the check: a put after it sets the event again
            if not self._items:
                await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        if gather_s > 0 and not item.finished:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ended.wait(), gather_s)
            while self._items and not isinstance(self._items[0], BaseException):  # an error comes next
                item.merge(self._items.popleft())
        return item


class Sink(Generic[Out]):
    """Many requests' outputs for one reader that takes them all at once (a device's turn
    stream), merged per request as they come: what waits is bounded by the requests' own
    tokens, and the reader is woken once per batch, not once per output. `urgent` is set as
    well when a request ends, for a reader that sends ends at once and the rest in batches."""

    def __init__(self, ready: asyncio.Event | None = None) -> None:
        """`ready`: set when outputs wait (a reader's own event, which it may set for its own
        reasons too)."""
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()  # the loop thread puts, the reader's event loop takes
        self._outputs: dict[str, Out] = {}
        self._errors: dict[str, BaseException] = {}
        self.ready = ready or asyncio.Event()
        self.urgent = asyncio.Event()

    def __bool__(self) -> bool:
        return bool(self._outputs or self._errors)

    def entry(self, request_id: str) -> _SinkEntry[Out]:
        return _SinkEntry(self, request_id)

    def put(self, request_id: str, item: Out | BaseException) -> bool:
        return self.put_many([(request_id, item)])

    def put_many(self, items: list[tuple[str, Out | BaseException]]) -> bool:
        """Put an iteration's outputs at once: the reader takes them together."""
        last = False
        with self._lock:
            wake = not self._outputs and not self._errors
            for request_id, item in items:
                if isinstance(item, BaseException):
                    self._errors[request_id], last = item, True
                    continue
                last = last or item.finished
                if (held := self._outputs.get(request_id)) is not None:
                    held.merge(item)
                else:
                    self._outputs[request_id] = item
        try:
            if wake:
                self._loop.call_soon_threadsafe(self.ready.set)
            if last:
                self._loop.call_soon_threadsafe(self.urgent.set)
        except RuntimeError:  # the reader's event loop is closed: nobody will read
            return False
        return True

    def take(self) -> tuple[dict[str, Out], dict[str, BaseException]]:
        """Everything put since the last take: each request's outputs merged, and the requests
        that ended in error."""
        with self._lock:
            outputs, errors = self._outputs, self._errors
            self._outputs, self._errors = {}, {}
            self.urgent.clear()
        return outputs, errors


class _SinkEntry(Generic[Out]):
    """One request's place in a `Sink`, standing where a `_Stream` would."""

    def __init__(self, sink: Sink[Out], request_id: str) -> None:
        self.sink, self.request_id = sink, request_id

    def put(self, item: Out | BaseException, force: bool = False) -> bool:
        return self.sink.put(self.request_id, item)


class StepLoop(Generic[Out]):
    def __init__(self, target: Steppable[Out], name: str = "rose-loop",
                 max_queued_outputs: int = MAX_QUEUED_OUTPUTS) -> None:
        self.target = target
        self.name = name
        self.max_queued_outputs = max_queued_outputs
        self._commands: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future]] = (
            queue.SimpleQueue())
        self._streams: dict[str, _Stream[Out] | _SinkEntry[Out]] = {}  # the loop thread's, until closed
        self._wake = threading.Event()
        self._stop = False
        self._paused = False
        self._lock = threading.Lock()  # orders submit against closing
        self._dead: str | None = None  # why the loop no longer runs commands
        self._ids = itertools.count()
        self._progress = time.monotonic()  # the thread's last sign of progress (`check`)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop from any state: every pending call fails and every open stream ends with
        LoopDeadError; the thread is joined for at most `timeout_s` (an iteration that never
        returns is left behind, its results dropped)."""
        self._stop = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        stuck = " while an iteration was still running" if self._thread.is_alive() else ""
        self._close(f"{self.name} was shut down{stuck}")

    def pause(self) -> None:
        """Run no iteration until `resume` (commands still run: heartbeats answer, weights
        load): the device is wanted by another process, such as a trainer on the same cores."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue `fn` to run on the loop's thread between two iterations (a future that is
        cancelled before it runs is skipped)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._dead is None:
                self._commands.put((fn, future))
                self._wake.set()
                return future
        future.set_exception(LoopDeadError(self._dead))
        return future

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the loop's thread between two iterations and return its result."""
        return await asyncio.wrap_future(self.submit(fn))

    async def ping(self, timeout_s: float, probe: Callable[[], object] | None = None) -> None:
        """Raise LoopDeadError unless the loop's thread runs a command (`probe`, which may raise
        its own error for a target that can no longer run) within `timeout_s`."""
        if self._dead is not None or not self._thread.is_alive():
            raise LoopDeadError(self._dead or f"{self.name}: the loop's thread has ended")
        try:
            await asyncio.wait_for(self.call(probe or (lambda: None)), timeout_s)
        except asyncio.TimeoutError:
            raise LoopDeadError(f"{self.name}: no answer within {timeout_s} s; an iteration "
                                  "or a command is stuck") from None

    def check(self, timeout_s: float) -> None:
        """Any thread, without a round trip through the loop's: raise LoopDeadError if the
        thread has ended, or has made no progress for `timeout_s` (an iteration or a command
        that does not return). An idle loop makes progress: it wakes every `IDLE_WAIT_S`."""
        if self._dead is not None or not self._thread.is_alive():
            raise LoopDeadError(self._dead or f"{self.name}: the loop's thread has ended")
        quiet_s = time.monotonic() - self._progress
        if quiet_s > timeout_s:
            raise LoopDeadError(f"{self.name}: no progress for {quiet_s:.1f} s (more than {timeout_s} s); "
                                "an iteration or a command is stuck")

    def progressing(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, each one taken counting as the loop's progress: the input of a long command
        that consumes it item by item (a weight push, tensor by tensor), which `check` must not
        take for a stuck loop."""
        for item in items:
            self._progress = time.monotonic()
            yield item

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    async def stream(self, request_id: str, add: Callable[[], object],
                     gather_s: float = 0.0) -> AsyncIterator[Out]:
        """Run `add` (which queues `request_id`) on the loop's thread,
        then yield the request's outputs, one per iteration that advanced it (each with its new
        tokens); the last is finished. Whatever `add` raises (bad input) is raised here before
        anything is queued. Raises RequestFailed when the target fails the request or this
        reader falls `max_queued_outputs` behind, LoopDeadError when the loop ends. Leaving early (a
        client that went away, a cancelled task) aborts the request. `gather_s`: each output after
        the first merges what that many seconds bring, for a reader that pays per output and does
        not show tokens as they come (a rollout turn: its manager streams every worker's turns)."""
        stream = _Stream(asyncio.get_running_loop(), self.max_queued_outputs)

        def register() -> None:
            add()
            self._streams[request_id] = stream  # only once accepted, before any step can answer

        try:
            await self.call(register)
            out = await stream.get()
            while True:
                yield out
                if out.finished:
                    return
                out = await stream.get(gather_s)
        finally:
            # On the loop's thread, after `register` (commands run in order), even if this
            # caller was cancelled while `register` ran.
            self.submit(lambda: self._drop(request_id, stream))

    async def submit_to(self, sink: Sink[Out],
                        adds: list[tuple[str, Callable[[], object]]]) -> list[Exception | None]:
        """Run each `add` (which queues its request id) on the loop's thread, in one command, and
        send the outputs of those that succeed to `sink`; what each raised (bad input, no room),
        or None."""

        def register() -> list[Exception | None]:
            raised: list[Exception | None] = []
            for request_id, add in adds:
                try:
                    add()
                except Exception as exc:
                    raised.append(exc)
                    continue
                self._streams[request_id] = sink.entry(request_id)
                raised.append(None)
            return raised

        return await self.call(register)

    async def abort_many(self, request_ids: list[str], how: Callable[[str], Out | None]) -> None:
        """`abort` for several requests, in one command."""

        def abort() -> None:
            self._deliver([out for rid in request_ids if (out := how(rid)) is not None])

        await self.call(abort)

    async def abort_all(self) -> None:
        """`abort` every request that has a stream or a sink (a server's last act before it
        exits): each ends with its last output, finish_reason 'abort'."""

        def abort() -> None:
            self._deliver([out for rid in list(self._streams) if (out := self.target.abort(rid)) is not None])

        await self.call(abort)

    async def detach(self, sink: Sink[Out], how: Callable[[str], Out | None] | None = None) -> None:
        """The reader of `sink` left: stop its requests still running (with `how`, default the
        target's `abort`) and send it nothing more."""

        def drop() -> None:
            for request_id in [r for r, s in self._streams.items() if getattr(s, "sink", None) is sink]:
                del self._streams[request_id]
                (how or self.target.abort)(request_id)

        with contextlib.suppress(LoopDeadError):  # a dead loop runs nothing any more
            await self.call(drop)

    async def abort(self, request_id: str,
                    how: Callable[[str], Out | None] | None = None) -> Out | None:
        """Stop a request with `how` (default: the target's `abort`; a target may have narrower
        ones); its stream ends with a last output (finish_reason 'abort')."""

        def abort() -> Out | None:
            out = (how or self.target.abort)(request_id)
            if out is not None:
                self._deliver([out])
            return out

        return await self.call(abort)

    # -- the loop's thread -----------------------------------------------------------------------

    def _run(self) -> None:
        reason = f"{self.name} stopped"
        stalled = 0  # iterations in a row that had work but produced nothing
        try:
            while not self._stop:
                self._progress = time.monotonic()
                self._run_commands()
                if self._paused or not self.target.has_unfinished():
                    self._wait(IDLE_WAIT_S)
                elif self._step():
                    stalled = 0
                else:  # e.g. a request waiting for pages that others hold: do not spin
                    low, high = STALLED_WAIT_S
                    self._wait(min(high, low * 2 ** min(stalled, 16)))
                    stalled += 1
        except BaseException as exc:  # reported to every caller, now and later
            reason = f"{self.name} died: {exc!r}"
            log.exception("%s: the loop died", self.name)
        finally:
            self._close(reason)

    def _wait(self, timeout_s: float) -> None:
        self._wake.wait(timeout_s)
        self._wake.clear()

    def _next_command(self) -> tuple[Callable[[], object], concurrent.futures.Future] | None:
        try:  # never blocks, even if `_close` drained it
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _run_commands(self) -> None:
        while (command := self._next_command()) is not None:
            fn, future = command
            if not future.set_running_or_notify_cancel():
                continue  # its caller was cancelled before it ran
            try:
                result = fn()
            except Exception as exc:  # handed to the awaiting caller
                future.set_exception(exc)
            else:
                future.set_result(result)
            self._progress = time.monotonic()

    def _step(self) -> bool:
        """One iteration; whether it produced anything."""
        try:
            outputs = self.target.step()
        except Exception as exc:  # the target could not tell which requests: fail those streamed
            log.exception("%s: an iteration failed", self.name)
            self._fail_streams(f"the iteration failed: {exc!r}")
            return False  # no progress: a fault that repeats backs off instead of spinning
        self._deliver(outputs)
        return bool(outputs)

    def _fail_streams(self, error: str) -> None:
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id)
            self.target.abort(request_id)
            stream.put(RequestFailed(f"request {request_id!r}: {error}"), force=True)

    def _deliver(self, outputs: list[Out]) -> None:
        sinks: dict[Sink[Out], list[tuple[str, Out | BaseException]]] = {}  # each sink's, put at once
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if isinstance(stream, _SinkEntry):
                if out.finished:
                    del self._streams[out.request_id]
                failed = out.finished and out.finish_reason == "error"
                item = RequestFailed(f"request {out.request_id!r}: {out.error}") if failed else out
                sinks.setdefault(stream.sink, []).append((out.request_id, item))
            elif out.finished:
                self._streams.pop(out.request_id, None)
                stream.put(RequestFailed(f"request {out.request_id!r}: {out.error}")
                           if out.finish_reason == "error" else out, force=True)
            elif not stream.put(out):
                self._streams.pop(out.request_id, None)
                self.target.abort(out.request_id)
                stream.put(RequestFailed(
                    f"request {out.request_id!r}: its reader fell {self.max_queued_outputs} outputs "
                    "behind; the request was aborted"), force=True)
        for sink, items in sinks.items():
            sink.put_many(items)

    def _drop(self, request_id: str, stream: _Stream[Out]) -> None:
        """A reader left: abort its request if still running (and still its own)."""
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]
            self.target.abort(request_id)

    def _close(self, reason: str) -> None:
        """No more commands: fail the queued ones and end every stream (idempotent)."""
        with self._lock:
            self._dead = self._dead or reason
        while (command := self._next_command()) is not None:
            _, future = command
            if future.set_running_or_notify_cancel():
                future.set_exception(LoopDeadError(self._dead))
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(LoopDeadError(self._dead), force=True)
