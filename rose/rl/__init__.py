"""Agentic RL: text environments, trajectories, GRPO/DAPO objectives and the policy trainer."""

from rose.rl.advantages import group_advantages, informative_groups, overlong_penalty
from rose.rl.conversation import Conversation
from rose.rl.envs import StepResult, TextEnv, list_envs, make_env, register_env
from rose.rl.episode import Episode, run_episodes
from rose.rl.objective import Objective, Prepared
from rose.rl.trainer import Trainer, TrainerConfig
from rose.rl.trajectory import TokenSequence, Trajectory, TurnRecord, shard_by_group

__all__ = [
    "Conversation",
    "Episode",
    "Objective",
    "Prepared",
    "StepResult",
    "TextEnv",
    "TokenSequence",
    "Trainer",
    "TrainerConfig",
    "Trajectory",
    "TurnRecord",
    "group_advantages",
    "informative_groups",
    "list_envs",
    "make_env",
    "overlong_penalty",
    "register_env",
    "run_episodes",
    "shard_by_group",
]
