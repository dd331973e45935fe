"""Lenient parsing of an action out of a model's reply.

Small and untrained policies rarely answer in one exact format, so every built-in environment
accepts the same forms (case-insensitive, surrounding spaces and punctuation ignored):

- the action inside tags: `<action>Right</action>` (the last tagged answer counts, so a model may
  think aloud before it answers);
- the action's name: `Right`;
- its first letter when the environment's action names start with distinct letters: `R`;
- its integer id, as gymnasium numbers the actions (0-based): `2`;
- failing those, free text naming exactly one action by its full name: `I move Right.`

Anything else is invalid (`None`); the environment turns that into an observation and a penalty.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_TAG = re.compile(r"<action>(.*?)</action>", re.IGNORECASE | re.DOTALL)
_STRIP = " \t\r\n.,;:!?'\"`()[]{}*"


def parse_action(text: str, actions: Sequence[str]) -> int | None:
    """The index into `actions` that `text` names, or None when it names none or several."""
    tagged = _TAG.findall(text)
    answer = (tagged[-1] if tagged else text).strip(_STRIP).lower()
    names = [a.lower() for a in actions]
    if answer in names:
        return names.index(answer)
    initials = [n[0] for n in names]
    if len(set(initials)) == len(initials) and answer in initials:
        return initials.index(answer)
    if answer.isdecimal() and int(answer) < len(actions):
        return int(answer)
    named = {names.index(w) for w in re.findall(r"[a-z]+", answer) if w in names}
    return named.pop() if len(named) == 1 else None
