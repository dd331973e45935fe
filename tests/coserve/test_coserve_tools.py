"""Tool calling through the OpenAI API: `tools` and `tool_choice` rendered into the prompt, tool
calls parsed from the reply, tool-call conversations accepted, bad tool requests refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from servers import running

from rose.coserve.executor import CoServingExecutor
from rose.coserve.openai_api import _Delta, _tool_delta, tool_reply
from rose.coserve.server import build_app
from rose.coserve.settings import ExecutorConfig
from rose.model import Tokenizer, init_model, load_tokenizer
from rose.steploop import StepLoop
from rose.tools.parsing import ToolCallStream, format_tool_call
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
def url(checkpoint: tuple[Path, Path]) -> Iterator[str]:
    executor = CoServingExecutor.from_pretrained(*checkpoint, ExecutorConfig(pool_mb=8))
    executor.profile()
    with running(build_app(StepLoop(executor), executor, load_tokenizer(checkpoint[0]), MODEL, None)) as base:
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


def test_a_reply_with_calls_becomes_tool_calls() -> None:
    names = frozenset({"calculator", "python"})
    text = "I will compute it.\n" + format_tool_call("calculator", {"expression": "6*7"})
    message, finish = tool_reply(text, "stop", names)
    assert finish == "tool_calls" and message["content"] == "I will compute it."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "6*7"}
    # Only calls: no content. Malformed, or a tool not offered: the whole text as content.
    assert tool_reply(format_tool_call("python", {"code": "1"}), "stop", names)[0]["content"] is None
    for bad in ('<tool_call>{"name": "calculator", "arguments": {</tool_call>',
                format_tool_call("shell", {"cmd": "ls"})):
        assert tool_reply(bad, "length", names) == ({"role": "assistant", "content": bad}, "length")
    assert tool_reply("42", "stop", names) == ({"role": "assistant", "content": "42"}, "stop")


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
    ({"tool_choice": "required", "tools": None}, "tool_choice", "needs tools"),
    ({"stream": True, "logprobs": True}, "logprobs", "streaming with tools"),
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


def test_a_streamed_call_comes_whole_in_the_last_chunk() -> None:
    names = frozenset({"calculator"})
    text = "Sure. " + format_tool_call("calculator", {"expression": "6*7"}) + " done"
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    stream = ToolCallStream(names)
    deltas = [_tool_delta(stream, _Delta(p, [], [], [], None)) for p in pieces[:-1]]
    last, finish = _tool_delta(stream, _Delta(pieces[-1], [], [], [], "stop"))
    assert "".join(d["content"] for d, _ in deltas) == "Sure. " and all(f is None for _, f in deltas)
    assert finish == "tool_calls" and last["content"] == "done"
    [call] = last["tool_calls"]
    assert call["index"] == 0 and json.loads(call["function"]["arguments"]) == {"expression": "6*7"}
    # Text that only looks like a call's start is held back, then sent; a malformed call as content.
    plain = ToolCallStream(names)
    assert plain.feed("a <tool") == "a " and plain.feed("s>") == "<tools>" and plain.finish() == ("", None)
    bad = ToolCallStream(names)
    got = _tool_delta(bad, _Delta("x<tool_call>{", [], [], [], "length"))
    assert got == ({"content": "x<tool_call>{"}, "length")


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


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_start_the_reply_with_a_call(client: openai.OpenAI,
                                                                    stream: bool) -> None:
    named = {"type": "function", "function": {"name": "calculator"}}
    auto = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=4, tools=TOOLS)
    for choice, opening in (("required", '<tool_call>\n{"name": "'),
                            (named, '<tool_call>\n{"name": "calculator", "arguments": ')):
        kwargs: dict[str, Any] = {"model": MODEL, "messages": [USER], "max_tokens": 4, "tools": TOOLS,
                                  "tool_choice": choice, "seed": 3}
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        else:
            done = client.chat.completions.create(**kwargs)
            assert done.usage.prompt_tokens > auto.usage.prompt_tokens  # the opening is in the prompt
            content, calls = done.choices[0].message.content or "", done.choices[0].message.tool_calls or []
        # A random model rarely completes the call: then its text, the opening first, is the content.
        if calls:
            assert choice == "required" or all(c.function.name == "calculator" for c in calls)
        else:
            assert content.startswith(opening), content
