"""One rollout turn as every layer passes it: what a worker is asked (`Turn`) and what comes back
(`TurnOutput`, streamed chunk by chunk and summed; an engine's output becomes one with
`RequestOutput.turn_output`, wherever the turn runs). The lease API's JSON carries every field of
both (`rose.coserve.protocol`); routing sees a turn only as counts
(`rose.rollout.routing.RoutedTurn`); a trajectory records each finished one with what its
environment answered (`rose.rl.trajectory.TurnRecord`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from rose.contracts.sampling import SamplingParams

# A worker streams a turn's tokens in chunks of what this many seconds produced (the last at
# once): the rollout manager pays per chunk for every worker's turns, on the trainer's cores when
# local, and keeps the tokens rather than showing them as they come.
TURN_CHUNK_S = 0.05


@dataclasses.dataclass(frozen=True)
class Turn:
    """One turn of one rollout trajectory: its whole prompt (every earlier turn and observation)
    as token ids, its sampling, and the policy version it needs."""

    # How the lease API's JSON reads it (pydantic): a field it does not know is refused.
    __pydantic_config__: ClassVar[dict[str, str]] = {"extra": "forbid"}

    turn_id: str  # this attempt's: one id from the rollout manager to the engine's request
    trajectory_id: str
    token_ids: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    policy_version: int | None = None  # the oldest version it may run on; None: any
    # The LoRA adapter it runs with (the engine's loaded adapter of this name; its version is
    # the one `policy_version` bounds), or None: the model's own weights.
    adapter: str | None = None


@dataclasses.dataclass
class TurnOutput:
    """What a turn produced: the new tokens of one streamed chunk, or all of them so far. One
    logprob and one policy version per token, and the `params.top_logprobs` likeliest (id,
    logprob) at each token's position where the turn asked for them; `finish_reason` None while
    unfinished, 'abort' when handed back unfinished."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)

    def extend(self, chunk: TurnOutput) -> TurnOutput:
        """Append a streamed chunk; return self."""
        c = chunk
        return self.add(c.token_ids, c.logprobs, c.versions, c.finish_reason, c.top_logprobs)

    def add(self, token_ids: list[int], logprobs: list[float], versions: list[int], finish_reason: str | None,
            top_logprobs: list[list[tuple[int, float]]]) -> TurnOutput:
        """Append a chunk given as its fields (a transport's, with no chunk object made); return self."""
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.versions += versions
        self.top_logprobs += top_logprobs
        self.finish_reason = finish_reason
        return self
