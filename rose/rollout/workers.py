"""The rollout workers behind the `Worker` contract (rose.contracts): what the rollout manager
talks to.

- `EngineWorker`: a dedicated rollout worker, an `AsyncLLMEngine` in this process;
- a device in another process, a co-serving executor's or a dedicated worker's (the runtime's
  `rose.runtime.actors.DedicatedWorkerActor`), is reached over its lease API's turn stream by
  `rose.coserve.lease_stream.LeaseStream`, a `Worker` itself.

`run_turn` writes tokens into its output as they arrive, so that a caller that loses the
worker midway (an exception, a cancellation) keeps every token already produced and can resume.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator

from rose.contracts import TURN_CHUNK_S, Heartbeat, Turn, TurnOutput, WorkerKind
from rose.coserve.executor import check_version, newest_version
from rose.coserve.lease_client import ExecutorBusy, TurnRejected
from rose.engine.async_engine import AsyncLLMEngine


class Failure(enum.Enum):
    """Why a turn's call failed, which decides what the rollout manager does about it."""

    REJECTED = "rejected"  # the turn's own fault: retried a few times, then its trajectory fails
    BUSY = "busy"          # the worker has no room now: routed again; the worker keeps its standing
    WORKER = "lost"        # transport or liveness: the worker is suspected, the turn resumes elsewhere


def classify(exc: Exception) -> Failure:
    """A refused turn (`TurnRejected`, or a worker's ValueError: the engine's validation of a
    prompt or its sampling parameters) is the turn's failure, a 429 a busy worker; anything else
    (connection errors, timeouts, 5xx, a dead actor) a worker failure."""
    if isinstance(exc, ExecutorBusy):
        return Failure.BUSY
    if isinstance(exc, TurnRejected | ValueError):
        return Failure.REJECTED
    return Failure.WORKER


class EngineWorker:
    """A dedicated rollout worker: the rollout model alone on its device."""

    kind = WorkerKind.DEDICATED

    def __init__(self, worker_id: str, engine: AsyncLLMEngine, max_concurrency: int,
                 ping_timeout_s: float = 10.0) -> None:
        self.worker_id, self.engine, self.max_concurrency = worker_id, engine, max_concurrency
        self.ping_timeout_s = ping_timeout_s

    async def stream(self, turn: Turn) -> AsyncIterator[TurnOutput]:
        """The turn's new tokens, a chunk per `TURN_CHUNK_S`; the last has a finish reason."""
        engine = self.engine.engine
        check_version(turn, engine.policy_version, engine.adapter_versions(), "worker")
        async for out in self.engine.generate(turn.token_ids, turn.params, request_id=turn.turn_id,
                                              gather_s=TURN_CHUNK_S, adapter=turn.adapter):
            yield out.turn_output()

    async def run_turn(self, turn: Turn, output: TurnOutput) -> TurnOutput:
        async for chunk in self.stream(turn):
            output.extend(chunk)
        return output

    async def heartbeat(self) -> Heartbeat:
        """Answered through the engine's thread: a dead or stuck loop raises LoopDeadError
        (no heartbeat, so the worker is replaced) instead of reporting a healthy worker."""
        await self.engine.ping(self.ping_timeout_s)
        return Heartbeat(newest_version(self.engine.engine))

    async def abort(self, turn_id: str) -> None:
        await self.engine.abort(turn_id)

    async def pause(self) -> None:
        """Stop generating (turns in flight wait, keeping their KV) until `resume`."""
        self.engine.pause()

    async def resume(self) -> None:
        self.engine.resume()

    async def close(self) -> None:
        self.engine.shutdown()
