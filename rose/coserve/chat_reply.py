"""A chat reply read as vLLM's server reads it: its reasoning split off (`--reasoning-parser`),
then tool calls read from the content after it, whole or streamed.

How the calls are read depends on `tool_choice`, as in vLLM:

- `auto` (the default with tools): the `--tool-call-parser` format (`rose.tools.tool_parsers`),
  in text the model writes freely; the content before the first call stays content;
- `required` and a named function: the reply is constrained (structured output) to JSON, and
  read as JSON: for a named function its arguments, for `required` an array of
  `{"name": ..., "parameters": {...}}`, as vLLM builds the schema (`tool_schema`);
- `none`: no calls; the tools are still in the prompt.

Streamed, a call's first delta carries its index, id, type and name (with the arguments
written so far), and its arguments then come in pieces as they are generated; content before a
call streams as content. Reasoning streams as `reasoning` deltas."""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from rose.contracts import StructuredOutput
from rose.contracts.sampling import StructuredKind
from rose.coserve.protocol import ChatCompletionRequest, NamedToolChoice
from rose.coserve.reasoning import REASONING_PARSERS, ReasoningParser
from rose.coserve.settings import ChatOptions
from rose.tools.json_spans import scan_array
from rose.tools.tool_parsers import CallSoFar, Scan, ToolParser, tool_parser

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"  # vLLM's form


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    return schema or {"type": "object", "properties": {}}  # no parameters: still a JSON object


def tool_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema a reply to `required` or a named function is held to, as vLLM builds it:
    the named function's parameters; for `required`, a non-empty array (of one call, with
    `parallel_tool_calls: false`) of `{"name", "parameters"}` of any tool, the tools' `$defs`
    gathered at the top."""
    tools = {t.function.name: t.function.parameters for t in body.tools or []}
    if isinstance(body.tool_choice, NamedToolChoice):
        return _parameters(tools[body.tool_choice.function.name])
    if body.tool_choice != REQUIRED:
        return None
    defs: dict[str, Any] = {}
    calls = []
    for name, params in tools.items():
        params = dict(params or {})
        defs.update(params.pop("$defs", None) or {})
        calls.append({"properties": {"name": {"type": "string", "enum": [name]},
                                     "parameters": _parameters(params)},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclasses.dataclass(frozen=True)
class ReplyPlan:
    """How one chat request's replies are read."""

    mode: str  # NONE (no calls read), AUTO, REQUIRED or NAMED
    parser: ToolParser | None  # AUTO's format
    function: str | None  # NAMED's
    reasoning: ReasoningParser | None  # None: no reasoning split off
    one_call: bool  # parallel_tool_calls: false keeps the first call only
    structured: StructuredOutput | None  # REQUIRED's and NAMED's constraint: `tool_schema`'s JSON

    @classmethod
    def of(cls, body: ChatCompletionRequest, chat: ChatOptions, chat_template: str) -> ReplyPlan:
        reasoning = REASONING_PARSERS[chat.reasoning_parser] if chat.reasoning_parser else None
        if reasoning is not None and not reasoning.thinks(body.chat_template_kwargs):
            reasoning = None
        choice, function = body.tool_choice, None
        if not body.tools or choice == NONE:
            mode = NONE
        elif isinstance(choice, NamedToolChoice):
            mode, function = NAMED, choice.function.name
        else:
            mode = REQUIRED if choice == REQUIRED else AUTO
        parser = tool_parser(chat.tool_call_parser, chat_template) if mode == AUTO else None
        schema = tool_schema(body) if mode in (REQUIRED, NAMED) else None
        structured = None if schema is None else StructuredOutput(StructuredKind.JSON, json.dumps(schema))
        return cls(mode, parser, function, reasoning, body.parallel_tool_calls is False, structured)

    @property
    def reads(self) -> bool:
        """Whether replies are read at all (else they are plain content)."""
        return self.mode != NONE or self.reasoning is not None

    @property
    def keeps_special_tokens(self) -> bool:
        """Tags a parser reads (`<think>`, `<tool_call>`) may be special tokens, whose text a
        reply otherwise leaves out: kept, as vLLM's Hermes parser keeps them."""
        return self.reasoning is not None or self.mode == AUTO


