"""The serving model over OpenAI's API: `POST /v1/completions`, `POST /v1/chat/completions`
(SSE streaming or not, `n` choices), `GET /v1/models`, as the official `openai` client expects;
beside them, as vLLM has them, `GET /health` (answers only while the engine loop does),
`GET /metrics` (Prometheus), `POST /tokenize`, `POST /detokenize` and `GET /version`."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError

from rose.contracts import SamplingParams
from rose.coserve.api_errors import APIError
from rose.coserve.api_state import Served, ServerState, sse, unless_gone
from rose.coserve.chat_reply import ChoiceReader, ReplyPlan
from rose.coserve.executor import SERVING
from rose.coserve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from rose.engine.detokenize import IncrementalDetokenizer
from rose.steploop import LoopDeadError, RequestFailed

router = APIRouter()
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclasses.dataclass
class _Delta:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per token, its likeliest (id, logprob) (if asked)
    finish_reason: str | None
    # vLLM's extension: the stop string or stop token id that ended the choice (None otherwise)
    stop_reason: str | int | None = None

    def extend(self, later: _Delta) -> None:
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.top += later.top
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                       "model", "not_found_error")


async def _generate(state: ServerState, prompt_ids: list[int], params: SamplingParams,
                    body: CompletionRequest | ChatCompletionRequest, arrived: Callable[[], None]
                    ) -> AsyncIterator[_Delta]:
    """Run one serving request; yield one delta per engine output (detokenized incrementally:
    text is held back while a UTF-8 character or a stop string may still be incomplete, but
    the delta still goes out with its token ids, so that the client sees every token when
    it is produced, as vLLM streams). `body` says how its text is written (stop strings,
    special tokens); `arrived` ends the request's arrival once it is queued."""
    executor = state.executor
    rid = f"cmpl-{uuid.uuid4().hex}"
    # vLLM counts the checkpoint's end-of-sequence ids other than the tokenizer's own as stop
    # tokens: one of them ending the reply is its stop reason.
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else state.eos_stops)
    skip_special = body.skip_special_tokens
    text = IncrementalDetokenizer(lambda ids: state.tokenizer.decode(ids, skip_special_tokens=skip_special),
                                  body.stop_strings, body.include_stop_str_in_output)

    def add() -> None:
        try:
            executor.add_serving(prompt_ids, params, rid)
        finally:  # queued (or refused): from the next iteration on, admission sees it waiting
            arrived()

    try:
        stream = state.loop.stream(rid, add)
        async for out in stream:
            last = out.token_ids[-1] if out.token_ids else None
            # A stop token's text is left out, as vLLM leaves it, unless asked for (the token and its
            # logprob stay).
            stop_token = last if out.finish_reason == "stop" and last in stop_ids else None
            hide = stop_token is not None and not body.include_stop_str_in_output
            shown = out.token_ids[:-1] if hide else out.token_ids
            delta = text.push(shown, out.finished, out.num_output_tokens > params.min_tokens)
            finish = "stop" if text.stopped else out.finish_reason if out.finished else None
            reason = text.stopped_at if text.stopped else stop_token
            yield _Delta(delta, out.token_ids, out.logprobs, out.top_logprobs, finish, reason)
            if text.stopped:
                await stream.aclose()  # aborts the request in the engine
                return
    except ValueError as exc:  # the engine refused the request: bad input
        raise APIError(400, str(exc)) from None
    except LoopDeadError as exc:
        raise APIError(503, str(exc), kind="server_error") from None
    except RequestFailed as exc:
        raise APIError(500, str(exc), kind="server_error") from None


