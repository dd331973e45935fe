"""Request bodies of the HTTP API: OpenAI's completions and chat completions, and the lease.

Every number is bounded here, at the edge, so that nothing out of range (beyond int64, NaN,
inf) reaches the engine thread. A field this server does not know is ignored with a warning in
the log, as vLLM does (clients and frameworks send their own: `metadata`, `store`,
`service_tier`); parameters of OpenAI's or vLLM's API that this server does not implement are
declared, and refused with a 400 unless they hold the neutral value some clients send explicitly,
so that no client believes such a parameter took effect. A leased turn is strict: its fields
are ROSE's own, and an unknown one is an error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from rose.contracts import SamplingParams, StructuredKind, StructuredOutput, Turn, TurnOutput
from rose.contracts.sampling import MAX_REPETITION_PENALTY

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_STOP = 16  # stop strings, and separately stop token ids, per request
MAX_LOGIT_BIAS = 1024  # biased tokens per request

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# torch.Generator.manual_seed takes any int64 or uint64.
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]
StopString = Annotated[str, Field(min_length=1)]


log = logging.getLogger(__name__)


class _Body(BaseModel):
    """A part of an OpenAI API body: unknown fields are logged and dropped."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _ignore_unknown(self) -> _Body:
        if self.__pydantic_extra__:
            log.warning("%s: fields ignored (this server does not know them): %s", type(self).__name__,
                        ", ".join(sorted(self.__pydantic_extra__)))
            self.__pydantic_extra__.clear()
        return self


class _Sampling(_Body):
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


class StreamOptions(_Body):
    include_usage: bool = False


# A structured output's schema, regex, grammar or choice list, as (JSON) text: the body's cap
# would let one take megabytes, each compiled on the engine thread.
MAX_STRUCTURED_CHARS = 64 * 1024


class JsonSchemaFormat(_Body):
    """OpenAI's `response_format.json_schema`: the schema is enforced whatever `strict` says (as
    under vLLM)."""

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("response_format", "response_format of type json_schema needs its "
                                      "json_schema: {\"name\": ..., \"schema\": {...}}")
        return self


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: one constraint of json (a schema), regex, choice, grammar
    (EBNF or Lark) and json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options of its backends, not implemented here: refused unless off.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _options_off(self) -> StructuredOutputs:
        for name in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                     "structural_tag"):
            if getattr(self, name) not in (None, False):
                raise PydanticCustomError("unsupported", "this server does not implement "
                                          "structured_outputs.{field}; accepted only: null, false",
                                          {"field": name})
        return self

    def specs(self) -> list[tuple[StructuredKind, Any]]:
        """Each constraint's kind and value (None: not given)."""
        return [(StructuredKind.JSON, self.json_), (StructuredKind.REGEX, self.regex),
                (StructuredKind.CHOICE, self.choice), (StructuredKind.GRAMMAR, self.grammar),
                (StructuredKind.JSON_OBJECT, "" if self.json_object else None)]


_SPEC_KINDS = (StructuredKind.JSON, StructuredKind.REGEX, StructuredKind.CHOICE, StructuredKind.GRAMMAR)


def _spec(value: dict[str, Any] | list[str] | str) -> str:
    return value if isinstance(value, str) else json.dumps(value)


MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's bound; vLLM's default max_logprobs)
LOGIT_BIAS = 100.0  # vLLM clamps each bias to [-LOGIT_BIAS, LOGIT_BIAS]

# Parameters of OpenAI's API (and vLLM's) this server does not implement, with the values
# that mean "off": anything else is refused with a 400 naming the parameter.
NEUTRAL: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""),
    # vLLM's
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (None, True),
    "chat_template": (None,),  # a request's own template (vLLM too takes one only when told to trust it)
}
_UNSUPPORTED = Field(default=None, description="not implemented: only its neutral value is accepted")


