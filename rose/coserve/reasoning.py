"""A reply's reasoning split off its content, as vLLM's `--reasoning-parser` does, into the
message's `reasoning` field (vLLM 0.32's name; `reasoning_content` before it).

Both parsers here read `<think>...</think>` and, as vLLM 0.32's, take a reply to start in its
reasoning whether or not it writes `<think>` (Qwen3's thinking templates open it in the
prompt): the reasoning ends at `</think>`, and a reply that never closes it is all reasoning.
They differ in two rules:

- `qwen3`: a tool call (`<tool_call>`) also ends the reasoning, and a request that turns
  thinking off (`chat_template_kwargs: {"enable_thinking": false}`, whose template then writes
  an empty `<think></think>` in the prompt) has no reasoning: its reply is all content;
- `deepseek_r1`: neither."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rose.tools.parsing import OPEN as TOOL_CALL_OPEN
from rose.tools.tool_parsers import tail_overlap

START, END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str
    ends_at_tool_call: bool  # a tool call's opening ends the reasoning (its text is content)
    follows_enable_thinking: bool  # chat_template_kwargs' enable_thinking: false means no reasoning

    def thinks(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether a request's reply starts in its reasoning."""
        return not (self.follows_enable_thinking and (template_kwargs or {}).get("enable_thinking") is False)

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        """The reasoning in a reply so far, and its content (None while the reasoning goes on;
        `final`: the reply is whole). Text that may still begin a tag is held back."""
        if not final and START.startswith(text) and text != START:
            return "", None
        body = text.removeprefix(START)
        ends = [END, TOOL_CALL_OPEN] if self.ends_at_tool_call else [END]
        found = [(at, tag) for tag in ends if (at := body.find(tag)) >= 0]
        if found:
            at, tag = min(found)
            return body[:at], body[at + (len(tag) if tag == END else 0):]
        hold = 0 if final else max(tail_overlap(body, tag) for tag in ends)
        return body[:len(body) - hold], None


REASONING_PARSERS = {p.name: p for p in (ReasoningParser("qwen3", True, True),
                                         ReasoningParser("deepseek_r1", False, False))}


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; the known ones are "
                         f"{', '.join(REASONING_PARSERS)}")
