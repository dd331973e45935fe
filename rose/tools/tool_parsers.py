"""Tool calls in a model's reply, in the formats vLLM's `--tool-call-parser` names:

- `hermes` (Qwen2.5/Qwen3, and ROSE's rendering for templates that know no tools):
  `<tool_call>\\n{"name": "f", "arguments": {"a": 1}}\\n</tool_call>`, after any text;
- `llama3_json` (Llama 3.1/3.2's JSON style; `llama4_json` is the same): the reply is one JSON
  object `{"name": "f", "parameters": {...}}` ("arguments" too), or several separated by `;`,
  after an optional `<|python_tag|>`;
- `pythonic` (Llama 3.2/4's pythonic templates): the reply is a Python list of calls with
  keyword arguments, `[f(a=1), g(b="x")]`.

Each parser reads a reply whole (`parse`: the calls, or None where the reply holds no
well-formed call and is all content) and as it arrives (`scan`: the content and the calls so
far, each piece of which only grows, so that a stream sends each piece once). vLLM's parsers
read the whole reply the same way; two differences, both lenient: leading whitespace may come
before a JSON or pythonic call list, and a JSON call list is only looked for at the start of
the reply (vLLM's whole-reply reading looks anywhere, its streaming one only at the start)."""

from __future__ import annotations

import abc
import ast
import dataclasses
import functools
import json
import logging
import re
from typing import Any, ClassVar

from rose.tools.json_spans import ObjectSpan, scan_object
from rose.tools.parsing import CLOSE, OPEN, parse_tool_calls

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CallSoFar:
    """A call as far as the reply has written it: its name once whole, its arguments' JSON text."""

    name: str | None
    arguments: str


@dataclasses.dataclass
class Scan:
    """What a reply read so far holds: the content that can go out, and the calls."""

    content: str
    calls: list[CallSoFar] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A whole reply's calls, (name, arguments as JSON text), and the content beside them."""

    content: str | None
    calls: list[tuple[str, str]]


def tail_overlap(text: str, tag: str) -> int:
    """How many characters at the end of `text` may begin `tag` (held back until known)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _object_call(text: str, span: ObjectSpan, final: bool, *arg_keys: str) -> CallSoFar:
    """A JSON call object's name and the text of its arguments value so far."""
    args = span.value(*arg_keys)
    arguments = "" if args is None else text[args.start:len(text) if args.end is None else args.end]
    if final and args is None and span.end is not None:
        arguments = "{}"  # a call without arguments, as the whole reading gives it
    return CallSoFar(span.string(text, "name"), arguments)