def _required_calls(text: str) -> list[tuple[str, str]]:
    """The calls of a whole `required` reply, or none where it is not such an array (vLLM's)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str)
                                              and "parameters" in i for i in items):
        return []
    return [(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


def _required_scan(text: str) -> Scan:
    at = len(text) - len(text.lstrip())
    if at == len(text) or text[at] != "[":
        return Scan("")
    objects, _ = scan_array(text, at)
    calls = []
    for obj in objects:
        params = obj.value("parameters")
        arguments = "" if params is None else text[params.start:params.end or len(text)]
        calls.append(CallSoFar(obj.string(text, "name"), arguments))
    return Scan("", calls)


class ChoiceReader:
    """One choice's reply, read whole (`message`) or delta by delta (`delta`)."""

    def __init__(self, plan: ReplyPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.sent_arguments: list[int] = []  # per call announced, its argument characters sent

    def _split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        if self.plan.reasoning is None:
            return None, text
        return self.plan.reasoning.split(text, final)

    def _finish(self, finish_reason: str | None, called: bool) -> str | None:
        """vLLM's: "tool_calls" when a call was made and the reply stopped by itself (a named
        function's reply keeps "stop", as OpenAI's does)."""
        if called and finish_reason == "stop" and self.plan.mode in (AUTO, REQUIRED):
            return "tool_calls"
        return finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole reply's message and finish reason."""
        reasoning, content = self._split(text, True)
        if self.plan.reasoning is not None:
            content = content or None  # vLLM's: nothing after the reasoning is no content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.plan.reasoning is not None:
            message["reasoning"] = reasoning
        mode, calls = self.plan.mode, []
        if mode == AUTO and self.plan.parser is not None:
            parsed = self.plan.parser.parse(content or "")
            if parsed is not None:
                message["content"], calls = parsed.content, parsed.calls
        elif mode == NAMED and self.plan.function is not None:
            calls = [(self.plan.function, content)] if content and content.strip() else []
            message["content"] = ""  # vLLM's: a forced call's message has empty content
        elif mode == REQUIRED:
            calls, message["content"] = _required_calls(content or ""), ""
        if calls:
            message["tool_calls"] = [_call(*c) for c in calls[:1 if self.plan.one_call else None]]
        if mode == AUTO:  # a call made ends the reply as "tool_calls" even when cut (vLLM's, unstreamed)
            return message, "tool_calls" if calls else finish_reason
        return message, self._finish(finish_reason, True)

    def _scan(self, content: str, final: bool) -> Scan:
        if self.plan.mode == NAMED and self.plan.function is not None:
            return Scan("", [CallSoFar(self.plan.function, content)])
        if self.plan.mode == REQUIRED:
            return _required_scan(content)
        if self.plan.mode == AUTO and self.plan.parser is not None:
            return self.plan.parser.scan(content, final)
        return Scan(content)

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The next piece of a streamed reply: what of it can be read now (empty while a tag or
        a call's name is incomplete), and the finish reason."""
        self.text += text
        final = finish_reason is not None
        out: dict[str, Any] = {}
        reasoning, content = self._split(self.text, final)
        if reasoning is not None and len(reasoning) > self.sent_reasoning:
            out["reasoning"], self.sent_reasoning = reasoning[self.sent_reasoning:], len(reasoning)
        if content is None:
            return out, finish_reason
        scan = self._scan(content, final)
        if len(scan.content) > self.sent_content:
            out["content"], self.sent_content = scan.content[self.sent_content:], len(scan.content)
        calls = []
        for index, call in enumerate(scan.calls[:1 if self.plan.one_call else None]):
            if index == len(self.sent_arguments):
                if call.name is None:
                    break  # calls are announced in order, each once its name is whole
                self.sent_arguments.append(len(call.arguments))
                calls.append({"index": index, **_call(call.name, call.arguments)})
            elif len(call.arguments) > self.sent_arguments[index]:
                calls.append({"index": index,
                              "function": {"arguments": call.arguments[self.sent_arguments[index]:]}})
                self.sent_arguments[index] = len(call.arguments)
        if calls:
            out["tool_calls"] = calls
        return out, self._finish(finish_reason, bool(self.sent_arguments))
