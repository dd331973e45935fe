"""Request bodies of the HTTP API: OpenAI's completions and chat completions, and the lease."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rose.engine import SamplingParams


class _Sampling(BaseModel):
    """Sampling fields shared by every generation request (vLLM's extensions included)."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    ignore_eos: bool = False

    def sampling(self, default_max_tokens: int, stop_token_ids: list[int]) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens,
                              temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, stop_token_ids=tuple(stop_token_ids),
                              ignore_eos=self.ignore_eos)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _OpenAIRequest(_Sampling):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1  # one choice per request
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=1)  # the sampled token's only
    echo: Literal[False] = False


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False


class TurnRequest(_Sampling):
    """One rollout turn leased to this executor (`POST /v1/lease/turns`)."""

    turn_id: str = Field(min_length=1)
    trajectory_id: str
    token_ids: list[int] = Field(min_length=1)
    stop_token_ids: list[int] = Field(default_factory=list)
    policy_version: int | None = None
