"""The serving model over OpenAI's API: `POST /v1/completions`, `POST /v1/chat/completions`
(SSE streaming or not), `GET /v1/models`, as the official `openai` client expects; beside them,
as vLLM has them, `GET /health` (answers only while the engine loop does) and `GET /metrics`
(Prometheus)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rose.coserve.api_errors import APIError
from rose.coserve.api_state import Served, ServerState, sse, unless_gone
from rose.coserve.executor import SERVING
from rose.coserve.protocol import ChatCompletionRequest, CompletionRequest
from rose.engine.detokenize import IncrementalDetokenizer
from rose.steploop import LoopDeadError, RequestFailed

router = APIRouter()
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclasses.dataclass
class _Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                       "model", "not_found_error")


async def _generate(state: ServerState, prompt_ids: list[int],
                    body: CompletionRequest | ChatCompletionRequest,
                    max_tokens: int | None, arrived: Callable[[], None]) -> AsyncIterator[_Delta]:
    """Run one serving request; yield one delta per engine output (detokenized incrementally:
    text is held back while a UTF-8 character or a stop string may still be incomplete, but
    the delta still goes out with its token ids, so that the client sees every token when
    it is produced, as vLLM streams). `arrived` ends the request's arrival once it is queued."""
    executor = state.executor
    body_max = max_tokens or body.max_tokens
    # By default a request may grow to what the model's context and the KV pool hold.
    default = max(1, executor.serving.max_request_tokens - len(prompt_ids))
    # End-of-sequence ids are the engine's (from the checkpoint), so that ignore_eos holds.
    params = body.model_copy(update={"max_tokens": body_max}).sampling(default, body.stop_token_ids)
    rid = f"cmpl-{uuid.uuid4().hex}"
    text = IncrementalDetokenizer(state.tokenizer.decode, body.stop_strings)

    def add() -> None:
        try:
            executor.add_serving(prompt_ids, params, rid)
        finally:  # queued (or refused): from the next iteration on, admission sees it waiting
            arrived()

    try:
        stream = state.loop.stream(rid, add)
        async for out in stream:
            delta = text.push(out.token_ids, out.finished)
            finish = "stop" if text.stopped else out.finish_reason if out.finished else None
            yield _Delta(delta, out.token_ids, out.logprobs, finish)
            if text.stopped:
                await stream.aclose()  # aborts the request in the engine
                return
    except ValueError as exc:  # the engine refused the request: bad input
        raise APIError(400, str(exc)) from None
    except LoopDeadError as exc:
        raise APIError(503, str(exc), kind="server_error") from None
    except RequestFailed as exc:
        raise APIError(500, str(exc), kind="server_error") from None


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _respond(state: ServerState, request: Request, kind: str, prompt_ids: list[int],
                   body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> Response:
    created, rid = int(time.time()), f"{kind}-{uuid.uuid4().hex}"
    chat = kind == "chatcmpl"
    obj = "chat.completion" if chat else "text_completion"
    deltas = _generate(state, prompt_ids, body, max_tokens, request.state.arrived)
    # Bad input surfaces here, as a 4xx, before any byte is sent.
    first = await state.first(request, deltas, SERVING)

    def choice(delta: _Delta, stream: bool) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0, "finish_reason": delta.finish_reason}
        if chat:
            c["delta" if stream else "message"] = {"role": "assistant", "content": delta.text}
        else:
            c["text"] = delta.text
        if body.logprobs:
            tokens = [state.tokenizer.decode([t], skip_special_tokens=False) for t in delta.token_ids]
            c["logprobs"] = ({"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                          for t, lp in zip(tokens, delta.logprobs, strict=True)]}
                             if chat else {"tokens": tokens, "token_logprobs": delta.logprobs,
                                           "top_logprobs": None, "text_offset": None})
        else:
            c["logprobs"] = None
        return c

    async def collect() -> _Delta:
        text, finish = first.text, first.finish_reason
        ids, lps = list(first.token_ids), list(first.logprobs)
        async for d in deltas:
            text, finish = text + d.text, d.finish_reason
            ids += d.token_ids
            lps += d.logprobs
        return _Delta(text, ids, lps, finish)

    if not body.stream:
        whole = await unless_gone(request, collect())  # a client gone: no use generating on
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": state.model_name,
                             "choices": [choice(whole, False)],
                             "usage": _usage(len(prompt_ids), len(whole.token_ids))})

    async def events() -> AsyncIterator[str]:
        chunk = {"id": rid, "object": f"{obj}.chunk" if chat else obj, "created": created,
                 "model": state.model_name}
        completion = len(first.token_ids)
        try:
            yield sse({**chunk, "choices": [choice(first, True)]})
            async for delta in deltas:
                completion += len(delta.token_ids)
                yield sse({**chunk, "choices": [choice(delta, True)]})
            if body.stream_options and body.stream_options.include_usage:
                yield sse({**chunk, "choices": [], "usage": _usage(len(prompt_ids), completion)})
            yield sse("[DONE]")
        finally:
            await deltas.aclose()  # a client that went away: abort the request

    return StreamingResponse(events(), media_type="text/event-stream")


async def _encode(state: ServerState, text: str, param: str) -> list[int]:
    """Tokenize off the event loop; a text too long to fit the context in any tokenization
    is refused before it is encoded (encoding megabytes costs seconds and memory)."""
    tokens, per_token = state.executor.serving.max_request_tokens, state.tokenizer.max_token_chars
    if len(text) > tokens * per_token:
        raise APIError(400, f"{param}: {len(text)} characters cannot fit in the {tokens} tokens a "
                            f"request may hold (a token has at most {per_token} characters)", param)
    return await asyncio.to_thread(state.tokenizer.encode, text)


# A route function's name makes its OpenAPI operation id: renaming one changes the schema.

@router.get("/health")
async def health(state: Served) -> dict[str, str]:
    await state.alive()
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(state: Served) -> Response:
    return Response(state.executor.metrics.expose(), media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(state: Served) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                        "owned_by": "rose"}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: Served) -> Response:
    _check_model(state, body.model)
    ids = await _encode(state, body.prompt, "prompt") if isinstance(body.prompt, str) else body.prompt
    return await _respond(state, request, "cmpl", ids, body, None)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: Served) -> Response:
    _check_model(state, body.model)
    text = state.tokenizer.apply_chat_template([m.model_dump(exclude={"name"}) for m in body.messages])
    ids = await _encode(state, text, "messages")
    return await _respond(state, request, "chatcmpl", ids, body, body.max_completion_tokens)
