"""Trajectories: what a multi-turn episode produced, token by token, for the trainer.

A trajectory is one conversation. Turn k's `prompt_ids` are the tokens added to the context
before its generation (the whole chat prompt for turn 0, then the closing of the previous reply
and the new observation); its `output_ids` are what the policy generated, with the behaviour
policy's log-probability and version of each token. Concatenating every turn's prompt and
output gives the conversation exactly as the policy saw it, which `flatten` turns into a
training sequence: generated tokens are trained on (mask 1), prompt and observation tokens are
context only (mask 0). A turn whose chat template rewrote the earlier turns (`new_sequence`)
was prompted with the whole new rendering instead: it starts a sequence of its own, so a
trajectory flattens into one sequence per run of turns that continue each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import torch


@dataclasses.dataclass
class TurnRecord:
    """One finished turn of a trajectory: the tokens the policy was given, what it generated
    (with each token's log-probability and policy version), and the environment's answer."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    text: str = ""  # the reply as the environment read it
    observation: str = ""  # the environment's answer to it
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    # `prompt_ids` are a whole context (the template's rendering of the conversation so far, which
    # did not extend the previous turn's context), not a continuation: a new training sequence.
    new_sequence: bool = False

    def __post_init__(self) -> None:
        if not len(self.output_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(f"turn: {len(self.output_ids)} output tokens but {len(self.logprobs)} logprobs "
                             f"and {len(self.versions)} versions; expected one of each per token")


@dataclasses.dataclass(frozen=True)
class TokenSequence:
    """A flattened trajectory, all `[L]`: `old_logprobs` is 0 and `versions` -1 where the
    `loss_mask` is 0."""

    token_ids: torch.Tensor  # int64
    loss_mask: torch.Tensor  # bool
    old_logprobs: torch.Tensor  # float32
    versions: torch.Tensor  # int64
    turns: torch.Tensor  # int64: the index in its trajectory of the turn each token belongs to
    # The sampling engine's logprobs, where `old_logprobs` were recomputed by the trainer.
    behaviour_logprobs: torch.Tensor | None = None


@dataclasses.dataclass
class Trajectory:
    """`group_id` is shared by the trajectories sampled from the same prompt (env and seed):
    GRPO normalises rewards within such a group."""

    group_id: Hashable
    turns: list[TurnRecord] = dataclasses.field(default_factory=list)
    done: bool = False  # the environment ended the episode
    success: bool = False
    truncated: bool = False  # a turn limit or the context length ended it
    env: str = ""
    seed: int | None = None

    @property
    def reward(self) -> float:
        """The episode's return: the sum of its turns' rewards."""
        return sum(t.reward for t in self.turns)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(t.output_ids) for t in self.turns)

    @property
    def num_tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.output_ids) for t in self.turns)

    def segments(self) -> list[list[TurnRecord]]:
        """The runs of turns that continue each other: one per training sequence."""
        runs: list[list[TurnRecord]] = []
        for turn in self.turns:
            if turn.new_sequence or not runs:
                runs.append([])
            runs[-1].append(turn)
        return runs

    def flatten(self) -> list[TokenSequence]:
        """One training sequence per segment (one, where no turn starts a new sequence)."""
        sequences, first = [], 0
        for run in self.segments():
            sequences.append(_sequence(run, first))
            first += len(run)
        if not sequences or any(len(s.token_ids) == 0 for s in sequences):
            raise ValueError(f"trajectory {self.group_id!r} has no tokens")
        return sequences


def _sequence(turns: list[TurnRecord], first: int) -> TokenSequence:
    """`turns` (the trajectory's from index `first` on) as one sequence, on the CPU: the trainer
    takes a whole padded batch to its device at once."""
    ids: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    versions: list[int] = []
    index: list[int] = []
    for k, t in enumerate(turns, start=first):
        ids += t.prompt_ids + t.output_ids
        mask += [False] * len(t.prompt_ids) + [True] * len(t.output_ids)
        logprobs += [0.0] * len(t.prompt_ids) + list(t.logprobs)
        versions += [-1] * len(t.prompt_ids) + list(t.versions)
        index += [k] * (len(t.prompt_ids) + len(t.output_ids))
    cpu = torch.device("cpu")
    return TokenSequence(torch.tensor(ids, dtype=torch.int64, device=cpu),
                         torch.tensor(mask, dtype=torch.bool, device=cpu),
                         torch.tensor(logprobs, dtype=torch.float32, device=cpu),
                         torch.tensor(versions, dtype=torch.int64, device=cpu),
                         torch.tensor(index, dtype=torch.int64, device=cpu))


def shard_by_group(trajectories: Sequence[Trajectory], world_size: int) -> list[list[Trajectory]]:
    """Split a batch over `world_size` data-parallel ranks, keeping each GRPO group on one rank
    (its advantages need the whole group) and balancing tokens: largest group first onto the
    rank with the fewest tokens so far."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    groups: dict[Hashable, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    shards: list[list[Trajectory]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for group in sorted(groups.values(), key=lambda g: -sum(t.num_tokens for t in g)):
        rank = loads.index(min(loads))
        shards[rank] += group
        loads[rank] += sum(t.num_tokens for t in group)
    return shards
