"""Tool calls in generated text (the Hermes `<tool_call>` format) and prompts for templates without tools."""

from __future__ import annotations

import json

from rose.tools.parsing import format_tool_call, parse_tool_calls, with_tools

TOOLS = {"calculator", "python"}


def test_a_good_call_with_text_around_it() -> None:
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}'
            '\n</tool_call>')
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.ok and parsed.content == "Let me compute."
    [call] = parsed.calls
    assert (call.name, call.arguments) == ("calculator", {"expression": "2+2"})


def test_several_calls_and_a_call_left_open_at_the_end() -> None:
    text = (format_tool_call("calculator", {"expression": "1"}) + "\n"
            + format_tool_call("python", '{"code": "print(1)"}') + "\n"
            + '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3"}}')  # cut by max_tokens
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.ok and parsed.content == ""
    assert [c.arguments for c in parsed.calls] == [{"expression": "1"}, {"code": "print(1)"},
                                                   {"expression": "3"}]


def test_malformed_calls_say_what_is_wrong() -> None:
    bad = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"x": </tool_call>', TOOLS)
    assert not bad.ok and not bad.calls and "not valid JSON" in bad.errors[0]
    assert "JSON object" in parse_tool_calls("<tool_call>[1, 2]</tool_call>", TOOLS).errors[0]
    not_object = parse_tool_calls('<tool_call>{"name": "python", "arguments": 3}</tool_call>')
    assert "arguments" in not_object.errors[0]
    unknown = parse_tool_calls('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', TOOLS)
    assert "unknown tool 'rm'" in unknown.errors[0]
    # A good call beside a bad one: both reported.
    mixed = parse_tool_calls(format_tool_call("python", {"code": "1"}) + "<tool_call>{</tool_call>", TOOLS)
    assert len(mixed.calls) == 1 and len(mixed.errors) == 1


def test_plain_text_has_no_calls() -> None:
    parsed = parse_tool_calls("  just an answer: 4 ", TOOLS)
    assert parsed.ok and parsed.calls == [] and parsed.content == "just an answer: 4"


def test_with_tools_renders_schemas_calls_and_results_as_text() -> None:
    tool = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "calculator",
                                                                 "arguments": '{"expression": "2+2"}'}}]},
                {"role": "tool", "content": "4", "tool_call_id": "a"},
                {"role": "tool", "content": "5", "tool_call_id": "b"}]
    out = with_tools(messages, [tool])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert json.dumps(tool) in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == format_tool_call("calculator", {"expression": "2+2"})
    assert out[3]["content"] == "<tool_response>\n4\n</tool_response>\n<tool_response>\n5\n</tool_response>"
    # An existing system message keeps its text, the tools after it; no tools: nothing added.
    system = with_tools([{"role": "system", "content": "Be brief."}], [tool])[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools")
    assert with_tools([{"role": "user", "content": "x"}], None) == [{"role": "user", "content": "x"}]
