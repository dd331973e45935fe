"""Where the members of a JSON object, or the objects of a JSON array, lie in text that may
still be arriving (a streamed reply).

A scan of any prefix of a text gives the same spans as the scan of the whole, cut to that
prefix: a value's start never moves and its end is set only once the value is over. That is
what lets a stream send a value's text as it grows, and each piece once. The scan checks only
the structure it needs (keys, nesting, strings); `json.loads` judges the finished text."""

from __future__ import annotations

import dataclasses
import json
import re

_OPEN, _CLOSE = "{[", "}]"


@dataclasses.dataclass
class Member:
    """One `"key": value` of an object: the value is `text[start:end]` (`end` None while open)."""

    key: str
    start: int
    end: int | None = None


@dataclasses.dataclass
class ObjectSpan:
    """An object's members so far; `end` is past its closing brace once it has one, and
    `broken` says the text stopped being the start of a JSON object."""

    members: list[Member] = dataclasses.field(default_factory=list)
    end: int | None = None
    broken: bool = False

    def value(self, *keys: str) -> Member | None:
        """The first member under any of `keys`."""
        return next((m for m in self.members if m.key in keys), None)

    def string(self, text: str, key: str) -> str | None:
        """The member's value, once it is a whole JSON string."""
        m = self.value(key)
        if m is None or m.end is None or not text.startswith('"', m.start):
            return None
        try:
            value = json.loads(text[m.start:m.end])
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, str) else None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


# A whole string, its escapes included, in one match, and the characters a scan stops at: the
# rest is jumped over in C (a stream scans its text again at every token, and a code argument
# holds thousands of escapes).
_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)  # possessive: an open one fails at once
_STRUCTURE = re.compile(r'["{}\[\]]')


def _string_end(text: str, i: int) -> int | None:
    """Past the closing quote of the string opening at `text[i]`, or None while it is open."""
    m = _STRING.match(text, i)
    return None if m is None else m.end()


def _value_end(text: str, i: int) -> tuple[int | None, bool]:
    """Past the value starting at `text[i]` (None while it may go on), and whether it is broken."""
    if text[i] == '"':
        return _string_end(text, i), False
    if text[i] in _OPEN:
        stack = [text[i]]
        i += 1
        while (m := _STRUCTURE.search(text, i)) is not None:
            ch, i = m.group(), m.start()
            if ch == '"':
                end = _string_end(text, i)
                if end is None:
                    return None, False
                i = end
                continue
            if ch in _OPEN:
                stack.append(ch)
            elif _OPEN.index(stack.pop()) != _CLOSE.index(ch):
                return None, True
            elif not stack:
                return i + 1, False
            i += 1
        return None, False
    # A number, true, false or null ends at the first character that cannot continue it.
    j = i
    while j < len(text) and (text[j].isalnum() or text[j] in "+-."):
        j += 1
    if j == i:
        return None, True
    return (j if j < len(text) else None), False


def scan_object(text: str, at: int) -> ObjectSpan:
    """The object whose `{` is `text[at]`."""
    span = ObjectSpan()
    i = _skip_space(text, at + 1)
    while i < len(text):
        if text[i] == "}" and not span.members:
            span.end = i + 1
            return span
        if text[i] != '"':
            span.broken = True
            return span
        key_end = _string_end(text, i)
        if key_end is None:
            return span
        try:
            key = json.loads(text[i:key_end])
        except json.JSONDecodeError:
            span.broken = True
            return span
        i = _skip_space(text, key_end)
        if i >= len(text):
            return span
        if text[i] != ":":
            span.broken = True
            return span
        i = _skip_space(text, i + 1)
        if i >= len(text):
            return span
        member = Member(key, i)
        span.members.append(member)
        member.end, span.broken = _value_end(text, i)
        if member.end is None:
            return span
        i = _skip_space(text, member.end)
        if i >= len(text):
            return span
        if text[i] == "}":
            span.end = i + 1
            return span
        if text[i] != ",":
            span.broken = True
            return span
        i = _skip_space(text, i + 1)
    return span


def scan_array(text: str, at: int) -> tuple[list[ObjectSpan], bool]:
    """The objects of the array whose `[` is `text[at]`, and whether it is broken (an element
    that is not an object, a missing comma). Text after its `]` is not read."""
    objects: list[ObjectSpan] = []
    i = _skip_space(text, at + 1)
    while i < len(text):
        if text[i] == "]" and not objects:
            return objects, False
        if text[i] != "{":
            return objects, True
        obj = scan_object(text, i)
        objects.append(obj)
        if obj.broken or obj.end is None:
            return objects, obj.broken
        i = _skip_space(text, obj.end)
        if i >= len(text) or text[i] == "]":
            return objects, False
        if text[i] != ",":
            return objects, True
        i = _skip_space(text, i + 1)
    return objects, False