async def _merge(streams: list[AsyncIterator[_Delta]]) -> AsyncIterator[tuple[int, _Delta]]:
    """The samples' deltas as they come, each with its sample's index. The others start once
    the first sends anything: its prompt's KV is in the prefix cache by then, so they compute
    only their last partial block of it (started together, each would prefill all of it).
    The first error ends them all; so does closing the merge (each request is aborted)."""
    # Bounded: a slow reader holds the samples back, and the engine loop's bound on a reader's
    # queued outputs still applies.
    queue: asyncio.Queue[tuple[int, _Delta | Exception | None]] = asyncio.Queue(len(streams))

    async def pump(i: int, stream: AsyncIterator[_Delta]) -> None:
        try:
            async for delta in stream:
                await queue.put((i, delta))
        except Exception as exc:  # handed to the reader, who answers with it
            await queue.put((i, exc))
        else:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(0, streams[0]))]
    try:
        running = len(streams)
        while running:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if len(tasks) == 1:
                tasks += [asyncio.create_task(pump(j, s)) for j, s in enumerate(streams[1:], 1)]
            if item is None:
                running -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


MIN_LOGPROB = -9999.0  # what OpenAI (and vLLM) answer for a logprob of -inf


def _token_text(decode: Callable[[list[int]], str], token: int, before: list[int]) -> str:
    """A token's text in logprobs, as vLLM gives it: its own decoding, unless that ends in an
    incomplete UTF-8 character (byte-fallback tokens); then the text it completes after the
    sampled tokens `before` it (up to 4), or "" while the character is still incomplete."""
    alone = decode([token])
    if not alone.endswith("\ufffd"):
        return alone
    context = before[-4:]
    for k in range(1, len(context) + 1):
        ctx = context[-k:]
        full = decode([*ctx, token])
        if full.endswith("\ufffd"):
            continue
        clean = len(ctx)  # the context's byte-fallback tail belongs to this token's text
        while clean > 0 and decode([ctx[clean - 1]]).endswith("\ufffd"):
            clean -= 1
        prefix = decode(ctx[:clean]) if clean else ""
        common = 0  # the prefix as the whole decodes it (normalisation may change it)
        while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
            common += 1
        return full[common:]
    return ""


def _logprobs(state: ServerState, chat: bool, delta: _Delta, before: list[int], offset: int
              ) -> dict[str, Any]:
    """A choice's `logprobs` for `delta`'s tokens, after the sampled tokens `before` them, whose
    texts end at character `offset`: chat's `content` entries (each with its text's UTF-8
    bytes), or completions' parallel lists, whose `top_logprobs` maps each top token's text to
    its logprob, the sampled token's included, and `text_offset` each token's start: as vLLM
    answers."""
    def decode(ids: list[int]) -> str:
        return state.tokenizer.decode(ids, skip_special_tokens=False)

    # vLLM's server lists chat's top k from its engine's map of a token's logprobs, where the
    # sampled token comes first, so a token drawn outside the k likeliest displaces the k-th.
    sampled_first = chat and state.executor.serving.chat_top_logprobs_sampled_first
    history = list(before)
    tokens: list[tuple[str, float]] = []
    tops: list[list[tuple[str, float]]] = []  # per token, its likeliest ones' (text, logprob)
    no_tops: list[list[tuple[int, float]]] = [[] for _ in delta.token_ids]
    for t, lp, top in zip(delta.token_ids, delta.logprobs, delta.top or no_tops, strict=True):
        if sampled_first:
            top = [(t, lp), *(pair for pair in top if pair[0] != t)][:len(top)]
        tokens.append((_token_text(decode, t, history), max(lp, MIN_LOGPROB)))
        tops.append([(_token_text(decode, i, history), max(v, MIN_LOGPROB)) for i, v in top])
        history.append(t)
    if chat:
        def entry(text: str, lp: float) -> dict[str, Any]:
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", errors="replace"))}
        return {"content": [{**entry(*token), "top_logprobs": [entry(*t) for t in top]}
                            for token, top in zip(tokens, tops, strict=True)]}
    offsets = []
    for text, _ in tokens:
        offsets.append(offset)
        offset += len(text)
    # The sampled token first, then the likeliest (vLLM's order: of two tokens with one text,
    # the map keeps the later).
    return {"tokens": [text for text, _ in tokens], "token_logprobs": [lp for _, lp in tokens],
            "top_logprobs": [dict([token, *top]) for token, top in zip(tokens, tops, strict=True)],
            "text_offset": offsets}


