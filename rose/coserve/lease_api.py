"""The rollout scheduler's side, the lease API: `GET /v1/lease/stream` (a WebSocket carrying
many turns both ways, the driver's transport: `rose.coserve.turn_stream`), `POST /v1/lease/turns`
(one turn, its tokens as an SSE stream: the simplest client's), `POST /v1/lease/turns/{id}/abort`,
`GET /v1/lease/capacity`, `POST /v1/lease/heartbeat`, `POST /v1/lease/new_rl_step`,
`POST /v1/lease/weights` (a safetensors body: the rollout model's weights, or with `adapter=NAME`
and its LoRA settings in the query, its LoRA adapter's). A turn is the contract's `Turn` as it is, in
either transport."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, WebSocket
from fastapi.responses import Response, StreamingResponse
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from rose.contracts import TURN_CHUNK_S, InFlight, RequestOutput, Turn, TurnOutput
from rose.contracts.adapter import LoRAConfig
from rose.coserve.api_errors import APIError, busy
from rose.coserve.api_state import Leased, LeaseState, Served, sse
from rose.coserve.executor import ROLLOUT, StaleVersion, TurnSlotsFull
from rose.coserve.protocol import INT64_MAX, MAX_ID_CHARS, TURN_OUTPUT, TurnError, check_turn
from rose.coserve.turn_stream import STREAM_PATH, serve_turns

LEASE_PREFIX = "/v1/lease/"
WEIGHTS_PATH = "/v1/lease/weights"
# The weights endpoint reads its body raw: the schema says so, for clients and fuzzers.
MAX_TARGETS = 64  # an adapter push's target module names
_BINARY_BODY = {"requestBody": {"required": True, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}

router = APIRouter()  # a turn host's: a serving executor's or a dedicated worker's
control_router = APIRouter()  # a co-serving executor's alone


def _event(out: RequestOutput) -> str:
    """A turn's new tokens as its stream's event (an abort's has none: its tokens were streamed)."""
    return TURN_OUTPUT.dump_json(out.turn_output()).decode()


async def _capacity(state: LeaseState) -> dict[str, Any]:
    try:
        return dataclasses.asdict(await state.loop.call(state.host.capacity))
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


# A route function's name makes its OpenAPI operation id: renaming one changes the schema.

@router.websocket(STREAM_PATH)
async def turn_stream(ws: WebSocket) -> None:
    state: LeaseState = ws.app.state.server
    await serve_turns(ws, state.loop, state.host)


@router.post("/v1/lease/turns")
async def submit_turn(turn: Turn, request: Request, state: Leased) -> Response:
    try:
        check_turn(turn)
    except TurnError as exc:
        raise APIError(400, str(exc), exc.field.split(".")[0]) from None
    outputs = state.loop.stream(turn.turn_id, lambda: state.host.submit_turn(turn), TURN_CHUNK_S)
    try:
        first = await state.first(request, outputs, ROLLOUT)
    except TurnSlotsFull as exc:
        raise busy(429, str(exc), "lease_slots_full") from None
    except ValueError as exc:
        raise APIError(400, str(exc)) from None

    async def events() -> AsyncIterator[str]:
        try:
            yield sse(_event(first))
            async for out in outputs:
                yield sse(_event(out))
        finally:
            await outputs.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


@router.post("/v1/lease/turns/{turn_id}/abort")
async def abort_turn(turn_id: str, state: Leased) -> TurnOutput:
    """The turn's last event, which also ends its stream."""
    out = await state.loop.abort(turn_id, state.host.abort_turn)  # rollout turns only; their streams end
    if out is None:
        raise APIError(404, f"no running turn {turn_id!r}", "turn_id", "not_found_error")
    return out.turn_output()


@router.get("/v1/lease/capacity")
async def capacity(state: Leased) -> dict[str, Any]:
    return await _capacity(state)


@router.post("/v1/lease/heartbeat")
async def heartbeat(state: Leased) -> dict[str, Any]:
    await state.alive()  # a dead or stuck engine loop must fail the heartbeat, not hang it
    return {"time": time.time(), "capacity": await state.answered(_capacity(state))}


@control_router.post("/v1/lease/new_rl_step")
async def new_rl_step(state: Served) -> dict[str, str]:
    await state.loop.call(state.executor.new_rl_step)
    return {"state": state.executor.burst.state.name.lower()}


def _adapter(name: str | None, rank: int | None, alpha: float | None, targets: list[str] | None,
             in_flight: InFlight) -> tuple[str, LoRAConfig] | None:
    """The pushed adapter's name and settings (None: the push is the model's weights); APIError
    400 naming what is missing or wrong."""
    settings = {"rank": rank, "alpha": alpha, "targets": targets}
    given = [key for key, value in settings.items() if value is not None]
    if name is None:
        if given:
            raise APIError(400, f"{given[0]}: an adapter's setting, given with no adapter; expected "
                                "adapter=NAME with it, or none of rank, alpha, targets", given[0])
        return None
    missing = [key for key in settings if key not in given]
    if missing:
        raise APIError(400, f"{missing[0]}: an adapter push names its LoRA rank, alpha and targets; "
                            f"{missing[0]} is missing", missing[0])
    if in_flight is not InFlight.CONTINUE:
        raise APIError(400, f"in_flight: an adapter's new version always continues its running turns over "
                            f"their KV; expected continue, got {in_flight.value}", "in_flight")
    try:
        return name, LoRAConfig(rank=rank, alpha=alpha, targets=tuple(targets or ()))  # type: ignore[arg-type]
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


@control_router.post(WEIGHTS_PATH, openapi_extra=_BINARY_BODY)
async def weights(request: Request, state: Served, version: int = Query(ge=0, le=INT64_MAX),
                  in_flight: InFlight = InFlight.CONTINUE,
                  adapter: Annotated[str | None, Query(min_length=1, max_length=MAX_ID_CHARS)] = None,
                  rank: int | None = None, alpha: float | None = None,
                  targets: Annotated[list[str] | None, Query(max_length=MAX_TARGETS)] = None
                  ) -> dict[str, Any]:
    """The rollout model's new weights; or, with `adapter` and its LoRA settings (`rank`, `alpha`,
    `targets`: PEFT's `r`, `lora_alpha`, `target_modules`), its adapter of that name: loaded, or
    given a new version of all its tensors or of those that changed."""
    pushed = _adapter(adapter, rank, alpha, targets, in_flight)
    body = await request.body()
    try:  # off the event loop: a whole model's body takes a while to read
        tensors = await asyncio.to_thread(load_safetensors, body)
    except (ValueError, SafetensorError) as exc:
        raise APIError(400, f"expected a safetensors body: {exc}") from None
    # Applied on the engine thread; each tensor taken is progress for /health.
    pieces = state.loop.progressing(tensors.items())
    executor = state.executor
    try:
        if pushed is None:
            await state.loop.call(lambda: executor.load_weights(pieces, version, in_flight))
        else:
            await state.loop.call(lambda: executor.load_adapter(*pushed, pieces, version))
    except StaleVersion as exc:
        raise APIError(409, str(exc), "version", code="stale_version") from None
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    return {"policy_version": version, "tensors": len(tensors)} | ({"adapter": adapter} if pushed else {})
