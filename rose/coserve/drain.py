"""`rose serve`'s uvicorn server, which drains on SIGTERM (and SIGINT) as `vllm serve
--shutdown-timeout` does: it stops accepting connections, answers every new request on the open
ones with a 503 (/metrics excepted), and waits for the serving requests in progress to finish,
up to `ServerLimits.drain_timeout_s`. Then what is left is aborted through the engine loop, so
that each stream ends with its last output (finish_reason "abort"): rollout turns (the lease
API's, whose driver resumes them elsewhere with the tokens they had) and serving requests still
open at the deadline. uvicorn's own shutdown closes the connections, and cancels within
`CUT_GRACE_S` what did not end (all of it, if the engine loop is stuck). The process exits with
0. A second signal ends the drain at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from rose.coserve.api_state import LeaseState
from rose.steploop import LoopDeadError

log = logging.getLogger(__name__)
CUT_GRACE_S = 1.0  # after the drain: what is still open is given this long, then cancelled


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: LeaseState) -> None:
        """`state`: the app's (`app.state.server`)."""
        config.timeout_graceful_shutdown = CUT_GRACE_S
        super().__init__(config)
        self.state, self.drain, self.timeout_s = state, state.drain, state.limits.drain_timeout_s
        self._listening = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Our handler instead of uvicorn's, which would exit at once and re-raise the signal
        afterwards (the process would die of it rather than exit with 0)."""
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self._signalled) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _signalled(self, sig: int, frame: FrameType | None) -> None:
        # Between two bytecodes of the event loop's thread: set flags, `on_tick` acts on them.
        if self.drain.started:
            self.should_exit = True
        else:
            self.drain.start(self.timeout_s)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.started and self._listening:
            self._listening = False
            for server in self.servers:
                server.close()
            log.info("shutting down: no new requests; waiting up to %g s for %d open serving request(s)",
                     self.timeout_s, self.drain.open)
        if not (await super().on_tick(counter) or self.drain.done()):  # super: a second signal
            return False
        if self.drain.open:
            log.warning("shutting down: %d serving request(s) still open are cut", self.drain.open)
        with contextlib.suppress(LoopDeadError, TimeoutError):  # a stuck loop: uvicorn cancels
            await asyncio.wait_for(self.state.loop.abort_all(), CUT_GRACE_S)
        return True
