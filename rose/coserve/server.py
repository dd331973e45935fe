"""The co-serving executor over HTTP: OpenAI-compatible serving, the lease API, metrics.

- `POST /v1/completions`, `POST /v1/chat/completions` (SSE streaming or not), `GET /v1/models`:
  the serving model, as the official `openai` client expects.
- `POST /v1/lease/turns` (SSE stream of a rollout turn's tokens), `POST /v1/lease/turns/{id}/abort`,
  `GET /v1/lease/capacity`, `POST /v1/lease/heartbeat`, `POST /v1/lease/new_rl_step`,
  `POST /v1/lease/weights` (a safetensors body): the rollout scheduler's side.
- `GET /health` (answers only while the engine loop does), `GET /metrics` (Prometheus).

Every 4xx has an OpenAI-style error body; the executor keeps serving the others. The OpenAI API
and the lease API each take their own bearer key (`ServerLimits`); /health and /metrics stay
open. Bodies are capped, each model's queue of requests waiting for their first token is
bounded (429 beyond it) and has a deadline (503). A client that disconnects, streaming or not,
has its request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rose.coserve.executor import ROLLOUT, SERVING, CoServingExecutor, Turn, TurnSlotsFull
from rose.coserve.protocol import INT64_MAX, ChatCompletionRequest, CompletionRequest, TurnRequest
from rose.engine import InFlight, RequestOutput
from rose.engine.async_engine import EngineDeadError, EngineLoop, RequestFailed
from rose.engine.detokenize import IncrementalDetokenizer
from rose.model import Tokenizer

T = TypeVar("T")
OPEN_PATHS = frozenset({"/health", "/metrics"})
LEASE_PREFIX = "/v1/lease/"
WEIGHTS_PATH = "/v1/lease/weights"
RETRY_AFTER_S = 1


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Who may call, and how much any caller may ask of the server."""

    api_key: str | None = None  # bearer key of the OpenAI API; None: open
    lease_key: str | None = None  # bearer key of /v1/lease/*; None: open
    max_body_bytes: int = 4 * 1024**2
    max_weights_bytes: int = 64 * 1024**3  # POST /v1/lease/weights: a whole model
    max_waiting_per_model: int = 256  # requests of one model waiting for their first token
    queue_timeout_s: float = 120.0  # no first token by then: aborted, answered 503
    health_timeout_s: float = 10.0  # the engine loop must answer /health within this
    shutdown_timeout_s: float = 5.0  # waited for the engine thread to stop at exit
    max_connections: int = 1024  # uvicorn's limit_concurrency: connections beyond it get a 503

    def __post_init__(self) -> None:
        for name in ("api_key", "lease_key"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must be a non-empty string, or None for no key")
        for name in ("max_body_bytes", "max_weights_bytes", "max_waiting_per_model", "queue_timeout_s",
                     "health_timeout_s", "shutdown_timeout_s", "max_connections"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code, self.headers = code, headers


class _StaleVersion(Exception):
    """New weights whose version is not above the current one."""


class _ClientGone(Exception):
    """The client disconnected before its response was ready."""


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _busy(status: int, message: str, code: str) -> APIError:
    kind = "rate_limit_error" if status == 429 else "server_error"
    return APIError(status, message, kind=kind, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@dataclasses.dataclass
class _Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


class _Guard:
    """ASGI middleware in front of routing: the bearer keys, then the body-size cap (from
    Content-Length, and while the body streams in). The body is read here, whole, so that no
    handler ever holds more than the cap; it is replayed to the app."""

    def __init__(self, app: ASGIApp, limits: ServerLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        try:
            self._authorize(scope, path)
            body = await _read_body(scope, receive, self.limits.max_weights_bytes if path == WEIGHTS_PATH
                                    else self.limits.max_body_bytes)
        except APIError as exc:
            await _error(exc.status, exc.message, exc.param, exc.kind, exc.code, exc.headers)(
                scope, receive, send)
            return
        if body is not None:  # None: the client left while sending it
            await self.app(scope, _replay(body, receive), send)

    def _authorize(self, scope: Scope, path: str) -> None:
        if path in OPEN_PATHS:
            return
        lease = path.startswith(LEASE_PREFIX)
        key = self.limits.lease_key if lease else self.limits.api_key
        if key is None:
            return
        headers = dict(scope["headers"])
        scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("latin-1"),
                                                                 key.encode()):
            api = "the lease API" if lease else "the OpenAI API"
            raise APIError(401, f"missing or wrong bearer key for {api}: send 'Authorization: Bearer "
                                f"<key>' with the server's {'lease key' if lease else 'API key'}",
                           kind="invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})


def _too_large(cap: int, size: str) -> APIError:
    return APIError(413, f"the request body is {size}; this endpoint takes at most {cap} bytes",
                    kind="invalid_request_error", code="request_too_large")


async def _read_body(scope: Scope, receive: Receive, cap: int) -> bytes | None:
    """The whole body, or None if the client disconnected; APIError 413 past `cap` bytes."""
    declared = dict(scope["headers"]).get(b"content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, f"Content-Length must be a number of bytes, got {declared[:40]!r}")
        if int(declared) > cap:
            raise _too_large(cap, f"{int(declared)} bytes (Content-Length)")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            raise _too_large(cap, f"over {cap} bytes (streamed)")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands out the body read by `_Guard`, then the client's later messages
    (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, unless the client disconnects first: then cancel it (closing a request's
    output stream aborts the request in the engine) and raise _ClientGone."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        task.cancel()  # a no-op once done
    if task in done:
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # its cleanup (the abort) runs before we answer
    raise _ClientGone


class _Queue:
    """One model's requests waiting for their first token (the event loop's thread alone
    counts them); beyond `limit` new ones are refused with a 429."""

    def __init__(self, model: str, limit: int) -> None:
        self.model, self.limit, self.waiting = model, limit, 0

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        if self.waiting >= self.limit:
            raise _busy(429, f"{self.waiting} {self.model} requests already wait for their first token "
                             f"(max_waiting_per_model {self.limit}); retry later", "queue_full")
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1


def _stop_loop(loop: EngineLoop, timeout_s: float) -> None:
    """Stop the engine thread, waiting at most `timeout_s`: an iteration that never returns
    must not keep the process from exiting (the engine thread is a daemon)."""
    stopper = threading.Thread(target=loop.shutdown, name="rose-executor-stop", daemon=True)
    stopper.start()
    stopper.join(timeout_s)


def _describe_model(app: FastAPI, model_name: str) -> None:
    """Say in the OpenAPI schema that `model` takes the one served name (clients and fuzzers
    read it from there)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for body in ("CompletionRequest", "ChatCompletionRequest"):
                schema["components"]["schemas"][body]["properties"]["model"]["enum"] = [model_name]
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# The weights endpoint reads its body raw: the schema says so, for clients and fuzzers.
_BINARY_BODY = {"requestBody": {"required": True, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


def build_app(executor: CoServingExecutor, tokenizer: Tokenizer, model_name: str,
              limits: ServerLimits | None = None) -> FastAPI:
    limits = limits or ServerLimits()
    loop: EngineLoop | None = None
    queues = {m: _Queue(m, limits.max_waiting_per_model) for m in (SERVING, ROLLOUT)}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal loop
        loop = EngineLoop(executor, name="rose-executor")
        executor.serving_arrived = loop.urgent_waiting
        yield
        _stop_loop(loop, limits.shutdown_timeout_s)

    app = FastAPI(title="ROSE co-serving executor", lifespan=lifespan)
    app.add_middleware(_Guard, limits=limits)
    _describe_model(app, model_name)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # In a union (a prompt is text or token ids) the branch of the wrong type says least.
        first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
        kind = first.get("type")
        # After "body"/"query"/"path": field names and list indices, not union branch tags (nor
        # the character offset of a JSON syntax error).
        loc = [] if kind == "json_invalid" else [
            p for p in first.get("loc", ())[1:] if isinstance(p, int) or str(p).isidentifier()]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        message = ("malformed JSON body" if kind == "json_invalid" else
                   "unknown parameter: this server does not implement it" if kind == "extra_forbidden"
                   else first.get("msg"))
        return _error(400, f"{where or 'body'}: {message}", str(loc[0]) if loc else None)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, exc.kind, exc.code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind,
                      headers=dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def crashed(_: Request, exc: Exception) -> JSONResponse:  # a bug: still an OpenAI-shaped body
        return _error(500, f"internal error: {type(exc).__name__}", kind="server_error")

    @app.exception_handler(_ClientGone)
    async def gone(_: Request, __: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it

    def _loop() -> EngineLoop:
        assert loop is not None, "the app's lifespan has not started"
        return loop

    def _check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "model", "not_found_error")

    async def _first(request: Request, outputs: AsyncIterator[T], model: str) -> T:
        """A request's first output (its first token): the request counts as waiting until
        then, is dropped at `queue_timeout_s`, and aborted if its client leaves."""
        with queues[model].slot():
            try:
                return await _unless_gone(request, asyncio.wait_for(anext(outputs), limits.queue_timeout_s))
            except TimeoutError:
                raise _busy(503, f"no first token within queue_timeout_s ({limits.queue_timeout_s} s): "
                                 f"the executor is overloaded; the request was dropped",
                            "queue_timeout") from None

    async def _alive() -> None:
        try:
            await _loop().ping(limits.health_timeout_s)
        except EngineDeadError as exc:
            raise APIError(503, f"the engine loop is down: {exc}", kind="server_error",
                           code="engine_dead") from None

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
            stream = _loop().stream(rid, lambda: executor.add_serving(prompt_ids, params, rid),
                                    urgent=True)
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
        await _alive()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(executor.metrics.expose(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "rose"}]}

    async def _respond(request: Request, kind: str, prompt_ids: list[int],
                       body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> Response:
        created, rid = int(time.time()), f"{kind}-{uuid.uuid4().hex}"
        chat = kind == "chatcmpl"
        obj = "chat.completion" if chat else "text_completion"
        deltas = _generate(prompt_ids, body, max_tokens)
        # Bad input surfaces here, as a 4xx, before any byte is sent.
        first = await _first(request, deltas, SERVING)

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

        async def collect() -> _Delta:
            text, finish = first.text, first.finish_reason
            ids, lps = list(first.token_ids), list(first.logprobs)
            async for d in deltas:
                text, finish = text + d.text, d.finish_reason
                ids += d.token_ids
                lps += d.logprobs
            return _Delta(text, ids, lps, finish)

        if not body.stream:
            whole = await _unless_gone(request, collect())  # a client gone: no use generating on
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name,
                                 "choices": [choice(whole, False)],
                                 "usage": _usage(len(prompt_ids), len(whole.token_ids))})

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

    async def _encode(text: str, param: str) -> list[int]:
        """Tokenize off the event loop; a text too long to fit the context in any tokenization
        is refused before it is encoded (encoding megabytes costs seconds and memory)."""
        tokens, per_token = executor.serving.max_request_tokens, tokenizer.max_token_chars
        if len(text) > tokens * per_token:
            raise APIError(400, f"{param}: {len(text)} characters cannot fit in the {tokens} tokens a "
                                f"request may hold (a token has at most {per_token} characters)", param)
        return await asyncio.to_thread(tokenizer.encode, text)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(body.model)
        ids = await _encode(body.prompt, "prompt") if isinstance(body.prompt, str) else body.prompt
        return await _respond(request, "cmpl", ids, body, None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(body.model)
        text = tokenizer.apply_chat_template([m.model_dump(exclude={"name"}) for m in body.messages])
        ids = await _encode(text, "messages")
        return await _respond(request, "chatcmpl", ids, body, body.max_completion_tokens)

    # -- the lease API ---------------------------------------------------------------------------

    def _turn_event(out: RequestOutput) -> dict[str, Any]:
        """A turn's new tokens (an abort's event has none: its tokens were streamed)."""
        return {"turn_id": out.request_id, "token_ids": out.token_ids, "logprobs": out.logprobs,
                "versions": out.versions, "finished": out.finished,
                "finish_reason": out.finish_reason, "num_tokens": out.num_output_tokens}

    @app.post("/v1/lease/turns")
    async def submit_turn(body: TurnRequest, request: Request) -> Response:
        turn = Turn(body.turn_id, body.trajectory_id, body.token_ids,
                    body.sampling(64, body.stop_token_ids), body.policy_version)
        outputs = _loop().stream(turn.turn_id, lambda: executor.submit_turn(turn))
        try:
            first = await _first(request, outputs, ROLLOUT)
        except TurnSlotsFull as exc:
            raise _busy(429, str(exc), "lease_slots_full") from None
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
        out = await _loop().abort(turn_id, executor.abort_turn)  # rollout turns only; their streams end
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
        await _alive()  # a dead or stuck engine loop must fail the heartbeat, not hang it
        return {"time": time.time(), "capacity": await _capacity()}

    @app.post("/v1/lease/new_rl_step")
    async def new_rl_step() -> dict[str, str]:
        await _loop().call(executor.new_rl_step)
        return {"state": executor.burst.state.name.lower()}

    @app.post(WEIGHTS_PATH, openapi_extra=_BINARY_BODY)
    async def weights(request: Request, version: int = Query(ge=0, le=INT64_MAX),
                      in_flight: InFlight = InFlight.CONTINUE) -> dict[str, Any]:
        try:
            tensors = load_safetensors(await request.body())
        except (ValueError, SafetensorError) as exc:
            raise APIError(400, f"expected a safetensors body: {exc}") from None

        def swap() -> None:  # on the engine thread: no other swap can pass the check meanwhile
            current = executor.capacity().policy_version
            # The same version again is a re-sync (a full copy after a failed delta, a restart).
            if version < current:
                raise _StaleVersion(f"version {version}: the rollout model already has version {current}; "
                                    f"weight versions only move forward")
            executor.load_weights(tensors.items(), version, in_flight)

        try:
            await _loop().call(swap)
        except _StaleVersion as exc:
            raise APIError(409, str(exc), "version", code="stale_version") from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        return {"policy_version": version, "tensors": len(tensors)}

    return app
