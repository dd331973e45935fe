"""Tool calling and reasoning through the OpenAI API, as vLLM's server answers them: `tools` and
`tool_choice` rendered into the prompt, tool calls read from the reply (whole, and streamed in
pieces), the reasoning split off, tool-call conversations accepted, bad tool requests refused
by name.

A random model writes no tool call of its own accord: the tests of how a given reply is read
script the engine's output (`scripted`), and everything between it and the `openai` client is
the server's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from servers import running

from rose.coserve import openai_api
from rose.coserve.executor import CoServingExecutor
from rose.coserve.openai_api import _Delta
from rose.coserve.server import build_app
from rose.coserve.settings import ChatOptions, ExecutorConfig
from rose.model import Tokenizer, init_model, load_tokenizer
from rose.steploop import StepLoop
from rose.tools.parsing import format_tool_call
from rose.tools.sandbox import CALCULATOR_TOOL, PYTHON_TOOL

TOOLS = [CALCULATOR_TOOL, PYTHON_TOOL]
MODEL = "tiny-serving"
USER = {"role": "user", "content": "What is 6 * 7?"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tools")
    return (init_model("qwen2", "tiny", root / "serving", seed=1),
            init_model("qwen3", "tiny", root / "rollout", seed=2))


@pytest.fixture(scope="module")
def app(checkpoint: tuple[Path, Path]) -> Any:
    executor = CoServingExecutor.from_pretrained(*checkpoint, ExecutorConfig(pool_mb=8))
    executor.profile()
    return build_app(StepLoop(executor), executor, load_tokenizer(checkpoint[0]), MODEL, None)


@pytest.fixture(scope="module")
def url(app: Any) -> Iterator[str]:
    with running(app) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _prompt(url: str, messages: list[Any]) -> str:
    """The prompt the server renders for `messages` with TOOLS, via /tokenize and /detokenize."""
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    return httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]


def test_tools_are_rendered_into_the_prompt(client: openai.OpenAI, url: str) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=2)
    with_tools = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=2, tools=TOOLS,
                                                tool_choice="auto")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=2, tools=TOOLS,
                                          tool_choice="none")
    assert none.usage.prompt_tokens == with_tools.usage.prompt_tokens  # rendered, as vLLM does
    assert none.choices[0].message.tool_calls is None
    # The template knows no tools: they are in the system message, in Qwen's words.
    prompt = _prompt(url, [USER])
    assert prompt.startswith("<|im_start|>system\n# Tools") and json.dumps(CALCULATOR_TOOL) in prompt


def test_a_tool_call_conversation_round_trips(client: openai.OpenAI, url: str) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": "6 * 7"})}}
    messages: list[Any] = [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, tools=TOOLS)
    assert done.choices[0].message.role == "assistant" and done.usage.completion_tokens <= 3
    prompt = _prompt(url, messages)
    assert format_tool_call("calculator", {"expression": "6 * 7"}) in prompt
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>" in prompt


@pytest.mark.parametrize(("extra", "param", "message"), [
    ({"tool_choice": {"type": "function", "function": {"name": "shell"}}}, "tool_choice", "not in tools"),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "tool_choice 'required' needs tools"),
    ({"tool_choice": "auto", "tools": None}, "tool_choice", "tool_choice 'auto' needs tools"),
    ({"tools": []}, "tools", "must not be empty"),
    ({"tools": [CALCULATOR_TOOL] * 2}, "tools", "two tools have one name"),
    ({"tools": [PYTHON_TOOL] * 129}, "tools", "at most 128"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "should match pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"d": "x" * 300_000}}}]},
     "tools", "more than the"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "Input should be 'function'"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "content is required"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages", "only an assistant"),
    ({"messages": [USER, {"role": "assistant", "content": None,
                          "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]}]},
     "messages", "arguments"),
])
def test_bad_tool_requests_are_refused_by_name(url: str, extra: dict, param: str, message: str) -> None:
    body = {"model": MODEL, "messages": [USER], "max_tokens": 2, "tools": TOOLS, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_streaming_with_tools_streams(client: openai.OpenAI, choice: str) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=4, tools=TOOLS,
                                                 tool_choice=choice, stream=True, n=2))
    finished = [c.choices[0] for c in chunks if c.choices[0].finish_reason is not None]
    assert sorted(c.index for c in finished) == [0, 1]
    assert all(c.finish_reason in ("stop", "length", "tool_calls") for c in finished)


def test_a_template_with_tools_renders_them_itself(checkpoint: tuple[Path, Path]) -> None:
    base = load_tokenizer(checkpoint[0])
    assert not base.supports_tools
    template = ("{% if tools %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
                "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad role') }}"
                "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    tok = Tokenizer(base._tok, chat_template=template)
    assert tok.supports_tools
    tool = {"type": "function", "function": {"name": "f", "description": "a < b & c"}}
    # As transformers' tojson: no HTML escaping of <, >, &.
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[tool]) == \
        json.dumps(tool) + "\nuser: x\n"
    with pytest.raises(Exception, match="no bad role"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])


@pytest.mark.parametrize("depth", [100, 5000])
def test_a_deeply_nested_schema_is_not_a_server_error(url: str, depth: int) -> None:
    schema = "[" * depth + "]" * depth
    tool = '{"type": "function", "function": {"name": "f", "parameters": {"p": ' + schema + "}}}"
    body = '{"model": "' + MODEL + '", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], ' \
        '"tools": [' + tool + "]}"
    r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code < 500, r.text


@pytest.fixture
def scripted(app: Any, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, ChatOptions], None]:
    """`script(reply, options)`: every choice's reply is `reply`, one token per engine output
    (the server's tokenizer's), read with `options` (`--tool-call-parser`, `--reasoning-parser`)."""
    state = app.state.server

    def script(reply: str, options: ChatOptions) -> None:
        ids = state.tokenizer.encode(reply)

        async def generate(*args: Any, **kwargs: Any) -> AsyncIterator[_Delta]:
            args[-1]()  # the request has arrived
            for k, t in enumerate(ids):
                last = k == len(ids) - 1
                yield _Delta(state.tokenizer.decode([t], skip_special_tokens=False), [t], [-1.0], [],
                             "stop" if last else None)

        monkeypatch.setattr(openai_api, "_generate", generate)
        monkeypatch.setattr(state, "chat", options)

    return script


def _streamed_calls(chunks: list[Any]) -> tuple[str, list[dict[str, Any]], list[Any]]:
    """A stream's content, its calls (each: its first delta, and its arguments joined), and
    its finish reasons."""
    content, calls, finishes = "", [], []
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            finishes += [c.finish_reason] if c.finish_reason else []
            for call in c.delta.tool_calls or []:
                if call.index == len(calls):
                    calls.append({"first": call, "arguments": call.function.arguments or "", "pieces": 1})
                else:
                    assert call.id is None and call.function.name is None
                    calls[call.index]["arguments"] += call.function.arguments
                    calls[call.index]["pieces"] += 1
    return content, calls, finishes


CALL = format_tool_call("calculator", {"expression": "6 * 7"})


@pytest.mark.parametrize(("parser", "reply", "before"), [
    ("auto", "Let me compute it.\n" + CALL, "Let me compute it.\n"),  # the template knows no tools: hermes
    ("llama3_json", '{"name": "calculator", "parameters": {"expression": "6 * 7"}}', ""),
    ("pythonic", "[calculator(expression='6 * 7')]", ""),
])
def test_a_streamed_tool_call_arrives_in_pieces(client: openai.OpenAI, scripted: Any, parser: str, reply: str,
                                                before: str) -> None:
    scripted(reply, ChatOptions(tool_call_parser=parser))
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [USER], "tools": TOOLS}
    content, [call], finishes = _streamed_calls(list(client.chat.completions.create(stream=True, **kwargs)))
    assert content == before and finishes == ["tool_calls"]
    first = call["first"]
    assert first.index == 0 and first.type == "function" and first.id.startswith("chatcmpl-tool-")
    assert first.function.name == "calculator"
    assert json.loads(call["arguments"]) == {"expression": "6 * 7"}
    if parser != "pythonic":  # the model's JSON as it is written (pythonic's: one piece per argument)
        assert call["pieces"] > 3
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and (whole.message.content or "") == before
    [got] = whole.message.tool_calls
    assert got.function.name == "calculator" and json.loads(got.function.arguments) == {"expression": "6 * 7"}


def test_streamed_tool_calls_come_with_their_logprobs(client: openai.OpenAI, scripted: Any) -> None:
    """Each token's logprob goes out in its chunk, whatever of the reply can be read by then
    (vLLM's): none is lost while a call's text is read."""
    scripted("ok " + CALL, ChatOptions())
    chunks = list(client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS, stream=True,
                                                 logprobs=True))
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert "".join(t.token for t in tokens) == "ok " + CALL
    assert _streamed_calls(chunks)[2] == ["tool_calls"]


def test_tool_choice_none_leaves_a_call_as_content(client: openai.OpenAI, scripted: Any) -> None:
    scripted(CALL, ChatOptions())
    done = client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS, tool_choice="none")
    assert done.choices[0].message.content == CALL and done.choices[0].message.tool_calls is None
    assert done.choices[0].finish_reason == "stop"


def test_the_reasoning_is_split_off(client: openai.OpenAI, scripted: Any) -> None:
    scripted("<think>\nSix sevens.\n</think>\n\nIt is 42.", ChatOptions(reasoning_parser="qwen3"))
    done = client.chat.completions.create(model=MODEL, messages=[USER]).choices[0].message
    assert (done.reasoning, done.content) == ("\nSix sevens.\n", "\n\nIt is 42.")  # type: ignore[attr-defined]
    chunks = list(client.chat.completions.create(model=MODEL, messages=[USER], stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = [d.reasoning for d in deltas if getattr(d, "reasoning", None)]  # type: ignore[attr-defined]
    assert len(reasoning) > 1 and "".join(reasoning) == "\nSix sevens.\n"
    assert "".join(d.content or "" for d in deltas) == "\n\nIt is 42."
    # Thinking turned off (Qwen3's template kwarg): the reply is all content.
    off = client.chat.completions.create(model=MODEL, messages=[USER],
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == "<think>\nSix sevens.\n</think>\n\nIt is 42."


def test_a_call_after_the_reasoning_is_read_from_the_content(client: openai.OpenAI, scripted: Any) -> None:
    scripted("<think>I need the calculator.</think>" + CALL, ChatOptions(reasoning_parser="qwen3"))
    content, [call], finishes = _streamed_calls(list(client.chat.completions.create(
        model=MODEL, messages=[USER], tools=TOOLS, stream=True)))
    assert content == "" and finishes == ["tool_calls"] and call["first"].function.name == "calculator"
    done = client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS).choices[0]
    assert done.message.reasoning == "I need the calculator."  # type: ignore[attr-defined]
    assert done.message.tool_calls[0].function.name == "calculator"


# Tools whose arguments a random model completes within a few hundred tokens (a free string it
# writes on and on): for the replies held to their schemas.
CHOICE_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {key: {"enum": values}}, "required": [key],
    "additionalProperties": False}}}
    for name, key, values in (("pick", "op", ["add", "mul"]), ("flip", "side", ["heads", "tails"]))]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in CHOICE_TOOLS}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "flip"}}],
                         ids=["required", "named"])
def test_required_and_named_tool_choice_constrain_the_reply_to_a_call(client: openai.OpenAI, choice: Any,
                                                                      stream: bool) -> None:
    """A random model calls a tool when it must: its reply is held to the call's JSON schema
    (structured output), as vLLM holds it, and read as JSON."""
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [USER], "max_tokens": 400, "tools": CHOICE_TOOLS,
                              "tool_choice": choice, "seed": 6, "temperature": 0.5}  # a seed that completes
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content, calls, finishes = _streamed_calls(chunks)
        got = [(c["first"].function.name, c["arguments"]) for c in calls]
    else:
        done = client.chat.completions.create(**kwargs).choices[0]
        content, finishes = done.message.content, [done.finish_reason]
        got = [(c.function.name, c.function.arguments) for c in done.message.tool_calls or []]
    assert content == "" and got, (choice, content)
    # OpenAI's (and vLLM's) finish reasons: "tool_calls" for required, "stop" for a named function.
    assert finishes == ["tool_calls" if choice == "required" else "stop"]
    for name, arguments in got:
        assert choice == "required" or name == "flip"
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_tool_choice_none_and_auto_leave_a_random_model_s_text_as_content(client: openai.OpenAI) -> None:
    for choice in ("none", "auto"):
        done = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=8, tools=TOOLS,
                                              tool_choice=choice, seed=3).choices[0]
        assert done.message.tool_calls is None and done.message.content
        assert done.finish_reason in ("stop", "length")
