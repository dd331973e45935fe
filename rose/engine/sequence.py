"""One request's state in the engine: its tokens, where its KV lives, what it produced."""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

import torch

from rose.contracts import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from rose.engine.lora import Adapter
    from rose.engine.structured_output import Constraint

_arrivals = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt plus output tokens; `num_computed_tokens` of them have KV in `block_table`."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, generator: torch.Generator | None = None,
                 constraint: Constraint | None = None, adapter: Adapter | None = None,
                 guest: bool = False) -> None:
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
        # Its structured output's grammar, advanced by each token it draws (never by the tokens a
        # preempted sequence computes again: they are not drawn again).
        self.constraint = constraint
        self.adapter = adapter  # the LoRA adapter it runs with; None: the base model
        self.guest = guest  # a co-serving executor's rollout turn on the serving engine (`Scheduler`)
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash of each full block, chained from the first
        self.hash_seed = 0  # the chain's start: the base model's 0, or its adapter's (`match_prefix`)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (last admission)
        self.num_preemptions = 0
        # The policy version (with an adapter: the adapter's) its oldest KV was computed under
        # (None: no KV yet): every token it samples attends to that KV, so it carries that
        # version (InFlight.CONTINUE swaps the weights under running sequences; their later
        # tokens are not the new version's alone).
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

    def output(self, token_ids: list[int] | None = None, logprobs: list[float] | None = None,
               versions: list[int] | None = None,
               top_logprobs: list[list[tuple[int, float]]] | None = None) -> RequestOutput:
        """Its progress as the engine hands it up, with these new tokens (none by default)."""
        return RequestOutput(self.request_id, token_ids or [], logprobs or [], versions or [],
                             self.num_prompt_tokens, self.num_output_tokens, self.status is Status.FINISHED,
                             self.finish_reason, self.num_cached_tokens, self.arrival_time,
                             self.first_token_time, self.last_token_time, self.error, top_logprobs or [])
