"""The co-serving executor over HTTP: OpenAI-compatible serving, the lease API, metrics.

- `POST /v1/completions`, `POST /v1/chat/completions` (SSE streaming or not), `GET /v1/models`:
  the serving model, as the official `openai` client expects.
- `POST /v1/lease/turns` (SSE stream of a rollout turn's tokens), `POST /v1/lease/turns/{id}/abort`,
  `GET /v1/lease/capacity`, `POST /v1/lease/heartbeat`, `POST /v1/lease/new_rl_step`,
  `POST /v1/lease/weights` (a safetensors body): the rollout scheduler's side.
- `GET /health`, `GET /metrics` (Prometheus).

Bad requests get a 4xx with an OpenAI-style error body; the executor keeps serving the others.
A client that disconnects mid-stream has its request aborted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from rose.coserve.executor import CoServingExecutor, Turn
from rose.coserve.protocol import ChatCompletionRequest, CompletionRequest, TurnRequest
from rose.engine import InFlight, RequestOutput
from rose.engine.async_engine import EngineDeadError, EngineLoop, RequestFailed
from rose.engine.detokenize import IncrementalDetokenizer
from rose.model import Tokenizer


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error(status: int, message: str, param: str | None = None,
           kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@dataclasses.dataclass
class _Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


def build_app(executor: CoServingExecutor, tokenizer: Tokenizer, model_name: str) -> FastAPI:
    loop: EngineLoop | None = None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal loop
        loop = EngineLoop(executor, name="rose-executor")
        yield
        loop.shutdown()

    app = FastAPI(title="ROSE co-serving executor", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = "malformed JSON body" if first.get("type") == "json_invalid" else first.get("msg")
        return _error(400, f"{where or 'body'}: {message}", where or None)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, exc.kind)

    def _loop() -> EngineLoop:
        assert loop is not None, "the app's lifespan has not started"
        return loop

    def _check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "model", "not_found_error")

    async def _generate(prompt_ids: list[int], body: CompletionRequest | ChatCompletionRequest,
                        max_tokens: int | None) -> AsyncIterator[_Delta]:
        """Run one serving request; yield one delta per engine output (detokenized incrementally:
        text is held back while a UTF-8 character or a stop string may still be incomplete, but
        the delta still goes out with its token ids, so that the client sees every token when
        it is produced, as vLLM streams)."""
        body_max = max_tokens or body.max_tokens
        # By default a request may grow to what the model's context and the KV pool hold.
        default = max(1, executor.serving.max_request_tokens - len(prompt_ids))
        # End-of-sequence ids are the engine's (from the checkpoint), so that ignore_eos holds.
        params = body.model_copy(update={"max_tokens": body_max}).sampling(default, body.stop_token_ids)
        rid = f"cmpl-{uuid.uuid4().hex}"
        text = IncrementalDetokenizer(tokenizer.decode, body.stop_strings)
        try:
            stream = _loop().stream(rid, lambda: executor.add_serving(prompt_ids, params, rid))
            async for out in stream:
                delta = text.push(out.token_ids, out.finished)
                finish = "stop" if text.stopped else out.finish_reason if out.finished else None
                yield _Delta(delta, out.token_ids, out.logprobs, finish)
                if text.stopped:
                    await stream.aclose()  # aborts the request in the engine
                    return
        except ValueError as exc:  # the engine refused the request: bad input
            raise APIError(400, str(exc)) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), kind="server_error") from None
        except RequestFailed as exc:
            raise APIError(500, str(exc), kind="server_error") from None

    def _usage(prompt: int, completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(executor.metrics.expose(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "rose"}]}

    async def _respond(kind: str, prompt_ids: list[int], body: CompletionRequest | ChatCompletionRequest,
                       max_tokens: int | None) -> Response:
        created, rid = int(time.time()), f"{kind}-{uuid.uuid4().hex}"
        chat = kind == "chatcmpl"
        obj = "chat.completion" if chat else "text_completion"
        deltas = _generate(prompt_ids, body, max_tokens)
        first = await anext(deltas)  # bad input surfaces here, as a 4xx, before any byte is sent

        def choice(delta: _Delta, stream: bool) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "finish_reason": delta.finish_reason}
            if chat:
                c["delta" if stream else "message"] = {"role": "assistant", "content": delta.text}
            else:
                c["text"] = delta.text
            if body.logprobs:
                tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in delta.token_ids]
                c["logprobs"] = ({"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                              for t, lp in zip(tokens, delta.logprobs, strict=True)]}
                                 if chat else {"tokens": tokens, "token_logprobs": delta.logprobs,
                                               "top_logprobs": None, "text_offset": None})
            else:
                c["logprobs"] = None
            return c

        if not body.stream:
            text, finish = first.text, first.finish_reason
            ids, lps = list(first.token_ids), list(first.logprobs)
            async for d in deltas:
                text, finish = text + d.text, d.finish_reason
                ids += d.token_ids
                lps += d.logprobs
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                                 "choices": [choice(_Delta(text, ids, lps, finish), False)],
                                 "usage": _usage(len(prompt_ids), len(ids))})

        async def events() -> AsyncIterator[str]:
            chunk = {"id": rid, "object": f"{obj}.chunk" if chat else obj, "created": created,
                     "model": model_name}
            completion = len(first.token_ids)
            try:
                yield _sse({**chunk, "choices": [choice(first, True)]})
                async for delta in deltas:
                    completion += len(delta.token_ids)
                    yield _sse({**chunk, "choices": [choice(delta, True)]})
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse({**chunk, "choices": [], "usage": _usage(len(prompt_ids), completion)})
                yield _sse("[DONE]")
            finally:
                await deltas.aclose()  # a client that went away: abort the request

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        _check_model(body.model)
        ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        return await _respond("cmpl", ids, body, None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        _check_model(body.model)
        text = tokenizer.apply_chat_template([m.model_dump() for m in body.messages])
        return await _respond("chatcmpl", tokenizer.encode(text), body, body.max_completion_tokens)

    # -- the lease API ---------------------------------------------------------------------------

    def _turn_event(out: RequestOutput) -> dict[str, Any]:
        """A turn's new tokens (an abort's event has none: its tokens were streamed)."""
        return {"turn_id": out.request_id, "token_ids": out.token_ids, "logprobs": out.logprobs,
                "versions": out.versions, "finished": out.finished,
                "finish_reason": out.finish_reason, "num_tokens": out.num_output_tokens}

    @app.post("/v1/lease/turns")
    async def submit_turn(body: TurnRequest) -> Response:
        turn = Turn(body.turn_id, body.trajectory_id, body.token_ids,
                    body.sampling(64, body.stop_token_ids), body.policy_version)
        outputs = _loop().stream(turn.turn_id, lambda: executor.submit_turn(turn))
        try:
            first = await anext(outputs)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

        async def events() -> AsyncIterator[str]:
            try:
                yield _sse(_turn_event(first))
                async for out in outputs:
                    yield _sse(_turn_event(out))
            finally:
                await outputs.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/lease/turns/{turn_id}/abort")
    async def abort_turn(turn_id: str) -> dict[str, Any]:
        out = await _loop().abort(turn_id)
        if out is None:
            raise APIError(404, f"no running turn {turn_id!r}", "turn_id", "not_found_error")
        return _turn_event(out)

    async def _capacity() -> dict[str, Any]:
        try:
            return dataclasses.asdict(await _loop().call(executor.capacity))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    @app.get("/v1/lease/capacity")
    async def capacity() -> dict[str, Any]:
        return await _capacity()

    @app.post("/v1/lease/heartbeat")
    async def heartbeat() -> dict[str, Any]:
        return {"time": time.time(), "capacity": await _capacity()}

    @app.post("/v1/lease/new_rl_step")
    async def new_rl_step() -> dict[str, str]:
        await _loop().call(executor.new_rl_step)
        return {"state": executor.burst.state.name.lower()}

    @app.post("/v1/lease/weights")
    async def weights(request: Request, version: int, in_flight: str = "continue") -> dict[str, Any]:
        try:
            mode = InFlight(in_flight)
            tensors = load_safetensors(await request.body())
        except (ValueError, SafetensorError) as exc:
            raise APIError(400, f"expected a safetensors body and in_flight in "
                                f"{[m.value for m in InFlight]}: {exc}") from None
        try:
            await _loop().call(lambda: executor.load_weights(tensors.items(), version, mode))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return {"policy_version": version, "tensors": len(tensors)}

    return app
