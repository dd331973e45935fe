"""One request's state in the engine: its tokens, where its KV lives, what it produced."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time

import torch

from rose.engine.sampling import SamplingParams

_arrivals = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt plus output tokens; `num_computed_tokens` of them have KV in `block_table`."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, generator: torch.Generator | None = None) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority  # lower runs first; the executor puts serving at 0
        self.arrival = next(_arrivals)
        self.arrival_time = time.monotonic()
        self.last_token_time: float | None = None  # when the latest output token was sampled
        self.first_token_time: float | None = None
        self.generator = generator or torch.Generator()
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash of each full block, chained from the first
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (last admission)
        self.num_preemptions = 0
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # policy version that produced each output token
        self.finish_reason: str | None = None

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority class first, then arrival."""
        return self.priority, self.arrival

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append(self, token: int, logprob: float, version: int, now: float) -> None:
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)


@dataclasses.dataclass
class RequestOutput:
    """What a request produced so far; `new_token_ids` are this step's additions."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    arrival_time: float  # time.monotonic() of add_request
    first_token_time: float | None
    last_token_time: float | None

    @classmethod
    def of(cls, seq: Sequence, num_new: int) -> RequestOutput:
        out = seq.output_token_ids
        return cls(seq.request_id, seq.token_ids[:seq.num_prompt_tokens], out, list(seq.logprobs),
                   list(seq.versions), out[len(out) - num_new:], seq.status is Status.FINISHED,
                   seq.finish_reason, seq.num_cached_tokens, seq.arrival_time, seq.first_token_time,
                   seq.last_token_time)