class ToolParser(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def parse(self, text: str) -> Parsed | None:
        """The calls in a whole reply, or None: no well-formed call, the reply is all content."""

    def scan(self, text: str, final: bool) -> Scan:
        """A reply so far (`final`: all of it): text that may still begin a call is held back. A
        whole reply none of whose calls got as far as its name is all content, as `parse` reads it."""
        scan = self._scan(text, final)
        if final and not any(c.name for c in scan.calls):
            return Scan(text)
        return scan

    @abc.abstractmethod
    def _scan(self, text: str, final: bool) -> Scan: ...


class Hermes(ToolParser):
    name = "hermes"

    def parse(self, text: str) -> Parsed | None:
        parsed = parse_tool_calls(text)
        if not parsed.calls or not parsed.ok:
            return None
        content = text[:text.find(OPEN)]
        calls = [(c.name, _dumps(c.arguments)) for c in parsed.calls]
        return Parsed(content if content.strip() else None, calls)

    def _scan(self, text: str, final: bool) -> Scan:
        start = text.find(OPEN)
        if start < 0:
            return Scan(text if final else text[:len(text) - tail_overlap(text, OPEN)])
        out = Scan(text[:start])
        while start >= 0:
            body_at = start + len(OPEN)
            end = text.find(CLOSE, body_at)
            body = text[body_at:end] if end >= 0 else text[body_at:]
            if end < 0 and not final:
                body = body[:len(body) - tail_overlap(body, CLOSE)]
            brace = len(body) - len(body.lstrip())
            if brace == len(body) or body[brace] != "{":
                break  # no call object (yet)
            out.calls.append(_object_call(body, scan_object(body, brace), final or end >= 0, "arguments"))
            start = text.find(OPEN, end) if end >= 0 else -1
        return out


class Llama3Json(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def _calls_start(self, text: str, final: bool) -> int | None:
        """Where the first call object starts; -1: the reply is content; None: not known yet."""
        i = len(text) - len(text.lstrip())
        if text.startswith(self.PYTHON_TAG, i):
            i += len(self.PYTHON_TAG)
            i += len(text[i:]) - len(text[i:].lstrip())
        elif not final and self.PYTHON_TAG.startswith(text[i:]) and i < len(text):
            return None
        if i == len(text):
            return -1 if final else None
        return i if text[i] == "{" else -1

    def parse(self, text: str) -> Parsed | None:
        i = self._calls_start(text, True)
        if i is None or i < 0:
            return None
        decoder, calls = json.JSONDecoder(), []
        while True:
            try:
                obj, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return None
            args = obj.get("arguments", obj.get("parameters"))
            if not isinstance(args, dict):
                return None
            calls.append((obj["name"], _dumps(args)))
            rest = text[i:].lstrip()
            if not rest.startswith(";") or not rest[1:].lstrip().startswith("{"):
                return Parsed(None, calls)
            i = len(text) - len(rest[1:].lstrip())

    def _scan(self, text: str, final: bool) -> Scan:
        i = self._calls_start(text, final)
        if i is None:
            return Scan("")
        if i < 0:
            return Scan(text)
        out = Scan("")
        while True:
            span = scan_object(text, i)
            ended = final or span.end is not None
            out.calls.append(_object_call(text, span, ended, "arguments", "parameters"))
            if span.end is None:
                return out
            rest = text[span.end:].lstrip()
            if not rest.startswith(";") or not rest[1:].lstrip().startswith("{"):
                return out
            i = len(text) - len(rest[1:].lstrip())


class Pythonic(ToolParser):
    name = "pythonic"
    _NAME = re.compile(r"[A-Za-z_][\w.]*")
    _KEY = re.compile(r"[A-Za-z_]\w*")
    _OPENING = re.compile(r"([A-Za-z_][\w.]*\s*)?")  # after `[`: what may still become `name(`
    _JSON_WORDS: ClassVar[dict[str, Any]] = {"true": True, "false": False, "null": None}

    @classmethod
    def _literal(cls, node: ast.expr) -> Any:
        """A keyword's value: a Python literal, or JSON's true, false, null (some models write them)."""
        if isinstance(node, ast.Name) and node.id in cls._JSON_WORDS:
            return cls._JSON_WORDS[node.id]
        if isinstance(node, ast.List):
            return [cls._literal(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {cls._literal(k): cls._literal(v) for k, v in zip(node.keys, node.values, strict=True)
                    if k is not None}
        return ast.literal_eval(node)

    @classmethod
    def _value(cls, text: str) -> str | None:
        """A keyword's value text as JSON, or None where it is no literal."""
        try:
            return _dumps(cls._literal(ast.parse(text.strip(), mode="eval").body))
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return None

    def parse(self, text: str) -> Parsed | None:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
                return None
            name = ast.unparse(call.func)
            values = [self._value(ast.unparse(k.value)) for k in call.keywords]
            if not self._NAME.fullmatch(name) or None in values:
                return None
            calls.append((name, "{" + ", ".join(f"{_dumps(k.arg)}: {v}" for k, v in
                                                zip(call.keywords, values, strict=True)) + "}"))
        return Parsed(None, calls)

    def _scan(self, text: str, final: bool) -> Scan:
        i = len(text) - len(text.lstrip())
        if i == len(text):
            return Scan(text if final else "")
        if text[i] != "[":
            return Scan(text)
        calls: list[CallSoFar] = []
        i += 1
        while True:
            i = self._space(text, i)
            name = self._NAME.match(text, i)
            if name is None or name.end() == len(text):
                break
            i = self._space(text, name.end())
            if i == len(text) or text[i] != "(":
                break
            call = CallSoFar(name.group(), "{")
            calls.append(call)
            i, closed = self._keywords(text, i + 1, call)
            if not closed:
                break
            i = self._space(text, i)
            if i < len(text) and text[i] == ",":
                i += 1
                continue
            break
        if not calls:  # not (yet) a call list: content, once it cannot become one
            undecided = not final and self._call_list_prefix(text)
            return Scan("" if undecided else text)
        return Scan("", calls)

    def _call_list_prefix(self, text: str) -> bool:
        """Whether `text` (no call opened yet) may still become `[name(`."""
        return self._OPENING.fullmatch(text.lstrip()[1:].lstrip()) is not None

    @staticmethod
    def _space(text: str, i: int) -> int:
        while i < len(text) and text[i].isspace():
            i += 1
        return i

    def _keywords(self, text: str, i: int, call: CallSoFar) -> tuple[int, bool]:
        """Read `key=value, ...)` from `i` into `call.arguments` (each pair once its value is over);
        where the call ends, and whether it is closed."""
        first = True
        while True:
            i = self._space(text, i)
            if i == len(text):
                return i, False
            if text[i] == ")":
                call.arguments += "}"
                return i + 1, True
            key = self._KEY.match(text, i)
            if key is None or key.end() == len(text):
                return i, False
            i = self._space(text, key.end())
            if i == len(text) or text[i] != "=":
                return i, False
            end = self._value_end(text, i + 1)
            if end is None:
                return i, False
            value = self._value(text[i + 1:end])
            if value is None:
                return i, False
            call.arguments += ("" if first else ", ") + f"{_dumps(key.group())}: {value}"
            first = False
            i = end + 1 if text[end] == "," else end

    @staticmethod
    def _value_end(text: str, i: int) -> int | None:
        """Where the value from `i` ends: at the `,` or `)` that closes it (None: not yet)."""
        depth, quote = 0, ""
        while i < len(text):
            ch = text[i]
            if quote:
                if ch == "\\":
                    i += 1
                elif ch == quote:
                    quote = ""
            elif ch in "'\"":
                quote = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")]}":
                if depth == 0:
                    return i if ch == ")" else None
                depth -= 1
            elif ch == "," and depth == 0:
                return i
            i += 1
        return None


TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (Hermes(), Llama3Json(), Pythonic())}
TOOL_PARSERS["llama4_json"] = TOOL_PARSERS["llama3_json"]
AUTO = "auto"
TOOL_PARSER_NAMES = (AUTO, *TOOL_PARSERS)

# What a chat template says about the call format it asks for, likeliest first.
_TEMPLATE_SIGNS = (("<tool_call>", "hermes"), ("func_name1(", "pythonic"), ("[func_name", "pythonic"),
                   ('"parameters": dictionary of argument name', "llama3_json"),
                   ("<|python_tag|>", "llama3_json"))


def check_tool_parser(name: str) -> None:
    if name not in TOOL_PARSER_NAMES:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; the known ones are "
                         f"{', '.join(TOOL_PARSER_NAMES)}")


@functools.lru_cache(maxsize=8)
def tool_parser(name: str, chat_template: str) -> ToolParser:
    """The parser `name` names; `auto`: the one whose format `chat_template` writes (Hermes for a
    template that knows no tools: ROSE renders tools for it in Hermes' format)."""
    check_tool_parser(name)
    if name != AUTO:
        return TOOL_PARSERS[name]
    chosen = next((parser for sign, parser in _TEMPLATE_SIGNS if sign in chat_template), None)
    if chosen is None and "tools" in chat_template:
        log.warning("the chat template renders tools in a format ROSE does not recognise; its replies are "
                    "read as hermes tool calls (set --tool-call-parser to choose another)")
    return TOOL_PARSERS[chosen or "hermes"]
