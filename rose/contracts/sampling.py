"""What a request asks of the sampler: the parameters every layer passes down to the engine."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import ClassVar

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this a temperature divides logits into inf/NaN (float32): such requests are greedy.
MIN_TEMPERATURE = 1e-5
MAX_REPETITION_PENALTY = 100.0  # vLLM asks only > 0; a bound keeps it finite


def _check_int(name: str, value: object, low: int) -> None:
    """An integer from `low` up to int64's largest (what torch and the wire formats hold)."""
    # bool is an int subclass: True would pass as 1.
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= INT64_MAX:
        shown = "-2**63" if low == INT64_MIN else low
        raise ValueError(f"{name} must be an integer >= {shown} and < 2**63, got {value!r}")


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    """A finite number in [low, high] ((low, high] with `low_open`); NaN fails every comparison."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value <= high \
        and (value > low if low_open else value >= low)
    if not ok:
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")


class StructuredKind(str, enum.Enum):
    """What a structured output's `spec` is (vLLM's `StructuredOutputsParams` fields)."""

    JSON = "json"  # a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object (spec unused)
    REGEX = "regex"
    CHOICE = "choice"  # a JSON list of strings: the output is one of them
    GRAMMAR = "grammar"  # an EBNF grammar (GBNF, as xgrammar and vLLM take it)


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate: every token drawn keeps the output a prefix
    of a string the constraint accepts, and generation ends once it is complete."""

    __pydantic_config__: ClassVar[dict[str, str]] = {"extra": "forbid"}

    kind: StructuredKind
    spec: str = ""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    # On the wire (a leased turn's, read by pydantic): a field it does not know is refused.
    __pydantic_config__: ClassVar[dict[str, str]] = {"extra": "forbid"}

    max_tokens: int = 16
    temperature: float = 1.0  # under MIN_TEMPERATURE (0 included): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k; beyond the vocabulary: the whole vocabulary
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep going past the model's end-of-sequence ids
    # Record each token's logprob at this temperature (the policy it was drawn from, as RL
    # needs) rather than under the raw softmax (what OpenAI-style clients get, as from vLLM).
    logprobs_at_temperature: bool = False
    # vLLM's semantics: presence and frequency penalties count the output tokens; the repetition
    # penalty divides positive logits (multiplies negative ones) of tokens in prompt or output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest
    min_tokens: int = 0  # until this many output tokens, no stop or end-of-sequence id is drawn
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    top_logprobs: int = 0  # with each token, the logprobs of this many likeliest ones
    structured: StructuredOutput | None = None  # constrained decoding (structured output)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in self.logit_bias))

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (integers must fit int64; floats must be
        finite)."""
        _check_int("max_tokens", self.max_tokens, 1)
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, -1)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN)
        for token in self.stop_token_ids:
            _check_int("stop_token_ids[]", token, 0)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY,
                     low_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for token, bias in self.logit_bias:
            _check_int("logit_bias token id", token, 0)
            _check_float("logit_bias value", bias, -100.0, 100.0)
        _check_int("top_logprobs", self.top_logprobs, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
