"""Fake devices for the control-plane benchmark: real lease servers over an engine with no model.

Each device is what a real one is on the wire: the lease API's turn endpoints
(`rose.coserve.server.build_lease_app`: the turn stream, and one HTTP stream per turn) around a
step loop, its turns run by `EngineHost`, behind a lease key. Only the engine is fake:
`PacedEngine` gives every running turn one token per iteration and takes `iteration_s` per
iteration (a GPU's decode step, e.g. Table 1's 117.8 ms TPOT), whatever it runs. Each token's
logprob is minus the wall-clock second it was made, so that the driver can time its delivery.

`python -m rose.bench.fake_devices N ITERATION_S CAP KEY` serves N devices from one process
(one event loop, one engine thread each) and prints their URLs, one a line, then serves until its
stdin closes (its parent, the benchmark, ended).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable

import uvicorn

from rose.contracts import InFlight, RequestOutput, SamplingParams
from rose.coserve.server import build_lease_app
from rose.coserve.settings import ServerLimits
from rose.coserve.turn_stream import MAX_MESSAGE_BYTES, EngineHost
from rose.steploop import StepLoop


class PacedEngine:
    """A `GenerationEngine` with no model: one token (id 50) per running request per iteration,
    an iteration every `iteration_s`."""

    TOKEN = 50

    def __init__(self, iteration_s: float) -> None:
        self.iteration_s = iteration_s
        self.policy_version = 0
        self._requests: dict[str, list[int]] = {}  # id -> [max tokens, produced, prompt tokens]
        self._next = 0.0

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                    priority: int = 0, adapter: str | None = None) -> str:
        if adapter is not None:
            raise ValueError(f"request {request_id!r}: adapter {adapter!r} is not loaded (a fake engine "
                             "has none)")
        params.validate()
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        self._requests[request_id] = [params.max_tokens, 0, len(prompt_token_ids)]
        return request_id

    def adapter_versions(self) -> dict[str, int]:
        return {}

    def _output(self, request_id: str, state: list[int], tokens: list[int], made: float,
                reason: str | None) -> RequestOutput:
        return RequestOutput(request_id, tokens, [-made] * len(tokens), [self.policy_version] * len(tokens),
                             state[2], state[1], reason is not None, reason, 0, 0.0, None, None)

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self._requests.pop(request_id, None)
        return None if state is None else self._output(request_id, state, [], time.time(), "abort")

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        if self._next > now:
            time.sleep(self._next - now)
        self._next = max(now, self._next) + self.iteration_s
        made, outputs = time.time(), []
        for request_id, state in list(self._requests.items()):
            state[1] += 1
            done = state[1] >= state[0]
            if done:
                del self._requests[request_id]
            outputs.append(self._output(request_id, state, [self.TOKEN], made, "length" if done else None))
        return outputs

    def load_weights(self, named_tensors: Iterable[object], version: int,
                     in_flight: InFlight = InFlight.CONTINUE) -> None:
        self.policy_version = version

    def check_health(self) -> None:
        pass


async def serve(devices: int, iteration_s: float, cap: int, key: str) -> None:
    """Serve `devices` fake devices on loopback; print each one's URL once all listen."""
    servers, urls = [], []
    for _ in range(devices):
        engine = PacedEngine(iteration_s)
        app = build_lease_app(StepLoop(engine, name="fake-device"), EngineHost(engine, cap),
                              ServerLimits(lease_key=key, max_connections=4 * cap + 64))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        urls.append(f"http://127.0.0.1:{sock.getsockname()[1]}")
        server = uvicorn.Server(uvicorn.Config(app, log_level="error", ws_max_size=MAX_MESSAGE_BYTES,
                                               lifespan="off"))
        servers.append(server.serve(sockets=[sock]))
    tasks = [asyncio.create_task(s) for s in servers]
    await asyncio.sleep(0.5)
    print("\n".join(urls), flush=True)
    await asyncio.gather(*tasks)


def _exit_with_parent() -> None:
    """The benchmark holds this process's stdin: when it ends, however it ends, so does this."""
    sys.stdin.read()
    os._exit(0)


if __name__ == "__main__":
    count, iteration, slots, lease_key = sys.argv[1:5]
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    asyncio.run(serve(int(count), float(iteration), int(slots), lease_key))
