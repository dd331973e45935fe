"""The co-serving executor over HTTP: the app assembled from the OpenAI router (`openai_api`:
completions, chat, models, /health, /metrics) and the lease router (`lease_api`), around an
engine loop its caller made, which the caller may also use in process (the serving device
loads its weights through it).

Here: the limits, the middleware in front of routing, and error handling. Every 4xx has an
OpenAI-style error body; the executor keeps serving the others. The OpenAI API and the lease
API each take their own bearer key (`ServerLimits`); /health and /metrics stay open. Bodies are
capped, each model's queue of requests waiting for their first token is bounded (429 beyond it)
and has a deadline (503). A client that disconnects, streaming or not, has its request aborted.
Once the shutdown drain starts (`rose.coserve.drain`) every new request but /metrics gets a 503.
"""

from __future__ import annotations

import contextlib
import hmac
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, ExceptionHandler, Message, Receive, Scope, Send

from rose.contracts import TurnHost
from rose.coserve import lease_api, openai_api
from rose.coserve.api_errors import APIError, ClientGone
from rose.coserve.api_state import Arrivals, Drain, LeaseState, ServerState
from rose.coserve.executor import CoServingExecutor
from rose.coserve.lease_api import LEASE_PREFIX, WEIGHTS_PATH
from rose.coserve.settings import ChatOptions, ServerLimits
from rose.engine import RequestOutput
from rose.model import Tokenizer
from rose.steploop import StepLoop

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class _Guard:
    """ASGI middleware in front of routing: the drain, the bearer keys, then the body-size cap
    (from Content-Length, and while the body streams in). The body is read here, whole, so that
    no handler ever holds more than the cap; it is replayed to the app. An authorized serving
    request counts as arriving from here until the engine has it (`Arrivals`): the handler ends
    its arrival (`scope["state"]["arrived"]`) once it is queued, this middleware at the latest;
    and as open for the drain until its response is sent."""

    def __init__(self, app: ASGIApp, limits: ServerLimits, arrivals: Arrivals, drain: Drain) -> None:
        self.app, self.limits, self.arrivals, self.drain = app, limits, arrivals, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # the turn stream: its key on the upgrade, its bounds its own
            try:
                self._admit(scope["path"])
                self._authorize(scope, scope["path"])
            except APIError as exc:
                await receive()  # the client's connect
                code = 1013 if exc.status == 503 else 1008  # try again later; policy violation
                await send({"type": "websocket.close", "code": code, "reason": exc.message[:120]})
                return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        try:
            self._admit(path)
            self._authorize(scope, path)
        except APIError as exc:
            await exc.response()(scope, receive, send)
            return
        arrived = (self.arrivals.arrive() if scope["method"] == "POST" and path in openai_api.GENERATE_PATHS
                   else _nothing)
        scope.setdefault("state", {})["arrived"] = arrived
        serving = path not in OPEN_PATHS and not path.startswith(LEASE_PREFIX)
        with self.drain.serving() if serving else contextlib.nullcontext():
            await self._forward(scope, receive, send, path, arrived)

    async def _forward(self, scope: Scope, receive: Receive, send: Send, path: str,
                       arrived: Callable[[], None]) -> None:
        try:
            try:
                body = await _read_body(scope, receive, self.limits.max_weights_bytes
                                        if path == WEIGHTS_PATH else self.limits.max_body_bytes)
            except APIError as exc:
                await exc.response()(scope, receive, send)
                return
            if body is not None:  # None: the client left while sending it
                await self.app(scope, _replay(body, receive), send)
        finally:
            arrived()

    def _admit(self, path: str) -> None:
        if self.drain.started and path != "/metrics":
            raise APIError(503, "the server is shutting down and takes no new requests; send it to "
                                "another replica", kind="server_error", code="shutting_down",
                           headers={"Connection": "close"})

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


def _nothing() -> None:
    pass


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


# -- error handling: every error an OpenAI-style body ------------------------------------------

