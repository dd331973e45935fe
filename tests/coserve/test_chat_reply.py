"""A chat reply read as vLLM reads it: reasoning split off (`--reasoning-parser`), tool calls by
`tool_choice`, whole (a message) and streamed (deltas, split at every character), the deltas
adding up to the message."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rose.contracts.sampling import StructuredKind
from rose.coserve.chat_reply import ChoiceReader, ReplyPlan, tool_schema
from rose.coserve.protocol import ChatCompletionRequest
from rose.coserve.reasoning import check_reasoning_parser
from rose.coserve.settings import ChatOptions
from rose.tools.sandbox import CALCULATOR_TOOL, PYTHON_TOOL

CHATML = "{% for m in messages %}{{ m.content }}{% endfor %}"  # knows no tools: hermes
NAMED = {"type": "function", "function": {"name": "calculator"}}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


def plan(reasoning: str | None = None, **request: Any) -> ReplyPlan:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 **request})
    return ReplyPlan.of(body, ChatOptions(reasoning_parser=reasoning), CHATML)


def folded(plan: ReplyPlan, text: str, cuts: list[int], finish: str = "stop") -> tuple[dict[str, Any], str]:
    """A stream of `text`, cut at `cuts`, as one message: its pieces joined, each call's from
    the delta that names it (which carries its id and type) and the argument pieces after it."""
    reader = ChoiceReader(plan)
    bounds = [0, *cuts, len(text)]
    message: dict[str, Any] = {}
    calls: list[dict[str, Any]] = []
    reason = None
    for k in range(1, len(bounds)):
        last = k == len(bounds) - 1
        delta, reason = reader.delta(text[bounds[k - 1]:bounds[k]], finish if last else None)
        assert last or reason is None
        for key in ("reasoning", "content"):
            if key in delta:
                message[key] = message.get(key, "") + delta[key]
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):
                assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
                calls.append({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
    if calls:
        message["tool_calls"] = calls
    return message, reason or ""


def unstreamed(plan: ReplyPlan, text: str, finish: str = "stop") -> tuple[dict[str, Any], str]:
    """The whole reading, as `folded` gives a stream: no role, no empty fields, calls by name."""
    message, reason = ChoiceReader(plan).message(text, finish)
    assert message.pop("role") == "assistant"
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.pop("tool_calls", [])]
    out = {k: v for k, v in message.items() if v}
    return ({**out, "tool_calls": calls} if calls else out), reason or ""


def as_json(message: dict[str, Any]) -> dict[str, Any]:
    """The message with each call's arguments read as JSON."""
    calls = [{**c, "arguments": json.loads(c["arguments"])} for c in message.get("tool_calls", [])]
    return {**message, "tool_calls": calls} if calls else message


