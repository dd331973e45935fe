"""What the co-serving executor needs of the engine that serves production requests, beyond
`GenerationEngine` (rose.contracts): what admission reads of each request in flight, the KV pages
the burst state machine follows, the last iteration's load and time (the latency model learns
from them) and the request limits the OpenAI API states. The native engine provides it
(`NativeServing`); so does vLLM's (`rose.coserve.vllm_serving.VllmServing`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

from rose.contracts import GenerationEngine, RequestOutput
from rose.coserve.admission import RolloutWait, ServingRequest
from rose.engine import LLMEngine
from rose.engine.llm_engine import EngineStep


class KVPages(NamedTuple):
    """The serving engine's KV, in its own pages."""

    active: int      # pages its requests hold (pages only its prefix cache holds are reclaimable)
    total: int       # pages it may hold at most
    page_bytes: int


class ServingEngine(GenerationEngine, Protocol):
    """A `GenerationEngine` the co-serving executor serves production requests with."""

    vocab_size: int
    max_model_len: int
    last_step: EngineStep  # the last `step()`: its serving load and seconds
    # Chat's top logprobs as vLLM's server lists them, the sampled token first and then the
    # likeliest (k in all), rather than the k likeliest: the vLLM engine answers as that server.
    chat_top_logprobs_sampled_first: bool

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt and output) one request may reach."""
        ...

    def step(self) -> list[RequestOutput]: ...

    def has_request(self, request_id: str) -> bool: ...

    def in_flight(self, waited: Mapping[str, RolloutWait]) -> dict[str, ServingRequest]:
        """Each unfinished request, in arrival order, as admission reads it, with its account
        in `waited` (none: rollouts never delayed it)."""
        ...

    def queue_lengths(self) -> tuple[int, int]:
        """Requests running and waiting, as the engine's scheduler counts them (`/metrics`)."""
        ...

    def kv_pages(self) -> KVPages:
        """Asked every iteration, by the burst state machine: cheap."""
        ...

    def cached_pages(self) -> int:
        """Pages only the prefix cache holds (for `/metrics`)."""
        ...

    def reset_prefix_cache(self) -> None:
        """Drop what only the prefix cache holds (after the start-up profile)."""
        ...


class NativeServing(LLMEngine):
    """ROSE's engine as a `ServingEngine`: its scheduler's sequences and its block manager. Its
    guest requests (the executor's adapter mode: rollout turns on the serving model) are not
    serving's: what it reports here leaves them out."""

    chat_top_logprobs_sampled_first = False

    def in_flight(self, waited: Mapping[str, RolloutWait]) -> dict[str, ServingRequest]:
        sched, no_wait = self.scheduler, RolloutWait()
        return {s.request_id: ServingRequest(s.arrival_time, s.num_uncomputed, len(s.token_ids),
                                             s.first_token_time, s.last_token_time, s.num_output_tokens,
                                             waited.get(s.request_id, no_wait))
                for s in sorted(sched.running + sched.waiting, key=lambda s: s.arrival) if not s.guest}

    def queue_lengths(self) -> tuple[int, int]:
        sched = self.scheduler
        return sum(not s.guest for s in sched.running), sum(not s.guest for s in sched.waiting)

    def kv_pages(self) -> KVPages:
        return KVPages(self.blocks.num_active_pages, self.blocks.max_pages, self.pool.page_bytes)

    def cached_pages(self) -> int:
        return self.blocks.num_cached_pages