async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
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
    return APIError(400, f"{where or 'body'}: {message}", str(loc[0]) if loc else None).response()


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind,
                    headers=dict(exc.headers or {})).response()


async def _crashed(_: Request, exc: Exception) -> JSONResponse:  # a bug: still an OpenAI-shaped body
    return APIError(500, f"internal error: {type(exc).__name__}", kind="server_error").response()


async def _gone(_: Request, __: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it


_HANDLERS: dict[type[Exception], ExceptionHandler] = {RequestValidationError: _invalid, APIError: _api_error,
                                         StarletteHTTPException: _http_error, Exception: _crashed,
                                         ClientGone: _gone}


# -- the app -----------------------------------------------------------------------------------

def _stop_loop(loop: StepLoop[RequestOutput], timeout_s: float) -> None:
    """Stop the engine thread, waiting at most `timeout_s`: an iteration that never returns
    must not keep the process from exiting (the engine thread is a daemon)."""
    stopper = threading.Thread(target=loop.shutdown, name="rose-executor-stop", daemon=True)
    stopper.start()
    stopper.join(timeout_s)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    # A serving request on its way in interrupts the rollout iteration in progress.
    state.executor.serving_arrived = state.arrivals.pending
    yield
    _stop_loop(state.loop, state.limits.shutdown_timeout_s)


@contextlib.asynccontextmanager
async def _lifespan_of_loop(app: FastAPI) -> AsyncIterator[None]:
    yield
    state: LeaseState = app.state.server
    _stop_loop(state.loop, state.limits.shutdown_timeout_s)


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


def build_app(loop: StepLoop[RequestOutput], executor: CoServingExecutor, tokenizer: Tokenizer,
              model_name: str, limits: ServerLimits | None = None, chat: ChatOptions | None = None,
              sampling_defaults: Mapping[str, float | int] | None = None) -> FastAPI:
    """The HTTP server of `executor`, whose commands go through `loop` (a `StepLoop` over it,
    e.g. `StepLoop(executor, name="rose-executor")`); the app's lifespan stops the loop at exit.
    `sampling_defaults`: what a request samples with where it sets nothing (`serve_config.
    sampling_defaults`)."""
    if loop.target is not executor:
        raise ValueError("the engine loop must drive the executor the app serves")
    limits, chat = limits or ServerLimits(), chat or ChatOptions()
    if chat.chat_template is not None:
        tokenizer = tokenizer.with_chat_template(chat.chat_template)
    app = FastAPI(title="ROSE co-serving executor", lifespan=_lifespan)
    app.state.server = state = ServerState(loop, executor, limits, executor=executor, tokenizer=tokenizer,
                                           model_name=model_name, chat=chat,
                                           sampling_defaults=dict(sampling_defaults or {}))
    executor.metrics.set_model_name(model_name)
    app.add_middleware(_Guard, limits=limits, arrivals=state.arrivals, drain=state.drain)
    for kind, handler in _HANDLERS.items():
        app.add_exception_handler(kind, handler)
    app.include_router(openai_api.router)
    app.include_router(lease_api.router)
    app.include_router(lease_api.control_router)
    _describe_model(app, model_name)
    return app


def build_lease_app(loop: StepLoop[RequestOutput], host: TurnHost, limits: ServerLimits) -> FastAPI:
    """The lease API's turn endpoints alone (the turn stream first), around `host` on `loop`: a
    dedicated worker's, behind the lease key; `/health` answers while the loop makes progress."""
    app = FastAPI(title="ROSE turn host", lifespan=_lifespan_of_loop)
    app.state.server = state = LeaseState(loop, host, limits)
    app.add_middleware(_Guard, limits=limits, arrivals=Arrivals(), drain=state.drain)
    for kind, handler in _HANDLERS.items():
        app.add_exception_handler(kind, handler)
    app.include_router(lease_api.router)

    @app.get("/health")
    async def health() -> Response:
        await state.alive()
        return Response()

    return app
