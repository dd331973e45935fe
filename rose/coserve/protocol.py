"""Request bodies of the HTTP API: OpenAI's completions and chat completions, and the lease.

Every number is bounded here, at the edge, so that nothing out of range (beyond int64, NaN,
inf) reaches the engine thread. Unknown fields are refused (a client must not believe a
parameter took effect when it did not); parameters this server does not implement are
declared only to accept the neutral value some clients send explicitly.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from rose.contracts import SamplingParams, Turn

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_STOP = 16  # stop strings, and separately stop token ids, per request

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# torch.Generator.manual_seed takes any int64 or uint64.
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]
StopString = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Sampling(_Strict):
    """Sampling fields shared by every generation request (vLLM's extensions included)."""

    max_tokens: MaxTokens | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)  # beyond the vocabulary: the whole of it
    seed: Seed | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP)

    def sampling(self, default_max_tokens: int, stop_token_ids: list[int]) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens or default_max_tokens,
                              temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, stop_token_ids=tuple(stop_token_ids),
                              ignore_eos=self.ignore_eos)


class StreamOptions(_Strict):
    include_usage: bool = False


# Parameters of OpenAI's API (and vLLM's) this server does not implement, with the values
# that mean "off": anything else is refused with a 400 naming the parameter.
NEUTRAL: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""),
    "top_logprobs": (None, 0),
    "min_tokens": (None, 0),
}
_UNSUPPORTED = Field(default=None, description="not implemented: only its neutral value is accepted")


def _check_neutral(value: object, field: str) -> object:
    allowed = NEUTRAL[field]
    # bool is an int in Python: True must not pass as 1, nor False as 0.
    if isinstance(value, bool) or value not in allowed:
        raise PydanticCustomError(
            "unsupported", "this server does not implement {field}; accepted only: {allowed}",
            {"field": field, "allowed": ", ".join("null" if a is None else repr(a) for a in allowed)})
    return value


class _OpenAIRequest(_Sampling):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1  # one choice per request
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    user: str | None = None  # accepted, unused

    best_of: Any = _UNSUPPORTED
    presence_penalty: Any = _UNSUPPORTED
    frequency_penalty: Any = _UNSUPPORTED
    repetition_penalty: Any = _UNSUPPORTED
    logit_bias: Any = _UNSUPPORTED
    response_format: Any = _UNSUPPORTED
    tools: Any = _UNSUPPORTED
    tool_choice: Any = _UNSUPPORTED
    functions: Any = _UNSUPPORTED
    function_call: Any = _UNSUPPORTED
    min_tokens: Any = _UNSUPPORTED

    # check_fields=False: `suffix` and `top_logprobs` belong to one subclass each.
    @field_validator(*NEUTRAL, check_fields=False)
    @classmethod
    def _neutral(cls, value: object, info: Any) -> object:
        return _check_neutral(value, info.field_name)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_OpenAIRequest):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    logprobs: int | None = Field(default=None, ge=0, le=1)  # the sampled token's only
    echo: Literal[False] = False
    suffix: Any = _UNSUPPORTED


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None  # accepted, unused


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Any = _UNSUPPORTED


class TurnRequest(_Sampling):
    """One rollout turn leased to this executor (`POST /v1/lease/turns`): a `Turn` on the wire."""

    turn_id: str = Field(min_length=1, max_length=256)
    trajectory_id: str = Field(max_length=256)
    token_ids: list[TokenId] = Field(min_length=1)
    policy_version: int | None = Field(default=None, ge=0, le=INT64_MAX)

    @classmethod
    def of(cls, turn: Turn) -> TurnRequest:
        """The body a client sends (unchecked here: the executor checks it, and refuses it with a
        4xx naming what is wrong)."""
        p = turn.params
        return cls.model_construct(turn_id=turn.turn_id, trajectory_id=turn.trajectory_id,
                                   token_ids=turn.token_ids, policy_version=turn.policy_version,
                                   max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                   top_k=p.top_k, seed=p.seed, ignore_eos=p.ignore_eos,
                                   stop_token_ids=list(p.stop_token_ids))

    def turn(self, default_max_tokens: int = 64) -> Turn:
        """A rollout turn: its logprobs at the temperature that samples it (the behaviour policy)."""
        params = dataclasses.replace(self.sampling(default_max_tokens, self.stop_token_ids),
                                     logprobs_at_temperature=True)
        return Turn(self.turn_id, self.trajectory_id, self.token_ids, params, self.policy_version)
