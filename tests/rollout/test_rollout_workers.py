"""How a worker's failure is read: a turn refused for what it is (a 4xx from a device's lease
API, an in-process worker's ValueError), a device without room (429), or a failure of the worker
itself (transport, 5xx)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from rose.contracts import SamplingParams, Turn, TurnOutput
from rose.coserve.lease_client import ExecutorBusy, LeaseClient, LeaseError, TurnRejected
from rose.rollout.workers import Failure, classify

URL = "http://executor.test"


def lease_worker(handler: Callable[[httpx.Request], httpx.Response]) -> LeaseClient:
    return LeaseClient(URL, httpx.AsyncClient(transport=httpx.MockTransport(handler)), worker_id="s",
                       max_concurrency=4)


def run_turn(worker: LeaseClient, result: TurnOutput | None = None) -> TurnOutput:
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
    # An in-process worker's engine refusing a prompt or a sampling parameter: the turn's fault.
    assert classify(ValueError("prompt of 9000 tokens does not fit the context of 8192")) is Failure.REJECTED