async def _respond(state: ServerState, request: Request, kind: str, prompts: list[list[int]],
                   body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                   plan: ReplyPlan | None = None, echoes: list[str] | None = None) -> Response:
    """Each prompt's `n` choices, numbered as vLLM numbers them (prompt i's sample j is choice
    i * n + j); a completion's choice starts with `echoes[i]`, its prompt's text, if given. A
    chat's replies are read as `plan` says (reasoning, tool calls)."""
    created, rid = int(time.time()), f"{kind}-{uuid.uuid4().hex}"
    chat = kind == "chatcmpl"
    obj = "chat.completion" if chat else "text_completion"
    samples: list[tuple[list[int], SamplingParams]] = []
    body = body.with_defaults(state.sampling_defaults)
    for ids in prompts:
        # By default a request may grow to what the model's context and the KV pool hold (and the
        # model's recommended max_tokens, if it has one).
        room = max(1, state.executor.serving.max_request_tokens - len(ids))
        default = min(room, state.sampling_defaults.get("max_tokens", room))
        # End-of-sequence ids are the engine's (from the checkpoint), so that ignore_eos holds.
        params = body.model_copy(update={"max_tokens": max_tokens or body.max_tokens}).sampling(
            default, body.stop_token_ids)
        if plan is not None and plan.structured is not None:  # a forced call's JSON
            params = dataclasses.replace(params, structured=plan.structured)
        samples += [(ids, p) for p in body.samples(params)]
    num_choices, prompt_tokens = len(samples), sum(len(ids) for ids in prompts)
    deltas = _merge([_generate(state, ids, p, body, request.state.arrived) for ids, p in samples])
    # Bad input surfaces here, as a 4xx, before any byte is sent.
    first = await state.first(request, deltas, SERVING)

    # Per choice, the tokens answered so far and their texts' length in logprobs: what the next
    # chunk's logprobs follow; the echoed prompt its first text starts with.
    sent: list[list[int]] = [[] for _ in range(num_choices)]
    offsets = [0] * num_choices
    unechoed = [echoes[i // body.n] if echoes else "" for i in range(num_choices)]
    readers = [ChoiceReader(plan) for _ in range(num_choices)] if plan is not None and plan.reads else None

    def choice(index: int, delta: _Delta, stream: bool) -> dict[str, Any]:
        c: dict[str, Any] = {"index": index, "finish_reason": delta.finish_reason}
        if delta.finish_reason is not None:
            c["stop_reason"] = delta.stop_reason
        if chat and readers is not None and not stream:
            c["message"], c["finish_reason"] = readers[index].message(delta.text, delta.finish_reason)
        elif chat and readers is not None:  # a chunk with nothing to read yet is not sent (`unread`)
            c["delta"], c["finish_reason"] = readers[index].delta(delta.text, delta.finish_reason)
        elif chat:  # streamed, the role comes once, in a chunk of its own (`events`)
            c["delta" if stream else "message"] = {"content": delta.text} if stream else {
                "role": "assistant", "content": delta.text}
        else:
            c["text"], unechoed[index] = unechoed[index] + delta.text, ""
        if chat and not stream and body.echoed:  # vLLM's: after the reply is read
            c["message"]["content"] = body.echoed + (c["message"]["content"] or "")
        c["logprobs"] = None
        if body.returns_logprobs:
            c["logprobs"] = _logprobs(state, chat, delta, sent[index], offsets[index])
            if not chat and delta.token_ids:
                offsets[index] = c["logprobs"]["text_offset"][-1] + len(c["logprobs"]["tokens"][-1])
        sent[index] += delta.token_ids
        return c

    async def collect() -> list[_Delta]:
        whole = [_Delta("", [], [], [], None) for _ in range(num_choices)]
        whole[first[0]].extend(first[1])
        async for i, delta in deltas:
            whole[i].extend(delta)
        return whole

    if not body.stream:
        whole = await unless_gone(request, collect())  # a client gone: no use generating on
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": state.model_name,
                             "choices": [choice(i, d, False) for i, d in enumerate(whole)],
                             "usage": _usage(prompt_tokens, sum(len(d.token_ids) for d in whole))})

    def unread(c: dict[str, Any]) -> bool:
        """A read chunk with nothing to send: no text read yet, no logprobs, no finish (vLLM's)."""
        return c.get("delta") == {} and c["logprobs"] is None and c["finish_reason"] is None

    async def events() -> AsyncIterator[str]:
        chunk = {"id": rid, "object": f"{obj}.chunk" if chat else obj, "created": created,
                 "model": state.model_name}
        completion = len(first[1].token_ids)
        try:
            if chat:  # as vLLM opens a chat stream: each choice's role, no content yet
                role = {"role": "assistant", "content": ""}
                for i in range(num_choices):
                    yield sse({**chunk, "choices": [{"index": i, "delta": role, "logprobs": None,
                                                     "finish_reason": None}]})
                for i in range(num_choices if body.echoed else 0):  # then, as vLLM, what is echoed
                    yield sse({**chunk, "choices": [{"index": i, "delta": {"content": body.echoed},
                                                     "logprobs": None, "finish_reason": None}]})
            if not unread(c := choice(*first, True)):
                yield sse({**chunk, "choices": [c]})
            async for i, delta in deltas:
                completion += len(delta.token_ids)
                if not unread(c := choice(i, delta, True)):
                    yield sse({**chunk, "choices": [c]})
            if body.stream_options and body.stream_options.include_usage:
                yield sse({**chunk, "choices": [], "usage": _usage(prompt_tokens, completion)})
            yield sse("[DONE]")
        finally:
            await deltas.aclose()  # a client that went away: abort the requests

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
    prompts = [await _encode(state, p, "prompt") if isinstance(p, str) else p for p in body.prompts]
    echoes = None
    if body.echo:  # the prompt as sent, or as its token ids decode
        echoes = [p if isinstance(p, str) else state.tokenizer.decode(p, skip_special_tokens=False)
                  for p in body.prompts]
    return await _respond(state, request, "cmpl", prompts, body, None, echoes=echoes)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: Served) -> Response:
    _check_model(state, body.model)
    if (wrong := body.tool_error()) is not None:
        raise APIError(400, f"{wrong[0]}: {wrong[1]}", wrong[0])
    plan = ReplyPlan.of(body, state.chat, state.tokenizer.chat_template)
    if plan.keeps_special_tokens:
        body = body.model_copy(update={"skip_special_tokens": False})
    text = _render(state, body.messages, body.add_generation_prompt, body.tool_dicts,
                   body.continue_final_message, body.chat_template_kwargs)
    ids = await _encode(state, text, "messages")
    return await _respond(state, request, "chatcmpl", [ids], body, body.max_completion_tokens, plan)


def _render(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
            template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt, with the tools (and past calls and results) as the model's template writes them
    (`Tokenizer.apply_chat_template`)."""
    rendered = [m.rendered() for m in messages]
    try:
        return state.tokenizer.apply_chat_template(rendered, add_generation_prompt, tools,
                                                   continue_final_message, template_kwargs)
    except (TemplateError, TypeError, ValueError) as e:  # the template's own refusal, or its bad input
        raise APIError(400, f"messages: the model's chat template cannot render them: {e}", "messages") from e


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: Served) -> dict[str, Any]:
    _check_model(state, body.model)
    if body.messages is None:
        ids = await _encode(state, body.prompt or "", "prompt")
    else:
        text = _render(state, body.messages, body.add_generation_prompt, body.tool_dicts,
                       body.continue_final_message, body.chat_template_kwargs)
        ids = await _encode(state, text, "messages")
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": state.executor.serving.max_model_len,
                             "tokens": ids}
    if body.return_token_strs:
        reply["token_strs"] = [state.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return reply


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: Served) -> dict[str, str]:
    _check_model(state, body.model)
    vocab = state.tokenizer.vocab_size
    if bad := [t for t in body.tokens if t >= vocab]:
        raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": importlib.metadata.version("rose-rl")}
