"""How a worker's failure is read: a turn refused for what it is (a 4xx from an executor's lease
API, a dedicated worker's ValueError, also inside a Ray RayTaskError), an executor without room
(429), or a failure of the worker itself (transport, 5xx, a dead actor)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from rose.contracts import SamplingParams, Turn, TurnOutput
from rose.coserve.lease_client import ExecutorBusy, LeaseClient, LeaseError, TurnRejected
from rose.rollout.workers import Failure, RemoteWorker, classify

URL = "http://executor.test"


def lease_worker(handler: Callable[[httpx.Request], httpx.Response]) -> LeaseClient:
    return LeaseClient(URL, httpx.AsyncClient(transport=httpx.MockTransport(handler)), worker_id="s",
                       max_concurrency=4)


def run_turn(worker: LeaseClient | RemoteWorker, result: TurnOutput | None = None) -> TurnOutput:
    turn = Turn("t0:0:0", "t0", [1, 2, 3], SamplingParams(max_tokens=4))
    return asyncio.run(worker.run_turn(turn, result if result is not None else TurnOutput()))


@pytest.mark.parametrize(("status", "failure", "error"), [
    (400, Failure.REJECTED, TurnRejected),  # a prompt past the context, a bad sampling parameter
    (404, Failure.REJECTED, TurnRejected),
    (422, Failure.REJECTED, TurnRejected),
    (429, Failure.BUSY, ExecutorBusy),      # lease slots or queue full: not the turn's fault
    (401, Failure.WORKER, LeaseError),      # our key refused: the executor is unusable to us
    (500, Failure.WORKER, LeaseError),
    (503, Failure.WORKER, LeaseError),
])
def test_a_lease_turn_status_decides_whose_failure_it_is(status: int, failure: Failure,
                                                         error: type[LeaseError]) -> None:
    worker = lease_worker(lambda request: httpx.Response(status, json={"error": {"message": "no"}}))
    with pytest.raises(LeaseError) as info:
        run_turn(worker)
    assert type(info.value) is error and info.value.status == status and classify(info.value) is failure
    assert f"HTTP {status}" in str(info.value)


def test_transport_failures_and_garbled_streams_are_the_workers() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(LeaseError) as info:
        run_turn(lease_worker(refuse))
    assert info.value.status is None and classify(info.value) is Failure.WORKER
    # A malformed event is a JSON (Value)Error underneath: it must not read as the turn's fault.
    stream = 'data: {"token_ids": [5]\n\ndata: {oops\n\n'
    garbled = lease_worker(lambda request: httpx.Response(200, text=stream))
    with pytest.raises(LeaseError, match="malformed stream event") as info:
        run_turn(garbled)
    assert classify(info.value) is Failure.WORKER
    assert classify(ConnectionError("gone")) is Failure.WORKER and classify(TimeoutError()) is Failure.WORKER


class _Method:
    def __init__(self, call: Callable[..., Any]) -> None:
        self.remote = call


class _Handle:
    """A Ray actor handle's streaming `stream`: one chunk, then `exc` as Ray raises it."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.stream = _Method(self._stream)

    async def _stream(self, *args: Any) -> AsyncIterator[Awaitable[TurnOutput]]:
        chunk = asyncio.get_running_loop().create_future()
        chunk.set_result(TurnOutput([7], [-0.5], [0]))
        yield chunk
        raise self.exc


def ray_error(cause: Exception) -> RayTaskError:
    return RayTaskError("stream", "Traceback: ...", cause, proctitle="worker", pid=1, ip="127.0.0.1")


@pytest.mark.parametrize("wrap", [lambda e: e, RayTaskError.as_instanceof_cause], ids=["plain", "dual"])
def test_a_dedicated_workers_value_error_is_the_turns(wrap: Callable[[RayTaskError], Exception]) -> None:
    cause = ValueError("prompt of 9000 tokens does not fit the context of 8192")
    worker, result = RemoteWorker("d0", _Handle(wrap(ray_error(cause))), 4), TurnOutput()
    with pytest.raises(TurnRejected, match="turn 't0:0:0' on d0: prompt of 9000 tokens") as info:
        run_turn(worker, result)
    assert classify(info.value) is Failure.REJECTED and result.token_ids == [7]  # what came is kept


@pytest.mark.parametrize("exc", [ray_error(RuntimeError("CUDA error")), ActorDiedError()],
                         ids=["crash", "died"])
def test_a_dedicated_workers_crash_or_death_is_the_workers(exc: Exception) -> None:
    with pytest.raises(type(exc)) as info:
        run_turn(RemoteWorker("d0", _Handle(exc), 4))
    assert classify(info.value) is Failure.WORKER
