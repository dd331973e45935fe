"""The multi-turn text environment interface (`TextEnv`) and discrete-action environments
(`ActionEnv`).

`reset(seed)` returns the first observation; `step(text)` takes the model's whole reply and
returns the next observation, a reward, whether the episode is over, and an `info` dict. An
`ActionEnv`'s has at least `valid` (the reply named a legal action), `success`, `turn` and `truncated` (a turn
limit ended the episode). A reply that names no legal action is never an error: the agent gets
an observation that says so, the `invalid_penalty` is subtracted, and the turn counts.

With `ask`, every observation ends with the question a person would ask ("Which action do you
take: Left, Down, Right or Up?"). A small pretrained chat model answers what its last message
asks: SmolLM2-135M-Instruct named a legal action in 16 of 32 first FrozenLake replies with it,
1 of 32 without (docs/rl.md). A policy trained from scratch needs no such prompt.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from typing import Any

from rose.rl.envs.actions import parse_action


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any]


def check_positive_int(owner: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")
    return value


def check_non_negative(owner: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")
    return float(value)


class TextEnv(ABC):
    """An environment played in text, turn by turn: `reset(seed)` gives the first observation,
    `step(reply)` the next one, the reward, whether the episode is over and an `info` dict (with
    at least `success` at the end)."""

    name: str

    @property
    @abstractmethod
    def system_prompt(self) -> str:
        """The rules and the answer format."""

    @abstractmethod
    def reset(self, seed: int | None = None) -> str: ...

    @abstractmethod
    def step(self, text: str) -> StepResult: ...


class ActionEnv(TextEnv):
    """A discrete-action environment played in text, turn by turn, up to `max_turns` turns.

    Subclasses set `name` and `actions` (names, in id order) and implement `system_prompt`,
    `_reset`, `_act` (apply a legal action; return its reward and, as gymnasium does, whether
    the episode terminated and whether it was truncated), `render` (the observation text) and
    `success`.
    """

    actions: tuple[str, ...]

    def __init__(self, max_turns: int, invalid_penalty: float, ask: bool = False) -> None:
        self.max_turns = check_positive_int(self.name, "max_turns", max_turns)
        self.invalid_penalty = check_non_negative(self.name, "invalid_penalty", invalid_penalty)
        if not isinstance(ask, bool):
            raise ValueError(f"{self.name}: ask must be true or false, got {ask!r}")
        named = " or ".join(filter(None, (", ".join(self.actions[:-1]), self.actions[-1])))
        self.question = f"\nWhich action do you take: {named}?" if ask else ""
        self.turn = 0
        self.done = True  # until the first reset

    @property
    @abstractmethod
    def success(self) -> bool:
        """Whether the episode's goal is reached."""

    @abstractmethod
    def _reset(self, seed: int | None) -> None: ...

    @abstractmethod
    def _act(self, action: int) -> tuple[float, bool, bool]: ...

    @abstractmethod
    def render(self) -> str: ...

    def reset(self, seed: int | None = None) -> str:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"{self.name}: seed must be an integer or None, got {seed!r}")
        self.turn, self.done = 0, False
        self._reset(seed)
        return self.render() + self.question

    def step(self, text: str) -> StepResult:
        if self.done:
            raise RuntimeError(f"{self.name}: step() after the episode ended; call reset() first")
        self.turn += 1
        action = parse_action(text, self.actions)
        if action is None:
            reward, terminated, truncated = -self.invalid_penalty, False, False
            observation = f"Invalid action.\n{self.render()}"  # the system prompt lists the actions
        else:
            reward, terminated, truncated = self._act(action)
            observation = self.render()
        observation += self.question
        truncated = not terminated and (truncated or self.turn >= self.max_turns)
        self.done = terminated or truncated
        info = {"valid": action is not None, "action": None if action is None else self.actions[action],
                "success": self.success, "turn": self.turn, "truncated": truncated}
        return StepResult(observation, reward, self.done, info)
