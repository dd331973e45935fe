"""Structured output through the official `openai` client against `rose serve` (its app, on the
native engine): OpenAI's response_format (json_schema, json_object) on chat and completions,
vLLM's structured_outputs and its older guided_* fields; bad or conflicting constraints are 400s
that name the field, and the server goes on serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from servers import running

from rose.coserve.executor import CoServingExecutor
from rose.coserve.server import build_app
from rose.coserve.settings import ExecutorConfig
from rose.model import Tokenizer, init_model, load_tokenizer
from rose.steploop import StepLoop

MODEL = "tiny-serving"
# Strings bounded by patterns, as in tests/engine/test_structured_output.py (xgrammar lets raw
# control characters into a string bounded by maxLength).
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z]{1,10}$"},
        "population": {"type": "integer", "minimum": 0},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Name a city as JSON."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Tokenizer]]:
    root = tmp_path_factory.mktemp("structured")
    serving = init_model("qwen2", "tiny", root / "serving", seed=1)
    rollout = init_model("qwen3", "tiny", root / "rollout", seed=2)
    executor = CoServingExecutor.from_pretrained(serving, rollout, ExecutorConfig(pool_mb=8))
    tok = load_tokenizer(serving)
    with running(build_app(StepLoop(executor), executor, tok, MODEL)) as url:
        yield url, tok


@pytest.fixture
def client(served: tuple[str, Tokenizer]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chat_json_schema_validates(client: openai.OpenAI, seed: int) -> None:
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300, temperature=1.0,
                                          seed=seed, response_format=JSON_SCHEMA)  # type: ignore[arg-type]
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    # Streamed, the same seed gives the same text.
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300, temperature=1.0,
                                            seed=seed, response_format=JSON_SCHEMA,  # type: ignore[arg-type]
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == choice.message.content


def test_completions_take_response_format_and_vllm_s_fields(client: openai.OpenAI) -> None:
    done = client.completions.create(model=MODEL, prompt="A city:", max_tokens=300, temperature=1.0, seed=1,
                                     n=2, extra_body={"response_format": JSON_SCHEMA})
    for choice in done.choices:  # each sample held to the schema
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=50, temperature=1.0, seed=2,
                                      extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}})
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", regex.choices[0].text)
    # vLLM 0.32 ignores guided_*; ROSE holds the output to them.
    guided = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=50, temperature=1.0,
                                            seed=3, extra_body={"guided_choice": ["Paris", "Lima", "Oslo"]})
    assert guided.choices[0].message.content in ("Paris", "Lima", "Oslo")


@pytest.mark.parametrize("seed", [1, 2])
def test_json_object_is_an_object(client: openai.OpenAI, served: tuple[str, Tokenizer], seed: int) -> None:
    # A bias towards the quote: a random model's strings rarely close by themselves.
    quote = {str(served[1].encode('"')[0]): 5}
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1.0,
                                          seed=seed, logit_bias=quote,
                                          response_format={"type": "json_object"})
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(("extra", "message"), [
    ({"response_format": {"type": "json_schema",
                           "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "structured output (json): xgrammar cannot compile it"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured output (regex): "),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured output (grammar): "),
    ({"guided_choice": []}, "structured output (choice): the spec must be a non-empty JSON list"),
    ({"response_format": {"type": "json_schema"}},
     "response_format of type json_schema needs its json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "response_format and guided_regex both constrain the output"),
    ({"structured_outputs": {"json": {"type": "object"}, "choice": ["a"]}},
     "structured_outputs.json and structured_outputs.choice both constrain the output"),
    ({"guided_json": {"description": "x" * 70_000}},
     "guided_json takes 70019 characters (as JSON), more than the 65536"),
])
def test_bad_constraints_are_400s(client: openai.OpenAI, served: tuple[str, Tokenizer], extra: dict,
                                  message: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert message in caught.value.message
    ok = httpx.post(f"{served[0]}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
