"""Tool calls in generated text, in the Hermes format that Qwen2.5/Qwen3's chat templates ask for:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 2"}}
    </tool_call>

A template that knows no tools (SmolLM2's, ROSE's own ChatML) gets the same format: `with_tools`
renders the tool schemas into the system message as Qwen3's template does, assistant tool calls
as `<tool_call>` blocks and tool results as `<tool_response>` blocks in a user turn.

`parse_tool_calls` says what is wrong with each malformed call (an RL agent answers the model
with it); the server reads replies in this and vLLM's other formats, whole and streamed, with
`rose.tools.tool_parsers`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Collection
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A block may be left open when generation stopped inside it (max_tokens, a stop string).
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParsedCalls:
    content: str  # the text outside the calls, stripped
    calls: list[ToolCall]
    errors: list[str]  # one per block that is not a well-formed call of a known tool

    @property
    def ok(self) -> bool:
        return not self.errors


def _call(body: str, tools: Collection[str] | None) -> ToolCall | str:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"the tool call is not valid JSON ({e.msg} at character {e.pos}): {body.strip()[:200]!r}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return 'a tool call must be a JSON object {"name": ..., "arguments": {...}}'
    name, args = obj["name"], obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string, as the API does
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f"the arguments of the call to {name!r} are not a JSON object"
    if not isinstance(args, dict):
        return f"the arguments of the call to {name!r} are not a JSON object"
    if tools is not None and name not in tools:
        return f"unknown tool {name!r}; the tools are {sorted(tools)}"
    return ToolCall(name, args)


def parse_tool_calls(text: str, tools: Collection[str] | None = None) -> ParsedCalls:
    """The calls in `text`, the text around them, and what is wrong with any malformed one.
    `tools`: the names a call may use (None: any)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in _BLOCK.finditer(text):
        got = _call(match.group(1), tools)
        (errors if isinstance(got, str) else calls).append(got)  # type: ignore[arg-type]
    return ParsedCalls(_BLOCK.sub("", text).strip(), calls, errors)


def format_tool_call(name: str, arguments: dict[str, Any] | str) -> str:
    """A call as the model writes it (and as a past assistant turn is rendered)."""
    if isinstance(arguments, str):
        # Not JSON: rendered as sent, the model sees what it (or the client) wrote.
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The tool schemas and the call format, in Qwen3's template's words."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{schemas}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages (OpenAI-shaped dicts, `content` a string) rewritten for a chat template that knows
    no tools: tool schemas in the system message, tool calls and results as text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [format_tool_call(c["function"]["name"], c["function"]["arguments"])
                      for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        elif role == "tool":
            # Consecutive results share one user turn, as Qwen3's template groups them.
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool", None)
    if tools:
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + tools_prompt(tools)
        else:
            out.insert(0, {"role": "system", "content": tools_prompt(tools)})
    return out
