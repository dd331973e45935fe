"""One request's state in the engine: its tokens, where its KV lives, what it produced."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time

import torch

from rose.contracts import SamplingParams

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
        self.generator = generator or torch.Generator(device="cpu")
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash of each full block, chained from the first
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (last admission)
        self.num_preemptions = 0
        # The policy version its oldest KV was computed under (None: no KV yet): every token it
        # samples attends to that KV, so it carries that version (InFlight.CONTINUE swaps the
        # weights under running sequences; their later tokens are not the new version's alone).
        self.kv_version: int | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None  # why the engine failed or dropped it

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

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append(self, token: int, now: float) -> None:
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        self.token_ids.append(token)


@dataclasses.dataclass
class RequestOutput:
    """A request's progress. `token_ids`, `logprobs` and `versions` (the policy version that
    produced each token) are the output tokens this output carries: an output of `step()` carries
    only that iteration's new tokens (none for an abort), so streaming costs O(1) per token;
    `merge` concatenates them (`LLMEngine.generate` returns each request's merged output)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    num_prompt_tokens: int
    num_output_tokens: int  # produced so far in all
    finished: bool
    finish_reason: str | None  # 'stop', 'length', 'abort', 'error' (see `error`)
    num_cached_tokens: int
    arrival_time: float  # time.monotonic() of add_request
    first_token_time: float | None
    last_token_time: float | None
    error: str | None = None
    # Per token, the `top_logprobs` likeliest (id, logprob) at its position (empty if not asked).
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, seq: Sequence, token_ids: list[int] | None = None, logprobs: list[float] | None = None,
           versions: list[int] | None = None,
           top_logprobs: list[list[tuple[int, float]]] | None = None) -> RequestOutput:
        return cls(seq.request_id, token_ids or [], logprobs or [], versions or [],
                   seq.num_prompt_tokens, seq.num_output_tokens, seq.status is Status.FINISHED,
                   seq.finish_reason, seq.num_cached_tokens, seq.arrival_time, seq.first_token_time,
                   seq.last_token_time, seq.error, top_logprobs or [])

    def merge(self, later: RequestOutput) -> None:
        """Append a later output of the same request (its tokens and its state)."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot merge request {later.request_id!r} into {self.request_id!r}")
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.versions += later.versions
        self.top_logprobs += later.top_logprobs
        for field in ("num_output_tokens", "finished", "finish_reason", "num_cached_tokens",
                      "first_token_time", "last_token_time", "error"):
            setattr(self, field, getattr(later, field))