@pytest.mark.parametrize(("reasoning", "request_", "text", "expected", "finish"), [
    ("qwen3", {"tools": [CALCULATOR_TOOL]}, f"<think>\nplan it\n</think>\n\nSure. {CALL}",
     {"reasoning": "\nplan it\n", "content": "\n\nSure. ",
      "tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]}, "tool_calls"),
    ("qwen3", {}, "still thinking when cut", {"reasoning": "still thinking when cut"}, "length"),
    ("qwen3", {"tools": [CALCULATOR_TOOL]}, f"no need to close it{CALL}",  # a call ends the reasoning
     {"reasoning": "no need to close it",
      "tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]}, "tool_calls"),
    ("qwen3", {"chat_template_kwargs": {"enable_thinking": False}}, "Hello </think> there",
     {"content": "Hello </think> there"}, "stop"),
    ("deepseek_r1", {"tools": [CALCULATOR_TOOL], "chat_template_kwargs": {"enable_thinking": False}},
     f"R1 thinks anyway {CALL}</think>ok", {"reasoning": f"R1 thinks anyway {CALL}", "content": "ok"},
     "stop"),
    (None, {"tools": [CALCULATOR_TOOL], "tool_choice": "none"}, CALL, {"content": CALL}, "stop"),
    (None, {"tools": [CALCULATOR_TOOL, PYTHON_TOOL], "tool_choice": {"type": "function",
                                                                   "function": {"name": "python"}}},
     '{"code": "print(1)"}', {"tool_calls": [{"name": "python", "arguments": {"code": "print(1)"}}]}, "stop"),
    (None, {"tools": [CALCULATOR_TOOL, PYTHON_TOOL], "tool_choice": "required"},
     '[{"name": "calculator", "parameters": {"expression": "1"}}, {"name": "python", "parameters": {}}]',
     {"tool_calls": [{"name": "calculator", "arguments": {"expression": "1"}},
                     {"name": "python", "arguments": {}}]}, "tool_calls"),
    (None, {"tools": [CALCULATOR_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
     '[{"name": "calculator", "parameters": {"expression": "1"}}, {"name": "x", "parameters": {}}]',
     {"tool_calls": [{"name": "calculator", "arguments": {"expression": "1"}}]}, "tool_calls"),
], ids=["qwen3-then-a-call", "qwen3-cut-thinking", "qwen3-call-ends-thinking", "qwen3-thinking-off",
        "deepseek-r1", "tool-choice-none", "named", "required", "required-one-call"])
def test_a_reply_read_whole_and_streamed_at_every_split(reasoning: str | None, request_: dict[str, Any],
                                                       text: str, expected: dict[str, Any],
                                                       finish: str) -> None:
    how = plan(reasoning, **request_)
    base = "length" if finish == "length" else "stop"
    message, reason = unstreamed(how, text, base)
    assert as_json(message) == expected and reason == finish
    for cut in range(1, len(text)):
        got, reason = folded(how, text, [cut], base)
        assert as_json(got) == expected and reason == finish, cut
    got, reason = folded(how, text, list(range(1, len(text))), base)
    assert as_json(got) == expected and reason == finish


def test_a_forced_call_s_message_and_finish_are_vllm_s() -> None:
    named = plan(tools=[CALCULATOR_TOOL], tool_choice=NAMED)
    message, finish = ChoiceReader(named).message('{"expression": "2"}', "stop")
    assert message["content"] == "" and finish == "stop"  # a named function's call keeps "stop"
    assert message["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "2"}'}
    # The first streamed delta names the call before any argument is written.
    delta, _ = ChoiceReader(named).delta("", None)
    assert delta["tool_calls"][0]["function"] == {"name": "calculator", "arguments": ""}
    required = plan(tools=[CALCULATOR_TOOL], tool_choice="required")
    assert ChoiceReader(required).message("[not json", "length") == ({"role": "assistant", "content": ""},
                                                                     "length")
    # auto: a reply without a call is plain content; one with a call cut short is still a call
    auto = plan(tools=[CALCULATOR_TOOL])
    assert ChoiceReader(auto).message("42", "stop") == ({"role": "assistant", "content": "42"}, "stop")
    assert ChoiceReader(auto).message(CALL.removesuffix("\n</tool_call>"), "length")[1] == "tool_calls"
    assert ChoiceReader(auto).delta(CALL[:-5], "length")[1] == "length"  # streamed: as vLLM streams it


def test_required_and_named_hold_the_reply_to_vllm_s_schema() -> None:
    defs = {"$defs": {"Point": {"type": "object"}}, "type": "object",
            "properties": {"p": {"$ref": "#/$defs/Point"}}}
    tools = [CALCULATOR_TOOL, {"type": "function", "function": {"name": "draw", "parameters": defs}},
             {"type": "function", "function": {"name": "noop"}}]
    required = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools,
         "tool_choice": "required", "parallel_tool_calls": False})
    schema = tool_schema(required)
    assert schema is not None and schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
    assert schema["$defs"] == {"Point": {"type": "object"}}
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["calculator"], ["draw"],
                                                                                    ["noop"]]
    assert schema["items"]["anyOf"][2]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]
    assert "$defs" in tools[1]["function"]["parameters"]  # the request's own schema is left alone
    named = plan(tools=[CALCULATOR_TOOL], tool_choice=NAMED)
    assert named.structured is not None and named.structured.kind is StructuredKind.JSON
    assert json.loads(named.structured.spec) == CALCULATOR_TOOL["function"]["parameters"]
    assert plan(tools=[CALCULATOR_TOOL]).structured is None  # auto: free text


def test_special_tokens_are_kept_where_a_parser_reads_tags() -> None:
    assert plan(tools=[CALCULATOR_TOOL]).keeps_special_tokens and plan("qwen3").keeps_special_tokens
    assert not plan(tools=[CALCULATOR_TOOL], tool_choice="none").keeps_special_tokens
    assert not plan().reads
    with pytest.raises(ValueError, match="unknown parser 'qwen'; the known ones are qwen3, deepseek_r1"):
        check_reasoning_parser("qwen")