def _check_neutral(value: object, field: str) -> object:
    allowed = NEUTRAL[field]
    # Of one type: bool is an int in Python, and True must not pass as 1, nor False as 0.
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise PydanticCustomError(
            "unsupported", "this server does not implement {field}; accepted only: {allowed}",
            {"field": field, "allowed": ", ".join("null" if a is None else repr(a) for a in allowed)})
    return value


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}`, each bias clamped as vLLM does (the engine checks the ids
    against its vocabulary)."""
    biases: dict[int, float] = {}  # "5" and "05" name one token: the last wins, as in vLLM's dict
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:  # not an integer (or one of thousands of digits)
            token = -1
        if token < 0:
            raise PydanticCustomError("logit_bias", "logit_bias keys must be token ids (integers >= 0), "
                                      "got {key!r}", {"key": key})
        biases[token] = min(LOGIT_BIAS, max(-LOGIT_BIAS, value))
    return tuple(biases.items())


class _OpenAIRequest(_Sampling):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    user: str | None = None  # accepted, unused
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) ends the text
    skip_special_tokens: bool = True  # special tokens' text left out of the reply

    # Structured output: OpenAI's response_format, vLLM's structured_outputs, or vLLM's older
    # guided_* fields (vLLM 0.32 dropped those: it ignores them with a warning and leaves the
    # output unconstrained; clients written for older vLLMs still send them, and get them here).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    best_of: Any = _UNSUPPORTED
    tools: Any = _UNSUPPORTED
    tool_choice: Any = _UNSUPPORTED
    functions: Any = _UNSUPPORTED
    function_call: Any = _UNSUPPORTED
    use_beam_search: Any = _UNSUPPORTED
    prompt_logprobs: Any = _UNSUPPORTED
    allowed_token_ids: Any = _UNSUPPORTED
    bad_words: Any = _UNSUPPORTED
    truncate_prompt_tokens: Any = _UNSUPPORTED
    spaces_between_special_tokens: Any = _UNSUPPORTED

    _implemented: ClassVar[frozenset[str]] = frozenset()  # of NEUTRAL's, those a subclass implements

    # check_fields=False: `suffix` belongs to one subclass.
    @field_validator(*NEUTRAL, check_fields=False)
    @classmethod
    def _neutral(cls, value: object, info: ValidationInfo) -> object:
        if info.field_name in cls._implemented:
            return value
        return _check_neutral(value, info.field_name)

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        _logit_bias(value)
        return value

    def _constraints(self) -> list[tuple[str, StructuredOutput]]:
        """Each structured output the request asks for, with the field that asks."""
        fmt, so = self.response_format, self.structured_outputs
        given: list[tuple[str, StructuredKind, Any]] = []
        if fmt is not None and fmt.json_schema is not None and fmt.type == "json_schema":
            given.append(("response_format", StructuredKind.JSON, fmt.json_schema.schema_))
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", StructuredKind.JSON_OBJECT, ""))
        if so is not None:
            given += [(f"structured_outputs.{kind.value}", kind, value) for kind, value in so.specs()]
        given += [(f"guided_{k.value}", k, getattr(self, f"guided_{k.value}")) for k in _SPEC_KINDS]
        return [(name, StructuredOutput(kind, _spec(value))) for name, kind, value in given
                if value is not None]

    @model_validator(mode="after")
    def _one_structured_output(self) -> _OpenAIRequest:
        found = self._constraints()
        if len(found) > 1:
            raise PydanticCustomError("structured_output", "{first} and {second} both constrain the output; "
                                      "send one of them", {"first": found[0][0], "second": found[1][0]})
        for name, constraint in found:
            if len(constraint.spec) > MAX_STRUCTURED_CHARS:
                raise PydanticCustomError("structured_output", "{field} takes {size} characters (as JSON), "
                                          "more than the {limit} a request may send",
                                          {"field": name, "size": len(constraint.spec),
                                           "limit": MAX_STRUCTURED_CHARS})
        return self

    @property
    def structured(self) -> StructuredOutput | None:
        """The structured output asked for, if any (at most one: checked)."""
        found = self._constraints()
        return found[0][1] if found else None

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def num_top_logprobs(self) -> int:
        """How many likeliest tokens' logprobs to return with each token."""
        raise NotImplementedError

    @property
    def returns_logprobs(self) -> bool:
        raise NotImplementedError

    def sampling(self, default_max_tokens: int, stop_token_ids: list[int]) -> SamplingParams:
        return dataclasses.replace(
            super().sampling(default_max_tokens, stop_token_ids),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0, min_p=self.min_p,
            min_tokens=self.min_tokens, logit_bias=_logit_bias(self.logit_bias),
            top_logprobs=self.num_top_logprobs, structured=self.structured)

    def with_defaults(self, defaults: Mapping[str, Any]) -> Self:
        """The request with the model's recommended sampling (`rose serve --generation-config`,
        applied as vLLM applies it) in each field it did not set; `max_tokens` is the caller's."""
        unset = {k: v for k, v in defaults.items() if k != "max_tokens" and k not in self.model_fields_set}
        return self.model_copy(update=unset) if unset else self

    def samples(self, params: SamplingParams) -> list[SamplingParams]:
        """The `n` samples' parameters: a seed gives sample i `seed + i`, as vLLM does, so that
        the samples differ and each is reproducible."""
        if params.seed is None:
            return [params] * self.n
        return [dataclasses.replace(params, seed=params.seed + i) for i in range(self.n)]


MAX_PROMPTS = 64  # prompts in one completion request, as a list
PromptText = Annotated[str, Field(min_length=1)]
PromptIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_OpenAIRequest):
    # One prompt (text or token ids), or a list of them: each gets `n` choices.
    prompt: (PromptText | PromptIds | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # with this many top ones
    echo: bool = False  # the prompt's text before each choice's
    suffix: Any = _UNSUPPORTED

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:  # vLLM would score the prompt's tokens too
            raise PydanticCustomError("echo", "echo with logprobs needs the prompt's logprobs, which this "
                                      "server does not compute; send echo or logprobs, not both")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids."""
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)  # type: ignore[list-item]

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    @property
    def returns_logprobs(self) -> bool:
        return self.logprobs is not None  # 0: the sampled token's alone


class TextPart(_Body):
    type: Literal["text"]
    text: str


MAX_TOOLS = 128  # tools per request (OpenAI's bound)
MAX_TEMPLATE_KWARGS_JSON = 64 * 1024  # chat_template_kwargs, as JSON characters
MAX_TOOLS_JSON = 256 * 1024  # the tools' schemas together, as JSON characters
MAX_TOOL_CALLS = 128  # tool calls per assistant message
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionCall(_Body):
    name: FunctionName
    arguments: str  # a JSON string, as OpenAI sends it back


class ToolCallIn(_Body):
    """A past assistant turn's call, as OpenAI's reply gave it."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Body):
    name: FunctionName
    description: str | None = None
    # A JSON schema: rendered for the model; a reply to tool_choice "required" or naming this
    # function is held to it (`rose.coserve.chat_reply.tool_schema`), one to "auto" is not.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; as above, whatever its value


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only in an assistant turn with tool_calls
    name: str | None = None  # accepted, unused
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOL_CALLS)] | None = None  # assistant's
    tool_call_id: str | None = Field(default=None, max_length=256)  # a tool result's

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("tool_calls", "only an assistant message has tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("content", "content is required (null only in an assistant "
                                      "message with tool_calls)")
        return self

    def rendered(self) -> dict[str, Any]:
        """The message as the chat template takes it: its text parts joined by newlines, as vLLM
        joins them; the role as sent (a template that knows no `developer` renders it as is);
        tool calls as OpenAI's shape, which Qwen's templates read."""
        content = self.content or ""
        text = content if isinstance(content, str) else "\n".join(p.text for p in content)
        out: dict[str, Any] = {"role": self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _check_tools(tools: list[ToolDef] | None) -> list[ToolDef] | None:
    if tools:
        size = len(json.dumps([t.model_dump(exclude_none=True) for t in tools]))
        if size > MAX_TOOLS_JSON:
            raise PydanticCustomError("tools", "the tools' schemas take {size} characters of JSON, "
                                      "more than the {limit} a request may send",
                                      {"size": size, "limit": MAX_TOOLS_JSON})
        names = [t.function.name for t in tools]
        if len(set(names)) < len(names):
            raise PydanticCustomError("tools", "two tools have one name")
    return tools


def _check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value and len(json.dumps(value)) > MAX_TEMPLATE_KWARGS_JSON:
        raise PydanticCustomError("chat_template_kwargs", "chat_template_kwargs takes more than {limit} "
                                  "characters of JSON", {"limit": MAX_TEMPLATE_KWARGS_JSON})
    return value


class ChatCompletionRequest(_OpenAIRequest):
    _implemented: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice"})

    messages: list[ChatMessage] = Field(min_length=1)
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    # None: "auto" with tools, else "none" (`rose.coserve.chat_reply` reads replies by it).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: a reply's first call only
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # As vLLM renders a chat: the generation prompt, or the last message continued; more template
    # variables (Qwen3's `enable_thinking`); echo: the reply starts with the last message's content
    # when that is the assistant's.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    chat_template: Any = _UNSUPPORTED

    _template_kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)

    @model_validator(mode="after")
    def _continue_or_prompt(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:  # vLLM's rule
            raise PydanticCustomError("continue_final_message", "continue_final_message and "
                                      "add_generation_prompt cannot both be true: send "
                                      "add_generation_prompt: false to continue the last message")
        return self

    @property
    def echoed(self) -> str:
        """The text the reply starts with under `echo`: the last message's, if it is the assistant's."""
        last = self.messages[-1]
        return last.rendered()["content"] if self.echo and last.role == "assistant" else ""

    _tools = field_validator("tools")(_check_tools)

    def tool_error(self) -> tuple[str, str] | None:
        """The field and what is wrong with tools and tool_choice together, by vLLM's (and
        OpenAI's) rules (a model validator's error would name no field)."""
        if self.tools == []:
            return "tools", "tools must not be empty: give at least one tool, or leave tools out"
        if self.tool_choice not in (None, "none") and not self.tools:
            return "tool_choice", f"tool_choice {self._choice_name} needs tools"
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools and \
                self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            name = self.tool_choice.function.name
            return "tool_choice", f"tool_choice names {name!r}, which is not in tools"
        return None

    @property
    def _choice_name(self) -> str:
        named = isinstance(self.tool_choice, NamedToolChoice)
        return "naming a function" if named else repr(self.tool_choice)

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):  # OpenAI's and vLLM's rule
            raise PydanticCustomError("top_logprobs", "top_logprobs needs logprobs: true")
        return value

    @property
    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0

    @property
    def returns_logprobs(self) -> bool:
        return self.logprobs


class TokenizeRequest(_Body):
    """`POST /tokenize` (vLLM's): a prompt's token ids, or a chat's as the template renders it."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # With `messages`, as a chat completion renders them:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    return_token_strs: bool = False

    _template_kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise PydanticCustomError("tokenize", "give either prompt or messages, not both nor neither")
        return self

    _tools = field_validator("tools")(_check_tools)

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


# A leased turn on the wire is the contract's `Turn` as it is, its `SamplingParams` whole (a field
# added to either travels with it): pydantic builds both from the JSON, and `check_turn` bounds it.
TURN: TypeAdapter[Turn] = TypeAdapter(Turn)
MAX_ID_CHARS = 256  # a turn's id, its trajectory's, an adapter's name


class TurnError(ValueError):
    """A leased turn out of bounds: `field` (a dotted path, as `params.top_k`) and what it must be."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_turn(turn: Turn) -> Turn:
    """The turn, or a TurnError naming its first field out of bounds: this edge's bounds (as the
    OpenAI API's: ids of int32, lists of at most so many) and then `SamplingParams.validate`."""
    p, ids = turn.params, turn.token_ids
    checks = (
        ("turn_id", 1 <= len(turn.turn_id) <= MAX_ID_CHARS, f"1 to {MAX_ID_CHARS} characters"),
        ("trajectory_id", len(turn.trajectory_id) <= MAX_ID_CHARS, f"at most {MAX_ID_CHARS} characters"),
        ("token_ids", bool(ids) and min(ids) >= 0 and max(ids) <= INT32_MAX,
         f"one token id or more, each in [0, {INT32_MAX}]"),
        ("policy_version", turn.policy_version is None or 0 <= turn.policy_version <= INT64_MAX,
         f"null or in [0, {INT64_MAX}]"),
        ("adapter", turn.adapter is None or 1 <= len(turn.adapter) <= MAX_ID_CHARS,
         f"null or a name of 1 to {MAX_ID_CHARS} characters"),
        ("params.max_tokens", p.max_tokens <= INT32_MAX, f"at most {INT32_MAX}"),
        ("params.min_tokens", p.min_tokens <= INT32_MAX, f"at most {INT32_MAX}"),
        ("params.top_k", p.top_k <= INT32_MAX, f"at most {INT32_MAX}"),
        ("params.temperature", p.temperature <= 100.0, "at most 100"),
        ("params.stop_token_ids", len(p.stop_token_ids) <= MAX_STOP
         and all(t <= INT32_MAX for t in p.stop_token_ids), f"at most {MAX_STOP} ids, each <= {INT32_MAX}"),
        ("params.logit_bias", len(p.logit_bias) <= MAX_LOGIT_BIAS, f"at most {MAX_LOGIT_BIAS} pairs"),
        ("params.top_logprobs", p.top_logprobs <= MAX_LOGPROBS, f"at most {MAX_LOGPROBS}"),
        ("params.structured", p.structured is None or len(p.structured.spec) <= MAX_STRUCTURED_CHARS,
         f"null, or a spec of at most {MAX_STRUCTURED_CHARS} characters"),
    )
    for field, ok, expected in checks:
        if not ok:
            raise TurnError(field, f"expected {expected}")
    try:
        p.validate()
    except ValueError as exc:  # "<field> must be ...": the field first, as above
        name = str(exc).split(" ", 1)[0]
        raise TurnError(f"params.{name}", str(exc).removeprefix(name).strip()) from None
    return turn


# A leased turn's streamed events and an abort's answer: a `TurnOutput` as JSON, every field of it.
TURN_OUTPUT: TypeAdapter[TurnOutput] = TypeAdapter(TurnOutput)
