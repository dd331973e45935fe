"""Multi-turn text environments: the interface, the registry, built-ins and a gymnasium adapter."""

from rose.rl.envs.actions import parse_action
from rose.rl.envs.base import ActionEnv, StepResult, TextEnv
from rose.rl.envs.frozen_lake import FrozenLake
from rose.rl.envs.gym_adapter import GymEnvAdapter
from rose.rl.envs.registry import env_options, list_envs, make_env, register_env
from rose.rl.envs.sokoban import Sokoban

__all__ = ["ActionEnv", "FrozenLake", "GymEnvAdapter", "Sokoban", "StepResult", "TextEnv", "env_options",
           "list_envs", "make_env", "parse_action", "register_env"]
