"""What a generation engine offers the layers above it, and what it hands up: requests in (token
ids and `SamplingParams`), one iteration per `step()`, each request's progress out
(`RequestOutput`). The native engine (`rose.engine.LLMEngine`) and vLLM's behind ROSE's surface
(`rose.engine.vllm_engine.VllmEngine`) implement `GenerationEngine`; the async front
(`rose.engine.async_engine.AsyncLLMEngine`) and the dedicated rollout worker drive either through
it, and any of them is a step loop's target (`rose.steploop.Steppable`)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from rose.contracts.sampling import SamplingParams
from rose.contracts.turn import TurnOutput

if TYPE_CHECKING:
    import torch

    from rose.contracts.adapter import LoRAConfig


class InFlight(enum.Enum):
    """What `load_weights` does to sequences already running (every token keeps the version
    that produced it, whichever is chosen)."""

    # Keep their KV; their later tokens come from the new weights over the old KV, and carry
    # the old version (the oldest that shaped them). Immediate and cheapest.
    CONTINUE = "continue"
    # Stage the new weights and admit nothing new; the running sequences finish under the old
    # weights, then the swap happens: each sequence stays single-version.
    FINISH_OLD = "finish_old"
    # Preempt them at the iteration boundary and swap: each resumes from its prompt plus the
    # tokens it produced, re-prefilled under the new weights.
    ABORT_RESUME = "abort_resume"


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
    finish_reason: str | None  # 'stop', 'length', 'abort', 'error' (see `error`); None while running
    num_cached_tokens: int
    arrival_time: float  # time.monotonic() of add_request
    first_token_time: float | None
    last_token_time: float | None
    error: str | None = None
    # Per token, the `top_logprobs` likeliest (id, logprob) at its position (empty if not asked).
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)

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

    def turn_output(self) -> TurnOutput:
        """This output as a rollout turn's chunk, wherever the turn runs (a dedicated worker's
        stream, a lease API's event): its new tokens and, once finished, why."""
        return TurnOutput(self.token_ids, self.logprobs, self.versions, self.finish_reason, self.top_logprobs)


class GenerationEngine(Protocol):
    """An engine as its drivers use it. Every call is made between two iterations, on the thread
    that steps it."""

    policy_version: int  # the weights' version: each token it samples carries it (or an older one)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                    priority: int = 0, adapter: str | None = None) -> str:
        """Queue a request (a lower `priority` runs first), on the base model or with the loaded
        LoRA `adapter` of that name; bad input (the prompt, the sampling parameters, an adapter
        not loaded) raises ValueError naming the request, and nothing else changes."""
        ...

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request; its last output (no new tokens; None if unknown or finished)."""
        ...

    def has_unfinished(self) -> bool: ...

    def has_request(self, request_id: str) -> bool:
        """Whether the request is queued or running."""
        ...

    def step(self) -> list[RequestOutput]:
        """One iteration: the requests that produced a token or finished, each with its new tokens."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                     in_flight: InFlight = ...) -> None:
        """Take new weights as policy `version`. Each engine has its default `in_flight` and
        refuses those it cannot do (ValueError)."""
        ...

    def load_adapter(self, name: str, config: LoRAConfig, named_tensors: Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None:
        """Load LoRA adapter `name` (tensors under `rose.model.lora`'s names), or give a loaded
        one new tensors (all, or only those that changed) as `version`: requests running on it
        go on over their KV, as `InFlight.CONTINUE`; each token of an adapter's request carries
        the adapter's version. ValueError for an adapter of another base, or an engine that
        cannot run adapters."""
        ...

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter; ValueError while a request uses it."""
        ...

    def adapter_versions(self) -> dict[str, int]:
        """Each loaded adapter's version, by name."""
        ...

    def check_health(self) -> None:
        """Raise if the engine can no longer run (its worker is then replaced)."""
        ...
