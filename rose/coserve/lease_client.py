"""Client of the executor's lease API: what a rollout worker or scheduler calls over HTTP."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

import httpx
import torch
from safetensors.torch import save

from rose.engine import InFlight, SamplingParams


@dataclasses.dataclass
class TurnResult:
    """What a leased turn produced; `finish_reason` 'abort' means handed back unfinished."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


class LeaseError(RuntimeError):
    """The executor refused a lease call (its 4xx message) or could not be reached."""


class LeaseClient:
    def __init__(self, url: str, client: httpx.AsyncClient | None = None, key: str | None = None) -> None:
        """`key`: the executor's lease key, sent as a bearer token (None: the executor has none)."""
        self.url = url.rstrip("/")
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(300.0))
        if key is not None:
            self._client.headers["Authorization"] = f"Bearer {key}"

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _post(self, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            r = await self._client.post(f"{self.url}{path}", **kwargs)
        except httpx.HTTPError as exc:
            raise LeaseError(f"{self.url}{path}: {exc}") from exc
        if r.status_code != 200:
            raise LeaseError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    async def run_turn(self, turn_id: str, trajectory_id: str, token_ids: list[int],
                       params: SamplingParams, policy_version: int | None = None,
                       result: TurnResult | None = None) -> TurnResult:
        """Stream one turn to completion (or until the executor hands it back). Tokens land in
        `result` as they arrive, so a caller that is cancelled midway keeps what came."""
        result = result or TurnResult()
        body = {"turn_id": turn_id, "trajectory_id": trajectory_id, "token_ids": token_ids,
                "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "seed": params.seed, "ignore_eos": params.ignore_eos,
                "stop_token_ids": list(params.stop_token_ids), "policy_version": policy_version}
        try:
            async with self._client.stream("POST", f"{self.url}/v1/lease/turns", json=body) as r:
                if r.status_code != 200:
                    raise LeaseError(f"turn {turn_id!r}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    result.token_ids += event["token_ids"]
                    result.logprobs += event["logprobs"]
                    result.versions += event["versions"]
                    result.finish_reason = event["finish_reason"] if event["finished"] else None
        except httpx.HTTPError as exc:
            raise LeaseError(f"turn {turn_id!r} on {self.url}: {exc}") from exc
        return result

    async def capacity(self) -> dict[str, Any]:
        try:
            r = await self._client.get(f"{self.url}/v1/lease/capacity")
        except httpx.HTTPError as exc:
            raise LeaseError(f"{self.url}: {exc}") from exc
        return r.json()

    async def heartbeat(self) -> dict[str, Any]:
        return await self._post("/v1/lease/heartbeat")

    async def abort(self, turn_id: str) -> dict[str, Any]:
        return await self._post(f"/v1/lease/turns/{turn_id}/abort")

    async def new_rl_step(self) -> dict[str, Any]:
        return await self._post("/v1/lease/new_rl_step")

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                           in_flight: InFlight = InFlight.CONTINUE) -> dict[str, Any]:
        body = save({n: t.detach().contiguous() for n, t in named_tensors})
        return await self._post("/v1/lease/weights", content=body,
                                params={"version": version, "in_flight": in_flight.value})
