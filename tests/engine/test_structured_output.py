"""Structured output on the native engine: a random tiny model held to a JSON schema, a regex, a
choice or a grammar writes what the constraint accepts and stops at its end; unconstrained
requests beside it draw the tokens they draw alone; a preempted request resumes its grammar where
it was; a bad constraint is refused when the request is added."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest

from rose.contracts import InFlight, SamplingParams, StructuredKind, StructuredOutput
from rose.engine import LLMEngine
from rose.model import Tokenizer, load_tokenizer, preset_config, random_model

# Strings bounded by patterns: xgrammar (vLLM's as well) lets raw control characters into a
# string bounded by maxLength, which strict JSON refuses.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "tags", "ok"],
    "additionalProperties": False,
}
JSON = StructuredOutput(StructuredKind.JSON, json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def engine(tiny_qwen3: Path) -> LLMEngine:
    return LLMEngine.from_pretrained(tiny_qwen3)


@pytest.fixture(scope="module")
def tok(tiny_qwen3: Path) -> Tokenizer:
    return load_tokenizer(tiny_qwen3)


def _prompt(tok: Tokenizer) -> list[int]:
    return tok.encode("Describe a person as JSON:")


def _no_whitespace(tok: Tokenizer) -> tuple[tuple[int, float], ...]:
    """A bias against every whitespace token: a random model's likeliest token is often one, and
    JSON allows whitespace without end, so greedy decoding would never close the object."""
    return tuple((i, -100.0) for i in range(tok.vocab_size) if tok.decode([i]).isspace())


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_json_schema_output_validates(engine: LLMEngine, tok: Tokenizer, seed: int | None) -> None:
    params = SamplingParams(max_tokens=300, temperature=1.0, seed=seed, structured=JSON)
    if seed is None:
        params = dataclasses.replace(params, temperature=0.0, logit_bias=_no_whitespace(tok))
    out = engine.generate([_prompt(tok)], params)[0]
    assert out.finish_reason == "stop", tok.decode(out.token_ids)
    assert out.token_ids[-1] in engine.eos_token_ids  # the grammar ends at end of sequence, as vLLM's
    jsonschema.validate(json.loads(tok.decode(out.token_ids)), SCHEMA)


CHOICES = ['say "hi"', "back\\slash", "two\nlines", "ünï"]


@pytest.mark.parametrize(("kind", "spec", "accepts"), [
    (StructuredKind.REGEX, r"[a-z]{3}-\d{2}", lambda text: re.fullmatch(r"[a-z]{3}-\d{2}", text)),
    (StructuredKind.CHOICE, json.dumps(CHOICES), lambda text: text in CHOICES),
    (StructuredKind.GRAMMAR, 'root ::= "(" [0-9] [0-9]? ")" ("," " "? root)?',
     lambda text: re.fullmatch(r"\(\d\d?\)(, ?\(\d\d?\))*", text)),
    (StructuredKind.GRAMMAR, 'start: "yes" | "no" NUM\nNUM: /[0-9]/',  # Lark, as vLLM takes too
     lambda text: re.fullmatch(r"yes|no\d", text)),
])
@pytest.mark.parametrize("seed", [4, 5, 6])
def test_each_kind_holds(engine: LLMEngine, tok: Tokenizer, kind: StructuredKind, spec: str, accepts: object,
                         seed: int) -> None:
    structured = StructuredOutput(kind, spec)
    out = engine.generate([_prompt(tok)], SamplingParams(max_tokens=200, temperature=1.0, seed=seed,
                                                         structured=structured))[0]
    text = tok.decode(out.token_ids)
    assert out.finish_reason == "stop" and accepts(text), text  # type: ignore[operator]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_json_object_is_an_object(engine: LLMEngine, tok: Tokenizer, seed: int) -> None:
    # A bias towards the quote: a random model's strings rarely close by themselves.
    quote = ((tok.encode('"')[0], 5.0),)
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=seed, logit_bias=quote,
                            structured=StructuredOutput(StructuredKind.JSON_OBJECT))
    out = engine.generate([_prompt(tok)], params)[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(tok.decode(out.token_ids)), dict)


def test_greedy_regex_and_choice(engine: LLMEngine, tok: Tokenizer) -> None:
    regex = StructuredOutput(StructuredKind.REGEX, r"\d{4}")
    choice = StructuredOutput(StructuredKind.CHOICE, '["left", "right"]')
    for spec, accepts in ((regex, lambda t: re.fullmatch(r"\d{4}", t)),
                          (choice, lambda t: t in ("left", "right"))):
        params = SamplingParams(max_tokens=50, temperature=0.0, structured=spec)
        out = engine.generate([_prompt(tok)], params)[0]
        assert out.finish_reason == "stop" and accepts(tok.decode(out.token_ids))


def test_unconstrained_rows_draw_what_they_draw_alone(engine: LLMEngine, tok: Tokenizer) -> None:
    prompts = [tok.encode(text) for text in ("The cat", "Once upon a time", "1 2 3")]
    free = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=12, ignore_eos=True)]
    alone = engine.generate(prompts, free)
    constrained = SamplingParams(max_tokens=300, temperature=1.0, seed=1, structured=JSON)
    mixed = engine.generate([_prompt(tok), *prompts], [constrained, *free])
    jsonschema.validate(json.loads(tok.decode(mixed[0].token_ids)), SCHEMA)
    for a, m in zip(alone, mixed[1:], strict=True):
        assert m.token_ids == a.token_ids
        assert m.logprobs == pytest.approx(a.logprobs, abs=1e-5)


def test_a_preempted_request_resumes_its_grammar(engine: LLMEngine, tok: Tokenizer) -> None:
    """Recomputed after preemption, the tokens already drawn are not fed to the grammar again:
    the request goes on as if it had never stopped."""
    params = SamplingParams(max_tokens=300, temperature=1.0, seed=2, structured=JSON)
    whole = engine.generate([_prompt(tok)], params)[0]
    request = engine.add_request(_prompt(tok), params)
    tokens: list[int] = []
    for _ in range(6):
        tokens += [t for out in engine.step() for t in out.token_ids]
    weights = [(name, p.detach().clone()) for name, p in engine.model.named_parameters()]
    engine.load_weights(weights, engine.policy_version + 1, InFlight.ABORT_RESUME)  # preempts it
    assert engine.scheduler.waiting and not engine.scheduler.running
    while engine.has_request(request):
        tokens += [t for out in engine.step() for t in out.token_ids]
    assert tokens == whole.token_ids
    jsonschema.validate(json.loads(tok.decode(tokens)), SCHEMA)


def test_an_aborted_request_lets_go_of_its_grammar(engine: LLMEngine, tok: Tokenizer) -> None:
    request = engine.add_request(_prompt(tok), SamplingParams(max_tokens=50, structured=JSON))
    engine.step()
    assert engine.abort(request).finish_reason == "abort"  # type: ignore[union-attr]
    assert not engine.has_unfinished()


@pytest.mark.parametrize(("kind", "spec", "message"), [
    (StructuredKind.JSON, '{"type": "objectx"}', r"\(json\): xgrammar cannot compile it: .*objectx"),
    (StructuredKind.JSON, "{not json", r"\(json\): the spec is not JSON"),
    (StructuredKind.JSON, "[1, 2]", r"\(json\): the spec is a JSON list; expected a JSON schema"),
    (StructuredKind.JSON, "[" * 65 + "]" * 65, r"\(json\): the spec nests .* more than 64 levels deep"),
    (StructuredKind.REGEX, "(a", r"\(regex\): .*parenthesis is not closed"),
    (StructuredKind.REGEX, "a\x00", r"\(regex\): the spec holds a NUL character"),
    (StructuredKind.CHOICE, "[1, 2]", r"\(choice\): the spec must be a non-empty JSON list"),
    (StructuredKind.CHOICE, "[]", r"\(choice\): the spec must be a non-empty JSON list"),
    (StructuredKind.GRAMMAR, "root ::= undefined_rule", r"\(grammar\): .*undefined_rule"),
])
def test_a_bad_constraint_is_refused_when_added(engine: LLMEngine, tok: Tokenizer, kind: StructuredKind,
                                                spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"request '.*': structured output " + message):
        engine.add_request(_prompt(tok), SamplingParams(structured=StructuredOutput(kind, spec)))
    assert not engine.has_unfinished()


def test_an_engine_without_a_tokenizer_refuses_structured_output() -> None:
    model = random_model(preset_config("qwen3", "tiny", eos_token_id=3), seed=0)
    engine = LLMEngine(model, eos_token_ids=[3])
    with pytest.raises(ValueError, match="structured output needs the model's tokenizer"):
        engine.add_request([5, 6], SamplingParams(structured=JSON))
    assert engine.generate([[5, 6]], SamplingParams(max_tokens=3))[0].finished  # and serves the rest
