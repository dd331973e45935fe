"""Any gymnasium-style environment with discrete actions, played in text.

Duck-typed against the gymnasium API, so gymnasium itself is not a dependency: the wrapped
object needs `reset(seed=...) -> (obs, info)` and `step(action: int) -> (obs, reward,
terminated, truncated, info)`. The observation text comes from `render(obs, info)` when given,
else from the env's own `render()` (gymnasium's `render_mode="ansi"` returns a string).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rose.rl.envs.base import ActionEnv


def _reached_reward(reward: float, terminated: bool, info: dict[str, Any]) -> bool:
    return terminated and reward > 0


class GymEnvAdapter(ActionEnv):
    def __init__(self, env: Any, actions: Sequence[str], system_prompt: str,
                 render: Callable[[Any, dict[str, Any]], str] | None = None,
                 success: Callable[[float, bool, dict[str, Any]], bool] = _reached_reward,
                 max_turns: int = 20, invalid_penalty: float = 0.1, name: str = "gym",
                 ask: bool = False) -> None:
        """`actions`: a name per discrete action id, in id order. `success(reward, terminated,
        info)` judges the last step (default: it terminated with a positive reward)."""
        self.name = name
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise ValueError(f"{name}: the wrapped env has no {method}(); expected a gymnasium-style env")
        if render is None and not callable(getattr(env, "render", None)):
            raise ValueError(f"{name}: pass render=, or wrap an env whose render() returns text")
        self.actions = tuple(actions)
        if not self.actions or not all(isinstance(a, str) and a.strip() for a in self.actions):
            raise ValueError(f"{name}: actions must be non-empty names, got {actions!r}")
        n = getattr(getattr(env, "action_space", None), "n", None)
        if n is not None and int(n) != len(self.actions):
            raise ValueError(f"{name}: {len(self.actions)} action names for an action space of {int(n)}")
        super().__init__(max_turns, invalid_penalty, ask)
        self.env, self._system_prompt = env, system_prompt
        self._render, self._success = render, success
        self._obs: Any = None
        self._info: dict[str, Any] = {}
        self._reached = False

    @property
    def system_prompt(self) -> str:
        return self._system_prompt

    @property
    def success(self) -> bool:
        return self._reached

    def _reset(self, seed: int | None) -> None:
        self._obs, self._info = self.env.reset(seed=seed)
        self._reached = False

    def _act(self, action: int) -> tuple[float, bool, bool]:
        self._obs, reward, terminated, truncated, self._info = self.env.step(action)
        self._reached = bool(self._success(float(reward), bool(terminated), self._info))
        return float(reward), bool(terminated), bool(truncated)

    def render(self) -> str:
        return self._render(self._obs, self._info) if self._render else str(self.env.render())
