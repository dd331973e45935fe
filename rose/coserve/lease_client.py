"""Client of the executor's lease API: the rollout scheduler's `Worker` (rose.contracts) for a
co-serving executor, and the rest of the API (new RL steps, weights) for whoever drives it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from typing import Any

import httpx
import torch
from safetensors.torch import save

from rose.contracts import Heartbeat, InFlight, Turn, TurnOutput, WorkerKind
from rose.contracts.adapter import LoRAConfig
from rose.coserve.protocol import TURN, TURN_OUTPUT


class LeaseError(RuntimeError):
    """A lease call failed: the executor answered `status` (an HTTP code), or could not be reached
    or broke off (`status` None). A failure of the executor, unless a subclass says otherwise."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class TurnRejected(LeaseError):
    """The turn itself was refused and would be wherever it ran: an executor's 4xx naming what is
    wrong with it (a prompt past the context, a bad sampling parameter), or a dedicated worker's
    ValueError (`status` None). The turn's failure, not the worker's."""


class ExecutorBusy(LeaseError):
    """429: the executor has no room for the turn now (lease slots or queue full); it is healthy
    and the turn may go elsewhere or come back later."""


# 4xx that are not about the turn: our key refused (the executor is unusable to us, as if
# down) or the executor timing the request out.
_NOT_THE_TURN = frozenset({401, 403, 408})


def error_for(message: str, status: int) -> LeaseError:
    """The error class an HTTP status stands for."""
    if status == 429:
        return ExecutorBusy(message, status)
    if 400 <= status < 500 and status not in _NOT_THE_TURN:
        return TurnRejected(message, status)
    return LeaseError(message, status)


def _chunk(data: str, turn_id: str, url: str) -> TurnOutput:
    """One streamed event. A malformed event is the executor's failure (a ValueError would read
    as the turn's own)."""
    try:
        chunk = TURN_OUTPUT.validate_json(data)
        if not len(chunk.token_ids) == len(chunk.logprobs) == len(chunk.versions):
            raise ValueError("expected one logprob and one version per token")
    except ValueError as exc:
        raise LeaseError(f"turn {turn_id!r} on {url}: malformed stream event {data[:200]!r}: {exc}",
                         200) from exc
    return chunk


class LeaseClient:
    """A co-serving executor's rollout side, over its lease HTTP API."""

    kind = WorkerKind.SERVING

    def __init__(self, url: str, client: httpx.AsyncClient | None = None, key: str | None = None, *,
                 worker_id: str | None = None, max_concurrency: int = 1) -> None:
        """`key`: the executor's lease key, sent as a bearer token (None: the executor has none).
        `worker_id` (default: the URL) and `max_concurrency` (the turns in flight the rollout
        scheduler allows it, beside the free slots it reports) are what the scheduler knows it by."""
        self.url = url.rstrip("/")
        self.worker_id, self.max_concurrency = worker_id or self.url, max_concurrency
        self.key = key
        self._given = client

    @functools.cached_property
    def _client(self) -> httpx.AsyncClient:
        """Made at first use (a client loads its TLS context: tens of ms, where a fleet has
        thousands of devices)."""
        client = self._given or httpx.AsyncClient(timeout=httpx.Timeout(300.0))
        if self.key is not None:
            client.headers["Authorization"] = f"Bearer {self.key}"
        return client

    async def close(self) -> None:
        if "_client" in self.__dict__:
            await self._client.aclose()

    async def _post(self, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            r = await self._client.post(f"{self.url}{path}", **kwargs)
        except httpx.HTTPError as exc:
            raise LeaseError(f"{self.url}{path}: {exc}") from exc
        if r.status_code != 200:
            raise error_for(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}", r.status_code)
        return r.json()

    async def run_turn(self, turn: Turn, output: TurnOutput | None = None) -> TurnOutput:
        """Stream one turn to completion (or until the executor hands it back). Tokens land in
        `output` as they arrive, so a caller that is cancelled midway keeps what came."""
        output = output if output is not None else TurnOutput()
        try:
            async with self._client.stream("POST", f"{self.url}/v1/lease/turns", content=TURN.dump_json(turn),
                                           headers={"Content-Type": "application/json"}) as r:
                if r.status_code != 200:
                    raise error_for(f"turn {turn.turn_id!r} on {self.url}: HTTP {r.status_code}: "
                                 f"{(await r.aread())[:300]!r}", r.status_code)
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        output.extend(_chunk(line[6:], turn.turn_id, self.url))
        except httpx.HTTPError as exc:
            raise LeaseError(f"turn {turn.turn_id!r} on {self.url}: {exc}") from exc
        return output

    async def heartbeat(self) -> Heartbeat:
        """The executor's capacity report, through its engine loop (a dead or stuck loop fails it)."""
        capacity = (await self._post("/v1/lease/heartbeat"))["capacity"]
        return Heartbeat(int(capacity["policy_version"]), int(capacity["free_slots"]))

    async def abort(self, turn_id: str) -> None:
        """Hand the turn back now: its stream ends with what it produced (`run_turn` returns)."""
        with contextlib.suppress(LeaseError):  # already finished or handed back: its stream ended
            await self._post(f"/v1/lease/turns/{turn_id}/abort")

    async def new_rl_step(self) -> dict[str, Any]:
        return await self._post("/v1/lease/new_rl_step")

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                           in_flight: InFlight = InFlight.CONTINUE) -> dict[str, Any]:
        return await self._push(named_tensors, {"version": version, "in_flight": in_flight.value})

    async def load_adapter(self, name: str, config: LoRAConfig,
                           named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
        """Load the rollout model's LoRA adapter `name`, or give it `version` of its tensors (all,
        or those that changed); turns naming it run with it (`Turn.adapter`)."""
        return await self._push(named_tensors, {"version": version, "adapter": name, "rank": config.rank,
                                                "alpha": config.alpha, "targets": list(config.targets)})

    async def _push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], params: dict[str, Any]
                    ) -> dict[str, Any]:
        body = save({n: t.detach().contiguous() for n, t in named_tensors})
        return await self._post("/v1/lease/weights", content=body, params=params)
