"""Environments by name: `make_env("frozenlake", size=8)`, `list_envs()`, `register_env`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from rose.rl.envs.base import TextEnv
from rose.rl.envs.frozen_lake import FrozenLake
from rose.rl.envs.reasoning import ReasoningGymTask
from rose.rl.envs.sokoban import Sokoban
from rose.rl.envs.textworld_env import TextWorldGame

_FACTORIES: dict[str, Callable[..., TextEnv]] = {}


def register_env(name: str, factory: Callable[..., TextEnv]) -> None:
    """Make `factory(**kwargs)` available as `make_env(name, **kwargs)`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"env name must be a non-empty string, got {name!r}")
    if name in _FACTORIES:
        raise ValueError(f"env {name!r} is already registered")
    _FACTORIES[name] = factory


def list_envs() -> list[str]:
    return sorted(_FACTORIES)


def env_options(name: str) -> list[str] | None:
    """The keyword options `make_env(name, ...)` accepts (None: any, the factory takes **kwargs)."""
    params = inspect.signature(_FACTORIES[name]).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def make_env(name: str, **kwargs: Any) -> TextEnv:
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown env {name!r}; expected one of {', '.join(list_envs())}")
    signature = inspect.signature(factory)
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        accepted = ", ".join(p for p in signature.parameters if p != "self")
        raise ValueError(f"env {name!r}: {exc}; it accepts {accepted}") from None
    return factory(**kwargs)


register_env(FrozenLake.name, FrozenLake)
register_env(Sokoban.name, Sokoban)
register_env(ReasoningGymTask.name, ReasoningGymTask)
register_env(TextWorldGame.name, TextWorldGame)
